//! C ABI over kvwire's NIXL-like [`TransferEngine`]: create/destroy an
//! engine, register/deregister caller-owned memory, get/load (connect)
//! metadata, post one-sided READ/WRITE transfers, poll or wait for their
//! status, release, drain notifications.
//!
//! Rules (see `docs/CAPI.md`): every function returns a [`KvwStatus`]
//! (0 = OK); on failure [`kvw_last_error`] returns a message, kept per
//! thread until the next failing call on that thread. Handles are opaque;
//! no Rust type crosses the boundary; no panic crosses it either (it becomes
//! `KVW_ERR_PANIC`). An engine is not thread-safe: drive each from one
//! thread at a time.

#![warn(clippy::undocumented_unsafe_blocks)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

mod xfer;
pub use xfer::*;

use kvwire::engine::{AgentMetadata, EngineError, LoadOutcome, RegistrationHandle, TransferEngine};
use kvwire::transport::{
    FailureKind, MAX_COPY_THREADS, MAX_PEER_TIMEOUT, MemoryDesc, MemoryKind, RawMemory, TransferFailure,
    TransportConfig, TransportError, TransportKind,
};

/// Result of every call. 0 is success.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvwStatus {
    /// Success.
    KvwOk = 0,
    /// A null pointer, bad UTF-8, an unknown enum value or transport name.
    KvwErrInvalidArg = 1,
    /// An unknown registration, transfer handle or peer agent.
    KvwErrNotFound = 2,
    /// Descriptors out of bounds, mismatched or empty; an empty registration.
    KvwErrBadDesc = 3,
    /// Malformed peer metadata.
    KvwErrMetadata = 4,
    /// The transport failed (socket, peer died, registration refused).
    KvwErrTransport = 5,
    /// A registration still used by a transfer in flight.
    KvwErrInUse = 6,
    /// The output buffer is too small; the needed size was written.
    KvwErrBufferTooSmall = 7,
    /// Already connected to that agent, or connecting to itself.
    KvwErrState = 8,
    /// A transfer failed: the peer process or its connection went away
    /// (`FailureKind::PeerDied`).
    KvwErrPeerDied = 10,
    /// A transfer failed: the peer stopped answering within the peer
    /// timeout (`FailureKind::PeerTimeout`); or a call waited that long for
    /// a peer (`kvw_deregister` on shm: the memory stays registered).
    KvwErrPeerTimeout = 11,
    /// A transfer failed: the target refused the access (out of bounds,
    /// unknown key, denied; `FailureKind::RemoteAccess`).
    KvwErrRemoteAccess = 12,
    /// A transfer was cancelled (`FailureKind::Cancelled`).
    KvwErrCancelled = 13,
    /// A transfer failed on a local registration (`FailureKind::LocalProtection`).
    KvwErrLocalProtection = 14,
    /// A transfer failed: the peer broke the wire protocol (`FailureKind::Protocol`).
    KvwErrProtocol = 15,
    /// A bug in kvwire (a Rust panic was caught at the boundary).
    KvwErrPanic = 99,
}

/// State of a posted transfer.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvwXferState {
    /// Still moving.
    KvwXferInProgress = 0,
    /// Every byte landed (and the notification, if any, was sent).
    KvwXferDone = 1,
    /// Terminal failure; `kvw_last_error()` says why.
    KvwXferFailed = 2,
}

/// `KVW_OP_READ` pulls remote bytes into local memory; `KVW_OP_WRITE` pushes.
pub const KVW_OP_READ: i32 = 0;
/// See [`KVW_OP_READ`].
pub const KVW_OP_WRITE: i32 = 1;

/// One contiguous range: `len_bytes` bytes at virtual address `addr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KvwDesc {
    /// Start virtual address (bytes).
    pub addr: u64,
    /// Length (bytes).
    pub len_bytes: u64,
}

/// Called once per notification by [`kvw_get_notifs`]: the sending agent's
/// name (NUL-terminated) and the payload (`len` bytes), both valid only
/// during the call.
pub type KvwNotifFn = Option<unsafe extern "C" fn(user: *mut c_void, agent: *const c_char, msg: *const u8, len: usize)>;

/// An engine (opaque to C).
pub struct KvwEngine {
    engine: TransferEngine,
    regs: HashMap<u64, RegistrationHandle>,
    next_reg: u64,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: String) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// The C code of a failed transfer's [`FailureKind`] (`KVW_ERR_TRANSPORT`
