//! Completion queues, polled through the provider's `poll_cq` op.

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
        // SAFETY: `ctx` is an open context.
        let poll = unsafe { (*ctx.raw.as_ptr()).ops.poll_cq }
            .ok_or_else(|| VerbsError::Unsupported("provider has no poll_cq".into()))?;
        // SAFETY: open context; no channel, no user context, vector 0.
        let raw = unsafe {
            (ctx.lib.create_cq)(ctx.raw.as_ptr(), num_entries, std::ptr::null_mut(), std::ptr::null_mut(), 0)
        };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::call("ibv_create_cq", 0))?;
        Ok(Arc::new(Self { raw, ctx: ctx.clone(), poll }))
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
    }
}
