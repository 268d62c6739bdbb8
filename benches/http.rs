//! Delivery over HTTP at steady offered rates: kubecast's HTTP sink (`[sink] type = "http"`)
//! POSTing into a local receiver, against a raw reqwest client POSTing kubecast's own requests
//! at the same rate. Prints figures; asserts nothing about time.
//!
//!     cargo bench --bench http                       # 1500 and 10000 events/s, 15 s each, 3 rounds
//!     cargo bench --bench http -- --rates 1500 --seconds 30 --rounds 5
//!     cargo bench --bench http -- --side kubecast --mode structured   # one run kind only
//!
//! The receiver is this benchmark's own binary in a child process (`--serve-receiver PORT`, 0:
//! any free port; it prints the port): an axum HTTP/1.1 server on one thread answering 202 with
//! an empty body to every POST once it has read the whole request, so its CPU is not this
//! process's; it notes when each request arrived and which event it was (the
//! `ce-resourceversion` header in binary mode, the `resourceversion` attribute of the body in
//! structured mode), and hands the notes over afterwards (`GET /take`).
//!
//! Per offered rate and mode (binary, structured), each round runs both sides, in alternating
//! order, after `sync` and a second's pause:
//! - kubecast: its own wiring (`Pipeline::start_downstream` as `kubecast run` starts it:
//!   shaping and CloudEvent, the outbound queue with per-object order and `max_in_flight` 1000,
//!   the HTTP sink, acknowledgements, the persister with a file checkpoint); a task standing for
//!   the reflector hands it the items of the recorded watch lines (~8 KB Pods, 5000 objects,
//!   the stream of the Kafka and NATS benchmarks cycled through its first 10000 lines) at the
//!   offered rate, each at its due time (tokio's timer: up to ~1 ms late, in small bursts);
//! - raw: a reqwest client built with the sink's settings POSTs the requests kubecast makes of
//!   the same lines (its headers and body in that mode, made before the clock starts), fed at the
//!   same rate by the same kind of task, at most 1000 in flight.
//!
//! Measured from the first due time to the last response (kubecast: the queue's end, every
//! event acknowledged): requests per second achieved; this process's CPU per event (user +
//! system, every thread, `getrusage`; the receiver is another process) and context switches
//! per event; the receiver's CPU per event; the latency of each event from its due time to the
//! moment the receiver had the whole request (its clock and this one are the same machine's
//! `CLOCK_REALTIME`), p50 / p99 / max; the p99 of a request's own time, send to response: for
//! kubecast from its `kubecast_publish_latency_seconds` histogram on its admin server's
//! `/metrics` (started in this process), so an upper bucket bound (the buckets double from
//! 0.5 ms), for the raw client measured around each request; and the connections the receiver
//! accepted (each side's client is new for each run). Where a rate is not reached the figures
//! say so (events/s below the offered rate).
//! No server of the test environment is needed.

mod common;

use std::io::BufRead as _;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use http::HeaderMap;
use kubecast::app::wiring::{CHANNEL_CAPACITY, Pipeline};
use kubecast::model::EventSource;
use kubecast::sink::Sink;
use kubecast::sink::http::Mode;
use kubecast::source::reflector::Item;
use kubecast::state::store::file::FileStore;
use kubecast::state::store::{Owner, Store};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The allocator of the kubecast binary (src/main.rs).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Distinct recorded lines; longer runs cycle through them (each line is copied as it is fed).
const RECORDED: usize = 10_000;
/// `[delivery] max_in_flight`'s default, which kubecast's side runs with: the raw client's bound.
const MAX_IN_FLIGHT: usize = 1000;

fn main() {
    if let Some(port) = common::arg("--serve-receiver") {
        receiver::serve(&port);
        return;
    }
    common::run_like_the_binary(run());
}

