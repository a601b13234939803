//! `kvwire._kvwire.NixlCore`: the Rust core of the `nixl` compatibility
//! package (`python/nixl-compat`), one kvwire [`TransferEngine`] with NIXL's
//! request model on top: prepared descriptor lists, repostable transfer
//! requests, standalone notifications, telemetry.
//!
//! Same locking as `KVTransferEngine`: calls are serialized by a `Mutex` that
//! is taken with the GIL released. Descriptor lists cross as `bytes` of
//! little-endian `u64` rows (see `nixl_descs`). Errors raise
//! `NixlCoreError(status, message)` with NIXL's status code
//! (ai-dynamo/nixl `src/api/cpp/nixl_types.h`, `nixl_status_t`); the package
//! turns each code into the matching `nixl*Error` class.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvwire::engine::{
    AgentMetadata, Desc, EngineError, FailureCause, LoadStep, RegistrationHandle, TransferEngine, TransferHandle,
    TransferStatus,
};
use kvwire::transport::{
    MemoryDesc, MemoryKind, Op, RawMemory, Segment, TransportConfig, TransportError, TransportKind,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

#[path = "nixl_descs.rs"]
mod descs;

use descs::{gather, index_count, parse_rows};

create_exception!(kvwire, NixlCoreError, PyRuntimeError, "A NIXL-core call failed: args are (status, message).");

/// NIXL status codes (`nixl_status_t`).
mod status {
    pub const IN_PROG: i32 = 1;
    pub const SUCCESS: i32 = 0;
    pub const NOT_POSTED: i32 = -1;
    pub const INVALID_PARAM: i32 = -2;
    pub const BACKEND: i32 = -3;
    pub const NOT_FOUND: i32 = -4;
    pub const MISMATCH: i32 = -5;
    pub const NOT_ALLOWED: i32 = -6;
    pub const REPOST_ACTIVE: i32 = -7;
    pub const NOT_SUPPORTED: i32 = -9;
    pub const REMOTE_DISCONNECT: i32 = -10;
    pub const CANCELED: i32 = -11;
}

fn err(code: i32, msg: impl Into<String>) -> PyErr {
    NixlCoreError::new_err((code, msg.into()))
}

/// NIXL's status for an engine error.
fn engine_err(e: EngineError) -> PyErr {
    err(engine_code(&e), e.to_string())
}

/// NIXL's status code for an engine error.
fn engine_code(e: &EngineError) -> i32 {
    match e {
        EngineError::UnknownAgent(_)
        | EngineError::UnknownRegistration
        | EngineError::LocalOutOfBounds { .. }
        | EngineError::RemoteOutOfBounds { .. } => status::NOT_FOUND,
        EngineError::MetadataConflict(_) | EngineError::RegistrationInUse { .. } => status::NOT_ALLOWED,
        EngineError::LengthMismatch { .. } | EngineError::TransportMismatch { .. } => status::MISMATCH,
        EngineError::Transport(TransportError::PeerDisconnected(_)) => status::REMOTE_DISCONNECT,
        EngineError::Transport(TransportError::Unsupported(_)) => status::NOT_SUPPORTED,
        EngineError::Transport(_) => status::BACKEND,
        EngineError::NotCompleted(_) => status::IN_PROG,
        _ => status::INVALID_PARAM,
    }
}

/// A repostable transfer request (NIXL `nixlXferReqH`).
struct Request {
    op: Op,
    agent: String,
    local: Vec<Desc>,
    remote: Vec<Desc>,
    notif: Option<Vec<u8>>,
    /// The latest post, until the next post or release.
    handle: Option<TransferHandle>,
    /// The latest post was refused because the peer is dead: `state`
    /// raises this (NIXL 1.5.1's `check_xfer_state` of such a handle raises
    /// `nixlRemoteDisconnectError`, not `nixlNotPostedError`).
    refused: Option<(i32, String)>,
}

struct Core {
    engine: TransferEngine,
    /// Registrations by `(addr, length)`: a range registered more than once
    /// (NIXL keeps identical registrations apart too) has one handle per
    /// registration, and each `deregister` of it ends the latest.
    regs: HashMap<(u64, u64), Vec<RegistrationHandle>>,
    dlists: HashMap<u64, (String, Vec<Desc>)>,
    reqs: HashMap<u64, Request>,
    segments: Vec<Segment>,
    /// Descriptor lists of released requests, for the next `make` to refill
    /// without faulting in fresh pages (1 MiB per side at 65,536).
    spare: Vec<Vec<Desc>>,
    /// Host memory kvwire allocated (`alloc_host`), by start address:
    /// registrations inside one are views of it, which shm peers map.
    hosted: std::collections::BTreeMap<u64, Arc<kvwire::HostBuffer>>,
}

impl Core {
    /// A new id for a descriptor list or request: unique in the process,
    /// not only in this core, so that an id kept from a closed core (a
    /// `mooncake` batch id after `close()` + `initialize()`) is unknown to
    /// the next one instead of naming another caller's request.
    fn id(&mut self) -> u64 {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
    }

    fn check(&self, agent: &str, descs: &[Desc]) -> Result<(), EngineError> {
        if agent.is_empty() { self.engine.check_local(descs) } else { self.engine.check_remote(agent, descs) }
    }

    fn req(&mut self, id: u64) -> PyResult<&mut Request> {
        self.reqs.get_mut(&id).ok_or_else(|| err(status::INVALID_PARAM, format!("unknown transfer request {id}")))
    }

    /// NIXL status of request `id`: SUCCESS, IN_PROG, or a raise.
    fn state(&mut self, id: u64) -> PyResult<i32> {
        let r = self.req(id)?;
        if let Some((code, why)) = &r.refused {
            return Err(err(*code, why.clone()));
        }
        let h = r.handle.ok_or_else(|| err(status::NOT_POSTED, "transfer request was never posted"))?;
        match self.engine.status(h).map_err(engine_err)? {
            TransferStatus::Done => Ok(status::SUCCESS),
            TransferStatus::InProgress => Ok(status::IN_PROG),
            TransferStatus::Failed(why) => {
                let code = match self.engine.failure_cause(h).ok().flatten() {
                    Some(FailureCause::PeerLost) => status::REMOTE_DISCONNECT,
                    Some(FailureCause::Removed) => status::NOT_FOUND,
                    Some(FailureCause::Released) => status::CANCELED,
                    _ => status::BACKEND,
                };
                Err(err(code, why.to_string()))
            }
        }
    }

    /// The backing to register for `desc`: a view of the `alloc_host`
    /// buffer holding the whole range (when it is the whole buffer, shm peers
    /// map its memfd and copy with plain stores), else the caller's memory by
    /// address (shm peers reach it by cross-memory attach).
    fn backing(&self, desc: MemoryDesc) -> Arc<dyn kvwire::transport::MemoryBacking> {
        if desc.kind == MemoryKind::Dram
            && let Some((&start, hb)) = self.hosted.range(..=desc.addr).next_back()
            && let Some(v) = kvwire::transport::View::new(hb.clone(), desc.addr - start, desc.len_bytes)
        {
            return Arc::new(v);
        }
        // SAFETY: NIXL's `registerMem` contract, which this API is: the
        // caller passes memory it owns (`nixl._utils.malloc_passthru`
        // memory, numpy arrays, torch tensors it holds) and keeps it valid
        // until it deregisters it. Python hands raw addresses here, so
        // nothing stronger can be checked; documented in docs/NIXL.md.
        Arc::new(unsafe { RawMemory::new(desc) })
    }

    /// Post request `id`; see [`PyNixlCore::post`].
    fn post(&mut self, id: u64, notif: Option<Vec<u8>>) -> PyResult<i32> {
        if self.req(id)?.handle.is_some() && self.state(id).unwrap_or(status::SUCCESS) == status::IN_PROG {
            return Err(err(status::REPOST_ACTIVE, "the request's previous post is still in progress"));
        }
        let Core { engine, reqs, segments, .. } = self;
        let r = reqs.get_mut(&id).ok_or_else(|| err(status::INVALID_PARAM, "unknown request"))?;
        if let Some(n) = notif {
            r.notif = Some(n);
        }
        if let Some(old) = r.handle.take() {
            let _ = engine.release(old);
        }
        r.refused = None;
        let h = match engine.post_with(r.op, &r.local, &r.agent, &r.remote, r.notif.clone(), segments) {
            Ok(h) => h,
            Err(e) => {
                if engine_code(&e) == status::REMOTE_DISCONNECT {
                    r.refused = Some((status::REMOTE_DISCONNECT, e.to_string()));
                }
                return Err(engine_err(e));
            }
        };
        r.handle = Some(h);
        self.state(id)
    }
}

/// See the module docs. `transport`: `"shm"`, `"tcp"` or `"verbs"`.
#[pyclass(module = "kvwire._kvwire", name = "NixlCore", frozen)]
pub struct PyNixlCore {
    inner: Mutex<Core>,
    name: String,
    transport: TransportKind,
    /// `state` calls in a row that found a transfer in progress.
    busy_polls: std::sync::atomic::AtomicU32,
    /// `notifs` calls in a row that found nothing.
    empty_polls: std::sync::atomic::AtomicU32,
    /// The transport's completion channel, for `wait` to sleep on without
    /// the lock.
    signal: Option<kvwire::transport::CompletionSignal>,
    /// One slot per agent being loaded now (`load` dials one agent at a
    /// time, outside the core's lock); an entry leaves with its last loader.
    dials: Mutex<HashMap<String, Arc<DialSlot>>>,
}

/// One agent's loads (`PyNixlCore::load`): run one at a time; callers
/// queued behind a failed load of the same metadata take its answer.
#[derive(Default)]
struct DialSlot {
    lock: Mutex<()>,
    /// Loads of this agent that failed so far.
    failures: std::sync::atomic::AtomicU64,
    /// The last failure: the metadata it loaded, its status and message.
    failed: Mutex<Option<(Vec<u8>, i32, String)>>,
}

/// Empty `notifs` answers in a row per yield of the caller's core (see
/// `PyNixlCore::notifs`).
const EMPTY_POLLS_PER_YIELD: u32 = 1024;

/// In-progress `state` polls in a row that spin before each further one
/// yields the core (see `PyNixlCore::state`): the first keep a short
/// transfer's latency low, the rest give a tight polling loop's core to the
/// copy threads.
const SPIN_POLLS: u32 = 16;

/// Longest sleep of `PyNixlCore::wait` on the completion signal before it
/// checks again: a wake is a hint, and a failure found by the engine's own
/// checks (a peer declared dead) rings nothing.
const WAIT_SLICE: Duration = Duration::from_millis(2);
/// `PyNixlCore::wait`'s sleep between checks on a transport without a
/// completion signal.
const WAIT_NAP: Duration = Duration::from_micros(200);

impl PyNixlCore {
    fn run<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Core) -> PyResult<T> + Send) -> PyResult<T> {
        crate::gil::without_gil(py, || f(&mut *self.lock()?))
    }

    /// [`TransferEngine::load_remote`] in its three steps, the handshake
    /// without the core's lock.
    /// Errors: (NIXL status, message).
    fn load_one(&self, meta: &AgentMetadata) -> Result<(), (i32, String)> {
        let failed = |e: EngineError| (engine_code(&e), e.to_string());
        let poisoned = |_| (status::BACKEND, "NIXL core poisoned by a panic".to_string());
        let step = self.inner.lock().map_err(poisoned)?.engine.begin_load(meta).map_err(failed)?;
        let LoadStep::Dial(pending) = step else {
            return Ok(());
        };
        let dialed = pending.dial().map_err(failed)?;
        self.inner.lock().map_err(poisoned)?.engine.finish_load(dialed).map_err(failed)?;
        Ok(())
    }

    /// The per-agent load slots (`load`).
    fn dial_locks(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<DialSlot>>> {
        self.dials.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The core, locked (call with the GIL released, as `run` does).
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, Core>> {
        self.inner.lock().map_err(|_| PyRuntimeError::new_err("NIXL core poisoned by a panic"))
    }
}

fn op_of(op: &str) -> PyResult<Op> {
    match op {
        "READ" => Ok(Op::Read),
        "WRITE" => Ok(Op::Write),
        other => Err(err(status::INVALID_PARAM, format!("unknown op {other:?} (READ or WRITE)"))),
    }
}

/// The descriptors of [`NixlCore::create_scattered`]'s three sequences and
/// their total length in bytes (zero-length entries left out), written into
/// `l` and `r` (cleared first; spare vectors of an earlier request, so that
/// a batch of 65,536 descriptors does not fault in 2 MiB of fresh pages).
fn scattered_descs(
    local_addrs: &Bound<'_, PyAny>,
    remote_addrs: &Bound<'_, PyAny>,
    lengths: &Bound<'_, PyAny>,
    (mut l, mut r): (Vec<Desc>, Vec<Desc>),
) -> PyResult<(Vec<Desc>, Vec<Desc>, u64)> {
    l.clear();
    r.clear();
    if let (Ok(a), Ok(b), Ok(c)) =
        (local_addrs.downcast::<PyList>(), remote_addrs.downcast::<PyList>(), lengths.downcast::<PyList>())
    {
        // What SGLang and vLLM pass: three lists, read row by row.
        l.reserve(a.len());
        r.reserve(a.len());
        let mut total = 0u64;
        crate::ints::rows3(a, b, c, |la, ra, n| {
            let n = u64::try_from(n).map_err(|_| PyValueError::new_err(format!("negative length {n}")))?;
            if n > 0 {
                l.push(Desc::new(la, n));
                r.push(Desc::new(ra, n));
                total = total.saturating_add(n);
            }
            Ok(())
        })?;
        return Ok((l, r, total));
    }
    let seq = |o: &Bound<'_, PyAny>, signed: bool| -> PyResult<Vec<u64>> {
        match o.downcast::<PyList>() {
            Ok(list) => crate::ints::list_u64(list, signed),
            Err(_) if signed => Ok(o.extract::<Vec<i64>>()?.into_iter().map(|v| v as u64).collect()),
            Err(_) => o.extract::<Vec<u64>>(),
        }
    };
    let (la, ra) = (seq(local_addrs, false)?, seq(remote_addrs, false)?);
    let lens: Vec<i64> = seq(lengths, true)?.into_iter().map(|v| v as i64).collect();
    if la.len() != ra.len() || la.len() != lens.len() {
        return Err(PyValueError::new_err(format!(
            "buffers ({}), peer_buffer_addresses ({}) and lengths ({}) have different sizes",
            la.len(),
            ra.len(),
            lens.len()
        )));
    }
    l.reserve(la.len());
    r.reserve(la.len());
    let mut total = 0u64;
    for ((&a, &b), &n) in la.iter().zip(&ra).zip(&lens) {
        let n = u64::try_from(n).map_err(|_| PyValueError::new_err(format!("negative length {n}")))?;
        if n > 0 {
            l.push(Desc::new(a, n));
            r.push(Desc::new(b, n));
            total = total.saturating_add(n);
        }
    }
    Ok((l, r, total))
}

