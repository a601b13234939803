//! The transfer calls of the C ABI: post, poll (`kvw_status`,
//! `kvw_status_code`), wait, release, and draining notifications.

use std::ffi::{CString, c_char, c_void};
use std::time::Duration;

use kvwire::engine::{Desc, TransferHandle, TransferStatus};
use kvwire::transport::Op;

use super::{
    KVW_OP_READ, KVW_OP_WRITE, KvwDesc, KvwEngine, KvwNotifFn, KvwStatus, KvwXferState, engine_arg, failure_status,
    guard, invalid, set_error, slice_arg, str_arg, write_out,
};

/// Post a one-sided transfer: `op` (`KVW_OP_READ` / `KVW_OP_WRITE`) between
/// `local[i]` and `remote[i]` of connected agent `remote_agent`, with an
/// optional notification (`notif` NULL = none) delivered to that agent once
/// every byte is visible there. `*out_handle` receives the transfer handle.
/// Nothing moves when an error is returned.
///
/// # Safety
/// `engine` valid; `local`/`remote` point to `num_local`/`num_remote`
/// descriptors; `remote_agent` NUL-terminated; `notif` NULL or `notif_len` bytes.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvw_post(
    engine: *mut KvwEngine,
    op: i32,
    local: *const KvwDesc,
    num_local: usize,
    remote_agent: *const c_char,
    remote: *const KvwDesc,
    num_remote: usize,
    notif: *const u8,
    notif_len: usize,
    out_handle: *mut u64,
) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        let op = match op {
            KVW_OP_READ => Op::Read,
            KVW_OP_WRITE => Op::Write,
            other => return Err(invalid(format!("unknown op {other}"))),
        };
        // SAFETY: the slices and string are valid per the contract.
        let (local, remote, agent) = unsafe {
            (
                slice_arg(local, num_local, "local")?,
                slice_arg(remote, num_remote, "remote")?,
                str_arg(remote_agent, "remote_agent")?,
            )
        };
        let notif = if notif.is_null() {
            None
        } else {
            // SAFETY: `notif_len` readable bytes per the contract.
            Some(unsafe { slice_arg(notif, notif_len, "notif") }?.to_vec())
        };
        if out_handle.is_null() {
            return Err(invalid("out_handle is NULL"));
        }
        let to = |d: &[KvwDesc]| d.iter().map(|d| Desc::new(d.addr, d.len_bytes)).collect::<Vec<_>>();
        let h = e.engine.post(op, &to(local), agent, &to(remote), notif)?;
        // SAFETY: checked non-null; writable per the contract.
        unsafe { write_out(out_handle, h.0, "out_handle") }
    })
}

/// Poll a transfer: `*out_state` receives a [`KvwXferState`]. When it is
/// `KVW_XFER_FAILED` the call still returns OK and `kvw_last_error()` holds the reason.
///
/// # Safety
/// `engine` valid; `out_state` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_status(engine: *mut KvwEngine, handle: u64, out_state: *mut KvwXferState) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        if out_state.is_null() {
            return Err(invalid("out_state is NULL"));
        }
        let (state, _) = state_code(e.engine.status(TransferHandle(handle))?);
        // SAFETY: checked non-null; writable per the contract.
        unsafe { write_out(out_state, state, "out_state") }
    })
}

/// Poll a transfer like [`kvw_status`], and also say why a failed one
/// failed: `*out_code` receives `KVW_OK` unless `*out_state` is
/// `KVW_XFER_FAILED`, then the failure's category: `KVW_ERR_PEER_DIED`,
/// `KVW_ERR_PEER_TIMEOUT`, `KVW_ERR_REMOTE_ACCESS`, `KVW_ERR_CANCELLED`,
/// `KVW_ERR_LOCAL_PROTECTION`, `KVW_ERR_PROTOCOL`, or `KVW_ERR_TRANSPORT`
/// for any other (kvwire's `FailureKind`). `kvw_last_error()` holds the
/// message. The call itself returns OK for a failed transfer.
///
/// # Safety
/// `engine` valid; `out_state` and `out_code` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_status_code(
    engine: *mut KvwEngine,
    handle: u64,
    out_state: *mut KvwXferState,
    out_code: *mut KvwStatus,
) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        if out_state.is_null() || out_code.is_null() {
            return Err(invalid("out_state or out_code is NULL"));
        }
        let (state, code) = state_code(e.engine.status(TransferHandle(handle))?);
        // SAFETY: checked non-null; writable per the contract.
        unsafe { write_out(out_state, state, "out_state") }?;
        // SAFETY: checked non-null; writable per the contract.
        unsafe { write_out(out_code, code, "out_code") }
    })
}

/// The C state and failure category of `status`; a failure's message goes
/// to [`kvw_last_error`].
fn state_code(status: TransferStatus) -> (KvwXferState, KvwStatus) {
    match status {
        TransferStatus::InProgress => (KvwXferState::KvwXferInProgress, KvwStatus::KvwOk),
        TransferStatus::Done => (KvwXferState::KvwXferDone, KvwStatus::KvwOk),
        TransferStatus::Failed(why) => {
            set_error(why.to_string());
            (KvwXferState::KvwXferFailed, failure_status(&why))
        }
    }
}

