//! The container image that `docker/build` makes without a container daemon (an OCI archive):
//! it describes the same image as `docker/Dockerfile`'s runtime stage, its root filesystem has
//! what the binary needs, and the binary starts in it as a container (runc), as the image's user.
//!
//! The archive is `$KUBECAST_IMAGE_ARCHIVE` when set (a test runner that built it before the
//! tests, with `docker/build --out FILE`); without it, this test runs `docker/build` itself (the
//! release binary, then the image). Both need root: buildah and runc run as root here.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kubecast_kit as common;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const WAIT: Duration = Duration::from_secs(60);

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(out: Output, what: &str) -> String {
    assert!(out.status.success(), "{what} failed ({}):\n{}{}", out.status, text(&out.stdout), text(&out.stderr));
    text(&out.stdout)
}

fn require_root() {
    let uid = ok(Command::new("id").arg("-u").output().expect("run id -u"), "id -u");
    assert_eq!(uid.trim(), "0", "docker/build (buildah) and this test (runc, ownership in the image) need root");
}

/// The OCI archive: `$KUBECAST_IMAGE_ARCHIVE`, or one `docker/build` makes now.
fn archive() -> &'static Path {
    static ARCHIVE: OnceLock<PathBuf> = OnceLock::new();
    ARCHIVE.get_or_init(|| {
        require_root();
        if let Some(path) = std::env::var_os("KUBECAST_IMAGE_ARCHIVE") {
            let path = repo().join(path);
            assert!(
                path.is_file(),
                "KUBECAST_IMAGE_ARCHIVE={} is not a file: build it with docker/build",
                path.display()
            );
            return path;
        }
        let out = repo().join("target/image/kubecast.oci.tar");
        let build = Command::new(repo().join("docker/build"))
            .arg("--out")
            .arg(&out)
            .current_dir(repo())
            .stdin(Stdio::null())
            .output()
            .expect("run docker/build");
        ok(build, "docker/build");
        out
    })
}

/// One file of the archive.
fn member(name: &str) -> Vec<u8> {
    let out = Command::new("tar").arg("-xOf").arg(archive()).arg(name).output().expect("run tar");
    assert!(out.status.success(), "{name} is not in {}: {}", archive().display(), text(&out.stderr));
    out.stdout
}

/// A blob of the archive by its descriptor, checked against the descriptor's digest and size.
fn blob(descriptor: &Value) -> Vec<u8> {
    let digest = descriptor["digest"].as_str().unwrap_or_else(|| panic!("descriptor without a digest: {descriptor}"));
    let hex = digest.strip_prefix("sha256:").unwrap_or_else(|| panic!("not a sha256 digest: {digest}"));
    let bytes = member(&format!("blobs/sha256/{hex}"));
    let actual: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(actual, hex, "blob {digest} has other contents");
    assert_eq!(descriptor["size"].as_u64(), Some(bytes.len() as u64), "blob {digest}: size");
    bytes
}

struct Image {
    /// The image configuration (`config` holds User, Env, Entrypoint, ...).
    config: Value,
    /// The layers, unpacked as root (owners and modes as in the image).
    rootfs: tempfile::TempDir,
}

fn image() -> &'static Image {
    static IMAGE: OnceLock<Image> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let index: Value = serde_json::from_slice(&member("index.json")).expect("index.json is JSON");
        let manifests = index["manifests"].as_array().expect("index.json: manifests");
        assert_eq!(manifests.len(), 1, "one image in the archive: {index}");
        let name = manifests[0]["annotations"]["org.opencontainers.image.ref.name"].as_str().unwrap_or_default();
        assert!(name.contains("/kubecast:"), "the image's name (ref.name) is {name:?}: {index}");
        let manifest: Value = serde_json::from_slice(&blob(&manifests[0])).expect("the manifest is JSON");
        assert_eq!(manifest["mediaType"], "application/vnd.oci.image.manifest.v1+json", "{manifest}");
        let config: Value = serde_json::from_slice(&blob(&manifest["config"])).expect("the config is JSON");
        let rootfs = tempfile::tempdir().unwrap();
        let layers = manifest["layers"].as_array().expect("manifest: layers");
        assert!(!layers.is_empty(), "{manifest}");
        for layer in layers {
            assert_eq!(layer["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip", "{layer}");
            let mut tar = Command::new("tar")
                .args(["-xz", "--numeric-owner", "--same-owner", "--same-permissions", "-C"])
                .arg(rootfs.path())
                .stdin(Stdio::piped())
                .spawn()
                .expect("run tar");
            tar.stdin.take().unwrap().write_all(&blob(layer)).unwrap();
            assert!(tar.wait().unwrap().success(), "unpacking layer {layer}");
        }
        Image { config, rootfs }
    })
}