async fn run() {
    let rates: Vec<u32> = common::arg("--rates")
        .unwrap_or_else(|| "1500,10000".into())
        .split(',')
        .map(|r| r.trim().parse().expect("--rates N,M,..."))
        .collect();
    let seconds: f64 = common::arg("--seconds").map_or(15.0, |s| s.parse().expect("--seconds S"));
    let rounds = common::arg("--rounds").map_or(3, |r| r.parse::<usize>().expect("--rounds N")).max(1);
    let modes: Vec<Mode> = [Mode::Binary, Mode::Structured]
        .into_iter()
        .filter(|m| common::arg("--mode").is_none_or(|x| x == mode_name(*m)))
        .collect();
    let most = rates.iter().map(|&r| (f64::from(r) * seconds) as usize).max().unwrap_or(0);
    let recording = common::record(most.clamp(1, RECORDED));
    let receiver = Receiver::spawn();
    let metrics = Metrics::start().await;
    println!(
        "{} recorded Pods (~{:.1} KB each), {seconds} s per rate and mode, {rounds} round(s), the receiver (pid {}) at {}",
        recording.len(),
        recording.iter().map(Bytes::len).sum::<usize>() as f64 / recording.len() as f64 / 1024.0,
        receiver.pid(),
        receiver.url
    );
    // What the raw client sends: kubecast's own requests of each recorded line, made before
    // anything is measured (only when the raw side runs).
    let raw_runs = common::side("raw");
    let messages = |mode| Arc::new(if raw_runs { kubecast_requests(&recording, mode) } else { Vec::new() });
    let requests: Vec<(Mode, Arc<Vec<Message>>)> = modes.iter().map(|&m| (m, messages(m))).collect();

    // Warm-up outside the measurements: connections, the allocator, kubecast's first run in a
    // process (the NATS benchmark saw it cost up to 1.7x the later ones).
    let warmup = 3000.min(recording.len());
    for (mode, messages) in &requests {
        if common::side("kubecast") {
            kubecast_run(&receiver, &metrics, *mode, &recording, 1500, warmup).await;
        }
        if raw_runs {
            raw_run(&receiver, messages, 1500, warmup).await;
        }
    }

    let mut results: Vec<Run> = Vec::new();
    for round in 0..rounds {
        for &rate in &rates {
            let events = ((f64::from(rate) * seconds) as usize).max(1);
            for (mode, messages) in &requests {
                let raw_side = async {
                    if !raw_runs {
                        return None;
                    }
                    let f = raw_run(&receiver, messages, rate, events).await;
                    println!("round {} at {rate}/s, {} mode, raw: {}", round + 1, mode_name(*mode), f.summary);
                    Some(f)
                };
                let kubecast_side = async {
                    if !common::side("kubecast") {
                        return None;
                    }
                    let f = kubecast_run(&receiver, &metrics, *mode, &recording, rate, events).await;
                    println!("round {} at {rate}/s, {} mode, kubecast: {}", round + 1, mode_name(*mode), f.summary);
                    Some(f)
                };
                let (raw, kubecast) = common::in_turn(round, raw_side, kubecast_side).await;
                results.push(Run { rate, mode: *mode, raw, kubecast });
            }
        }
    }
    report(&results, &rates, &modes, rounds);
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Binary => "binary",
        Mode::Structured => "structured",
    }
}

/// One round's runs at one rate in one mode.
struct Run {
    rate: u32,
    mode: Mode,
    raw: Option<Figures>,
    kubecast: Option<Figures>,
}

/// One run's figures.
struct Figures {
    events: usize,
    /// Events (requests answered) per second, first due time to last response.
    per_second: f64,
    cpu_us: f64,
    switches: f64,
    receiver_cpu_us: f64,
    /// Due time -> the receiver has the request, ms.
    p50: f64,
    p99: f64,
    max: f64,
    /// A request's own p99 (send -> response), ms; `request_bound`: an upper bucket bound.
    request_p99: f64,
    request_bound: bool,
    /// Requests the receiver got beyond one per event (retries).
    extra: usize,
    /// Connections the receiver accepted.
    connections: u64,
    /// One line: events/s, p99, connections, CPU and switches per event of each thread kind.
    summary: String,
}

