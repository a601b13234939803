//! `kvwire bench` end to end: both roles, both directions, every byte checked.

use std::process::{Command, Stdio};
use std::time::Duration;

fn kvwire() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvwire"))
}

fn json_of(out: &std::process::Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or("")).unwrap_or(serde_json::Value::Null)
}

#[test]
fn write_and_read_report_every_documented_key_and_verify() {
    for op in ["write", "read"] {
        let out = kvwire()
            .args(["bench", "--op", op, "--block-size", "4KiB", "--blocks", "256", "--iters", "3", "--warmup", "1"])
            .args(["--scatter", "--lat-iters", "20", "--json"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let j = json_of(&out);
        for key in [
            "gb_per_s",
            "memcpy_gb_per_s",
            "memcpy_ratio",
            "memcpy_n_gb_per_s",
            "stream_n_gb_per_s",
            "ceiling_gb_per_s",
            "ceiling_ratio",
            "p50_us",
            "p99_us",
            "post_ns_per_block",
            "post_cpu_ns_per_block",
            "verified",
        ] {
            assert!(j.get(key).is_some(), "{op}: missing {key} in {j}");
        }
        assert_eq!(j["verified"], true, "{op}");
        assert_eq!(j["op"], op);
        assert_eq!(j["bytes_per_transfer"], 256 * 4096);
        assert!(j["gb_per_s"].as_f64().unwrap() > 0.0);
        // scattered destinations: (almost) nothing coalesces
        assert!(j["segments_after_coalescing"].as_u64().unwrap() > 200, "{j}");
    }
}

#[test]
fn contiguous_blocks_coalesce_into_one_segment() {
    let out = kvwire()
        .args(["bench", "--block-size", "4KiB", "--blocks", "128", "--iters", "2", "--lat-iters", "5", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(json_of(&out)["segments_after_coalescing"], 1);
}

#[test]
fn two_terminal_mode_listen_and_connect() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let mut target = kvwire().args(["bench", "--listen", &addr]).stderr(Stdio::null()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let out = kvwire()
        .args(["bench", "--connect", &addr, "--block-size", "64KiB", "--blocks", "32", "--iters", "2"])
        .args(["--lat-iters", "5", "--json"])
        .output()
        .unwrap();
    let status = target.wait().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(status.success(), "the target must exit cleanly after the run");
    assert_eq!(json_of(&out)["verified"], true);
}

#[test]
fn bad_arguments_are_refused_with_a_message() {
    for args in
        [&["--block-size", "0"][..], &["--block-size", "12XB"], &["--blocks", "0"], &["--transport", "carrier-pigeon"]]
    {
        let out = kvwire().arg("bench").args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        assert!(!out.stderr.is_empty(), "{args:?}: no message");
    }
}

#[test]
fn pipelined_transfers_stream_and_still_verify() {
    for op in ["write", "read"] {
        let out = kvwire()
            .args(["bench", "--op", op, "--block-size", "16KiB", "--blocks", "128", "--iters", "6", "--pipeline", "3"])
            .args(["--scatter", "--lat-iters", "5", "--json"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{op}: {}", String::from_utf8_lossy(&out.stderr));
        let j = json_of(&out);
        assert_eq!(j["verified"], true, "{op}");
        assert_eq!(j["pipeline"], 3);
        assert_eq!(j["notifications_received"], 2 + 6, "{op}: one per warmup (default 2) and measured transfer");
    }
}

#[test]
fn no_notify_posts_transfers_without_notifications() {
    let out = kvwire()
        .args(["bench", "--op", "write", "--block-size", "4KiB", "--blocks", "64", "--iters", "3", "--warmup", "1"])
        .args(["--scatter", "--lat-iters", "2", "--no-notify", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j = json_of(&out);
    assert_eq!(j["verified"], true);
    assert_eq!(j["notifications_received"], 0);
}