fn rows(bytes: &[u8], ncols: usize) -> PyResult<Vec<Desc>> {
    parse_rows(bytes, ncols).map_err(|m| err(status::INVALID_PARAM, m))
}

#[pymethods]
impl PyNixlCore {
    /// Create agent `name` over `transport`. `options` are kvwire transport
    /// options (`key=value` pairs). Raises `ValueError` on a bad name and
    /// `NixlCoreError` when the transport cannot start here.
    #[new]
    #[pyo3(signature = (name, transport, copy_threads=2, peer_timeout_ms=5000, options=Vec::new()))]
    fn new(
        py: Python<'_>,
        name: String,
        transport: &str,
        copy_threads: usize,
        peer_timeout_ms: u64,
        options: Vec<(String, String)>,
    ) -> PyResult<Self> {
        let kind: TransportKind =
            transport.parse().map_err(|e: TransportError| PyValueError::new_err(e.to_string()))?;
        let cfg = TransportConfig {
            peer_timeout: Duration::from_millis(peer_timeout_ms.max(1)),
            copy_threads: copy_threads.max(1),
            options,
        };
        let engine = crate::gil::without_gil(py, || TransferEngine::new(&name, kind, &cfg)).map_err(|e| match e {
            EngineError::BadAgentName { .. } => PyValueError::new_err(e.to_string()),
            other => engine_err(other),
        })?;
        let signal = engine.completion_signal();
        let core = Core {
            engine,
            regs: HashMap::new(),
            dlists: HashMap::new(),
            reqs: HashMap::new(),
            segments: Vec::new(),
            spare: Vec::new(),
            hosted: Default::default(),
        };
        Ok(Self {
            inner: Mutex::new(core),
            name,
            transport: kind,
            busy_polls: Default::default(),
            empty_polls: Default::default(),
            signal,
            dials: Default::default(),
        })
    }

