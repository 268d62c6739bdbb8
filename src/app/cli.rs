//! Command line (clap). Every option can also be set from the environment.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "kubecast",
    version,
    about = "Turns Kubernetes changes into CloudEvents on Kafka, NATS, stdout or a file"
)]
pub struct Cli {
    /// Log format on standard error.
    #[arg(long, env = "KUBECAST_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon: watch the configured resources and publish their changes.
    Run {
        /// TOML config file; without it the embedded defaults are used.
        #[arg(long, short, env = "KUBECAST_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Validate the configuration without connecting to anything (with --connect: and look up
    /// every destination it names).
    CheckConfig {
        /// TOML config file; without it the embedded defaults are checked.
        #[arg(long, short, env = "KUBECAST_CONFIG")]
        config: Option<PathBuf>,
        /// Also connect to the apiserver and the broker and look up, without creating them,
        /// the event topics or the streams of the event subjects, the dead-letter destination
        /// and the state topic; exit 2 naming each problem.
        #[arg(long)]
        connect: bool,
    },
    /// See, reset, export and import the stored state of the streams (see docs/operations.md).
    State {
        /// TOML config file (the store, the cluster, the Lease); without it the defaults.
        #[arg(long, short, env = "KUBECAST_CONFIG", global = true)]
        config: Option<PathBuf>,
        #[command(subcommand)]
        command: super::state_cmd::StateCommand,
    },
    /// List the dead-lettered events, or send them again to their destinations (see
    /// docs/operations.md, "The dead letter").
    DeadLetter {
        /// TOML config file (the dead letter and the sink); without it the defaults.
        #[arg(long, short, env = "KUBECAST_CONFIG", global = true)]
        config: Option<PathBuf>,
        #[command(subcommand)]
        command: super::dead_letter_cmd::DeadLetterCommand,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}