/// The medians over the rounds, per rate and mode: each side's figures, and the ratio of
/// kubecast's CPU per event to the raw client's in the same round.
fn report(results: &[Run], rates: &[u32], modes: &[Mode], rounds: usize) {
    println!();
    println!("medians over {rounds} round(s); latency: from the event's due time to the receiver having the request");
    println!(
        "{:>8} {:>11} {:>9} {:>8} {:>10} {:>13} {:>15} {:>14} {:>8} {:>8} {:>8} {:>15} {:>12}",
        "offered",
        "mode",
        "side",
        "events",
        "events/s",
        "CPU µs/event",
        "switches/event",
        "receiver µs/ev",
        "p50 ms",
        "p99 ms",
        "max ms",
        "request p99 ms",
        "connections"
    );
    for &rate in rates {
        for &mode in modes {
            let runs: Vec<&Run> = results.iter().filter(|r| r.rate == rate && r.mode == mode).collect();
            for side in ["raw", "kubecast"] {
                let figures: Vec<&Figures> = runs
                    .iter()
                    .filter_map(|r| if side == "raw" { r.raw.as_ref() } else { r.kubecast.as_ref() })
                    .collect();
                if figures.is_empty() {
                    continue;
                }
                let m = |f: fn(&Figures) -> f64| common::median(figures.iter().map(|x| f(x)).collect());
                let request = m(|f| f.request_p99);
                let request =
                    if figures[0].request_bound { format!("<= {request:.1}") } else { format!("{request:.2}") };
                let extra: usize = figures.iter().map(|f| f.extra).sum();
                println!(
                    "{rate:>8} {:>11} {side:>9} {:>8} {:>10.0} {:>13.1} {:>15.2} {:>14.1} {:>8.2} {:>8.2} {:>8.1} {:>15} {:>12.0}{}",
                    mode_name(mode),
                    figures[0].events,
                    m(|f| f.per_second),
                    m(|f| f.cpu_us),
                    m(|f| f.switches),
                    m(|f| f.receiver_cpu_us),
                    m(|f| f.p50),
                    m(|f| f.p99),
                    m(|f| f.max),
                    request,
                    m(|f| f.connections as f64),
                    if extra > 0 { format!(" ({extra} requests sent again)") } else { String::new() }
                );
                let reached = m(|f| f.per_second);
                if reached < 0.97 * f64::from(rate) {
                    println!("{:>8} {side} did not reach {rate} events/s: {reached:.0} events/s", "");
                }
            }
            let ratios: Vec<f64> =
                runs.iter().filter_map(|r| Some(r.kubecast.as_ref()?.cpu_us / r.raw.as_ref()?.cpu_us)).collect();
            if !ratios.is_empty() {
                let each: Vec<String> = ratios.iter().map(|x| format!("{x:.2}")).collect();
                println!(
                    "{:>8} kubecast / raw CPU per event: {:.2}x (rounds: {})",
                    "",
                    common::median(ratios.clone()),
                    each.join(", ")
                );
            }
        }
    }
}

/// The paced feed: event `i` is due `i / rate` seconds after the start.
#[derive(Clone, Copy)]
struct Clock {
    start: tokio::time::Instant,
    /// The start on the wall clock, µs since the epoch (the receiver's timestamps are too).
    start_us: f64,
    every: f64,
}

impl Clock {
    fn start(rate: u32) -> Self {
        let start = tokio::time::Instant::now();
        Clock { start, start_us: wall_us(), every: 1.0 / f64::from(rate.max(1)) }
    }

    /// Until event `i` is due (at once if it is).
    async fn wait(&self, i: usize) {
        let due = self.start + Duration::from_secs_f64(self.every * i as f64);
        if due > tokio::time::Instant::now() {
            tokio::time::sleep_until(due).await;
        }
    }

    fn due_us(&self, i: usize) -> f64 {
        self.start_us + self.every * 1e6 * i as f64
    }

    fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
}

fn wall_us() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64() * 1e6
}