    /// The agent name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }
    /// `"shm"`, `"tcp"` or `"verbs"`.
    #[getter]
    fn transport(&self) -> String {
        self.transport.to_string()
    }

    /// Register `[addr, addr + length)` of `mem` (`"DRAM"`/`"VRAM"`) on `dev`.
    /// The caller keeps the memory valid until `deregister`.
    fn register(&self, py: Python<'_>, addr: u64, length: u64, mem: &str, dev: u32) -> PyResult<()> {
        let kind = match mem {
            "DRAM" => MemoryKind::Dram,
            "VRAM" => MemoryKind::Vram,
            other => return Err(err(status::NOT_SUPPORTED, format!("memory type {other} is not supported by kvwire"))),
        };
        let desc =
            MemoryDesc { addr, len_bytes: length, kind, device_id: if kind == MemoryKind::Dram { 0 } else { dev } };
        self.run(py, |c| {
            let h = c.engine.register(c.backing(desc)).map_err(engine_err)?;
            c.regs.entry((addr, length)).or_default().push(h);
            Ok(())
        })
    }

    /// Register a list of `(addr, length, dev)` of `mem` at once, all or
    /// nothing (NIXL's `registerMem` of a descriptor list): the engine's
    /// `register_batch`, so on verbs views of a few allocations share a few
    /// memory regions. The caller keeps the memory valid until `deregister`.
    fn register_many(&self, py: Python<'_>, items: Vec<(u64, u64, u32)>, mem: &str) -> PyResult<()> {
        let kind = match mem {
            "DRAM" => MemoryKind::Dram,
            "VRAM" => MemoryKind::Vram,
            other => return Err(err(status::NOT_SUPPORTED, format!("memory type {other} is not supported by kvwire"))),
        };
        self.run(py, |c| {
            let mems: Vec<Arc<dyn kvwire::transport::MemoryBacking>> = items
                .iter()
                .map(|&(addr, length, dev)| {
                    let device_id = if kind == MemoryKind::Dram { 0 } else { dev };
                    c.backing(MemoryDesc { addr, len_bytes: length, kind, device_id })
                })
                .collect();
            let hs = c.engine.register_batch(mems).map_err(engine_err)?;
            for (&(addr, length, _), h) in items.iter().zip(hs) {
                c.regs.entry((addr, length)).or_default().push(h);
            }
            Ok(())
        })
    }

