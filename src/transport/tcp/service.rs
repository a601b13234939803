//! The target side: a listener thread and one service thread per accepted
//! connection. Every connection starts with a challenge: the target sends a
//! random nonce and serves nothing until the initiator proves it knows the
//! agent secret published in the connection info (`auth::prove`); a missing
//! or wrong proof is refused (status `DENIED`), logged and the connection
//! closed. A service thread then answers READ/WRITE requests against the
//! registered regions only (key and bounds checked) and queues
//! notifications. Anything else is refused and logged.
//!
//! No lock is held across socket I/O of the region table: a request looks its
//! regions up under the table's read lock for a moment and holds only those
//! regions' own `busy` read locks while it moves data; `deregister` removes the
//! region from the table first, then waits for the region's `busy` write lock.
//! Every request has a deadline ([`request_limit`]), so a peer that trickles
//! bytes cannot make `deregister`, or anyone else, wait without bound.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::io::{self as tio, Deadline, Range};
use super::wire::{self, Header, Kind, SegmentDesc, Status};
use crate::accept::{AcceptBackoff, AfterError};
use crate::transport::auth::{self, AgentSecret, Nonce};
use crate::transport::{Notification, TransportError};

/// Slowest data rate a request may have before its deadline cuts it off
/// (bytes per second): see [`request_limit`].
pub(super) const MIN_REQUEST_RATE: u64 = 16 << 20;

/// The longest a request carrying `len` data bytes may take, from its header
/// to its response: `peer_timeout` + `len` / [`MIN_REQUEST_RATE`] (a 4 MiB
/// chunk: `peer_timeout` + 0.25 s). Past it the connection is dropped.
pub(super) fn request_limit(peer_timeout: Duration, len: u64) -> Duration {
    peer_timeout + Duration::from_secs_f64(len as f64 / MIN_REQUEST_RATE as f64)
}

/// A registered local region, as the service checks requests against it.
#[derive(Debug)]
pub(super) struct LocalRegion {
    /// Start address (bytes).
    pub addr: u64,
    /// Length (bytes).
    pub len_bytes: u64,
    /// Read-held by each request that moves data in the region.
    busy: RwLock<()>,
    /// The memory, kept alive while registered (and by each transfer that
    /// uses it as its local side).
    pub backing: Arc<dyn crate::transport::MemoryBacking>,
}

impl LocalRegion {
    /// A region of `len_bytes` at `addr`.
    pub(super) fn new(backing: Arc<dyn crate::transport::MemoryBacking>) -> Self {
        let d = backing.desc();
        Self { addr: d.addr, len_bytes: d.len_bytes, busy: RwLock::new(()), backing }
    }

    /// Wait until no request touches the region (call after removing it
    /// from the table, so no new request can find it). Bounded by the
    /// deadline of the requests in progress.
    pub(super) fn wait_idle(&self) {
        drop(self.busy.write().unwrap_or_else(|p| p.into_inner()));
    }
}

/// Regions by remote key. Looked up under the read lock for a moment; see
/// the module docs.
pub(super) type RegionTable = Arc<RwLock<HashMap<u32, Arc<LocalRegion>>>>;
/// Notifications received, drained by `take_notifications`.
pub(super) type NotifQueue = Arc<crate::transport::notify::NotifQueue>;

struct Shared {
    secret: AgentSecret,
    regions: RegionTable,
    notifs: NotifQueue,
    stopping: AtomicBool,
    timeout: Duration,
    conns: Mutex<Vec<Conn>>,
    /// Most connections that have not yet proved the secret (the oldest is
    /// dropped to admit a new one).
    max_preauth: usize,
    /// This transport's counters (`fenced` counted here).
    counters: Arc<crate::metrics::LinkCounters>,
}

/// [`Conn::state`]: waiting for the hello's proof.
const PREAUTH: u8 = 0;
/// [`Conn::state`]: proved the secret.
const AUTHED: u8 = 1;
/// [`Conn::state`]: dropped to make room under `max_preauth`.
const EVICTED: u8 = 2;