/// for kinds without a code of their own).
fn failure_status(f: &TransferFailure) -> KvwStatus {
    match f.kind {
        FailureKind::PeerDied => KvwStatus::KvwErrPeerDied,
        FailureKind::PeerTimeout => KvwStatus::KvwErrPeerTimeout,
        FailureKind::RemoteAccess(_) => KvwStatus::KvwErrRemoteAccess,
        FailureKind::Cancelled => KvwStatus::KvwErrCancelled,
        FailureKind::LocalProtection => KvwStatus::KvwErrLocalProtection,
        FailureKind::Protocol => KvwStatus::KvwErrProtocol,
        _ => KvwStatus::KvwErrTransport,
    }
}

fn engine_status(e: &EngineError) -> KvwStatus {
    match e {
        EngineError::Transport(TransportError::InvalidOption { .. } | TransportError::InvalidConfig(_)) => {
            KvwStatus::KvwErrInvalidArg
        }
        EngineError::Transport(TransportError::Timeout { .. }) => KvwStatus::KvwErrPeerTimeout,
        EngineError::Transport(_) => KvwStatus::KvwErrTransport,
        EngineError::Metadata(_) => KvwStatus::KvwErrMetadata,
        EngineError::UnknownRegistration | EngineError::UnknownAgent(_) | EngineError::UnknownHandle(_) => {
            KvwStatus::KvwErrNotFound
        }
        EngineError::RegistrationInUse { .. } => KvwStatus::KvwErrInUse,
        EngineError::AlreadyConnected(_) | EngineError::SelfConnect(_) | EngineError::TransportMismatch { .. } => {
            KvwStatus::KvwErrState
        }
        _ => KvwStatus::KvwErrBadDesc,
    }
}

/// An error to hand back to C: status and message.
struct Fail(KvwStatus, String);

impl From<EngineError> for Fail {
    fn from(e: EngineError) -> Self {
        Fail(engine_status(&e), e.to_string())
    }
}

fn invalid(msg: impl Into<String>) -> Fail {
    Fail(KvwStatus::KvwErrInvalidArg, msg.into())
}

/// Run `f`, turning errors and panics into a status plus last-error message.
fn guard(f: impl FnOnce() -> Result<(), Fail>) -> KvwStatus {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => KvwStatus::KvwOk,
        Ok(Err(Fail(code, msg))) => {
            set_error(msg);
            code
        }
        Err(_) => {
            set_error("internal error: a Rust panic was caught at the C boundary".into());
            KvwStatus::KvwErrPanic
        }
    }
}

/// # Safety
/// `p` is null or a NUL-terminated string valid for the call.
unsafe fn str_arg<'a>(p: *const c_char, what: &str) -> Result<&'a str, Fail> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// # Safety
/// `p` is null or points to a live engine made by [`kvw_engine_create`], not used elsewhere meanwhile.
unsafe fn engine_arg<'a>(p: *mut KvwEngine) -> Result<&'a mut KvwEngine, Fail> {
    // SAFETY: per this function's contract the pointer is null or valid and exclusive.
    unsafe { p.as_mut() }.ok_or_else(|| invalid("engine is NULL"))
}

/// # Safety
/// `p` is null only when `n == 0`; otherwise it points to `n` readable `T`.
unsafe fn slice_arg<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Fail> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL with a count of {n}")));
    }
    // SAFETY: non-null and `n` elements readable per this function's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// # Safety
/// `p` is null or points to writable `T`.
unsafe fn write_out<T>(p: *mut T, v: T, what: &str) -> Result<(), Fail> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null and writable per this function's contract.
    unsafe { p.write(v) };
    Ok(())
}

/// The message of the last failing call on this thread ("" if none). Valid
/// until the next failing call on this thread; never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn kvw_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Create an engine (agent) named `name` on `transport` (`"shm"`, `"tcp"`,
/// `"verbs"`; NULL = `"shm"`) with default options, written to `*out`.
/// Destroy it with [`kvw_engine_destroy`]. Same as
/// [`kvw_engine_create_with_options`] with `options` NULL.
///
/// # Safety
/// `name` is a NUL-terminated string; `transport` is NULL or one; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_engine_create(
    name: *const c_char,
    transport: *const c_char,
    out: *mut *mut KvwEngine,
) -> KvwStatus {
    // SAFETY: forwarded under the same contract; NULL options are allowed.
    unsafe { kvw_engine_create_with_options(name, transport, std::ptr::null(), out) }
}