    /// Allocate `length` bytes of zeroed host memory that kvwire owns (a
    /// sealed memfd, mapped and pre-faulted) and return its address; nothing
    /// is registered. A later `register` of a range inside it registers a
    /// view of it; on shm a registration of the whole of it (once at a time)
    /// hands its memfd to peers on this host, which map it and copy with
    /// plain stores, where memory registered by address (and a part of this
    /// memory) is reached by cross-memory attach. The allocator behind the
    /// `mooncake` package's `allocate_managed_buffer`. It stays allocated
    /// until `free_host`, and after that for as long as a registration or a
    /// transfer uses it.
    /// Raises `ValueError` for a zero length, `NixlCoreError` (BACKEND) when
    /// the allocation fails (the cause named).
    fn alloc_host(&self, py: Python<'_>, length: u64) -> PyResult<u64> {
        if length == 0 {
            return Err(PyValueError::new_err("alloc_host of 0 bytes"));
        }
        let len = usize::try_from(length).map_err(|_| PyValueError::new_err(format!("{length} bytes is too large")))?;
        self.run(py, |c| {
            let hb = kvwire::HostBuffer::new(len)
                .map_err(|e| err(status::BACKEND, format!("host memory of {length} bytes: {e}")))?;
            let addr = hb.addr();
            c.hosted.insert(addr, Arc::new(hb));
            Ok(addr)
        })
    }