/// One accepted connection: a clone of its socket (to close it from here),
/// its service thread (set just after the spawn), and where it stands.
/// The thread removes its own entry when it ends, so a dead connection's
/// descriptor goes at once, not at the next accept.
struct Conn {
    id: u64,
    /// Once authenticated: the agent name it proved and its session.
    agent: Option<(String, u64)>,
    /// Once authenticated: the generation of the connection from the hello,
    /// which a FENCE names.
    generation: u64,
    sock: TcpStream,
    thread: Option<JoinHandle<()>>,
    state: Arc<AtomicU8>,
    fence: Arc<Fence>,
}

/// A connection's fence: once `fenced` is set no more of its data reaches
/// memory (a WRITE stops between two `readv` calls, the rest is dropped
/// with the connection); `copying` is held while a WRITE reads into
/// memory, so the fencer, having set the flag and shut the socket down
/// (waking a blocked `readv`), waits on it for the last `readv` to return.
#[derive(Default)]
struct Fence {
    fenced: AtomicBool,
    copying: Mutex<()>,
}

impl Fence {
    /// Held while the connection's thread puts a request's bytes into
    /// memory or its notification into the queue; `None` once fenced.
    fn enter(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        let g = self.copying.lock().unwrap_or_else(|p| p.into_inner());
        (!self.fenced.load(Ordering::Acquire)).then_some(g)
    }

    /// Fence the connection over `sock`: no more of its data is taken,
    /// and its thread, if it waits in a read, is woken. [`Fence::wait_out`]
    /// then waits for a copy in progress. False when it was fenced already.
    fn close(&self, sock: &TcpStream) -> bool {
        let first = !self.fenced.swap(true, Ordering::AcqRel);
        let _ = sock.shutdown(std::net::Shutdown::Both);
        first
    }

