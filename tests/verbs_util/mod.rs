//! Shared by the verbs test binaries: which RDMA devices to use, or why to
//! skip; the transport configuration for a device; waiting for a transfer.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvwire::engine::{TransferEngine, TransferHandle, TransferStatus};
use kvwire::transport::TransportConfig;

/// How long a test waits for a transfer (the guest is slow).
pub(crate) const WAIT: Duration = Duration::from_secs(60);

/// Verbs options for `device` (and `$SOFTROCE_GID_IDX` as `gid_index`), plus `extra`.
pub(crate) fn config(device: &str, extra: &[(&str, &str)]) -> TransportConfig {
    let mut c = TransportConfig::default();
    c.options.push(("device".into(), device.into()));
    if let Ok(i) = std::env::var("SOFTROCE_GID_IDX") {
        c.options.push(("gid_index".into(), i));
    }
    for (k, v) in extra {
        c.options.push((k.to_string(), v.to_string()));
    }
    c
}

/// Wait for `h` with [`TransferEngine::wait`] (sleeping on the verbs
/// transport's completion channel) until it leaves `InProgress` or [`WAIT`]
/// passed; its last status.
pub(crate) fn wait(e: &mut TransferEngine, h: TransferHandle) -> TransferStatus {
    let t0 = Instant::now();
    let s = e.wait(h, WAIT).unwrap();
    // `wait` returns early only with a final status.
    assert!(s != TransferStatus::InProgress || t0.elapsed() >= WAIT, "wait returned {s:?} early");
    s
}

/// `(target device, initiator device)` (Soft-RoCE: rxe0, rxe1) or the reason to skip.
pub(crate) fn devices() -> Result<(String, String), String> {
    if let Ok(devs) = std::env::var("SOFTROCE_DEVS") {
        let d: Vec<&str> = devs.split_whitespace().collect();
        if d.len() >= 2 {
            return Ok((d[0].to_string(), d[1].to_string()));
        }
    }
    match kvwire::verbs::device_names() {
        Err(e) => Err(e.to_string()),
        Ok(names) if names.is_empty() => Err("libibverbs lists no device and SOFTROCE_DEVS is unset".into()),
        Ok(names) => Ok((names[0].clone(), names[0].clone())),
    }
}

#[macro_export]
macro_rules! need_devices {
    () => {
        match $crate::verbs_util::devices() {
            Ok(d) => d,
            Err(why) => {
                eprintln!("skipped: no RDMA device ({why})");
                return;
            }
        }
    };
}
