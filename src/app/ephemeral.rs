//! Files that would go with the pod: the file dead letter and the file state store on storage
//! that does not outlive it. A Kubernetes emptyDir is a folder of the node's disk under the
//! pod's `volumes/kubernetes.io~empty-dir/`, bind-mounted into the container: in
//! `/proc/self/mountinfo` the mount's root (field 4) names it. A tmpfs (an emptyDir with
//! `medium: Memory`, or a `/tmp` or `/dev/shm` outside Kubernetes) goes at the latest with the
//! machine. Read by `kubecast check-config` and logged at the start of `run` as warnings: such a
//! place may be fine for a demo, never for events or positions that must outlive a pod.
//!
//! Written by hand: no maintained crate reads mountinfo's root field without pulling in a
//! whole process-inspection library, and the format is one line per mount (`proc(5)`).

use std::path::{Component, Path, PathBuf};

use crate::config::Config;
use crate::delivery::DeadLetterType;
use crate::state::StoreKind;

/// A mount that does not outlive the pod (or the machine).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ephemeral {
    pub mount_point: PathBuf,
    /// In words: "an emptyDir (…)" or "a tmpfs".
    pub what: String,
}

/// The mount of `path` (an existing path, or its nearest existing ancestor) in
/// `/proc/self/mountinfo`, if it does not outlive the pod. `None` where mountinfo cannot be read.
pub fn mount_of(path: &Path) -> Option<Ephemeral> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    ephemeral_in(&info, &resolve(path))
}

/// `path` made absolute and, as far as it exists, with its links resolved.
fn resolve(path: &Path) -> PathBuf {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().map(|d| d.join(path)).unwrap_or_else(|_| path.to_path_buf())
    };
    let mut rest = Vec::new();
    let mut at = abs.as_path();
    loop {
        if let Ok(real) = at.canonicalize() {
            return rest.iter().rev().fold(real, |p, c: &&std::ffi::OsStr| p.join(c));
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name);
                at = parent;
            }
            _ => return abs,
        }
    }
}

/// The mount `path` is on, from the text of a mountinfo file, if it is ephemeral.
pub fn ephemeral_in(mountinfo: &str, path: &Path) -> Option<Ephemeral> {
    let mut best: Option<(usize, Mount)> = None;
    for line in mountinfo.lines() {
        let Some(m) = Mount::parse(line) else { continue };
        if !path.starts_with(&m.mount_point) {
            continue;
        }
        let depth = m.mount_point.components().filter(|c| matches!(c, Component::Normal(_))).count();
        // The deepest mount point holds the path; of equal ones the later mount is on top.
        if best.as_ref().is_none_or(|(d, _)| depth >= *d) {
            best = Some((depth, m));
        }
    }
    let (_, m) = best?;
    if let Some(at) = m.root.find("/kubernetes.io~empty-dir/") {
        let name = m.root[at + "/kubernetes.io~empty-dir/".len()..].split('/').next().unwrap_or_default();
        return Some(Ephemeral {
            mount_point: m.mount_point,
            what: format!("an emptyDir (volume {name:?}): it is deleted with the pod"),
        });
    }
    (m.fstype == "tmpfs" || m.fstype == "ramfs").then(|| Ephemeral {
        mount_point: m.mount_point,
        what: format!("a {} (memory): it is lost with the pod or the machine", m.fstype),
    })
}

struct Mount {
    root: String,
    mount_point: PathBuf,
    fstype: String,
}

impl Mount {
    /// `36 35 98:0 /root /mount/point rw,noatime master:1 - ext3 /dev/root rw` (proc(5)).
    fn parse(line: &str) -> Option<Self> {
        let (left, right) = line.split_once(" - ")?;
        let mut fields = left.split(' ');
        let root = unescape(fields.nth(3)?);
        let mount_point = PathBuf::from(unescape(fields.next()?));
        let fstype = right.split(' ').next()?.to_string();
        Some(Self { root, mount_point, fstype })
    }
}

