//! A direct side channel between two processes: length-prefixed JSON
//! messages over one TCP connection (the `--listen` / `--connect` pair that
//! `bench` and `replay` use to exchange agent metadata and control messages).
#![forbid(unsafe_code)]

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::accept::{AcceptBackoff, AfterError};

/// Largest message accepted (bytes): 16 MiB. Side-channel messages are
/// agent metadata (a few KiB per agent; one with the 65,536 regions
/// `engine::metadata::MAX_REGIONS` allows is about 5 MiB as JSON) and
/// control messages (page lists of one request). A length over it is
/// refused before anything is allocated, and a message's buffer grows only
/// as its bytes actually arrive (at most [`RECV_STEP_BYTES`] ahead), so a
/// peer that announces a large message and sends nothing makes this side
/// allocate nothing.
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// The most a receive allocates ahead of the bytes received (bytes).
pub const RECV_STEP_BYTES: usize = 64 << 10;

/// Errors of the side channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SideChannelError {
    /// Socket error from the named call.
    #[error("{call}: {source}")]
    Io {
        /// The call.
        call: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The peer closed the connection.
    #[error("the other process closed the side channel (it exited or failed; its own error says why)")]
    Closed,
    /// A message over [`MAX_MESSAGE_BYTES`].
    #[error("side-channel message of {0} bytes exceeds the limit of {MAX_MESSAGE_BYTES} bytes")]
    TooLarge(usize),
    /// Undecodable JSON.
    #[error("undecodable side-channel message (is the other side a different kvwire version?): {0}")]
    Decode(#[from] serde_json::Error),
    /// The other side sent bytes that no kvwire side channel sends (a
    /// length prefix over [`MAX_MESSAGE_BYTES`]): it is another program, e.g.
    /// an HTTP or SSH server. Holds what it sent, quoted.
    #[error("not a kvwire peer: it sent {0} instead of a kvwire side-channel message")]
    NotKvwire(String),
    /// Nobody answered in time.
    #[error("timed out after {0:?} connecting to {1} (last error: {2})")]
    Timeout(Duration, String, String),
}

fn io_err(call: &'static str) -> impl Fn(io::Error) -> SideChannelError {
    move |source| SideChannelError::Io { call, source }
}

/// A side-channel listener for peers that come from other hosts (`bench
/// --listen`, `replay --role decode --listen`): non-blocking, and its
/// accept survives resource exhaustion as every listener of kvwire's does
/// (issue 27 item 2, `crate::accept`): `EMFILE`/`ENFILE`/`ENOMEM`/`ENOBUFS`
/// back off (5 ms doubling to 250 ms, logged once per episode) and a peer
/// that left while queued is skipped, so one exhausted moment never ends
/// the listener.
#[derive(Debug)]
pub struct SideListener {
    listener: TcpListener,
    addr: SocketAddr,
    backoff: AcceptBackoff,
}

impl SideListener {
    /// Bind `addr` (`IP:PORT`; port 0 picks one) in non-blocking mode.
    ///
    /// # Errors
    /// `bind` or `fcntl` failure.
    pub fn bind(addr: &str) -> Result<Self, SideChannelError> {
        let (listener, addr) = SideChannel::bind(addr)?;
        listener.set_nonblocking(true).map_err(io_err("fcntl(O_NONBLOCK)"))?;
        Ok(Self { listener, addr, backoff: AcceptBackoff::new("side channel") })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Accept one queued peer: `Ok(Some)` with the connected channel,
    /// `Ok(None)` when no peer is queued or after an error that does not
    /// break the listener (resource exhaustion, after its backoff sleep; a
    /// peer that gave up while queued): the caller polls again.
    ///
    /// # Errors
    /// The listener itself failed (`accept` with `EBADF`, `EINVAL`, ...).
    pub fn try_accept(&mut self) -> Result<Option<SideChannel>, SideChannelError> {
        match self.listener.accept() {
            Ok((stream, _)) => {
                self.backoff.accepted();
                stream.set_nonblocking(false).map_err(io_err("fcntl(O_NONBLOCK)"))?;
                stream.set_nodelay(true).map_err(io_err("setsockopt(TCP_NODELAY)"))?;
                Ok(Some(SideChannel { stream }))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => match self.backoff.failed(&e) {
                AfterError::Retry => Ok(None),
                AfterError::Stop => Err(SideChannelError::Io { call: "accept", source: e }),
            },
        }
    }
}

/// One end of a connected side channel.
#[derive(Debug)]
pub struct SideChannel {
    stream: TcpStream,
}

impl SideChannel {
    /// Bind `addr` (e.g. `127.0.0.1:0`) and return the listener and its address.
    ///
    /// # Errors
    /// `bind` failure.
    pub fn bind(addr: &str) -> Result<(TcpListener, SocketAddr), SideChannelError> {
        let l = TcpListener::bind(addr).map_err(io_err("bind"))?;
        let a = l.local_addr().map_err(io_err("getsockname"))?;
        Ok((l, a))
    }

    /// Accept one peer on `listener`.
    ///
    /// # Errors
    /// `accept` failure.
    pub fn accept(listener: &TcpListener) -> Result<Self, SideChannelError> {
        let (stream, _) = listener.accept().map_err(io_err("accept"))?;
        stream.set_nodelay(true).map_err(io_err("setsockopt(TCP_NODELAY)"))?;
        Ok(Self { stream })
    }

    /// Connect to `addr`, retrying until `timeout` (the peer may still be starting).
    ///
    /// # Errors
    /// [`SideChannelError::Timeout`].
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self, SideChannelError> {
        let deadline = Instant::now() + timeout;
        let mut last = String::from("no address");
        loop {
            for a in addr.to_socket_addrs().map_err(io_err("resolve"))? {
                match TcpStream::connect_timeout(&a, Duration::from_secs(1)) {
                    Ok(stream) => {
                        stream.set_nodelay(true).map_err(io_err("setsockopt(TCP_NODELAY)"))?;
                        return Ok(Self { stream });
                    }
                    Err(e) => last = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                return Err(SideChannelError::Timeout(timeout, addr.to_string(), last));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A second handle on the same connection (e.g. one thread receives
    /// while another sends).
    ///
    /// # Errors
    /// `dup` failure.
    pub fn try_clone(&self) -> Result<Self, SideChannelError> {
        Ok(Self { stream: self.stream.try_clone().map_err(io_err("dup"))? })
    }

    /// Bound every receive by `timeout` (`None`: wait forever).
    ///
    /// # Errors
    /// `setsockopt` failure.
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> Result<(), SideChannelError> {
        self.stream.set_read_timeout(timeout).map_err(io_err("setsockopt(SO_RCVTIMEO)"))
    }

    /// Shut the connection down both ways (every handle to it): a thread
    /// blocked receiving on it sees it closed.
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Send one message.
    ///
    /// # Errors
    /// Socket failure, or a message over the limit.
    pub fn send<T: Serialize>(&mut self, msg: &T) -> Result<(), SideChannelError> {
        let body = serde_json::to_vec(msg)?;
        if body.len() > MAX_MESSAGE_BYTES {
            return Err(SideChannelError::TooLarge(body.len()));
        }
        let mut frame = Vec::with_capacity(4 + body.len());
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(&body);
        self.stream.write_all(&frame).map_err(io_err("send"))
    }

    /// Receive one message.
    ///
    /// # Errors
    /// [`SideChannelError::Closed`] at end of stream, socket failure or
    /// timeout, a length over the limit, undecodable JSON.
    pub fn recv<T: DeserializeOwned>(&mut self) -> Result<T, SideChannelError> {
        let mut len = [0u8; 4];
        match self.stream.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(SideChannelError::Closed),
            Err(e) => return Err(SideChannelError::Io { call: "recv", source: e }),
        }
        let n = u32::from_le_bytes(len) as usize;
        if n > MAX_MESSAGE_BYTES {
            // `send` never announces more: another program is talking.
            return Err(SideChannelError::NotKvwire(self.quote_foreign(len)));
        }
        let body = read_body(&mut self.stream, n)?;
        Ok(serde_json::from_slice(&body)?)
    }

    /// What a foreign peer sent, starting with `first`, for an error
    /// message: its first line when it is text (`"HTTP/1.1 400 Bad
    /// Request"`), else the bytes in hex. Reads at most 60 more bytes, for
    /// at most 100 ms.
    fn quote_foreign(&mut self, first: [u8; 4]) -> String {
        let mut bytes = first.to_vec();
        let old = self.stream.read_timeout().ok().flatten();
        if self.stream.set_read_timeout(Some(Duration::from_millis(100))).is_ok() {
            let mut more = [0u8; 60];
            if let Ok(k) = self.stream.read(&mut more) {
                bytes.extend_from_slice(&more[..k]);
            }
            let _ = self.stream.set_read_timeout(old);
        }
        let text = |b: &u8| b.is_ascii_graphic() || *b == b' ';
        let line = bytes.split(|b| *b == b'\r' || *b == b'\n').next().unwrap_or_default();
        if line.len() >= 4 && line.iter().all(text) {
            format!("{:?}", String::from_utf8_lossy(line))
        } else {
            let hex: Vec<String> = first.iter().map(|b| format!("{b:02x}")).collect();
            format!("the bytes {}", hex.join(" "))
        }
    }

    /// Decode one message body (the bytes after the length prefix) as
    /// [`SideChannel::recv`] does: the decode entry of the side channel,
    /// for tests of hostile input.
    ///
    /// # Errors
    /// [`SideChannelError::TooLarge`], [`SideChannelError::Decode`].
    pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, SideChannelError> {
        if body.len() > MAX_MESSAGE_BYTES {
            return Err(SideChannelError::TooLarge(body.len()));
        }
        Ok(serde_json::from_slice(body)?)
    }
}

/// Read exactly `n` bytes, growing the buffer by at most [`RECV_STEP_BYTES`]
/// ahead of what arrived.
fn read_body(r: &mut impl Read, n: usize) -> Result<Vec<u8>, SideChannelError> {
    let mut body = Vec::with_capacity(n.min(RECV_STEP_BYTES));
    while body.len() < n {
        let at = body.len();
        let step = (n - at).min(RECV_STEP_BYTES);
        body.resize(at + step, 0);
        match r.read(&mut body[at..]) {
            Ok(0) => return Err(SideChannelError::Closed),
            Ok(k) => body.truncate(at + k),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => body.truncate(at),
            Err(e) => return Err(SideChannelError::Io { call: "recv", source: e }),
        }
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_close_is_reported() {
        let (l, addr) = SideChannel::bind("127.0.0.1:0").unwrap();
        let t = std::thread::spawn(move || {
            let mut s = SideChannel::accept(&l).unwrap();
            let v: Vec<u32> = s.recv().unwrap();
            s.send(&v.iter().sum::<u32>()).unwrap();
        });
        let mut c = SideChannel::connect(&addr.to_string(), Duration::from_secs(5)).unwrap();
        c.send(&vec![1u32, 2, 3]).unwrap();
        assert_eq!(c.recv::<u32>().unwrap(), 6);
        t.join().unwrap();
        assert!(matches!(c.recv::<u32>(), Err(SideChannelError::Closed)));
    }

    #[test]
    fn a_huge_announced_length_is_refused_before_allocating() {
        let (l, addr) = SideChannel::bind("127.0.0.1:0").unwrap();
        let t = std::thread::spawn(move || {
            let mut s = SideChannel::accept(&l).unwrap();
            // 256 MiB announced (the old limit): refused, nothing read.
            let r = s.recv::<u32>();
            assert!(matches!(&r, Err(SideChannelError::NotKvwire(q)) if q == "the bytes 00 00 00 10"), "{r:?}");
        });
        let mut raw = TcpStream::connect(addr).unwrap();
        raw.write_all(&(256u32 << 20).to_le_bytes()).unwrap();
        t.join().unwrap();
        const { assert!(MAX_MESSAGE_BYTES <= 16 << 20) };
    }

    #[test]
    fn an_http_server_is_reported_as_not_a_kvwire_peer() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n").unwrap();
            std::thread::sleep(Duration::from_millis(300));
        });
        let mut c = SideChannel::connect(&addr, Duration::from_secs(5)).unwrap();
        let e = c.recv::<u32>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "not a kvwire peer: it sent \"HTTP/1.1 400 Bad Request\" instead of a kvwire side-channel message"
        );
        t.join().unwrap();
    }

    #[test]
    fn an_announced_length_allocates_only_as_bytes_arrive() {
        // A reader that announces MAX_MESSAGE_BYTES and then delivers 10
        // bytes and EOF: the buffer never grows past one step.
        struct Few(usize);
        impl Read for Few {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                assert!(buf.len() <= RECV_STEP_BYTES, "asked for {} bytes at once", buf.len());
                let n = self.0.min(buf.len());
                self.0 -= n;
                buf[..n].fill(b' ');
                Ok(n)
            }
        }
        assert!(matches!(read_body(&mut Few(10), MAX_MESSAGE_BYTES), Err(SideChannelError::Closed)));
        assert_eq!(
            read_body(&mut Few(RECV_STEP_BYTES * 3 + 5), RECV_STEP_BYTES * 3 + 5).unwrap().len(),
            RECV_STEP_BYTES * 3 + 5
        );
    }
}