/// kubecast's wiring into the receiver, fed `events` items at `rate` per second.
async fn kubecast_run(
    receiver: &Receiver,
    metrics: &Metrics,
    mode: Mode,
    recording: &Arc<Vec<Bytes>>,
    rate: u32,
    events: usize,
) -> Figures {
    let dir = tempfile::tempdir().unwrap();
    let sink =
        format!("[sink]\ntype = \"http\"\n\n[sink.http]\nurl = \"{}\"\nmode = \"{}\"\n", receiver.url, mode_name(mode));
    let mut pipeline = Pipeline::new(common::config(dir.path(), &sink));
    let config = pipeline.config.clone();
    assert_eq!(config.delivery.max_in_flight, MAX_IN_FLIGHT, "the raw client's bound is kubecast's");
    let sink = Arc::new(Sink::open(&config.sink, config.delivery.max_in_flight).await.expect("sink"));
    let store = Store::File(FileStore::open(&config.checkpoint.dir, Owner::default()).expect("checkpoint store"));
    pipeline.load(store).await.expect("positions");
    let source = Arc::new(EventSource::new(&config.cluster.name, &common::pods()));
    let recording = recording.clone();
    let cycle = recording.len();
    let cancel = CancellationToken::new();
    let (_, connections) = receiver.take().await;
    common::settle();

    let published = metrics.publish_latency().await;
    let before = Usage::now(receiver);
    let (items_tx, items_rx) = mpsc::channel::<Item>(pipeline.bounds().channel_capacity());
    let mut downstream =
        pipeline.start_downstream(sink.clone(), items_rx, &kubecast::observe::health::Health::new(Vec::new()), &cancel);
    let clock = Clock::start(rate);
    // The reflector's part: each recorded line read (copied) and decoded as it is due.
    let feeder = tokio::spawn(async move {
        for i in 0..events {
            clock.wait(i).await;
            let line = &recording[i % recording.len()];
            if items_tx.send(common::item(i as u64, &common::read(line), &source)).await.is_err() {
                return;
            }
        }
    });
    downstream.queue.await.unwrap().expect("delivered");
    let wall = clock.elapsed();
    let after = Usage::now(receiver);
    let request_p99 = histogram_p99(&published, &metrics.publish_latency().await);
    feeder.await.unwrap();
    downstream.shaper.await.unwrap();
    cancel.cancel();
    if let Some(p) = downstream.persister.take() {
        p.await.unwrap().expect("persisted");
    }
    drop(sink);
    figures(receiver, events, cycle, connections, wall, &clock, &before, &after, request_p99, true).await
}

/// One request as the raw client sends it: kubecast's headers (binary mode: the `ce-*`
/// attributes and `Content-Type`; structured: `Content-Type`) and body.
type Message = (HeaderMap, Bytes);

/// The requests kubecast's HTTP sink makes of the recording's events in `mode`.
fn kubecast_requests(recording: &[Bytes], mode: Mode) -> Vec<Message> {
    let source = Arc::new(EventSource::new("bench", &common::pods()));
    recording.iter().map(|line| kubecast::sink::http::encode(&common::event(line, &source), mode)).collect()
}

/// A reqwest client as the sink builds it for an `http://` URL with the default settings
/// (`src/sink/http/client.rs`: HTTP version `auto`, 10 s timeout, no redirects).
fn raw_client() -> reqwest::Client {
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let timeout = Duration::from_secs(10);
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .timeout(timeout)
        .connect_timeout(timeout)
        .redirect(reqwest::redirect::Policy::none())
        .pool_idle_timeout(Duration::from_secs(60))
        .tcp_keepalive(Duration::from_secs(30))
        .user_agent("kubecast-bench-raw")
        .build()
        .expect("reqwest client")
}

