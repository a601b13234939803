//! Loading `libibverbs.so.1` at run time, as NCCL does, so that kvwire builds
//! and runs everywhere and only `verbs` needs rdma-core.
//!
//! Symbols are looked up with `dlvsym` at the version the mirror in
//! [`super::ffi`] follows (`IBVERBS_1.1`, the ABI since rdma-core v13;
//! `ibv_reg_mr_iova2` is `IBVERBS_1.8`, `ibv_reg_dmabuf_mr` `IBVERBS_1.12`, the completion channel's
//! `ibv_{create,destroy}_comp_channel` `IBVERBS_1.0`),
//! falling back to the default version (`dlsym`).

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use super::VerbsError;
use super::ffi::*;

/// The library file name we load.
pub const LIBRARY: &str = "libibverbs.so.1";

/// The libibverbs entry points kvwire calls (the non-inline ones).
#[allow(missing_docs)]
pub struct Verbs {
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    pub query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    pub query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub reg_mr_iova2: Option<unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, u64, u32) -> *mut ibv_mr>,
    pub reg_dmabuf_mr: Option<unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr>,
    pub dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub create_cq: unsafe extern "C" fn(*mut ibv_context, c_int, *mut c_void, *mut c_void, c_int) -> *mut ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub create_comp_channel: Option<unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel>,
    pub destroy_comp_channel: Option<unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int>,
    pub get_cq_event: Option<unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int>,
    pub ack_cq_events: Option<unsafe extern "C" fn(*mut ibv_cq, c_uint)>,
    pub create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
    /// Keeps the library mapped for the process lifetime.
    _lib: libloading::Library,
}

static VERBS: OnceLock<Result<Verbs, String>> = OnceLock::new();

/// The loaded library, loading it on first use.
///
/// # Errors
/// [`VerbsError::Unsupported`] naming the missing library or symbol.
pub fn verbs() -> Result<&'static Verbs, VerbsError> {
    VERBS.get_or_init(load).as_ref().map_err(|e| VerbsError::Unsupported(e.clone()))
}

/// True when libibverbs can be loaded here (for `auto` transport selection).
pub fn available() -> bool {
    verbs().is_ok()
}

// The target type of each transmute is the field it is assigned to.
#[allow(clippy::missing_transmute_annotations)]
fn load() -> Result<Verbs, String> {
    // SAFETY: loading libibverbs runs its constructors, which only set up
    // provider discovery; it has no other initialisation requirements.
    let lib = unsafe { libloading::Library::new(LIBRARY) }
        .map_err(|e| format!("{LIBRARY} not found: install rdma-core / libibverbs1 ({e})"))?;
    let lib = libloading::os::unix::Library::from(lib);
    let handle = lib.into_raw();
    // SAFETY: `handle` was just produced by `into_raw` and is turned back
    // into a Library exactly once, below.
    let lib = unsafe { libloading::os::unix::Library::from_raw(handle) };
    let sym = |name: &CStr, version: &CStr| -> *mut c_void {
        // SAFETY: `handle` is a live dlopen handle (owned by `lib`, alive in
        // this function); names are NUL-terminated.
        let p = unsafe { libc::dlvsym(handle, name.as_ptr(), version.as_ptr()) };
        if !p.is_null() {
            return p;
        }
        // SAFETY: as above.
        unsafe { libc::dlsym(handle, name.as_ptr()) }
    };
    macro_rules! req {
        ($name:literal, $ver:literal) => {{
            let p = sym($name, $ver);
            if p.is_null() {
                return Err(format!("{LIBRARY} lacks {}", $name.to_string_lossy()));
            }
            // SAFETY: the symbol has the C signature of the field it is
            // stored in (see verbs.h at the given symbol version).
            unsafe { std::mem::transmute::<*mut c_void, _>(p) }
        }};
    }
    macro_rules! opt {
        ($name:literal, $ver:literal) => {{
            let p = sym($name, $ver);
            if p.is_null() {
                None
            } else {
                // SAFETY: as for `req!`.
                Some(unsafe { std::mem::transmute::<*mut c_void, _>(p) })
            }
        }};
    }
    Ok(Verbs {
        get_device_list: req!(c"ibv_get_device_list", c"IBVERBS_1.1"),
        free_device_list: req!(c"ibv_free_device_list", c"IBVERBS_1.1"),
        get_device_name: req!(c"ibv_get_device_name", c"IBVERBS_1.1"),
        open_device: req!(c"ibv_open_device", c"IBVERBS_1.1"),
        close_device: req!(c"ibv_close_device", c"IBVERBS_1.1"),
        query_device: req!(c"ibv_query_device", c"IBVERBS_1.1"),
        query_port: req!(c"ibv_query_port", c"IBVERBS_1.1"),
        query_gid: req!(c"ibv_query_gid", c"IBVERBS_1.1"),
        alloc_pd: req!(c"ibv_alloc_pd", c"IBVERBS_1.1"),
        dealloc_pd: req!(c"ibv_dealloc_pd", c"IBVERBS_1.1"),
        reg_mr: req!(c"ibv_reg_mr", c"IBVERBS_1.1"),
        reg_mr_iova2: opt!(c"ibv_reg_mr_iova2", c"IBVERBS_1.8"),
        reg_dmabuf_mr: opt!(c"ibv_reg_dmabuf_mr", c"IBVERBS_1.12"),
        dereg_mr: req!(c"ibv_dereg_mr", c"IBVERBS_1.1"),
        create_cq: req!(c"ibv_create_cq", c"IBVERBS_1.1"),
        destroy_cq: req!(c"ibv_destroy_cq", c"IBVERBS_1.1"),
        create_comp_channel: opt!(c"ibv_create_comp_channel", c"IBVERBS_1.0"),
        destroy_comp_channel: opt!(c"ibv_destroy_comp_channel", c"IBVERBS_1.0"),
        get_cq_event: opt!(c"ibv_get_cq_event", c"IBVERBS_1.1"),
        ack_cq_events: opt!(c"ibv_ack_cq_events", c"IBVERBS_1.1"),
        create_qp: req!(c"ibv_create_qp", c"IBVERBS_1.1"),
        modify_qp: req!(c"ibv_modify_qp", c"IBVERBS_1.1"),
        destroy_qp: req!(c"ibv_destroy_qp", c"IBVERBS_1.1"),
        _lib: lib.into(),
    })
}