    /// Give back memory from `alloc_host` (its start address). Registrations
    /// and transfers that still use it keep it mapped until they end.
    /// Raises `NixlCoreError` (NOT_FOUND) for an address `alloc_host` did
    /// not return or that was given back already.
    fn free_host(&self, py: Python<'_>, addr: u64) -> PyResult<()> {
        self.run(py, |c| {
            c.hosted
                .remove(&addr)
                .map(|_| ())
                .ok_or_else(|| err(status::NOT_FOUND, format!("{addr:#x} is not memory from alloc_host")))
        })
    }

    /// Deregister what `register(addr, length, ...)` registered (one
    /// registration of it, the latest, when it was registered more than
    /// once; overlapping registrations stay).
    fn deregister(&self, py: Python<'_>, addr: u64, length: u64) -> PyResult<()> {
        self.run(py, |c| {
            let h = *c
                .regs
                .get(&(addr, length))
                .and_then(|hs| hs.last())
                .ok_or_else(|| err(status::NOT_FOUND, format!("{addr:#x}+{length} is not registered")))?;
            c.engine.deregister(h).map_err(engine_err)?;
            if let Some(hs) = c.regs.get_mut(&(addr, length)) {
                hs.pop();
                if hs.is_empty() {
                    c.regs.remove(&(addr, length));
                }
            }
            Ok(())
        })
    }