/// The raw client: `events` of `messages` (cycled) POSTed as they fall due at `rate` per
/// second, at most [`MAX_IN_FLIGHT`] in flight, each response's body read.
async fn raw_run(receiver: &Receiver, messages: &Arc<Vec<Message>>, rate: u32, events: usize) -> Figures {
    let client = raw_client();
    let url: reqwest::Url = receiver.url.parse().unwrap();
    let messages = messages.clone();
    let cycle = messages.len();
    let (_, connections) = receiver.take().await;
    common::settle();

    let before = Usage::now(receiver);
    let (tx, mut rx) = mpsc::channel::<Message>(CHANNEL_CAPACITY);
    let clock = Clock::start(rate);
    let feeder = tokio::spawn(async move {
        for i in 0..events {
            clock.wait(i).await;
            let (headers, body) = &messages[i % messages.len()];
            if tx.send((headers.clone(), body.clone())).await.is_err() {
                return;
            }
        }
    });
    // A task of the runtime, as kubecast's stages are.
    let sender = tokio::spawn(async move {
        let mut in_flight = FuturesUnordered::new();
        let mut took = Vec::with_capacity(events);
        let mut open = true;
        while open || !in_flight.is_empty() {
            tokio::select! {
                Some(t) = in_flight.next(), if !in_flight.is_empty() => took.push(t),
                m = rx.recv(), if open && in_flight.len() < MAX_IN_FLIGHT => match m {
                    Some((headers, body)) => in_flight.push(post(&client, &url, headers, body)),
                    None => open = false,
                },
            }
        }
        took
    });
    let mut took = sender.await.unwrap();
    let wall = clock.elapsed();
    let after = Usage::now(receiver);
    feeder.await.unwrap();
    assert_eq!(took.len(), events, "every request answered");
    took.sort_by(f64::total_cmp);
    let request_p99 = quantile(&took, 0.99) * 1000.0;
    figures(receiver, events, cycle, connections, wall, &clock, &before, &after, request_p99, false).await
}

/// One POST; its time from send to the response's end, seconds.
async fn post(client: &reqwest::Client, url: &reqwest::Url, headers: HeaderMap, body: Bytes) -> f64 {
    let t = Instant::now();
    let response = client.post(url.clone()).headers(headers).body(body).send().await.expect("the receiver answers");
    assert!(response.status().is_success(), "{}", response.status());
    response.bytes().await.expect("the response's body");
    t.elapsed().as_secs_f64()
}

/// The CPU and context switches of this process (every thread, `getrusage`), per thread kind,
/// and the receiver's CPU: a snapshot.
struct Usage {
    cpu: f64,
    switches: f64,
    threads: std::collections::BTreeMap<String, (f64, f64)>,
    receiver_cpu: f64,
}

impl Usage {
    fn now(receiver: &Receiver) -> Self {
        // SAFETY: getrusage fills the struct it is given; a zeroed rusage is a valid value.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0, "getrusage");
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        let mut threads = std::collections::BTreeMap::new();
        for t in common::threads() {
            let e = threads.entry(t.name).or_insert((0.0, 0.0));
            e.0 += t.cpu;
            e.1 += t.voluntary + t.involuntary;
        }
        Usage {
            cpu: secs(u.ru_utime) + secs(u.ru_stime),
            switches: (u.ru_nvcsw + u.ru_nivcsw) as f64,
            threads,
            receiver_cpu: receiver.cpu_seconds(),
        }
    }
}

/// A run's figures from its usage snapshots and the receiver's notes.
#[allow(clippy::too_many_arguments)]
async fn figures(
    receiver: &Receiver,
    events: usize,
    cycle: usize,
    connections_before: u64,
    wall: f64,
    clock: &Clock,
    before: &Usage,
    after: &Usage,
    request_p99: f64,
    request_bound: bool,
) -> Figures {
    let n = events as f64;
    let (notes, connections) = receiver.take().await;
    let (mut ms, extra) = latencies(notes, events, cycle, clock);
    ms.sort_by(f64::total_cmp);
    let threads: Vec<String> = after
        .threads
        .iter()
        .map(|(name, (cpu, sw))| {
            let (c0, s0) = before.threads.get(name).copied().unwrap_or((0.0, 0.0));
            (name, cpu - c0, sw - s0)
        })
        .filter(|(_, cpu, sw)| *cpu > 0.0 || *sw > 0.0)
        .map(|(name, cpu, sw)| format!("{name} {:.1} µs / {:.2}", cpu / n * 1e6, sw / n))
        .collect();
    Figures {
        events,
        per_second: n / wall,
        cpu_us: (after.cpu - before.cpu) / n * 1e6,
        switches: (after.switches - before.switches) / n,
        receiver_cpu_us: (after.receiver_cpu - before.receiver_cpu) / n * 1e6,
        p50: quantile(&ms, 0.5),
        p99: quantile(&ms, 0.99),
        max: quantile(&ms, 1.0),
        request_p99,
        request_bound,
        extra,
        connections: connections - connections_before,
        summary: format!(
            "{:.0} events/s, p99 {:.1} ms, {} connections; per event (thread: CPU / switches): {}",
            n / wall,
            quantile(&ms, 0.99),
            connections - connections_before,
            if threads.is_empty() { "-".to_string() } else { threads.join(", ") }
        ),
    }
}

