//! kubecast's test kit, shared by `tests/` and `benches/`:
//!
//! * [`env`]: the real servers started by `tests/env/up` (one environment shared by every test)
//!   and the compacting apiserver of `tests/env/compacting`, found through their env files;
//! * [`cluster`]: a Kubernetes client for them, namespaces, ConfigMaps;
//! * [`process`]: running the kubecast binary ([`Kubecast`]: a file sink and a checkpoint dir
//!   in a fresh directory, its log, its admin server, signals);
//! * [`sink`]: reading what it emitted (JSON lines of CloudEvents);
//! * [`receiver`]: the CloudEvents HTTP receiver example, run as a process;
//! * [`topic`]: a Kafka topic read to its end as it is now;
//! * [`traffic`]: a steady load of changes and an independent Kafka or NATS consumer that
//!   judges what was published (nothing lost, per-object order, duplicates);
//! * [`node`]: the single-node cluster of `tests/env/node`: the image, helm, kubectl, pods.
//!
//! Everything is also re-exported here, so a test reads `use kubecast_kit as common;` and
//! `common::client()`. The kit does not depend on the kubecast library: tests drive the binary.

pub mod cluster;
pub mod env;
pub mod node;
pub mod process;
pub mod receiver;
pub mod sink;
pub mod topic;
pub mod traffic;

pub use cluster::{
    Barrier, TestNamespace, barrier, client, client_for, cm_config, create_cm, create_cms, create_namespace, hundred_changes, lease_cm_config,
    names, settle, settle_at, unique, wait_until_expired,
};
pub use env::{
    Env, Paused, Stopped, compacting_kubeconfig, compacting_up, env, env_file, env_script, env_up, env_var, kubeconfig, repo_root,
    scale_up, sharded_kubeconfig,
};
pub use process::{Kubecast, bin, dead_letter_ok, set_bin};
pub use sink::{about, pretty, read_events, verb, without};