/// Split `key=value` pairs separated by commas, spaces or newlines into
/// the engine's [`TransportConfig`]: `peer_timeout_ms` (a dead or silent
/// peer fails its transfers after this many ms; default 5000) and
/// `copy_threads` (CPU copy threads of shm/tcp; default 2) are the engine's;
/// every other key is the backend's (e.g. tcp `listen=10.0.0.2:0`, verbs
/// `device=mlx5_0`, `gid_index=3`; see `kvwire bench --help`).
fn parse_options(text: &str) -> Result<TransportConfig, Fail> {
    let mut cfg = TransportConfig::default();
    for item in text.split([',', ' ', '\n', '\t']).filter(|s| !s.is_empty()) {
        let (k, v) = item.split_once('=').ok_or_else(|| invalid(format!("option {item:?} is not key=value")))?;
        let (k, v) = (k.trim(), v.trim());
        match k {
            "peer_timeout_ms" => {
                let ms: u64 =
                    v.parse().ok().filter(|&ms| ms > 0 && ms <= MAX_PEER_TIMEOUT.as_millis() as u64).ok_or_else(
                        || {
                            invalid(format!(
                                "peer_timeout_ms={v}: expected 1..={} (milliseconds)",
                                MAX_PEER_TIMEOUT.as_millis()
                            ))
                        },
                    )?;
                cfg.peer_timeout = Duration::from_millis(ms);
            }
            "copy_threads" => {
                cfg.copy_threads = v
                    .parse()
                    .ok()
                    .filter(|&n| (1..=MAX_COPY_THREADS).contains(&n))
                    .ok_or_else(|| invalid(format!("copy_threads={v}: expected 1..={MAX_COPY_THREADS}")))?;
            }
            _ => cfg.options.push((k.to_string(), v.to_string())),
        }
    }
    Ok(cfg)
}

/// Create an engine (agent) named `name` on `transport` (`"shm"`, `"tcp"`,
/// `"verbs"`; NULL = `"shm"`) configured by `options`, written to `*out`.
///
/// `options` is NULL (defaults) or a string of `key=value` pairs separated
/// by commas or spaces, e.g. `"listen=10.0.0.2:0,peer_timeout_ms=2000"`:
/// - `peer_timeout_ms`: a dead or silent peer fails its transfers after
///   this many milliseconds (default 5000);
/// - `copy_threads`: CPU copy threads of `shm`/`tcp` (default 2);
/// - any other key goes to the transport backend, which refuses keys it
///   does not know (tcp: `listen`, `conns_per_peer`, ...; verbs: `device`,
///   `gid_index`, ...; `kvwire bench --help` lists them).
///
/// A pair that is not `key=value`, a bad value, or a key the backend does
/// not know returns `KVW_ERR_INVALID_ARG`, and `kvw_last_error()` names the
/// key (and lists the valid ones).
///
/// # Safety
/// `name` is a NUL-terminated string; `transport` and `options` are NULL or
/// NUL-terminated strings; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_engine_create_with_options(
    name: *const c_char,
    transport: *const c_char,
    options: *const c_char,
    out: *mut *mut KvwEngine,
) -> KvwStatus {
    guard(|| {
        // SAFETY: the caller passes a NUL-terminated name.
        let name = unsafe { str_arg(name, "name") }?;
        let kind: TransportKind = if transport.is_null() {
            TransportKind::Shm
        } else {
            // SAFETY: non-null, NUL-terminated per the contract.
            let t = unsafe { str_arg(transport, "transport") }?;
            t.parse().map_err(|e| invalid(format!("{e}")))?
        };
        let cfg = if options.is_null() {
            TransportConfig::default()
        } else {
            // SAFETY: non-null, NUL-terminated per the contract.
            parse_options(unsafe { str_arg(options, "options") }?)?
        };
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        let engine = TransferEngine::new(name, kind, &cfg)?;
        let boxed = Box::into_raw(Box::new(KvwEngine { engine, regs: HashMap::new(), next_reg: 1 }));
        // SAFETY: `out` is non-null and writable per the contract.
        unsafe { write_out(out, boxed, "out") }
    })
}

/// Destroy an engine: cancels what is in flight, then frees it. NULL is a no-op.
///
/// # Safety
/// `engine` is NULL or from [`kvw_engine_create`], and is not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_engine_destroy(engine: *mut KvwEngine) {
    if engine.is_null() {
        return;
    }
    // SAFETY: made by Box::into_raw in kvw_engine_create; ownership returns here once.
    let boxed = unsafe { Box::from_raw(engine) };
    let _ = catch_unwind(AssertUnwindSafe(move || drop(boxed)));
}