/// Per event, the ms from its due time to its arrival at the receiver, and how many requests
/// arrived beyond one per event. The receiver names each request by its event's
/// resourceVersion, which repeats every `cycle` events (the recording's length) when the
/// recording is cycled: the requests with one resourceVersion are matched, in the order they
/// arrived, to the events that carry it, in feed order. Those are events of one object (a
/// recording is cycled only when it has `RECORDED` lines, a multiple of the objects), which
/// kubecast sends one after the other; the raw client sends them `RECORDED / rate` seconds
/// apart.
fn latencies(receipts: Vec<(u64, f64)>, events: usize, cycle: usize, clock: &Clock) -> (Vec<f64>, usize) {
    let mut by_rv: std::collections::HashMap<u64, Vec<f64>> = std::collections::HashMap::new();
    for (rv, at) in receipts {
        by_rv.entry(rv).or_default().push(at);
    }
    let mut out = Vec::with_capacity(events);
    let mut extra = 0;
    for (rv, mut times) in by_rv {
        let first = (rv as usize).wrapping_sub(common::FIRST_RESOURCE_VERSION);
        assert!(first < cycle, "a request without a resourceVersion of this run's events ({rv})");
        times.sort_by(f64::total_cmp);
        for (m, at) in times.into_iter().enumerate() {
            let position = first + m * cycle;
            if position >= events {
                extra += 1;
                continue;
            }
            out.push((at - clock.due_us(position)) / 1000.0);
        }
    }
    assert_eq!(out.len(), events, "every event received");
    (out, extra)
}

/// The `q` quantile of sorted `v` (nearest rank).
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() as f64 - 1.0) * q).round() as usize]
}

/// kubecast's `/metrics`, as its admin server serves it (started once, in this process, on a
/// free local port).
struct Metrics {
    url: String,
    client: reqwest::Client,
}

impl Metrics {
    async fn start() -> Self {
        let config = kubecast::observe::admin::AdminConfig { listen: "127.0.0.1:0".into() };
        let health = kubecast::observe::health::Health::new(Vec::new());
        // Left serving until the process ends.
        let addr = kubecast::observe::admin::serve(&config, health, CancellationToken::new())
            .await
            .expect("the admin server")
            .expect("an address");
        Metrics { url: format!("http://{addr}/metrics"), client: raw_client() }
    }

    /// The `kubecast_publish_latency_seconds` histogram (the time of each accepted send: for
    /// HTTP the sink's request, from its send to the response's end): (upper bound, cumulative
    /// count) per bucket.
    async fn publish_latency(&self) -> Vec<(f64, f64)> {
        let text = self.client.get(&self.url).send().await.expect("/metrics").text().await.expect("/metrics");
        text.lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("kubecast_publish_latency_seconds_bucket{le=\"")?;
                let (le, count) = rest.split_once("\"}")?;
                let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
                Some((le, count.split_whitespace().next()?.parse().ok()?))
            })
            .collect()
    }
}

/// The upper bound (ms) of the bucket holding the p99 of what was observed between two
/// snapshots of the histogram.
fn histogram_p99(before: &[(f64, f64)], after: &[(f64, f64)]) -> f64 {
    let delta: Vec<(f64, f64)> = after.iter().zip(before).map(|((le, a), (_, b))| (*le, a - b)).collect();
    let Some(&(_, total)) = delta.last() else { return f64::NAN };
    delta.iter().find(|(_, c)| *c >= 0.99 * total).map_or(f64::NAN, |(le, _)| le * 1000.0)
}

/// The receiver child process: killed when dropped.
struct Receiver {
    child: std::process::Child,
    url: String,
    /// For `GET /take` (not the measured clients).
    client: reqwest::Client,
}