/// [`kvw_wait`]'s `timeout_us` for "no limit".
pub const KVW_WAIT_FOREVER: u64 = u64::MAX;

/// Wait until a transfer leaves `KVW_XFER_IN_PROGRESS` or `timeout_us`
/// microseconds of wall time pass, sleeping on the transport's completion
/// channel instead of spinning (kvwire's `TransferEngine::wait`: it checks
/// about 5 µs first, then sleeps between checks), so the cores stay with the
/// threads moving the bytes. `timeout_us` 0 checks once;
/// [`KVW_WAIT_FOREVER`] waits without limit. `*out_state` receives the
/// state (`KVW_XFER_IN_PROGRESS` after a timeout: the handle stays yours to
/// wait on again or release); `*out_code`, when `out_code` is not NULL, the
/// failure category as [`kvw_status_code`]'s. A failed transfer returns
/// OK with `kvw_last_error()` holding why. NIXL has no such call (its
/// callers poll `getXferStatus`, as [`kvw_status`]); MAX's
/// `sync_and_release` is this wait followed by [`kvw_release`].
///
/// # Safety
/// `engine` valid; `out_state` writable; `out_code` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_wait(
    engine: *mut KvwEngine,
    handle: u64,
    timeout_us: u64,
    out_state: *mut KvwXferState,
    out_code: *mut KvwStatus,
) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        if out_state.is_null() {
            return Err(invalid("out_state is NULL"));
        }
        let timeout = if timeout_us == KVW_WAIT_FOREVER { Duration::MAX } else { Duration::from_micros(timeout_us) };
        let (state, code) = state_code(e.engine.wait(TransferHandle(handle), timeout)?);
        // SAFETY: checked non-null; writable per the contract.
        unsafe { write_out(out_state, state, "out_state") }?;
        if !out_code.is_null() {
            // SAFETY: non-null and writable per the contract.
            unsafe { write_out(out_code, code, "out_code") }?;
        }
        Ok(())
    })
}

/// Release a transfer handle. Releasing one still in progress cancels it and
/// returns once no copy can touch its buffers.
///
/// # Safety
/// `engine` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_release(engine: *mut KvwEngine, handle: u64) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        e.engine.release(TransferHandle(handle))?;
        Ok(())
    })
}

/// Drain the notifications received so far, calling `cb(user, agent, msg,
/// len)` once each (in arrival order per agent); `*out_count` (may be NULL)
/// receives how many.
///
/// # Safety
/// `engine` valid; `cb` NULL (notifications are then dropped) or a function
/// safe to call with these arguments; `out_count` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_get_notifs(
    engine: *mut KvwEngine,
    cb: KvwNotifFn,
    user: *mut c_void,
    out_count: *mut usize,
) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        let mut n = 0usize;
        for (agent, msgs) in e.engine.get_notifs() {
            let agent = CString::new(agent).unwrap_or_default();
            for m in msgs {
                if let Some(f) = cb {
                    // SAFETY: the caller vouches for `cb`; the pointers live for the call.
                    unsafe { f(user, agent.as_ptr(), m.as_ptr(), m.len()) };
                }
                n += 1;
            }
        }
        if !out_count.is_null() {
            // SAFETY: non-null and writable per the contract.
            unsafe { write_out(out_count, n, "out_count") }?;
        }
        Ok(())
    })
}

/// Send a standalone notification (NIXL `genNotif`): `len` bytes of `msg`
/// (binary-safe, at most 64 KiB) to connected agent `agent` (or this
/// engine's own name), delivered after the data of every transfer to that
/// agent in progress now and after earlier notifications to it. When such
/// transfers are still moving it is queued and sent by a later call that
/// polls ([`kvw_status`], [`kvw_wait`], [`kvw_get_notifs`]).
///
/// Returns `KVW_ERR_NOT_FOUND` for an agent that is not connected,
/// `KVW_ERR_TRANSPORT` for a payload over the limit or a peer that is gone.
///
/// # Safety
/// `engine` valid; `agent` NUL-terminated; `msg` NULL only when `len` is 0,
/// otherwise `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvw_notify(
    engine: *mut KvwEngine,
    agent: *const c_char,
    msg: *const u8,
    len: usize,
) -> KvwStatus {
    guard(|| {
        // SAFETY: per the contract.
        let e = unsafe { engine_arg(engine) }?;
        // SAFETY: NUL-terminated per the contract.
        let agent = unsafe { str_arg(agent, "agent") }?;
        // SAFETY: `len` readable bytes per the contract.
        let payload = unsafe { slice_arg(msg, len, "msg") }?.to_vec();
        e.engine.notify(agent, payload)?;
        Ok(())
    })
}