/// Register `len_bytes` of host memory at `addr` (`device_id` 0) for
/// transfers; `*out_reg` receives a registration id for [`kvw_deregister`].
///
/// # Safety
/// `[addr, addr + len_bytes)` is writable memory that stays valid until it
/// is deregistered or the engine destroyed; `engine` valid; `out_reg` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_register(
    engine: *mut KvwEngine,
    addr: u64,
    len_bytes: u64,
    out_reg: *mut u64,
) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        if out_reg.is_null() {
            return Err(invalid("out_reg is NULL"));
        }
        let desc = MemoryDesc { addr, len_bytes, kind: MemoryKind::Dram, device_id: 0 };
        // SAFETY: the caller guarantees the range stays valid while registered.
        let raw = unsafe { RawMemory::new(desc) };
        let h = e.engine.register(Arc::new(raw))?;
        let id = e.next_reg;
        e.next_reg += 1;
        e.regs.insert(id, h);
        // SAFETY: checked non-null; writable per the contract.
        unsafe { write_out(out_reg, id, "out_reg") }
    })
}

/// [`kvw_register_mem`]'s `mem_type` for host memory.
pub const KVW_MEM_DRAM: i32 = 0;
/// [`kvw_register_mem`]'s `mem_type` for GPU memory (a device address).
pub const KVW_MEM_VRAM: i32 = 1;

/// Register `len_bytes` at `addr` of memory type `mem_type` on device
/// `device_id` for transfers, like [`kvw_register`] (which is this with
/// [`KVW_MEM_DRAM`]). [`KVW_MEM_VRAM`] is a device address of GPU
/// `device_id` (`cudaMalloc`, `cuMemAlloc`, a mapped VMM range): the
/// `verbs` backend registers it with the NIC (dma-buf, else
/// nvidia-peermem); `shm` and `tcp`, which copy with the CPU, refuse it with
/// `KVW_ERR_TRANSPORT`. An unknown `mem_type` is `KVW_ERR_INVALID_ARG`.
/// `device_id` is ignored for DRAM.
///
/// # Safety
/// As [`kvw_register`]; for VRAM the range is device memory of that GPU
/// that stays allocated until it is deregistered or the engine destroyed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_register_mem(
    engine: *mut KvwEngine,
    addr: u64,
    len_bytes: u64,
    mem_type: i32,
    device_id: u32,
    out_reg: *mut u64,
) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        if out_reg.is_null() {
            return Err(invalid("out_reg is NULL"));
        }
        let (kind, device_id) = match mem_type {
            KVW_MEM_DRAM => (MemoryKind::Dram, 0),
            KVW_MEM_VRAM => (MemoryKind::Vram, device_id),
            other => return Err(invalid(format!("unknown mem_type {other} (KVW_MEM_DRAM 0, KVW_MEM_VRAM 1)"))),
        };
        let desc = MemoryDesc { addr, len_bytes, kind, device_id };
        // SAFETY: the caller guarantees the range stays valid while registered.
        let raw = unsafe { RawMemory::new(desc) };
        let h = e.engine.register(Arc::new(raw))?;
        let id = e.next_reg;
        e.next_reg += 1;
        e.regs.insert(id, h);
        // SAFETY: checked non-null; writable per the contract.
        unsafe { write_out(out_reg, id, "out_reg") }
    })
}

/// Deregister memory. Fails with `KVW_ERR_IN_USE` while a transfer uses it.
///
/// # Safety
/// `engine` is valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_deregister(engine: *mut KvwEngine, reg: u64) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        let h =
            *e.regs.get(&reg).ok_or_else(|| Fail(KvwStatus::KvwErrNotFound, format!("unknown registration {reg}")))?;
        e.engine.deregister(h)?;
        e.regs.remove(&reg);
        Ok(())
    })
}

/// Copy this engine's metadata (take it after registering) into `buf`
/// (`cap` bytes); `*out_len` receives its size. With `buf` NULL or `cap` too
/// small, returns `KVW_ERR_BUFFER_TOO_SMALL` and only sets `*out_len`.
///
/// # Safety
/// `engine` valid; `buf` NULL or `cap` writable bytes; `out_len` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_metadata_get(
    engine: *mut KvwEngine,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        let md = e.engine.metadata().to_bytes();
        // SAFETY: writable per the contract (checked non-null inside).
        unsafe { write_out(out_len, md.len(), "out_len") }?;
        if buf.is_null() || cap < md.len() {
            return Err(Fail(KvwStatus::KvwErrBufferTooSmall, format!("metadata needs {} bytes", md.len())));
        }
        // SAFETY: `buf` has `cap >= md.len()` writable bytes, and cannot overlap our fresh Vec.
        unsafe { std::ptr::copy_nonoverlapping(md.as_ptr(), buf, md.len()) };
        Ok(())
    })
}

