//! The target side: a listener thread and one service thread per accepted
//! connection. A service thread answers READ/WRITE requests against the
//! registered regions only (key and bounds checked, under the region
//! table's read lock so a region cannot be deregistered mid-access) and
//! queues notifications. Anything else is refused and logged.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use super::io::{self as tio, Range};
use super::wire::{self, Header, Kind, SegmentDesc, Status};
use crate::transport::{Notification, TransportError};

/// A registered local region, as the service checks requests against it.
#[derive(Debug, Clone, Copy)]
pub struct LocalRegion {
    /// Start address (bytes).
    pub addr: u64,
    /// Length (bytes).
    pub len_bytes: u64,
}

/// Regions by remote key. Service threads hold the read lock while they
/// touch a region's memory; `deregister` takes the write lock.
pub type RegionTable = Arc<RwLock<HashMap<u32, LocalRegion>>>;
/// Notifications received, drained by `take_notifications`.
pub type NotifQueue = Arc<Mutex<Vec<Notification>>>;

struct Shared {
    regions: RegionTable,
    notifs: NotifQueue,
    stopping: AtomicBool,
    timeout: Duration,
    conns: Mutex<Vec<(TcpStream, JoinHandle<()>)>>,
}

/// The listener and its service threads; dropping it stops them all.
pub struct Service {
    listener: Arc<TcpListener>,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl Service {
    /// Start serving `listener`.
    ///
    /// # Errors
    /// [`TransportError::Io`] when the thread cannot be spawned.
    pub fn start(
        listener: TcpListener,
        regions: RegionTable,
        notifs: NotifQueue,
        timeout: Duration,
    ) -> Result<Self, TransportError> {
        let listener = Arc::new(listener);
        let shared = Arc::new(Shared {
            regions,
            notifs,
            stopping: AtomicBool::new(false),
            timeout,
            conns: Mutex::new(Vec::new()),
        });
        let accept = {
            let (l, s) = (listener.clone(), shared.clone());
            std::thread::Builder::new()
                .name("kvwire-tcp-listen".into())
                .spawn(move || accept_loop(&l, &s))
                .map_err(|e| TransportError::io("spawn", e))?
        };
        Ok(Self { listener, shared, accept: Some(accept) })
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        // Wakes the thread blocked in accept (it then gets EINVAL).
        let _ = nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        let conns = std::mem::take(&mut *self.shared.conns.lock().unwrap_or_else(|p| p.into_inner()));
        for (s, _) in &conns {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        for (_, h) in conns {
            let _ = h.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    while let Ok((stream, from)) = listener.accept() {
        if shared.stopping.load(Ordering::Acquire) {
            break;
        }
        let Ok(handle) = stream.try_clone() else {
            continue;
        };
        let s = shared.clone();
        let spawned = std::thread::Builder::new().name("kvwire-tcp-serve".into()).spawn(move || {
            if let Err(e) = serve_conn(&stream, &s) {
                tracing::debug!("tcp: connection from {from} ended: {e}");
            }
            // `conns` holds a clone: close explicitly so the peer sees it now.
            let _ = stream.shutdown(std::net::Shutdown::Both);
        });
        match spawned {
            Ok(h) => {
                let mut conns = shared.conns.lock().unwrap_or_else(|p| p.into_inner());
                conns.retain(|(_, h)| !h.is_finished());
                conns.push((handle, h));
            }
            Err(e) => tracing::warn!("tcp: cannot serve {from}: {e}"),
        }
    }
}

fn protocol(e: wire::WireError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

fn read_header(sock: &TcpStream) -> io::Result<Header> {
    let mut b = [0u8; wire::HEADER_BYTES];
    tio::read_exact(sock, &mut b)?;
    Header::decode(&b).map_err(protocol)
}

/// Wait for the first byte of the next request; idle time is not a failure.
/// `Ok(false)` at a clean close or when the service stops.
fn wait_request(mut sock: &TcpStream, first: &mut [u8; 1], stopping: &AtomicBool) -> io::Result<bool> {
    loop {
        match sock.read(first) {
            Ok(0) => return Ok(false),
            Ok(_) => return Ok(true),
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                if stopping.load(Ordering::Acquire) {
                    return Ok(false);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

fn respond(mut sock: &TcpStream, id: u64, status: Status, reason: &str) -> io::Result<()> {
    let reason = &reason.as_bytes()[..reason.len().min(wire::MAX_REASON_BYTES as usize)];
    let h = Header { kind: Kind::Resp, count: status as u32, id, len: reason.len() as u64 };
    let mut frame = Vec::with_capacity(wire::HEADER_BYTES + reason.len());
    frame.extend_from_slice(&h.encode());
    frame.extend_from_slice(reason);
    sock.write_all(&frame)
}

fn serve_conn(sock: &TcpStream, shared: &Shared) -> io::Result<()> {
    sock.set_nodelay(true)?;
    sock.set_read_timeout(Some(shared.timeout))?;
    sock.set_write_timeout(Some(shared.timeout))?;
    let hello = read_header(sock)?;
    if hello.kind != Kind::Hello {
        tracing::warn!("tcp: expected a hello, got {:?}; dropping the connection", hello.kind);
        return Ok(());
    }
    let mut name = vec![0u8; hello.body_bytes()];
    tio::read_exact(sock, &mut name)?;
    let agent =
        String::from_utf8(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "agent name not UTF-8"))?;
    let ack = Header { kind: Kind::HelloAck, count: 0, id: wire::MAGIC_VERSION, len: 0 };
    (&*sock).write_all(&ack.encode())?;

    let mut body = Vec::new();
    let mut segs: Vec<SegmentDesc> = Vec::new();
    let mut ranges: Vec<Range> = Vec::new();
    let mut hdr = [0u8; wire::HEADER_BYTES];
    let mut first = [0u8; 1];
    loop {
        if !wait_request(sock, &mut first, &shared.stopping)? {
            return Ok(());
        }
        hdr[0] = first[0];
        tio::read_exact(sock, &mut hdr[1..])?;
        let h = match Header::decode(&hdr) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!("tcp: refused a frame from {agent}: {e}; dropping the connection");
                let _ = respond(sock, 0, Status::Protocol, &e.to_string());
                return Ok(());
            }
        };
        body.resize(h.body_bytes(), 0);
        tio::read_exact(sock, &mut body)?;
        match h.kind {
            Kind::Write | Kind::Read => {
                if let Err(e) = wire::decode_segments(&h, &body, &mut segs) {
                    tracing::warn!("tcp: refused a request from {agent}: {e}; dropping the connection");
                    let _ = respond(sock, h.id, Status::Protocol, &e.to_string());
                    return Ok(());
                }
                serve_data(sock, shared, &agent, &h, &segs, &mut ranges)?;
            }
            Kind::Notify => {
                shared
                    .notifs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(Notification { from_agent: agent.clone(), payload: body.clone() });
                respond(sock, h.id, Status::Ok, "")?;
            }
            other => {
                tracing::warn!("tcp: unexpected {other:?} frame from {agent}; dropping the connection");
                let _ = respond(sock, h.id, Status::Protocol, "unexpected frame kind");
                return Ok(());
            }
        }
    }
}

/// Check every segment against the region table; the reason for the first
/// violation, if any.
fn check(table: &HashMap<u32, LocalRegion>, segs: &[SegmentDesc], ranges: &mut Vec<Range>) -> Option<String> {
    ranges.clear();
    for s in segs {
        let Some(r) = table.get(&s.rkey) else {
            return Some(format!("remote access error: unknown rkey {}", s.rkey));
        };
        let inside = s.addr >= r.addr && s.addr.checked_add(s.len_bytes).is_some_and(|e| e <= r.addr + r.len_bytes);
        if !inside {
            return Some(format!(
                "remote access error: {:#x}+{} outside rkey {} ({:#x}+{})",
                s.addr, s.len_bytes, s.rkey, r.addr, r.len_bytes
            ));
        }
        ranges.push((s.addr, s.len_bytes));
    }
    None
}

fn serve_data(
    sock: &TcpStream,
    shared: &Shared,
    agent: &str,
    h: &Header,
    segs: &[SegmentDesc],
    ranges: &mut Vec<Range>,
) -> io::Result<()> {
    let table = shared.regions.read().unwrap_or_else(|p| p.into_inner());
    if let Some(why) = check(&table, segs, ranges) {
        drop(table);
        tracing::warn!("tcp: refused a {:?} from {agent}: {why}", h.kind);
        if h.kind == Kind::Write {
            tio::drain(sock, h.len)?;
        }
        return respond(sock, h.id, Status::RemoteAccess, &why);
    }
    let never = AtomicBool::new(false);
    match h.kind {
        Kind::Write => {
            // SAFETY: every range lies inside a registered region (checked
            // above) whose memory its owner keeps alive until deregister,
            // which waits for the read lock we hold. No Rust reference here
            // aliases it; concurrent access by the application follows the
            // one-sided contract (it must not touch a transfer's target).
            unsafe { tio::read_ranges(sock, ranges, &never)? };
            drop(table);
            respond(sock, h.id, Status::Ok, "")
        }
        _ => {
            let resp = Header { kind: Kind::Resp, count: Status::Ok as u32, id: h.id, len: h.len };
            // SAFETY: as above; writev only reads the ranges.
            let r = unsafe { tio::write_ranges(sock, &resp.encode(), ranges) };
            drop(table);
            r
        }
    }
}