// ------------------------------------------------------------------ docker/Dockerfile

/// The Dockerfile builds from the build context `.dockerignore` lets in (an allow-list:
/// `*`, then `!path` lines): that context must hold every file the manifest needs, path
/// dependencies (also dev-dependencies: cargo reads their manifests to resolve the lock file)
/// included. Checked with `cargo metadata --locked` on a copy of exactly that context (it
/// reads every locked package's manifest, other platforms' too: fetched from crates.io once
/// when the cargo cache lacks them); no container engine needed.
#[test]
fn the_docker_build_context_holds_what_cargo_needs() {
    let ignore = std::fs::read_to_string(repo().join(".dockerignore")).unwrap();
    let lines: Vec<&str> = ignore.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    assert_eq!(lines.first(), Some(&"*"), ".dockerignore starts with `*` (an allow-list): {lines:?}");
    let context = tempfile::tempdir().unwrap();
    for line in &lines[1..] {
        let path = line.strip_prefix('!').unwrap_or_else(|| panic!(".dockerignore: {line:?} is not an allow line"));
        let path = path.trim_end_matches('/');
        let from = repo().join(path);
        assert!(from.exists(), ".dockerignore lets in {path}, which does not exist");
        let to = context.path().join(path);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        ok(Command::new("cp").arg("-a").arg(&from).arg(&to).output().expect("run cp"), "cp");
    }
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked", "--manifest-path"])
        .arg(context.path().join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", context.path().join("target"))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "the build context .dockerignore lets in is not a buildable crate:\n{}",
        text(&out.stderr)
    );
}

/// The instructions of the runtime stage (`FROM ... AS runtime` to the next `FROM`), continuation
/// lines joined, comments dropped: (INSTRUCTION, arguments).
fn runtime_stage() -> Vec<(String, String)> {
    let dockerfile = std::fs::read_to_string(repo().join("docker/Dockerfile")).unwrap();
    let mut logical = Vec::new();
    let mut current = String::new();
    for line in dockerfile.lines() {
        let t = line.trim();
        if t.starts_with('#') || (t.is_empty() && current.is_empty()) {
            continue;
        }
        match t.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(t);
                logical.push(std::mem::take(&mut current));
            }
        }
    }
    let mut stage = Vec::new();
    let mut inside = false;
    for l in logical {
        let (word, args) = l.split_once(char::is_whitespace).unwrap_or((&l, ""));
        let word = word.to_ascii_uppercase();
        if word == "FROM" {
            inside = args.to_ascii_lowercase().trim_end().ends_with(" as runtime");
            continue;
        }
        if inside {
            stage.push((word, args.trim().to_string()));
        }
    }
    assert!(!stage.is_empty(), "docker/Dockerfile has no stage named runtime");
    stage
}

/// `key="value" key=value ...` of LABEL (backslash escapes in quoted values).
fn label_pairs(args: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let mut chars = args.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let key: String = std::iter::from_fn(|| chars.next_if(|c| *c != '=')).collect();
        if key.is_empty() {
            break;
        }
        assert_eq!(chars.next(), Some('='), "LABEL {key} without a value in docker/Dockerfile");
        let mut value = String::new();
        if chars.next_if_eq(&'"').is_some() {
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            value.extend(std::iter::from_fn(|| chars.next_if(|c| !c.is_whitespace())));
        }
        pairs.push((key, value));
    }
    pairs
}

fn json_array(instruction: &str, args: &str) -> Vec<String> {
    serde_json::from_str(args)
        .unwrap_or_else(|e| panic!("{instruction} {args} in docker/Dockerfile is not a JSON array (exec form): {e}"))
}