/// Load a peer's metadata (from its [`kvw_metadata_get`]) and connect to it.
///
/// # Safety
/// `engine` valid; `md` points to `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_metadata_load(engine: *mut KvwEngine, md: *const u8, len: usize) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        // SAFETY: `len` readable bytes per the contract.
        let bytes = unsafe { slice_arg(md, len, "md") }?;
        let meta = AgentMetadata::from_bytes(bytes).map_err(|err| Fail(KvwStatus::KvwErrMetadata, err.to_string()))?;
        e.engine.connect(&meta)?;
        Ok(())
    })
}

/// [`kvw_metadata_load_as`]'s outcome: a new agent, now connected.
pub const KVW_LOAD_CONNECTED: i32 = 0;
/// [`kvw_metadata_load_as`]'s outcome: a known agent whose regions were
/// replaced by the newer list in `md`.
pub const KVW_LOAD_UPDATED: i32 = 1;
/// [`kvw_metadata_load_as`]'s outcome: a known agent, nothing new (same
/// regions, or metadata older than what is loaded).
pub const KVW_LOAD_UNCHANGED: i32 = 2;

/// Load a peer's metadata like [`kvw_metadata_load`], but a known agent is
/// updated instead of refused (NIXL's `loadRemoteMD` merge): a new agent is
/// connected (`*out_outcome` = [`KVW_LOAD_CONNECTED`]); a known one with the
/// same connection info gets the newer region list
/// ([`KVW_LOAD_UPDATED`]; transfers already posted finish on the old
/// connection) or stays as it is when `md` is not newer
/// ([`KVW_LOAD_UNCHANGED`]). When `agent` is not NULL, metadata of any other
/// agent is refused with `KVW_ERR_METADATA`. A known agent whose connection
/// info or transport changed is refused with `KVW_ERR_STATE` (disconnect it
/// first). `md` is decoded with the same bounds as [`kvw_metadata_load`].
///
/// # Safety
/// `engine` valid; `agent` NULL or NUL-terminated; `md` points to `len`
/// readable bytes; `out_outcome` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_metadata_load_as(
    engine: *mut KvwEngine,
    agent: *const c_char,
    md: *const u8,
    len: usize,
    out_outcome: *mut i32,
) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        let expected = if agent.is_null() {
            None
        } else {
            // SAFETY: non-null, NUL-terminated per the contract.
            Some(unsafe { str_arg(agent, "agent") }?)
        };
        // SAFETY: `len` readable bytes per the contract.
        let bytes = unsafe { slice_arg(md, len, "md") }?;
        let meta = AgentMetadata::from_bytes(bytes).map_err(|err| Fail(KvwStatus::KvwErrMetadata, err.to_string()))?;
        if let Some(want) = expected
            && meta.name != want
        {
            return Err(Fail(
                KvwStatus::KvwErrMetadata,
                format!("metadata is agent {:?}'s, expected agent {want:?}'s", meta.name),
            ));
        }
        let outcome = e.engine.load_remote(&meta).map_err(|err| match err {
            EngineError::MetadataConflict(_) => Fail(KvwStatus::KvwErrState, err.to_string()),
            other => Fail::from(other),
        })?;
        let code = match outcome {
            LoadOutcome::Connected => KVW_LOAD_CONNECTED,
            LoadOutcome::Updated => KVW_LOAD_UPDATED,
            LoadOutcome::Unchanged => KVW_LOAD_UNCHANGED,
        };
        if !out_outcome.is_null() {
            // SAFETY: non-null and writable per the contract.
            unsafe { out_outcome.write(code) };
        }
        Ok(())
    })
}

/// Forget a connected peer agent.
///
/// # Safety
/// `engine` valid; `agent` NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_disconnect(engine: *mut KvwEngine, agent: *const c_char) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        // SAFETY: NUL-terminated per the contract.
        let agent = unsafe { str_arg(agent, "agent") }?;
        e.engine.disconnect(agent)?;
        Ok(())
    })
}
