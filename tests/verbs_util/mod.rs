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

/// Poll bare transport `t` until transfer `x` completed (at most [`WAIT`]).
pub(crate) fn wait_completion(
    t: &mut Box<dyn kvwire::transport::Transport>,
    x: kvwire::transport::XferId,
) -> kvwire::transport::Completion {
    let t0 = Instant::now();
    let mut out = Vec::new();
    loop {
        t.poll(&mut out);
        if let Some(c) = out.iter().find(|c| c.xfer == x) {
            return c.clone();
        }
        assert!(t0.elapsed() < WAIT, "no completion for {x:?}");
        std::thread::sleep(Duration::from_micros(200));
    }
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

/// Whether `KVWIRE_REQUIRE_RDMA=1`: a test that finds no RDMA device then
/// fails instead of passing without moving a byte (the Soft-RoCE guest sets
/// it, `scripts/softroce-tests.sh`).
pub(crate) fn rdma_required() -> bool {
    std::env::var("KVWIRE_REQUIRE_RDMA").is_ok_and(|v| v == "1")
}

/// The running test's name (libtest names each test's thread after it).
pub(crate) fn test_name() -> String {
    std::thread::current().name().unwrap_or("verbs test").to_string()
}

/// Say `<test>: skipped: <why>` on stderr; panic instead when
/// [`rdma_required`].
pub(crate) fn skip(why: &str) {
    skip_unless_required(rdma_required(), &test_name(), why);
}

/// [`skip`] with the requirement given: panics when `required`.
pub(crate) fn skip_unless_required(required: bool, test: &str, why: &str) {
    assert!(!required, "{test}: KVWIRE_REQUIRE_RDMA=1 but {why}");
    // Straight to stderr, past libtest's capture: visible without --nocapture.
    let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{test}: skipped: {why}\n").as_bytes());
}

/// The devices of [`devices`], or (after [`skip`]) return from the test.
#[macro_export]
macro_rules! need_devices {
    () => {
        match $crate::verbs_util::devices() {
            Ok(d) => d,
            Err(why) => {
                $crate::verbs_util::skip(&format!("no RDMA device ({why})"));
                return;
            }
        }
    };
}

#[test]
fn a_missing_device_fails_only_when_rdma_is_required() {
    skip_unless_required(false, "t", "no RDMA device (test)");
    let failed = std::panic::catch_unwind(|| skip_unless_required(true, "t", "no RDMA device (test)"));
    let msg = *failed.expect_err("must fail when required").downcast::<String>().unwrap();
    assert_eq!(msg, "t: KVWIRE_REQUIRE_RDMA=1 but no RDMA device (test)");
    let named = std::thread::Builder::new().name("probe".into()).spawn(test_name).unwrap().join().unwrap();
    assert_eq!(named, "probe");
}