fn config_strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

fn config_keys(v: &Value) -> BTreeSet<String> {
    v.as_object().unwrap_or_else(|| panic!("not an object: {v}")).keys().cloned().collect()
}

/// The label that names the base image: the archive has none (it is built from scratch).
const BASE_NAME: &str = "org.opencontainers.image.base.name";
/// buildah's own stamp.
const BUILDAH_VERSION: &str = "io.buildah.version";
/// The environment distroless images set (the Dockerfile inherits it from its base).
const DISTROLESS_ENV: [&str; 2] = [
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
];

#[test]
fn the_archive_describes_the_image_of_the_dockerfile() {
    let config = &image().config;
    let c = &config["config"];
    let mut args = BTreeMap::new();
    let mut labels = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for (word, a) in runtime_stage() {
        seen.insert(word.clone());
        match word.as_str() {
            "ARG" => {
                let (name, default) = a.split_once('=').unwrap_or((&a, ""));
                args.insert(name.to_string(), default.to_string());
            }
            "LABEL" => labels.extend(label_pairs(&a)),
            "USER" => assert_eq!(c["User"], json!(a), "USER"),
            "WORKDIR" => assert_eq!(c["WorkingDir"], json!(a), "WORKDIR"),
            "VOLUME" => {
                let want: BTreeSet<String> = json_array("VOLUME", &a).into_iter().collect();
                assert_eq!(config_keys(&c["Volumes"]), want, "VOLUME");
            }
            "EXPOSE" => {
                let want: BTreeSet<String> = a
                    .split_whitespace()
                    .map(|p| if p.contains('/') { p.to_string() } else { format!("{p}/tcp") })
                    .collect();
                assert_eq!(config_keys(&c["ExposedPorts"]), want, "EXPOSE");
            }
            "ENTRYPOINT" => assert_eq!(config_strings(&c["Entrypoint"]), json_array("ENTRYPOINT", &a), "ENTRYPOINT"),
            "CMD" => assert_eq!(config_strings(&c["Cmd"]), json_array("CMD", &a), "CMD"),
            "COPY" => assert_eq!(a, "--from=builder /out/ /", "the runtime stage copies more than the builder's /out"),
            other => panic!(
                "docker/Dockerfile's runtime stage has {other} {a}: docker/build does not reproduce it; add it there and here"
            ),
        }
    }
    for word in ["USER", "WORKDIR", "VOLUME", "EXPOSE", "ENTRYPOINT", "CMD", "LABEL"] {
        assert!(seen.contains(word), "docker/Dockerfile's runtime stage has no {word}");
    }
    assert_eq!(config_strings(&c["Env"]), DISTROLESS_ENV, "Env (as distroless sets it)");
    assert_eq!(config["os"], "linux");

    // Labels: the same keys (the archive has no base image, buildah adds its version); the same
    // values, the build arguments aside; those come from Cargo.toml, git and the build time.
    let image_labels = c["Labels"].as_object().expect("Labels");
    let want: BTreeSet<&str> = labels.keys().map(String::as_str).filter(|k| *k != BASE_NAME).collect();
    let have: BTreeSet<&str> = image_labels.keys().map(String::as_str).filter(|k| *k != BUILDAH_VERSION).collect();
    assert_eq!(have, want, "label keys");
    for (key, value) in &labels {
        let Some(arg) = value.strip_prefix("${").and_then(|v| v.strip_suffix('}')) else {
            if key != BASE_NAME {
                assert_eq!(image_labels[key], json!(value), "label {key}");
            }
            continue;
        };
        assert!(args.contains_key(arg), "label {key} uses ${{{arg}}}, which is no ARG of the runtime stage");
        let v = image_labels[key].as_str().unwrap();
        match arg {
            "VERSION" => {
                assert_eq!(v, env!("CARGO_PKG_VERSION"), "label {key}");
                assert_eq!(args[arg], env!("CARGO_PKG_VERSION"), "docker/Dockerfile's ARG VERSION default");
            }
            "CREATED" => assert_eq!(json!(v), config["created"], "label {key} and the config's created time"),
            "REVISION" => assert!(
                v == "unknown" || (v.len() == 40 && v.bytes().all(|b| b.is_ascii_hexdigit())),
                "label {key}: {v:?} is no git commit"
            ),
            other => panic!("label {key} uses ARG {other}, which docker/build does not set"),
        }
    }
}

