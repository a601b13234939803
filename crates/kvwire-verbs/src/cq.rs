//! Completion queues, polled through the provider's `poll_cq` op, with an
//! optional completion channel so an idle poller can block until the next
//! completion (`ibv_req_notify_cq` + `ibv_get_cq_event`).

use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use super::ffi::*;
use super::{Context, VerbsError, record_drop_failure};

/// One work completion (a copy of `struct ibv_wc`).
pub type WorkCompletion = ibv_wc;

/// `struct ibv_cq`; holds its [`Context`]. QPs hold an `Arc` of their CQ.
pub struct CompletionQueue {
    pub(crate) raw: NonNull<ibv_cq>,
    ctx: Arc<Context>,
    poll: PollCqFn,
    /// Completion channel and the provider's `req_notify_cq`, when events
    /// were asked for and are supported.
    events: Option<(NonNull<ibv_comp_channel>, ReqNotifyCqFn)>,
}

// SAFETY: providers lock the CQ inside poll_cq; the handle is shareable.
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// Create a CQ with at least `num_entries` entries.
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_create_cq`; [`VerbsError::Unsupported`]
    /// when the provider has no `poll_cq` op.
    pub fn new(ctx: &Arc<Context>, num_entries: i32) -> Result<Arc<Self>, VerbsError> {
        Self::create(ctx, num_entries, false)
    }

    /// As [`new`](Self::new), with a completion channel when `events` is set
    /// and the library and provider support one (else without: see
    /// [`has_events`](Self::has_events)).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn create(ctx: &Arc<Context>, num_entries: i32, events: bool) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: `ctx` is an open context.
        let ops = unsafe { &(*ctx.raw.as_ptr()).ops };
        let poll = ops.poll_cq.ok_or_else(|| VerbsError::Unsupported("provider has no poll_cq".into()))?;
        let lib = &ctx.lib;
        let mut channel = None;
        if events
            && let (Some(create), Some(notify), Some(_), Some(_), Some(_)) = (
                lib.create_comp_channel,
                ops.req_notify_cq,
                lib.destroy_comp_channel,
                lib.get_cq_event,
                lib.ack_cq_events,
            )
        {
            // SAFETY: open context.
            channel = NonNull::new(unsafe { create(ctx.raw.as_ptr()) }).map(|c| (c, notify));
        }
        let ch = channel.map_or(std::ptr::null_mut(), |(c, _)| c.as_ptr().cast());
        // SAFETY: open context; `ch` is null or a channel of this context;
        // no user context, vector 0.
        let raw = unsafe { (ctx.lib.create_cq)(ctx.raw.as_ptr(), num_entries, std::ptr::null_mut(), ch, 0) };
        let Some(raw) = NonNull::new(raw) else {
            if let (Some((c, _)), Some(destroy)) = (channel, lib.destroy_comp_channel) {
                // SAFETY: the channel has no CQ attached.
                unsafe { destroy(c.as_ptr()) };
            }
            return Err(VerbsError::call("ibv_create_cq", 0));
        };
        Ok(Arc::new(Self { raw, ctx: ctx.clone(), poll, events: channel }))
    }

    /// True when the CQ has a completion channel ([`arm`](Self::arm) and
    /// [`wait_event`](Self::wait_event) work).
    pub fn has_events(&self) -> bool {
        self.events.is_some()
    }

    /// Ask for an event on the next completion (`ibv_req_notify_cq`, all
    /// completions). Poll once more afterwards: completions that arrived
    /// before arming raise no event.
    ///
    /// # Errors
    /// [`VerbsError::Call`] from the provider; `Unsupported` without a channel.
    pub fn arm(&self) -> Result<(), VerbsError> {
        let (_, notify) = self.events.ok_or_else(|| VerbsError::Unsupported("CQ has no completion channel".into()))?;
        // SAFETY: live CQ with a channel.
        let rc = unsafe { notify(self.raw.as_ptr(), 0) };
        if rc != 0 {
            return Err(VerbsError::call("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    /// Wait up to `timeout_ms` for the armed CQ's event; consume and
    /// acknowledge it. Returns whether an event came (the CQ is then
    /// disarmed). One thread at a time.
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `poll(2)` or `ibv_get_cq_event`;
    /// `Unsupported` without a channel.
    pub fn wait_event(&self, timeout_ms: i32) -> Result<bool, VerbsError> {
        self.wait_event_or(None, timeout_ms)
    }

    /// [`wait_event`](Self::wait_event), also returning (with `false`) as
    /// soon as `wake` is readable: a thread blocked on completions can be
    /// woken for other work. `wake` is not read here.
    ///
    /// # Errors
    /// As [`wait_event`](Self::wait_event).
    pub fn wait_event_or(&self, wake: Option<BorrowedFd<'_>>, timeout_ms: i32) -> Result<bool, VerbsError> {
        let (ch, _) = self.events.ok_or_else(|| VerbsError::Unsupported("CQ has no completion channel".into()))?;
        let lib = &self.ctx.lib;
        let (Some(get), Some(ack)) = (lib.get_cq_event, lib.ack_cq_events) else {
            return Err(VerbsError::Unsupported("libibverbs lacks ibv_get_cq_event".into()));
        };
        // SAFETY: live channel.
        let fd = unsafe { (*ch.as_ptr()).fd };
        let mut pfds = [
            libc::pollfd { fd, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: wake.map_or(-1, |w| w.as_raw_fd()), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: two valid pollfds (poll ignores a negative fd).
        let rc = unsafe { libc::poll(pfds.as_mut_ptr(), 2, timeout_ms) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(VerbsError::call("poll(completion channel)", e.raw_os_error().unwrap_or(0)));
        }
        if rc == 0 || pfds[0].revents & libc::POLLIN == 0 {
            return Ok(false);
        }
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut cq_ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: live channel whose fd is readable (the read does not block).
        let rc = unsafe { get(ch.as_ptr(), &mut cq, &mut cq_ctx) };
        if rc != 0 {
            return Err(VerbsError::call("ibv_get_cq_event", 0));
        }
        // SAFETY: the event is for this channel's only CQ (`cq` is ours);
        // acknowledged at once so destroy_cq never waits.
        unsafe { ack(cq, 1) };
        Ok(true)
    }

    /// Poll up to `out.len()` completions into `out`; returns how many.
    ///
    /// # Errors
    /// [`VerbsError::Call`] when the provider reports a polling error.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError> {
        let n = out.len().min(i32::MAX as usize) as i32;
        // SAFETY: live CQ; `out` has room for `n` entries.
        let rc = unsafe { (self.poll)(self.raw.as_ptr(), n, out.as_mut_ptr()) };
        if rc < 0 {
            return Err(VerbsError::call("ibv_poll_cq", -rc));
        }
        Ok(rc as usize)
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: QPs hold an Arc of their CQ, so none is attached any more.
        let rc = unsafe { (self.ctx.lib.destroy_cq)(self.raw.as_ptr()) };
        if rc != 0 {
            record_drop_failure("ibv_destroy_cq", rc);
        }
        if let (Some((ch, _)), Some(destroy)) = (self.events, self.ctx.lib.destroy_comp_channel) {
            // SAFETY: its only CQ was destroyed above (every event acked).
            let rc = unsafe { destroy(ch.as_ptr()) };
            if rc != 0 {
                record_drop_failure("ibv_destroy_comp_channel", rc);
            }
        }
    }
}
