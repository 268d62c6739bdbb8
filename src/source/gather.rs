//! Gathering watch events on the apiserver's connection while they arrive fast.
//!
//! A watch delivers each change as it happens, and each one that finds the process waiting
//! wakes it: at 1500 changes/s, 1500 wake-ups a second for a few microseconds of work each.
//! While changes come in quick succession, [`GatherStream`] asks the kernel (`SO_RCVLOWAT`)
//! not to signal the socket readable until [`LOW_WATER`] bytes wait, or until a short window
//! ([`Gather::window`]) has passed: one wake-up then reads every change of the window. When
//! changes come slowly, nothing is gathered and nothing waits.
//!
//! Invariant: no byte waits longer than the window. Whenever the connection's reader finds
//! nothing to read while gathering, a timer for the window's end is armed; at its end the
//! low-water mark goes back to one byte, which the kernel signals at once if data waits.
//!
//! Written by hand: no crate offers an adaptive receive low-water mark for a tokio socket.

use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// Bytes that may wait before the kernel signals the socket while gathering: reached before
/// the window ends only at high rates (~30 Pods of 8 KB), where waiting longer gains nothing.
pub const LOW_WATER: usize = 256 * 1024;
/// Reads in quick succession (each within the window of the one before) before gathering
/// starts: a response that arrives in a few pieces is not delayed.
const STREAK: u32 = 4;

/// How long to gather; `Duration::ZERO` turns gathering off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gather {
    pub window: Duration,
}

impl Gather {
    pub const OFF: Gather = Gather { window: Duration::ZERO };

    pub fn from_millis(ms: u32) -> Self {
        Gather { window: Duration::from_millis(u64::from(ms)) }
    }

    pub fn is_on(self) -> bool {
        !self.window.is_zero()
    }
}

/// A TCP connection that gathers what arrives in quick succession (see the module's text).
pub struct GatherStream {
    tcp: TcpStream,
    gather: Gather,
    /// When the last read that returned data happened.
    last_data: Option<Instant>,
    /// Reads in quick succession so far.
    streak: u32,
    /// Whether the low-water mark is raised (until `timer`'s deadline).
    gathering: bool,
    /// The window's end, made once per connection and reset for each window.
    timer: Option<Pin<Box<Sleep>>>,
    /// When the last window ended.
    ended_at: Option<Instant>,
}

impl GatherStream {
    pub fn new(tcp: TcpStream, gather: Gather) -> Self {
        GatherStream { tcp, gather, last_data: None, streak: 0, gathering: false, timer: None, ended_at: None }
    }

    /// Ends the window: the kernel signals the socket again for any byte (at once if some wait).
    fn stop_gathering(&mut self) {
        self.gathering = false;
        // A failure leaves the mark as it was; the next read finds the data at the latest when
        // the watch's idle timeout ends it. It does not fail: setting it needs no privilege.
        if let Err(e) = set_low_water(&self.tcp, 1) {
            tracing::debug!(error = %e, "SO_RCVLOWAT could not be lowered");
        }
    }

    /// After a read that returned data: gathers while reads come in quick succession (each
    /// within a window of the read before it, or of the end of the last window).
    fn after_data(&mut self) {
        let now = Instant::now();
        let window = self.gather.window;
        let within = |t: Option<Instant>| t.is_some_and(|t| now.duration_since(t) <= window);
        let quick = within(self.last_data) || within(self.ended_at);
        self.last_data = Some(now);
        self.ended_at = None;
        self.streak = if quick { self.streak.saturating_add(1) } else { 0 };
        if self.streak >= STREAK && !self.gathering && set_low_water(&self.tcp, LOW_WATER).is_ok() {
            self.gathering = true;
            crate::observe::metrics::get().watch_gathered.inc();
            match self.timer.as_mut() {
                Some(timer) => timer.as_mut().reset(now + window),
                None => self.timer = Some(Box::pin(tokio::time::sleep_until(now + window))),
            }
        }
    }
}