impl Receiver {
    /// This benchmark's binary again, with `--serve-receiver 0`; waits for its port.
    fn spawn() -> Self {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--serve-receiver", "0"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("the receiver starts");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).expect("the receiver's port");
        let port: u16 = line.trim().parse().unwrap_or_else(|_| panic!("the receiver's port, got {line:?}"));
        Receiver { child, url: format!("http://127.0.0.1:{port}/events"), client: raw_client() }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its CPU seconds (user + system), from `/proc/<pid>/stat` (ticks of 1/100 s).
    fn cpu_seconds(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).expect("the receiver runs");
        let f: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().collect();
        (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
    }

    /// What it received since the last call: (resourceVersion, arrival in µs since the epoch),
    /// and how many connections it accepted so far.
    async fn take(&self) -> (Vec<(u64, f64)>, u64) {
        let url = self.url.replace("/events", "/take");
        let text = self.client.get(url).send().await.expect("the receiver answers").text().await.expect("its notes");
        let mut lines = text.lines();
        let connections = lines
            .next()
            .and_then(|l| l.strip_prefix("connections "))
            .and_then(|n| n.parse().ok())
            .expect("`connections N` first");
        let notes = lines
            .map(|l| {
                let (rv, at) = l.split_once(' ').expect("`rv µs`");
                (rv.parse().expect("a resourceVersion"), at.parse().expect("µs"))
            })
            .collect();
        (notes, connections)
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The receiver's side (in the child process).
mod receiver {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use axum::Router;
    use axum::body::Bytes;
    use axum::extract::State;
    use axum::routing::{get, post};
    use axum::serve::ListenerExt as _;
    use http::{HeaderMap, StatusCode};

    /// What arrived: (resourceVersion, µs since the epoch when the whole request was read).
    type Notes = Arc<Mutex<Vec<(u64, u64)>>>;

    /// Connections accepted so far.
    static CONNECTIONS: AtomicU64 = AtomicU64::new(0);

    /// Serves on 127.0.0.1:`port` (0: any free port), printing the port, until killed or its
    /// standard input ends (the benchmark is gone): one thread (a current-thread runtime),
    /// HTTP/1.1 with keep-alive, `TCP_NODELAY` on its connections.
    pub fn serve(port: &str) {
        let port: u16 = port.parse().expect("--serve-receiver PORT");
        std::thread::spawn(|| {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            std::process::exit(0);
        });
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.expect("a local port");
            println!("{}", listener.local_addr().unwrap().port());
            // As receivers commonly do (Go's net/http, hyper servers that set it).
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
                CONNECTIONS.fetch_add(1, Ordering::Relaxed);
            });
            let notes: Notes = Arc::default();
            let app = Router::new().route("/events", post(receive)).route("/take", get(take)).with_state(notes);
            axum::serve(listener, app).await.expect("serving");
        });
    }

    /// Where a structured event's `resourceversion` attribute starts (the object's own is
    /// `resourceVersion`).
    const NEEDLE: &[u8] = b"\"resourceversion\":\"";

    /// 202 to every event, noted with its resourceVersion and arrival time.
    async fn receive(State(notes): State<Notes>, headers: HeaderMap, body: Bytes) -> StatusCode {
        let at = super::wall_us() as u64;
        let rv = match headers.get("ce-resourceversion") {
            Some(v) => v.to_str().ok().and_then(|v| v.parse().ok()),
            None => memchr::memmem::find(&body, NEEDLE).and_then(|i| {
                let rest = &body[i + NEEDLE.len()..];
                let end = rest.iter().position(|b| !b.is_ascii_digit())?;
                std::str::from_utf8(&rest[..end]).ok()?.parse().ok()
            }),
        };
        // None: u64::MAX, which the benchmark reports as no event of its run.
        notes.lock().unwrap().push((rv.unwrap_or(u64::MAX), at));
        StatusCode::ACCEPTED
    }

    /// The connections accepted so far (`connections N`), then the notes since the last call,
    /// one `rv µs` per line.
    async fn take(State(notes): State<Notes>) -> String {
        let taken = std::mem::take(&mut *notes.lock().unwrap());
        let mut out = String::with_capacity(taken.len() * 24 + 32);
        out.push_str(&format!("connections {}\n", CONNECTIONS.load(Ordering::Relaxed)));
        for (rv, at) in taken {
            out.push_str(&format!("{rv} {at}\n"));
        }
        out
    }
}