// ------------------------------------------------------------------ the root filesystem

fn path(p: &str) -> PathBuf {
    image().rootfs.path().join(p.trim_start_matches('/'))
}

fn file(p: &str) -> String {
    std::fs::read_to_string(path(p)).unwrap_or_else(|e| panic!("{p} in the image: {e}"))
}

/// (uid, gid, permission bits) of a path in the image, without following a last symlink.
fn owner_mode(p: &str) -> (u32, u32, u32) {
    let m = std::fs::symlink_metadata(path(p)).unwrap_or_else(|e| panic!("{p} in the image: {e}"));
    (m.uid(), m.gid(), m.permissions().mode() & 0o7777)
}

/// A symlink of the image resolved inside the image (an absolute target is relative to its root).
fn resolve(p: &str) -> String {
    let mut p = p.to_string();
    for _ in 0..10 {
        match std::fs::read_link(path(&p)) {
            Ok(target) if target.is_absolute() => p = target.display().to_string(),
            Ok(target) => p = Path::new(&p).parent().unwrap().join(target).display().to_string(),
            Err(_) => return p,
        }
    }
    panic!("{p}: too many symlinks");
}

#[test]
fn the_root_filesystem_has_what_the_binary_needs() {
    assert_eq!(owner_mode("/usr/local/bin/kubecast"), (0, 0, 0o755), "/usr/local/bin/kubecast");
    // glibc (its loader, libc, libm), libgcc_s.
    let lib = std::fs::read_dir(path("/lib"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .find(|n| n.ends_with("-linux-gnu"))
        .expect("/lib/<arch>-linux-gnu in the image");
    for so in ["libc.so.6", "libm.so.6", "libgcc_s.so.1"] {
        assert!(path(&format!("/lib/{lib}/{so}")).is_file(), "/lib/{lib}/{so} is missing");
    }
    if cfg!(target_arch = "x86_64") {
        let loader = resolve("/lib64/ld-linux-x86-64.so.2");
        assert!(path(&loader).is_file(), "the loader /lib64/ld-linux-x86-64.so.2 -> {loader} is missing");
    }
    // CA certificates: one bundle, every certificate whole.
    let bundle = file("/etc/ssl/certs/ca-certificates.crt");
    let begins = bundle.matches("-----BEGIN CERTIFICATE-----\n").count();
    assert!(begins > 100, "{begins} certificates in /etc/ssl/certs/ca-certificates.crt");
    assert_eq!(bundle.matches("-----END CERTIFICATE-----\n").count(), begins, "a certificate of the bundle is cut");
    // Time zones, services, the OS.
    for zone in ["UTC", "Europe/Berlin", "America/New_York"] {
        let tz = std::fs::read(path(&resolve(&format!("/usr/share/zoneinfo/{zone}")))).unwrap();
        assert!(tz.starts_with(b"TZif"), "/usr/share/zoneinfo/{zone} is no time zone file");
    }
    assert!(file("/etc/services").lines().any(|l| l.starts_with("https") && l.contains("443/tcp")), "/etc/services");
    assert!(file(&resolve("/etc/os-release")).contains("ID=debian"), "/etc/os-release");
    assert!(file("/etc/nsswitch.conf").contains("hosts:     files dns"), "/etc/nsswitch.conf");
    // Users, and the directories they write to.
    let passwd = file("/etc/passwd");
    assert!(passwd.lines().any(|l| l.starts_with("nonroot:x:65532:65532:")), "{passwd}");
    assert!(passwd.lines().any(|l| l.starts_with("root:x:0:0:")), "{passwd}");
    assert!(file("/etc/group").lines().any(|l| l == "nonroot:x:65532:"), "/etc/group");
    assert_eq!(owner_mode("/var/lib/kubecast"), (65532, 65532, 0o750), "/var/lib/kubecast");
    assert_eq!(owner_mode("/tmp"), (0, 0, 0o1777), "/tmp");
    // The Debian packages are listed where scanners look.
    for pkg in ["libc6", "libgcc-s1", "ca-certificates", "tzdata", "netbase", "base-files"] {
        assert!(file(&format!("/var/lib/dpkg/status.d/{pkg}")).contains(&format!("Package: {pkg}\n")), "{pkg}");
    }
}

#[test]
fn the_root_filesystem_holds_no_other_program() {
    let mut programs = Vec::new();
    let mut stack = vec![image().rootfs.path().to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            let name = e.file_name().into_string().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() && m.permissions().mode() & 0o111 != 0 && !name.contains(".so") {
                programs.push(e.path().strip_prefix(image().rootfs.path()).unwrap().display().to_string());
            }
        }
    }
    assert_eq!(programs, ["usr/local/bin/kubecast"], "programs in the image (no shell, no package manager)");
    for doc in ["usr/share/man", "usr/share/info", "usr/share/locale", "usr/share/lintian"] {
        assert!(!path(doc).exists(), "{doc} is in the image");
    }
}

// ------------------------------------------------------------------ the binary in a container

/// A container of the image (runc, in a fresh bundle and state directory): the image's root
/// filesystem, read-only, its user, working directory and environment; the image's entrypoint
/// with `args`. `adjust` changes the runtime spec further. Deleted when dropped.
struct Container {
    id: String,
    bundle: tempfile::TempDir,
    child: Option<std::process::Child>,
}

impl Container {
    fn new(args: &[&str], adjust: impl FnOnce(&mut Value)) -> Self {
        let c = &image().config["config"];
        let bundle = tempfile::tempdir().unwrap();
        let spec = Command::new("runc")
            .arg("spec")
            .current_dir(bundle.path())
            .output()
            .expect("run runc (apt-get install runc)");
        ok(spec, "runc spec");
        let spec_path = bundle.path().join("config.json");
        let mut spec: Value = serde_json::from_slice(&std::fs::read(&spec_path).unwrap()).unwrap();
        let user = c["User"].as_str().unwrap();
        let (uid, gid) = user.split_once(':').unwrap_or((user, user));
        let mut argv = config_strings(&c["Entrypoint"]);
        argv.extend(args.iter().map(|a| a.to_string()));
        spec["process"]["terminal"] = json!(false);
        spec["process"]["args"] = json!(argv);
        spec["process"]["env"] = c["Env"].clone();
        spec["process"]["cwd"] = c["WorkingDir"].clone();
        spec["process"]["user"] = json!({"uid": uid.parse::<u32>().unwrap(), "gid": gid.parse::<u32>().unwrap()});
        spec["root"] = json!({"path": image().rootfs.path(), "readonly": true});
        adjust(&mut spec);
        std::fs::write(&spec_path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
        let id = common::unique("kubecast-image-test");
        Self { id, bundle, child: None }
    }

    fn runc(&self) -> Command {
        let mut cmd = Command::new("runc");
        cmd.arg("--root").arg(self.bundle.path().join("state"));
        cmd
    }

    /// `runc run`: stdout piped, stderr to `stderr.log` in the bundle.
    fn start(&mut self) -> std::process::ChildStdout {
        let stderr = std::fs::File::create(self.bundle.path().join("stderr.log")).unwrap();
        let mut child = self
            .runc()
            .args(["run", "--bundle"])
            .arg(self.bundle.path())
            .arg(&self.id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("run runc");
        let stdout = child.stdout.take().unwrap();
        self.child = Some(child);
        stdout
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.bundle.path().join("stderr.log")).unwrap_or_default()
    }

    /// Runs it to its end: stdout (the run must succeed).
    fn output(mut self) -> String {
        let mut stdout = self.start();
        let mut out = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut out).unwrap();
        let status = self.child.as_mut().unwrap().wait().unwrap();
        assert!(status.success(), "{status} in a container of the image:\n{out}{}", self.stderr());
        out
    }

    /// Sends `signal` and waits (at most `timeout`) for the end.
    fn stop(&mut self, signal: &str, timeout: Duration) -> std::process::ExitStatus {
        ok(self.runc().args(["kill", &self.id, signal]).output().unwrap(), "runc kill");
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut().expect("started");
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "the container did not stop within {timeout:?} after {signal}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = self.runc().args(["delete", "--force", &self.id]).output();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn the_binary_starts_in_the_image_as_its_user() {
    let version = Container::new(&["--version"], |_| {}).output();
    assert_eq!(version.trim(), format!("kubecast {}", env!("CARGO_PKG_VERSION")));
    // The embedded configuration: parsing, defaults.
    let check = Container::new(&["check-config"], |_| {}).output();
    assert!(check.starts_with("config OK:"), "{check}");
}

/// The image's kubecast, in a container on the host's network (the test apiserver listens on
/// 127.0.0.1), its volume a directory owned by 65532 (as a pod's emptyDir) that also holds its
/// kubeconfig and config: it emits the ConfigMap of a fresh namespace as a CloudEvent on stdout, stops on
/// SIGTERM, and leaves its checkpoint in the volume.
#[tokio::test(flavor = "multi_thread")]
async fn the_image_watches_the_test_apiserver() {
    let client = common::client().await;
    let ns = common::TestNamespace::new(&client, "image").await;
    common::create_cm(&client, &ns.name, "probe", json!({}), json!({"k": "v"})).await;

    // The volume holds the kubeconfig (certificates inline: the env's may name files) and the
    // config too: mount points that do not exist in the image would be created in its root.
    let dir = tempfile::tempdir().unwrap();
    let volume = dir.path().join("volume");
    std::fs::create_dir(&volume).unwrap();
    let kubeconfig = ok(
        Command::new(common::env_var("KUBECTL"))
            .args(["config", "view", "--raw", "--flatten", "--kubeconfig", &common::kubeconfig()])
            .output()
            .expect("run kubectl"),
        "kubectl config view",
    );
    std::fs::write(volume.join("kubeconfig"), kubeconfig).unwrap();
    std::fs::write(volume.join("config.toml"), common::cm_config(&ns.name, "")).unwrap();
    for p in [volume.join("kubeconfig"), volume.join("config.toml"), volume.clone()] {
        std::os::unix::fs::chown(&p, Some(65532), Some(65532)).unwrap();
    }
    std::fs::set_permissions(&volume, std::fs::Permissions::from_mode(0o750)).unwrap();
    let mut container = Container::new(&["run", "--config", "/var/lib/kubecast/config.toml"], |spec| {
        let volume =
            json!({"destination": "/var/lib/kubecast", "type": "bind", "source": volume, "options": ["rbind", "rw"]});
        spec["mounts"].as_array_mut().unwrap().push(volume);
        spec["process"]["env"].as_array_mut().unwrap().push(json!("KUBECONFIG=/var/lib/kubecast/kubeconfig"));
        spec["linux"]["namespaces"].as_array_mut().unwrap().retain(|n| n["type"] != "network");
    });
    let stdout = container.start();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
            if tx.send(line.unwrap()).is_err() {
                break;
            }
        }
    });
    let subject = format!("{}/probe", ns.name);
    let deadline = Instant::now() + WAIT;
    let mut lines = Vec::new();
    let event = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let ev: Value =
                    serde_json::from_str(&line).unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {line}"));
                if ev["subject"] == json!(subject) {
                    break ev;
                }
                lines.push(line);
            }
            Err(e) => panic!(
                "no event about {subject} within {WAIT:?} ({e}); stdout:\n{}\nstderr:\n{}",
                lines.join("\n"),
                container.stderr()
            ),
        }
    };
    assert_eq!(event["type"], "io.kubecast.core.ConfigMap.added", "{event}");

    let status = container.stop("TERM", WAIT);
    assert!(status.success(), "kubecast in the container ended with {status} after SIGTERM:\n{}", container.stderr());
    let state = volume.join("kubecast-state");
    let checkpoints: Vec<PathBuf> = std::fs::read_dir(&state)
        .unwrap_or_else(|e| panic!("{}: {e}\n{}", state.display(), container.stderr()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    assert!(!checkpoints.is_empty(), "no checkpoint in the volume:\n{}", container.stderr());
    for p in &checkpoints {
        let m = std::fs::metadata(p).unwrap();
        assert_eq!((m.uid(), m.gid()), (65532, 65532), "{} is not the image user's", p.display());
    }
}
