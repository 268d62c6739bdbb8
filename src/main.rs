use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use kubecast::app::cli::{Cli, Command, LogFormat};
use kubecast::config::Config;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

/// librdkafka's threads and tokio's workers allocate concurrently; glibc's malloc spent most
/// of the delivery path's CPU time (see benches/kafka.rs).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    kubecast::app::allocator::configure();
    kubecast::app::tls_provider();
    // clap would say only that `--config` needs a value (a template that rendered nothing).
    if std::env::var_os("KUBECAST_CONFIG").is_some_and(|v| v.is_empty()) {
        eprintln!(
            "kubecast: error: the environment variable KUBECAST_CONFIG is set but empty (fix: set it to the config file's path, or unset it for the embedded defaults)"
        );
        return ExitCode::from(2);
    }
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match real_main(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kubecast: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::CheckConfig { config, connect } => {
            let cfg = Config::load(config.as_deref())?;
            println!("{}", cfg.summary());
            for w in kubecast::app::ephemeral::warnings(&cfg) {
                eprintln!("kubecast: warning: {w}");
            }
            if !connect {
                return Ok(ExitCode::SUCCESS);
            }
            let rt = kubecast::app::runtime::build().context("starting the runtime")?;
            let findings = rt.block_on(kubecast::app::connect_check::check(&cfg)).map_err(anyhow::Error::msg)?;
            for f in &findings {
                println!("{} {}", if f.problem { "problem:" } else { "ok:" }, f.text);
            }
            let problems = findings.iter().filter(|f| f.problem).count();
            if problems > 0 {
                eprintln!("kubecast: error: {problems} problem(s) with the destinations, each named above");
                return Ok(ExitCode::from(2));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::State { config, command } => {
            let cfg = Config::load(config.as_deref())?;
            if config.is_none() {
                // The state of which deployment: say so when it is the defaults'.
                let place = match cfg.checkpoint.store {
                    kubecast::state::StoreKind::File => format!("directory {}", cfg.checkpoint.dir.display()),
                    other => format!("the {other} store"),
                };
                eprintln!(
                    "kubecast: note: no --config (nor KUBECAST_CONFIG): the embedded defaults, cluster {:?}, state in {place}",
                    cfg.cluster.name
                );
            }
            let rt = kubecast::app::runtime::build().context("starting the runtime")?;
            rt.block_on(kubecast::app::state_cmd::run(cfg, command))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::DeadLetter { config, command } => {
            let cfg = Config::load(config.as_deref())?;
            let rt = kubecast::app::runtime::build().context("starting the runtime")?;
            match rt.block_on(kubecast::app::dead_letter_cmd::run(cfg, command)) {
                Ok(()) => Ok(ExitCode::SUCCESS),
                Err(e) => {
                    eprintln!("kubecast: error: {e}");
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Command::Run { config } => {
            let cfg = Config::load(config.as_deref())?;
            // Flushes the spans still buffered when dropped, after the pipeline stopped.
            let _telemetry = kubecast::observe::trace::init(&cfg.telemetry)?;
            let rt = kubecast::app::runtime::build().context("starting the runtime")?;
            let result = rt.block_on(async move {
                let shutdown = CancellationToken::new();
                tokio::spawn(wait_for_signals(shutdown.clone()));
                kubecast::app::run::run(cfg, shutdown).await
            });
            // A store call given up at the shutdown deadline may still block a thread (librdkafka
            // waits up to its own timeout): not waited for.
            rt.shutdown_timeout(std::time::Duration::from_secs(1));
            result?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// First SIGINT/SIGTERM: clean shutdown. Second: exit at once.
async fn wait_for_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    tracing::info!("shutdown requested; finishing (a second signal aborts)");
    shutdown.cancel();
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    tracing::warn!("second signal: aborting");
    std::process::exit(130);
}

fn init_logging(format: LogFormat) {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // async-nats' connector logs each server address it tries at DEBUG, with a password given
    // in the URL: never below INFO unless that module is asked for by name.
    if !std::env::var("RUST_LOG").is_ok_and(|v| v.contains("async_nats::connector")) {
        filter = filter.add_directive("async_nats::connector=info".parse().expect("a valid directive"));
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