    /// Return once the thread's last read into memory (or notification
    /// push) since [`Fence::close`] has ended.
    fn wait_out(&self) {
        drop(self.copying.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

/// The listener and its service threads; dropping it stops them all.
pub(super) struct Service {
    listener: Arc<TcpListener>,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl Service {
    /// Start serving `listener`.
    ///
    /// # Errors
    /// [`TransportError::Io`] when the thread cannot be spawned.
    pub(super) fn start(
        listener: TcpListener,
        secret: AgentSecret,
        regions: RegionTable,
        notifs: NotifQueue,
        timeout: Duration,
        max_preauth: usize,
        counters: Arc<crate::metrics::LinkCounters>,
    ) -> Result<Self, TransportError> {
        let listener = Arc::new(listener);
        let shared = Arc::new(Shared {
            secret,
            regions,
            notifs,
            stopping: AtomicBool::new(false),
            timeout,
            conns: Mutex::new(Vec::new()),
            max_preauth: max_preauth.max(1),
            counters,
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
        for c in &conns {
            let _ = c.sock.shutdown(std::net::Shutdown::Both);
        }
        for c in conns {
            if let Some(h) = c.thread {
                let _ = h.join();
            }
        }
    }
}

fn lock_conns(shared: &Shared) -> std::sync::MutexGuard<'_, Vec<Conn>> {
    shared.conns.lock().unwrap_or_else(|p| p.into_inner())
}

/// Accept connections until the service stops. Running out of descriptors
/// or memory does not end it ([`AcceptBackoff`]); at most `max_preauth`
/// connections wait for their proof at once, the oldest dropped first, so
/// that an unauthenticated flood holds a bounded number of descriptors.
fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let mut backoff = AcceptBackoff::new("tcp listener");
    let mut next_id = 0u64;
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::Acquire) {
            break;
        }
        let (stream, from) = match accepted {
            Ok(c) => {
                backoff.accepted();
                c
            }
            Err(e) => match backoff.failed(&e) {
                AfterError::Retry => continue,
                AfterError::Stop => break,
            },
        };
        let Ok(handle) = stream.try_clone() else {
            continue;
        };
        next_id += 1;
        let id = next_id;
        let state = Arc::new(AtomicU8::new(PREAUTH));
        let fence = Arc::new(Fence::default());
        {
            let mut conns = lock_conns(shared);
            let waiting: Vec<usize> =
                (0..conns.len()).filter(|&i| conns[i].state.load(Ordering::Acquire) == PREAUTH).collect();
            if waiting.len() >= shared.max_preauth {
                // The oldest first: accept order is list order.
                for &i in &waiting[..=waiting.len() - shared.max_preauth] {
                    if conns[i].state.compare_exchange(PREAUTH, EVICTED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                        tracing::debug!("tcp: dropping a connection still unauthenticated (max_preauth)");
                        let _ = conns[i].sock.shutdown(std::net::Shutdown::Both);
                    }
                }
            }
            conns.push(Conn {
                id,
                agent: None,
                generation: 0,
                sock: handle,
                thread: None,
                state: state.clone(),
                fence: fence.clone(),
            });
        }
        let s = shared.clone();
        let spawned = std::thread::Builder::new().name("kvwire-tcp-serve".into()).spawn(move || {
            if let Err(e) = serve_conn(&stream, &s, from, id, &state, &fence) {
                tracing::debug!("tcp: connection from {from} ended: {e}");
            }
            // `conns` holds a clone: close explicitly so the peer sees it now,
            // and drop the clone with our entry.
            let _ = stream.shutdown(std::net::Shutdown::Both);
            let gone = {
                let mut conns = lock_conns(&s);
                conns.iter().position(|c| c.id == id).map(|i| conns.remove(i))
            };
            // Our own handle (if already set) is dropped, detaching: we are ending.
            drop(gone);
        });
        let mut conns = lock_conns(shared);
        match spawned {
            Ok(h) => {
                if let Some(c) = conns.iter_mut().find(|c| c.id == id) {
                    c.thread = Some(h);
                }
            }
            Err(e) => {
                conns.retain(|c| c.id != id);
                drop(conns);
                tracing::warn!("tcp: cannot serve {from}: {e}");
            }
        }
    }
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

/// The challenge/response: send a nonce, check the hello's proof. The
/// connecting agent's name once it proved it knows the secret, `None` when
/// it was refused (logged; the caller closes the connection).
fn handshake(
    sock: &TcpStream,
    shared: &Shared,
    from: SocketAddr,
    id: u64,
    state: &AtomicU8,
) -> io::Result<Option<String>> {
    let nonce = Nonce::random().map_err(io::Error::other)?;
    let ch = Header { kind: Kind::Challenge, count: wire::NONCE_BYTES, id: wire::MAGIC_VERSION, len: 0 };
    let mut frame = ch.encode().to_vec();
    frame.extend_from_slice(&nonce.0);
    (&*sock).write_all(&frame)?;
    // The whole handshake within one peer_timeout.
    let deadline = Deadline::new(shared.timeout, shared.timeout);
    let mut b = [0u8; wire::HEADER_BYTES];
    tio::read_exact_by(sock, &mut b, &deadline)?;
    let hello = match Header::decode(&b) {
        Ok(h) if h.kind == Kind::Hello => h,
        Ok(h) => {
            tracing::warn!("tcp: refused {from}: sent {:?} before proving it knows the agent secret", h.kind);
            let _ = respond(sock, h.id, Status::Denied, "authentication required: answer the challenge first");
            return Ok(None);
        }
        Err(e) => {
            tracing::warn!("tcp: refused {from}: bad hello ({e})");
            let _ = respond(sock, 0, Status::Denied, &format!("bad hello: {e}"));
            return Ok(None);
        }
    };
    let mut body = vec![0u8; hello.body_bytes()];
    tio::read_exact_by(sock, &mut body, &deadline)?;
    let (name, rest) = body.split_at(hello.count as usize);
    let (proof, theirs) = rest.split_at(wire::PROOF_BYTES);
    if !auth::verify(&shared.secret, &nonce, &wire::proof_context(name), proof) {
        let claimed = String::from_utf8_lossy(name);
        tracing::warn!("tcp: refused {from} (says it is agent {claimed:?}): wrong proof of the agent secret");
        let _ = respond(sock, 0, Status::Denied, "wrong proof of the agent secret");
        return Ok(None);
    }
    deadline.restore(sock)?;
    // Our proof back (wire v3), bound to the initiator's nonce, its hello
    // and our challenge: it shows we hold the secret of the metadata it used.
    let mut their_nonce = Nonce([0; auth::NONCE_BYTES]);
    their_nonce.0.copy_from_slice(theirs);
    let ack_proof = auth::prove(&shared.secret, &their_nonce, &wire::ack_context(name, &nonce));
    let Some((name, session)) = wire::split_session(name) else {
        tracing::warn!("tcp: refused {from}: malformed session in the hello");
        let _ = respond(sock, 0, Status::Protocol, "malformed session in the hello");
        return Ok(None);
    };
    let Ok(agent) = String::from_utf8(name.to_vec()) else {
        tracing::warn!("tcp: refused {from}: agent name not UTF-8");
        let _ = respond(sock, 0, Status::Protocol, "agent name not UTF-8");
        return Ok(None);
    };
    // The name is held by one session at a time: a connection under the
    // name of a peer connected now (another session whose connections are
    // not all closed) is refused, so nobody sends notifications as it.
    {
        let mut conns = lock_conns(shared);
        let clash = conns.iter().any(|c| {
            c.id != id
                && c.state.load(Ordering::Acquire) == AUTHED
                && c.agent.as_ref().is_some_and(|(n, s)| *n == agent && *s != session)
                && !at_eof(&c.sock)
        });
        if clash {
            drop(conns);
            tracing::warn!("tcp: refused {from}: agent name {agent:?} is already connected (another session)");
            let _ = respond(sock, 0, Status::NameInUse, &format!("agent name {agent:?} is already connected"));
            return Ok(None);
        }
        if state.compare_exchange(PREAUTH, AUTHED, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return Ok(None); // evicted (and closed) while it proved the secret
        }
        if let Some(c) = conns.iter_mut().find(|c| c.id == id) {
            c.agent = Some((agent.clone(), session));
            c.generation = wire::split_slot(hello.len).1;
        }
    }
    let ack = Header { kind: Kind::HelloAck, count: wire::PROOF_BYTES as u32, id: wire::MAGIC_VERSION, len: 0 };
    let mut frame = ack.encode().to_vec();
    frame.extend_from_slice(&ack_proof);
    (&*sock).write_all(&frame)?;
    Ok(Some(agent))
}

/// True when the peer closed `sock` (a zero-byte peek), without touching
/// the socket's blocking mode, which its service thread shares.
fn at_eof(sock: &TcpStream) -> bool {
    let mut b = 0u8;
    // SAFETY: a one-byte receive into a local, MSG_PEEK leaves the data queued.
    let n = unsafe { libc::recv(sock.as_raw_fd(), (&raw mut b).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    n == 0 || (n < 0 && !matches!(io::Error::last_os_error().raw_os_error(), Some(libc::EAGAIN | libc::EINTR)))
}

fn serve_conn(
    sock: &TcpStream,
    shared: &Shared,
    from: SocketAddr,
    id: u64,
    state: &AtomicU8,
    fence: &Fence,
) -> io::Result<()> {
    sock.set_nodelay(true)?;
    sock.set_read_timeout(Some(shared.timeout))?;
    sock.set_write_timeout(Some(shared.timeout))?;
    let Some(agent) = handshake(sock, shared, from, id, state)? else {
        return Ok(());
    };

    let mut body = Vec::new();
    let mut segs: Vec<SegmentDesc> = Vec::new();
    let mut ranges: Vec<Range> = Vec::new();
    let mut hdr = [0u8; wire::HEADER_BYTES];
    let mut first = [0u8; 1];
    loop {
        if !wait_request(sock, &mut first, &shared.stopping)? || fence.fenced.load(Ordering::Acquire) {
            return Ok(());
        }
        hdr[0] = first[0];
        let head_deadline = Deadline::new(shared.timeout, shared.timeout);
        tio::read_exact_by(sock, &mut hdr[1..], &head_deadline)?;
        head_deadline.restore(sock)?;
        let h = match Header::decode(&hdr) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!("tcp: refused a frame from {agent}: {e}; dropping the connection");
                let _ = respond(sock, 0, Status::Protocol, &e.to_string());
                return Ok(());
            }
        };
        let deadline = Deadline::new(request_limit(shared.timeout, h.len), shared.timeout);
        body.resize(h.body_bytes(), 0);
        tio::read_exact_by(sock, &mut body, &deadline)?;
        match h.kind {
            Kind::Write | Kind::Read => {
                if let Err(e) = wire::decode_segments(&h, &body, &mut segs) {
                    tracing::warn!("tcp: refused a request from {agent}: {e}; dropping the connection");
                    let _ = respond(sock, h.id, Status::Protocol, &e.to_string());
                    return Ok(());
                }
                let conn = Served { sock, agent: &agent, fence };
                serve_data(&conn, shared, &h, &segs, &mut ranges, &deadline)?;
            }
            Kind::Notify => {
                // As a WRITE's bytes: a fence answered before this point
                // drops it, one that comes later waits until it is queued.
                let pushed = {
                    let Some(_copying) = fence.enter() else { return Ok(()) };
                    shared.notifs.push(Notification { from_agent: agent.clone(), payload: body.clone() })
                };
                match pushed {
                    Ok(()) => respond(sock, h.id, Status::Ok, "")?,
                    Err(why) => respond(sock, h.id, Status::Overloaded, &why)?,
                }
            }
            Kind::Fence => {
                fence_cut(shared, id, &body);
                respond(sock, h.id, Status::Ok, "")?;
            }
            other => {
                tracing::warn!("tcp: unexpected {other:?} frame from {agent}; dropping the connection");
                let _ = respond(sock, h.id, Status::Protocol, "unexpected frame kind");
                return Ok(());
            }
        }
        deadline.restore(sock)?;
    }
}

/// A FENCE from the initiator of connection `id`: each entry is the
/// generation of a connection it cut; those connections of the same agent
/// and session take no more data (WRITE bytes or notifications). Returns
/// once none of them can write into memory or queue a notification any
/// more, so that a WRITE the initiator sends after the answer cannot be
/// overwritten by the late bytes of a cancelled one (docs/TCP.md, cancel).
/// Entries that name no live connection (it ended already) are nothing to
/// do.
fn fence_cut(shared: &Shared, id: u64, body: &[u8]) {
    let cut: std::collections::HashSet<u64> = body
        .chunks_exact(wire::FENCE_ENTRY_BYTES)
        .map(|e| u64::from_le_bytes(e.try_into().expect("8 bytes")))
        .collect();
    let mut first = 0;
    let fenced: Vec<Arc<Fence>> = {
        let conns = lock_conns(shared);
        let Some(me) = conns.iter().find(|c| c.id == id).and_then(|c| c.agent.clone()) else { return };
        conns
            .iter()
            .filter(|c| c.id != id && c.agent.as_ref() == Some(&me) && cut.contains(&c.generation))
            .map(|c| {
                first += u64::from(c.fence.close(&c.sock));
                c.fence.clone()
            })
            .collect()
    };
    // Each connection counted once (a repeated FENCE names it again).
    shared.counters.fenced.fetch_add(first, std::sync::atomic::Ordering::Relaxed);
    for f in fenced {
        f.wait_out();
    }
}

/// Check every segment against the region table and collect the regions
/// the request touches (each once); the status and reason for the first
/// violation, if any.
fn check(
    table: &HashMap<u32, Arc<LocalRegion>>,
    segs: &[SegmentDesc],
    ranges: &mut Vec<Range>,
    held: &mut Vec<(u32, Arc<LocalRegion>)>,
) -> Result<(), (Status, String)> {
    ranges.clear();
    held.clear();
    for s in segs {
        let Some(r) = table.get(&s.rkey) else {
            return Err((Status::UnknownKey, format!("unknown rkey {}", s.rkey)));
        };
        let inside = s.addr >= r.addr && s.addr.checked_add(s.len_bytes).is_some_and(|e| e <= r.addr + r.len_bytes);
        if !inside {
            return Err((
                Status::OutOfBounds,
                format!("{:#x}+{} outside rkey {} ({:#x}+{})", s.addr, s.len_bytes, s.rkey, r.addr, r.len_bytes),
            ));
        }
        if !held.iter().any(|(k, _)| *k == s.rkey) {
            held.push((s.rkey, r.clone()));
        }
        ranges.push((s.addr, s.len_bytes));
    }
    Ok(())
}

/// The connection a service thread serves: its socket, the agent that
/// proved itself on it, and its fence.
struct Served<'a> {
    sock: &'a TcpStream,
    agent: &'a str,
    fence: &'a Fence,
}

fn serve_data(
    conn: &Served<'_>,
    shared: &Shared,
    h: &Header,
    segs: &[SegmentDesc],
    ranges: &mut Vec<Range>,
    deadline: &Deadline,
) -> io::Result<()> {
    let Served { sock, agent, fence } = *conn;
    let mut held = Vec::new();
    let table = shared.regions.read().unwrap_or_else(|p| p.into_inner());
    if let Err((status, why)) = check(&table, segs, ranges, &mut held) {
        drop(table);
        tracing::warn!("tcp: refused a {:?} from {agent}: {why}", h.kind);
        if h.kind == Kind::Write {
            tio::drain(sock, h.len, Some(deadline))?;
        }
        return respond(sock, h.id, status, &why);
    }
    // Taken while the table is read-locked, so `deregister` (which removes
    // the region under the write lock before it waits for `busy`) either
    // sees these guards or the request never found the region.
    let guards: Vec<RwLockReadGuard<'_, ()>> =
        held.iter().map(|(_, r)| r.busy.read().unwrap_or_else(|p| p.into_inner())).collect();
    drop(table);
    let r = match h.kind {
        Kind::Write => {
            let _copying = fence.copying.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: every range lies inside a registered region (checked
            // above) whose memory its owner keeps alive until deregister,
            // which waits for the `busy` guards we hold. No Rust reference
            // here aliases it; concurrent access by the application follows
            // the one-sided contract (it must not touch a transfer's target).
            // A fence (`fenced`, looked at before every `readv`, the first
            // included) stops it; the connection is then dropped.
            match unsafe { tio::read_ranges(sock, ranges, &fence.fenced, false, Some(deadline)) } {
                Ok(true) => Ok(()),
                Ok(false) => Err(io::Error::new(io::ErrorKind::ConnectionAborted, "fenced by its initiator")),
                Err(e) => Err(e),
            }
        }
        _ => {
            let resp = Header { kind: Kind::Resp, count: Status::Ok as u32, id: h.id, len: h.len };
            // SAFETY: as above; sendmsg only reads the ranges.
            unsafe { tio::write_ranges(sock, &resp.encode(), ranges, Some(deadline)) }
        }
    };
    drop(guards);
    if let Err(e) = &r
        && e.kind() == io::ErrorKind::TimedOut
    {
        tracing::warn!("tcp: a {:?} from {agent} ran past its deadline; dropping the connection", h.kind);
    }
    r?;
    if h.kind == Kind::Write { respond(sock, h.id, Status::Ok, "") } else { Ok(()) }
}