    /// This agent's metadata (kvwire's binary form).
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let md = self.run(py, |c| Ok(c.engine.metadata().to_bytes()))?;
        Ok(PyBytes::new(py, &md))
    }

    /// Load a peer's metadata (connect, or update a known peer); returns its
    /// name. The handshake with a new peer runs outside the core's lock, so
    /// a peer slow to answer (up to the transport's peer timeout) holds up
    /// only the callers loading that same peer, never the transfers,
    /// registrations and loads of others.
    fn load(&self, py: Python<'_>, md: &[u8]) -> PyResult<String> {
        let meta = AgentMetadata::from_bytes(md).map_err(|e| err(status::INVALID_PARAM, e.to_string()))?;
        crate::gil::without_gil(py, || {
            let slot = self.dial_locks().entry(meta.name.clone()).or_default().clone();
            let loaded = {
                let failures = slot.failures.load(std::sync::atomic::Ordering::Acquire);
                let _one = slot.lock.lock().unwrap_or_else(|p| p.into_inner());
                let failed = slot.failed.lock().unwrap_or_else(|p| p.into_inner()).clone();
                match failed {
                    // A load of the same metadata failed while this one
                    // waited: take its answer rather than dial again.
                    Some((same, code, msg))
                        if slot.failures.load(std::sync::atomic::Ordering::Acquire) != failures && same == md =>
                    {
                        Err((code, msg))
                    }
                    _ => {
                        let loaded = self.load_one(&meta);
                        // A success clears the failure: callers queued
                        // behind it dial for themselves.
                        *slot.failed.lock().unwrap_or_else(|p| p.into_inner()) =
                            loaded.as_ref().err().map(|(code, msg)| (md.to_vec(), *code, msg.clone()));
                        if loaded.is_err() {
                            slot.failures.fetch_add(1, std::sync::atomic::Ordering::Release);
                        }
                        loaded
                    }
                }
            };
            let mut dials = self.dial_locks();
            // Ours and the map's: nobody else waits on this agent's lock
            // (others take it only under the map's lock).
            if Arc::strong_count(&slot) == 2 {
                dials.remove(&meta.name);
            }
            loaded.map(|()| meta.name.clone()).map_err(|(code, msg)| err(code, msg))
        })
    }

    /// Disconnect a peer and drop its metadata.
    fn forget(&self, py: Python<'_>, name: String) -> PyResult<()> {
        self.run(py, |c| c.engine.disconnect(&name).map_err(engine_err))
    }

    /// True when `name`'s metadata is loaded; a peer found dead stays loaded
    /// until `forget` (NIXL 1.5.1's `check_remote_metadata`).
    fn is_loaded(&self, py: Python<'_>, name: String) -> PyResult<bool> {
        self.run(py, |c| {
            c.engine.progress();
            Ok(c.engine.is_remote_loaded(&name))
        })
    }

    /// Check `descs` (`ncols`-column rows) against `agent`'s registrations
    /// (`""`: this agent's own, for the local side) without storing them.
    fn check(&self, py: Python<'_>, agent: String, descs: &[u8], ncols: usize) -> PyResult<()> {
        let d = rows(descs, ncols)?;
        self.run(py, |c| c.check(&agent, &d).map_err(engine_err))
    }

    /// Prepare a descriptor list for `agent` (`""` = local side, own name =
    /// loopback): checked now (NIXL raises NOT_FOUND at prep time), kept
    /// for `make`. Returns `(dlist id, descriptor count after expansion)`.
    fn prep(&self, py: Python<'_>, agent: String, descs: &[u8], ncols: usize) -> PyResult<(u64, usize)> {
        let d = rows(descs, ncols)?;
        self.run(py, |c| {
            c.check(&agent, &d).map_err(engine_err)?;
            let id = c.id();
            let n = d.len();
            c.dlists.insert(id, (agent, d));
            Ok((id, n))
        })
    }

    /// Forget a prepared list.
    fn release_dlist(&self, py: Python<'_>, id: u64) -> PyResult<()> {
        self.run(py, |c| {
            c.dlists.remove(&id).map(|_| ()).ok_or_else(|| err(status::INVALID_PARAM, format!("unknown dlist {id}")))
        })
    }

    /// A request from two prepared lists and index lists into them (NIXL
    /// `makeXferReq`): the bytes of little-endian `int64` indices, or of
    /// `int32` ones with `width=4` (SGLang's and vLLM's index arrays, passed
    /// as they are). Returns the request id.
    #[pyo3(signature = (op, local_id, local_idx, remote_id, remote_idx, notif=None, width=8))]
    #[allow(clippy::too_many_arguments)] // NIXL's makeXferReq arguments, plus `py` and `width`
    fn make(
        &self,
        py: Python<'_>,
        op: &str,
        local_id: u64,
        local_idx: &[u8],
        remote_id: u64,
        remote_idx: &[u8],
        notif: Option<Vec<u8>>,
        width: usize,
    ) -> PyResult<u64> {
        let op = op_of(op)?;
        let nl = index_count(local_idx, width).map_err(|m| err(status::INVALID_PARAM, m))?;
        let nr = index_count(remote_idx, width).map_err(|m| err(status::INVALID_PARAM, m))?;
        if nl != nr {
            return Err(err(status::INVALID_PARAM, format!("{nl} local vs {nr} remote indices")));
        }
        self.run(py, |c| {
            let unknown = |id| err(status::INVALID_PARAM, format!("unknown dlist {id}"));
            let (la, ld) = c.dlists.get(&local_id).ok_or_else(|| unknown(local_id))?;
            let (agent, rd) = c.dlists.get(&remote_id).ok_or_else(|| unknown(remote_id))?;
            if !la.is_empty() {
                return Err(err(status::INVALID_PARAM, "the local dlist was prepared for a remote agent"));
            }
            if agent.is_empty() {
                return Err(err(status::INVALID_PARAM, "the remote dlist was prepared for the local side"));
            }
            let (mut local, mut remote) = (c.spare.pop().unwrap_or_default(), c.spare.pop().unwrap_or_default());
            gather(ld, local_idx, width, &mut local).map_err(|m| err(status::INVALID_PARAM, m))?;
            gather(rd, remote_idx, width, &mut remote).map_err(|m| err(status::INVALID_PARAM, m))?;
            let agent = agent.clone();
            let id = c.id();
            c.reqs.insert(id, Request { op, agent, local, remote, notif, handle: None, refused: None });
            Ok(id)
        })
    }

    /// A request from descriptor rows directly (NIXL `createXferReq`),
    /// checked now. Returns the request id.
    #[pyo3(signature = (op, local, agent, remote, ncols, notif=None))]
    #[allow(clippy::too_many_arguments)] // NIXL's createXferReq arguments, plus `py`
    fn create(
        &self,
        py: Python<'_>,
        op: &str,
        local: &[u8],
        agent: String,
        remote: &[u8],
        ncols: usize,
        notif: Option<Vec<u8>>,
    ) -> PyResult<u64> {
        let op = op_of(op)?;
        let (l, r) = (rows(local, ncols)?, rows(remote, ncols)?);
        self.run(py, |c| {
            c.engine.check_local(&l).map_err(engine_err)?;
            c.engine.check_remote(&agent, &r).map_err(engine_err)?;
            let id = c.id();
            c.reqs.insert(id, Request { op, agent, local: l, remote: r, notif, handle: None, refused: None });
            Ok(id)
        })
    }

    /// A request from three equal-length lists (or tuples) of ints: local
    /// addresses, remote addresses and lengths in bytes, the shape of
    /// Mooncake 0.3's `batch_transfer_sync_write(session, buffers,
    /// peer_buffer_addresses, lengths)`, read straight into descriptors (no
    /// intermediate array). Entries of length 0 move nothing and are left
    /// out. Checked now, as [`create`](Self::create). Returns `(id, total
    /// bytes)`; id 0 when nothing is left to move (no request is made).
    /// `post=True` also posts it, as [`post`](Self::post) (one call and one
    /// pass of checks for Mooncake's one-shot batch calls); when that post
    /// fails, no request is left behind and its error is raised.
    ///
    /// Raises `TypeError` / `OverflowError` for an element that is not an
    /// int in `u64` range (a negative address), `ValueError` for sequences
    /// of different lengths or a negative length, `NixlCoreError` for the
    /// checks of [`create`](Self::create).
    #[pyo3(signature = (op, local_addrs, agent, remote_addrs, lengths, notif=None, post=false))]
    #[allow(clippy::too_many_arguments)] // Mooncake's batch arguments, plus `py`
    fn create_scattered(
        &self,
        py: Python<'_>,
        op: &str,
        local_addrs: &Bound<'_, PyAny>,
        agent: String,
        remote_addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        notif: Option<Vec<u8>>,
        post: bool,
    ) -> PyResult<(u64, u64)> {
        let op = op_of(op)?;
        let spare = self.run(py, |c| Ok((c.spare.pop().unwrap_or_default(), c.spare.pop().unwrap_or_default())))?;
        let (l, r, total) = scattered_descs(local_addrs, remote_addrs, lengths, spare)?;
        if l.is_empty() {
            return Ok((0, 0));
        }
        self.run(py, |c| {
            if !post {
                c.engine.check_local(&l).map_err(engine_err)?;
                c.engine.check_remote(&agent, &r).map_err(engine_err)?;
            }
            let id = c.id();
            c.reqs.insert(id, Request { op, agent, local: l, remote: r, notif, handle: None, refused: None });
            if post && let Err(e) = c.post(id, None) {
                // The post checks what create would have (same errors);
                // nothing moved, and no request is left behind.
                c.reqs.remove(&id);
                return Err(e);
            }
            Ok((id, total))
        })
    }

    /// Post request `id` (NIXL `postXferReq`): again after its last post
    /// finished; `notif` replaces the request's notification when given.
    /// Returns SUCCESS or IN_PROG; raises REPOST_ACTIVE while the last post
    /// is still moving.
    #[pyo3(signature = (id, notif=None))]
    fn post(&self, py: Python<'_>, id: u64, notif: Option<Vec<u8>>) -> PyResult<i32> {
        self.run(py, |c| c.post(id, notif))
    }

    /// NIXL status of request `id`: SUCCESS or IN_PROG; raises NOT_POSTED
    /// before the first post, REMOTE_DISCONNECT when the peer died, NOT_FOUND
    /// when it was removed, BACKEND otherwise.
    ///
    /// After [`SPIN_POLLS`] in-progress answers in a row this also yields
    /// the calling thread's core once per call: NIXL's UCX backend copies
    /// inside this call, so NIXL users poll it in a tight loop (vLLM,
    /// SGLang, NIXL's examples), while kvwire's copies run on its copy
    /// threads, which such a loop would otherwise starve where cores are
    /// few (`nixl_api_bench.py`, 256 MiB of 4 KiB pages, two processes on
    /// 2 vCPUs: 2.9 → 6.4 GB/s WRITE).
    fn state(&self, py: Python<'_>, id: u64) -> PyResult<i32> {
        use std::sync::atomic::Ordering::Relaxed;
        let s = self.run(py, |c| c.state(id));
        if matches!(s, Ok(status::IN_PROG)) {
            if self.busy_polls.fetch_add(1, Relaxed) >= SPIN_POLLS {
                crate::gil::without_gil(py, std::thread::yield_now);
            }
        } else {
            self.busy_polls.store(0, Relaxed);
        }
        s
    }

    /// Wait until request `id` leaves IN_PROG or `timeout_s` seconds (wall
    /// time, ≥ 0) pass; returns what [`state`](Self::state) would then: SUCCESS,
    /// IN_PROG on timeout (the request stays posted), or a raise with the
    /// failure's status. The GIL and the core's lock are released while it
    /// sleeps (on the transport's completion channel, woken by the
    /// completion; slices of at most 2 ms), so other threads post and poll
    /// meanwhile and the waiting thread spends no CPU on polling — the
    /// blocking half of Mooncake 0.3's `batch_transfer_sync_write`, where a
    /// NIXL caller spins on `state`. Raises `ValueError` for a negative or
    /// NaN `timeout_s`.
    fn wait(&self, py: Python<'_>, id: u64, timeout_s: f64) -> PyResult<i32> {
        if timeout_s.is_nan() || timeout_s < 0.0 {
            return Err(PyValueError::new_err(format!("timeout_s must be >= 0 seconds, got {timeout_s}")));
        }
        // Capped at a day: Instant + Duration must not overflow.
        let timeout = Duration::from_secs_f64(timeout_s.min(86_400.0));
        crate::gil::without_gil(py, || {
            let deadline = std::time::Instant::now() + timeout;
            loop {
                let s = self.lock()?.state(id)?;
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if s != status::IN_PROG || left.is_zero() {
                    return Ok(s);
                }
                match &self.signal {
                    Some(sig) => {
                        sig.wait(left.min(WAIT_SLICE));
                    }
                    None => std::thread::sleep(left.min(WAIT_NAP)),
                }
            }
        })
    }

    /// `(start_us, post_us, xfer_us, bytes, desc_count)` of the last post.
    fn telemetry(&self, py: Python<'_>, id: u64) -> PyResult<(u64, u64, u64, u64, u64)> {
        self.run(py, |c| {
            // A failed post or transfer answers with its status, as NIXL's
            // getXferTelemetry returns the request's status when not SUCCESS.
            c.state(id)?;
            let h = c.req(id)?.handle.ok_or_else(|| err(status::NOT_POSTED, "transfer request was never posted"))?;
            let t = c.engine.telemetry(h).map_err(engine_err)?;
            Ok((t.start_us, t.post_us, t.xfer_us, t.bytes, t.desc_count))
        })
    }

    /// Release request `id`: an active post is cancelled, and this returns
    /// once no byte of it can still move.
    fn release(&self, py: Python<'_>, id: u64) -> PyResult<()> {
        self.run(py, |c| {
            let r = c.reqs.remove(&id).ok_or_else(|| err(status::INVALID_PARAM, format!("unknown request {id}")))?;
            if let Some(h) = r.handle {
                c.engine.release(h).map_err(engine_err)?;
            }
            for mut v in [r.local, r.remote] {
                if c.spare.len() < 4 && v.capacity() >= 4096 {
                    v.clear();
                    c.spare.push(v);
                }
            }
            Ok(())
        })
    }

    /// Notifications received so far, `{agent: [bytes, ...]}`, taken.
    ///
    /// Never sleeps or yields while notifications arrive: an empty answer
    /// yields the calling thread's core only on every
    /// [`EMPTY_POLLS_PER_YIELD`]th empty call in a row. vLLM polls
    /// `get_new_notifs` once per engine step, and a yield there can park
    /// the caller behind other runnable threads for a scheduler slice
    /// (milliseconds); a tight loop that never yields would instead starve
    /// the copy threads where cores are few. One yield per 1,024 empty polls
    /// keeps both (docs/PERFORMANCE.md, notification delivery latency).
    fn notifs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use std::sync::atomic::Ordering::Relaxed;
        let got = self.run(py, |c| Ok(c.engine.get_notifs()))?;
        if got.is_empty() {
            let n = self.empty_polls.fetch_add(1, Relaxed).wrapping_add(1);
            if n.is_multiple_of(EMPTY_POLLS_PER_YIELD) {
                crate::gil::without_gil(py, std::thread::yield_now);
            }
        } else {
            self.empty_polls.store(0, Relaxed);
        }
        let d = PyDict::new(py);
        for (agent, msgs) in got {
            let l = PyList::new(py, msgs.iter().map(|m| PyBytes::new(py, m)))?;
            d.set_item(agent, l)?;
        }
        Ok(d)
    }

    /// A standalone notification to `agent` (NIXL `genNotif`).
    fn notify(&self, py: Python<'_>, agent: String, payload: Vec<u8>) -> PyResult<()> {
        self.run(py, |c| c.engine.notify(&agent, payload).map_err(engine_err))
    }

    fn __repr__(&self) -> String {
        format!("NixlCore(name={:?}, transport={})", self.name, self.transport)
    }
}

/// Add `NixlCore` and `NixlCoreError` to the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNixlCore>()?;
    m.add("NixlCoreError", m.py().get_type::<NixlCoreError>())?;
    Ok(())
}