/// mountinfo writes space, tab, newline and backslash as `\040`, `\011`, `\012`, `\134`.
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let code = rest.get(at + 1..at + 4).and_then(|d| u8::from_str_radix(d, 8).ok());
        match code {
            Some(c) => {
                out.push(char::from(c));
                rest = &rest[at + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// A warning for each of the config's files that would not outlive the pod: the file dead
/// letter and the file state store's directory.
pub fn warnings(config: &Config) -> Vec<String> {
    warnings_with(config, mount_of)
}

fn warnings_with(config: &Config, mount_of: impl Fn(&Path) -> Option<Ephemeral>) -> Vec<String> {
    let mut out = Vec::new();
    if config.delivery.dead_letter.kind == DeadLetterType::File {
        let path =
            config.delivery.dead_letter.path.clone().unwrap_or_else(|| config.checkpoint.dir.join("dead-letter.jsonl"));
        if let Some(e) = mount_of(&path) {
            out.push(format!(
                "[delivery.dead_letter] the file {} is on {} ({}): dead-lettered events would be lost with it (fix: with a Kafka or NATS sink, type = \"broker\" and a destination; else a path on a persistent volume)",
                path.display(),
                e.mount_point.display(),
                e.what
            ));
        }
    }
    if config.checkpoint.store == StoreKind::File
        && let Some(e) = mount_of(&config.checkpoint.dir)
    {
        out.push(format!(
            "[checkpoint] dir {} is on {} ({}): the stream positions would be lost with it, and every stream would start over by its `initial` setting (fix: store = \"kafka\" or \"nats\" with a broker sink, or a persistent volume)",
            config.checkpoint.dir.display(),
            e.mount_point.display(),
            e.what
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As a container of a pod on the test node sees its mounts (the emptyDir of the chart's
    /// checkpoint volume, a projected token, the image's root).
    const POD: &str = "\
1500 1400 0:120 / / rw,relatime master:300 - overlay overlay rw,lowerdir=/var/lib/containerd/a
1501 1500 0:122 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
1510 1500 259:1 /var/lib/kubelet/pods/5d1c/volumes/kubernetes.io~empty-dir/kubecast-state /var/lib/kubecast rw,relatime - ext4 /dev/nvme0n1p1 rw
1511 1500 259:1 /var/lib/kubelet/pods/5d1c/volumes/kubernetes.io~empty-dir/kubecast-tmp /tmp rw,relatime - ext4 /dev/nvme0n1p1 rw
1512 1500 0:130 / /var/run/secrets/kubernetes.io/serviceaccount ro,relatime - tmpfs tmpfs rw,size=65536k
1513 1500 259:1 /var/lib/kubelet/pods/5d1c/volumes/kubernetes.io~csi/pvc-1/mount /data\\040dir rw - ext4 /dev/nvme0n1p1 rw
1514 1500 0:131 / /dev/shm rw - tmpfs shm rw
1515 1514 0:132 / /dev/shm rw - ext4 /dev/sdb rw
";

    #[test]
    fn an_empty_dir_is_named_by_its_volume_and_a_volume_claim_is_not_ephemeral() {
        let e = ephemeral_in(POD, Path::new("/var/lib/kubecast/dead-letter.jsonl")).expect("an emptyDir");
        assert_eq!(e.mount_point, Path::new("/var/lib/kubecast"));
        assert!(e.what.contains("emptyDir (volume \"kubecast-state\")"), "{e:?}");
        assert_eq!(ephemeral_in(POD, Path::new("/data dir/state")), None, "a claim outlives the pod");
        assert_eq!(ephemeral_in(POD, Path::new("/etc/kubecast")), None, "the image's root");
        assert_eq!(ephemeral_in(POD, Path::new("/var/lib/kubecastx")), None, "a prefix is not a parent");
    }

    #[test]
    fn a_tmpfs_is_ephemeral_and_the_mount_on_top_counts() {
        let e = ephemeral_in(POD, Path::new("/var/run/secrets/kubernetes.io/serviceaccount/token")).unwrap();
        assert!(e.what.contains("tmpfs"), "{e:?}");
        // /dev/shm is mounted twice: the later mount (a disk) is the one in use.
        assert_eq!(ephemeral_in(POD, Path::new("/dev/shm/x")), None);
        let only_tmpfs = POD.lines().filter(|l| !l.starts_with("1515")).collect::<Vec<_>>().join("\n");
        assert!(ephemeral_in(&only_tmpfs, Path::new("/dev/shm/x")).is_some());
    }

    #[test]
    fn escapes_and_broken_lines() {
        assert_eq!(unescape("/a\\040b\\134c\\"), "/a b\\c\\");
        assert!(Mount::parse("garbage").is_none());
        assert_eq!(ephemeral_in("1 2 3\nnot a mount - x\n", Path::new("/x")), None);
    }

    #[test]
    fn warnings_name_the_dead_letter_file_and_the_state_directory() {
        let on_empty_dir = |p: &Path| ephemeral_in(POD, p);
        let mut config = Config::load(None).expect("the embedded defaults");
        config.delivery.dead_letter = Default::default();
        config.checkpoint.dir = "/var/lib/kubecast".into();
        config.checkpoint.store = StoreKind::File;
        let w = warnings_with(&config, on_empty_dir);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].starts_with("[delivery.dead_letter] the file /var/lib/kubecast/dead-letter.jsonl is on /var/lib/kubecast (an emptyDir"), "{w:?}");
        assert!(w[1].starts_with("[checkpoint] dir /var/lib/kubecast is on /var/lib/kubecast"), "{w:?}");
        // A broker dead letter and a broker store: nothing on the pod.
        config.delivery.dead_letter.kind = DeadLetterType::Broker;
        config.checkpoint.store = StoreKind::Kafka;
        assert!(warnings_with(&config, on_empty_dir).is_empty());
        // A dead-letter file on a claim.
        config.delivery.dead_letter.kind = DeadLetterType::File;
        config.delivery.dead_letter.path = Some("/data dir/dl.jsonl".into());
        assert!(warnings_with(&config, on_empty_dir).is_empty());
    }
}