fn set_low_water(tcp: &TcpStream, bytes: usize) -> io::Result<()> {
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: a valid socket descriptor owned by `tcp`, an option value of the size given.
    let rc = unsafe {
        libc::setsockopt(
            tcp.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw const value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

impl AsyncRead for GatherStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.gather.is_on() {
            return Pin::new(&mut this.tcp).poll_read(cx, buf);
        }
        // The window ended: lower the mark before reading, so the read sees everything. (While
        // it has not, polling it arms the timer that wakes this reader at its end.)
        if this.gathering
            && let Some(timer) = this.timer.as_mut()
            && timer.as_mut().poll(cx).is_ready()
        {
            this.stop_gathering();
            this.ended_at = Some(Instant::now());
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.tcp).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            this.after_data();
        } else if this.gathering {
            // The end of the stream: nothing to gather any more.
            this.stop_gathering();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for GatherStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

impl Connection for GatherStream {
    fn connected(&self) -> Connected {
        self.tcp.connected()
    }
}

/// hyper's TCP connector, its connections wrapped in [`GatherStream`].
#[derive(Clone)]
pub struct GatherConnector {
    http: HttpConnector,
    gather: Gather,
}

impl GatherConnector {
    pub fn new(http: HttpConnector, gather: Gather) -> Self {
        GatherConnector { http, gather }
    }
}

impl tower::Service<http::Uri> for GatherConnector {
    type Response = TokioIo<GatherStream>;
    type Error = <HttpConnector as tower::Service<http::Uri>>::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.http.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connecting = self.http.call(uri);
        let gather = self.gather;
        Box::pin(async move {
            let tcp = connecting.await?.into_inner();
            Ok(TokioIo::new(GatherStream::new(tcp, gather)))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use tokio::io::AsyncReadExt as _;

    use super::*;

    /// A connected pair: the writing end (a thread writes on it) and a gathering reading end.
    async fn pair(gather: Gather) -> (std::net::TcpStream, GatherStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let reading = TcpStream::connect(addr).await.unwrap();
        let (writing, _) = listener.accept().unwrap();
        writing.set_nodelay(true).unwrap();
        (writing, GatherStream::new(reading, gather))
    }

    /// Writes `bursts` of `n` messages of `size` bytes, `every` apart, with `pause` after each
    /// burst, then closes.
    fn write(
        mut w: std::net::TcpStream,
        bursts: usize,
        n: usize,
        size: usize,
        every: Duration,
        pause: Duration,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let message = vec![b'x'; size];
            for _ in 0..bursts {
                for _ in 0..n {
                    w.write_all(&message).unwrap();
                    std::thread::sleep(every);
                }
                std::thread::sleep(pause);
            }
        })
    }

    /// Reads to the end: (bytes, reads that returned data).
    async fn read_all(mut r: GatherStream) -> (usize, usize) {
        let mut buf = vec![0u8; 1 << 20];
        let (mut bytes, mut reads) = (0, 0);
        loop {
            // A bound for a stuck read, far above any window: the test fails rather than hangs.
            let n =
                tokio::time::timeout(Duration::from_secs(30), r.read(&mut buf)).await.expect("a read ended").unwrap();
            if n == 0 {
                return (bytes, reads);
            }
            bytes += n;
            reads += 1;
        }
    }

    #[tokio::test]
    async fn fast_messages_are_read_in_fewer_reads_and_none_is_left_behind() {
        let window = Duration::from_millis(50);
        let (w, r) = pair(Gather { window }).await;
        // Three bursts of 300 messages 1 ms apart, each followed by a pause of several windows:
        // the last message of each burst must be read although nothing follows it for a while.
        let writer = write(w, 3, 300, 1000, Duration::from_millis(1), window * 4);
        let (bytes, reads) = read_all(r).await;
        writer.join().unwrap();
        assert_eq!(bytes, 3 * 300 * 1000, "every byte read");
        // Without gathering a read per message (900); gathering reads a window's worth at once.
        assert!(reads < 300, "{reads} reads for 900 messages arriving 1 ms apart, gathered for 50 ms");
    }

    #[tokio::test]
    async fn the_last_message_of_a_burst_is_read_when_the_window_ends_not_when_more_come() {
        let window = Duration::from_millis(20);
        let (mut w, mut r) = pair(Gather { window }).await;
        // A burst that starts gathering, its last message written within the open window, then
        // silence with the connection open: that message must be read with nothing after it.
        let burst = std::thread::spawn(move || {
            for _ in 0..50 {
                w.write_all(&[b'x'; 100]).unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
            w.write_all(b"last").unwrap();
            w
        });
        let mut buf = vec![0u8; 1 << 16];
        let (mut got, mut tail) = (0, Vec::new());
        while got < 50 * 100 + 4 {
            let n =
                tokio::time::timeout(Duration::from_secs(30), r.read(&mut buf)).await.expect("a read ended").unwrap();
            got += n;
            tail.extend_from_slice(&buf[..n]);
        }
        assert!(tail.ends_with(b"last"));
        assert!(r.last_data.is_some() && r.streak >= STREAK, "the burst was gathered (streak {})", r.streak);
        drop(burst.join().unwrap());
    }

    #[tokio::test]
    async fn slow_messages_are_not_gathered() {
        let window = Duration::from_millis(5);
        let (w, r) = pair(Gather { window }).await;
        // 20 messages 30 ms apart: never within a window of each other.
        let writer = write(w, 1, 20, 100, Duration::from_millis(30), Duration::ZERO);
        let (bytes, reads) = read_all(r).await;
        writer.join().unwrap();
        assert_eq!(bytes, 2000);
        assert_eq!(reads, 20, "each message read on its own, when it arrived");
    }

    #[tokio::test]
    async fn off_reads_as_a_plain_socket() {
        let (w, r) = pair(Gather::OFF).await;
        let writer = write(w, 1, 200, 1000, Duration::from_micros(200), Duration::ZERO);
        let (bytes, _) = read_all(r).await;
        writer.join().unwrap();
        assert_eq!(bytes, 200_000);
    }
}
