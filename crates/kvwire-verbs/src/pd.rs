//! Protection domains.

use std::ptr::NonNull;
use std::sync::Arc;

use super::ffi::ibv_pd;
use super::{Context, VerbsError, record_drop_failure};

/// `struct ibv_pd`; holds its [`Context`].
pub struct ProtectionDomain {
    pub(crate) raw: NonNull<ibv_pd>,
    pub(crate) ctx: Arc<Context>,
}

// SAFETY: PDs are plain handles; libibverbs calls on them are thread-safe.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// Allocate a PD on `ctx`.
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_alloc_pd`.
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: `ctx` is an open context.
        let raw = unsafe { (ctx.lib.alloc_pd)(ctx.raw.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::call("ibv_alloc_pd", 0))?;
        Ok(Arc::new(Self { raw, ctx: ctx.clone() }))
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an Arc of this PD, so none is alive.
        let rc = unsafe { (self.ctx.lib.dealloc_pd)(self.raw.as_ptr()) };
        if rc != 0 {
            record_drop_failure("ibv_dealloc_pd", rc);
        }
    }
}
