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

/// `--target-memory plain` registers the target's buffer without its memfd:
/// over shm the bytes then move by cross-memory attach (verified), and a
/// target that denies cross-memory attach (`cma=deny`) cannot be reached at
/// all, which shows the memfd was not used.
#[test]
fn plain_target_memory_moves_by_cross_memory_attach() {
    let run = |op: &str, extra: &[&str]| {
        kvwire()
            .args(["bench", "--transport", "shm", "--op", op, "--block-size", "4KiB", "--blocks", "256"])
            .args(["--iters", "2", "--warmup", "1", "--scatter", "--lat-iters", "5", "--json"])
            .args(["--target-memory", "plain"])
            .args(extra)
            .output()
            .unwrap()
    };
    for op in ["write", "read"] {
        let out = run(op, &[]);
        assert!(out.status.success(), "{op}: {}", String::from_utf8_lossy(&out.stderr));
        let j = json_of(&out);
        assert_eq!((j["verified"].as_bool(), j["target_memory"].as_str()), (Some(true), Some("plain")), "{j}");
    }
    let out = run("write", &["--target-option", "cma=deny"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("cross-memory attach is disabled"), "{err}");
    // The default (memfd) needs no cross-memory attach.
    let out = kvwire()
        .args(["bench", "--transport", "shm", "--block-size", "4KiB", "--blocks", "64", "--iters", "1"])
        .args(["--lat-iters", "2", "--json", "--target-option", "cma=deny"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(json_of(&out)["target_memory"], "memfd");
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
fn a_listening_target_drops_foreign_connections_and_still_serves() {
    use std::io::Write;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let target = kvwire().args(["bench", "--listen", &addr]).stderr(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // A port scan (connect + close) and an HTTP client: neither may end the target.
    drop(std::net::TcpStream::connect(&addr).unwrap());
    let mut http = std::net::TcpStream::connect(&addr).unwrap();
    http.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    drop(http);
    let out = kvwire()
        .args(["bench", "--connect", &addr, "--block-size", "64KiB", "--blocks", "16", "--iters", "1"])
        .args(["--lat-iters", "2", "--json"])
        .output()
        .unwrap();
    let t = target.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(t.status.success(), "the target must serve the real initiator after the foreign ones");
    let t_err = String::from_utf8_lossy(&t.stderr);
    assert_eq!(t_err.matches("dropped a connection").count(), 2, "{t_err}");
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
    // Each op once with the default wait (TransferEngine::wait) and once polling status.
    for (op, wait) in [("write", "block"), ("read", "poll"), ("read", "block"), ("write", "poll")] {
        let poll: &[&str] = if wait == "poll" { &["--poll-wait", "--wait-sleep-us", "20"] } else { &[] };
        let out = kvwire()
            .args(["bench", "--op", op, "--block-size", "16KiB", "--blocks", "128", "--iters", "6", "--pipeline", "3"])
            .args(["--scatter", "--lat-iters", "5", "--json"])
            .args(poll)
            .output()
            .unwrap();
        assert!(out.status.success(), "{op}: {}", String::from_utf8_lossy(&out.stderr));
        let j = json_of(&out);
        assert_eq!(j["verified"], true, "{op}");
        assert_eq!(j["wait"], wait, "{op}");
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

/// Run a failing kvwire command with `RUST_BACKTRACE=1` (as a user's shell
/// may have it): its exit code and stderr.
fn failing(args: &[&str]) -> (i32, String) {
    let out = kvwire().args(args).env("RUST_BACKTRACE", "1").stdin(Stdio::null()).output().unwrap();
    assert!(!out.status.success(), "{args:?} succeeded");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// One `error:` line (plus at most a `hint:` line), no backtrace, no panic.
fn assert_one_error(stderr: &str, needle: &str) {
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "expected exactly one error line:\n{stderr}");
    assert!(errors[0].contains(needle), "error line lacks {needle:?}:\n{stderr}");
    for bad in ["panicked", "stack backtrace", "Caused by", "closed the side channel"] {
        assert!(!stderr.contains(bad), "{bad:?} in:\n{stderr}");
    }
}

#[test]
fn a_bench_too_big_for_memory_is_refused_before_allocating() {
    // 64 GiB per buffer (the most bench accepts), three buffers: 192 GiB.
    let avail_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find(|l| l.starts_with("MemAvailable:"))?.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    if avail_kib > 200 << 20 {
        eprintln!("a_bench_too_big_for_memory_is_refused_before_allocating: skipped: {avail_kib} KiB available");
        return;
    }
    let (code, err) = failing(&["bench", "--block-size", "1GiB", "--blocks", "64"]);
    assert_eq!(code, 1);
    assert_one_error(&err, "bench needs 192.0 GiB of memory");
    assert!(err.contains("available") && err.contains("hint: use fewer --blocks"), "{err}");
}

#[test]
fn a_target_that_cannot_start_is_reported_once_by_the_initiator_with_its_cause() {
    // No such RDMA device anywhere: the target child fails creating its engine.
    let (_, err) = failing(&["bench", "--transport", "verbs", "--target-device", "nosuchdev0", "--blocks", "4"]);
    assert_one_error(&err, "target");
    assert!(err.contains("hint:"), "{err}");
    // The library's "no device" error points to `kvwire devices` itself; the
    // hint then suggests another transport instead of repeating it.
    if err.contains("no RDMA device") {
        assert!(err.contains("see `kvwire devices`)"), "{err}");
        assert_eq!(err.matches("kvwire devices").count(), 1, "{err}");
    }
}

#[test]
fn options_are_checked_before_any_device_is_opened() {
    let (code, err) = failing(&["bench", "--option", "gid_idx=1", "--transport", "verbs", "--blocks", "4"]);
    assert_eq!(code, 1);
    assert_one_error(&err, "--option: verbs option \"gid_idx\": unknown option (valid verbs options: device, port");
    assert!(!err.contains("RDMA device") && !err.contains("ibv_"), "the device is not looked at first:\n{err}");
    let (_, err) = failing(&["bench", "--target-option", "gid_idx=1", "--transport", "verbs", "--blocks", "4"]);
    assert_one_error(&err, "--target-option: verbs option \"gid_idx\": unknown option");
    // A bad value is refused by the side that has it, before its device.
    let (_, err) = failing(&["bench", "--target-option", "timeout=99", "--transport", "verbs", "--blocks", "4"]);
    assert_one_error(&err, "verbs option \"timeout\": value \"99\" is not valid");
    let (_, err) = failing(&["replay", "--decode-option", "conn_per_peer=4", "--transport", "tcp"]);
    assert_one_error(&err, "--decode-option: tcp option \"conn_per_peer\": unknown option");
    let (_, err) = failing(&["serve", "--name", "x", "--etcd", "http://127.0.0.1:1", "--option", "conn_per_peer=4"]);
    assert_one_error(&err, "--option: tcp option \"conn_per_peer\": unknown option");
}

#[test]
fn verbose_prints_the_cause_chain() {
    use std::io::{Read, Write};
    let (addr, peer) = fake_peer(|mut s| {
        let _ = s.read(&mut [0u8; 256]);
        let _ = s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n");
        std::thread::sleep(Duration::from_millis(500));
    });
    let out = kvwire()
        .args(["-v", "bench", "--connect", &addr, "--blocks", "1"])
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("Caused by") && err.contains("\"SSH-2.0-OpenSSH_9.6\""), "{err}");
    peer.join().unwrap();
}

#[test]
fn devices_fails_for_a_device_that_is_not_there() {
    let (code, err) = failing(&["devices", "--device", "nosuchdev0"]);
    assert_eq!(code, 1);
    assert_one_error(&err, "no RDMA device");
    let (_, err) = failing(&["devices", "--gpu", "4096"]);
    assert_one_error(&err, "no GPU 4096");
    let out = kvwire().arg("devices").output().unwrap();
    assert!(out.status.success(), "plain `devices` reports, never fails");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("GPU"), "devices lists GPUs too:\n{text}");
}

#[test]
fn serve_refuses_bad_durations_without_panicking() {
    for bad in ["--peer-timeout=-1", "--peer-timeout=nan", "--peer-timeout=1e300", "--lookup-timeout=-1"] {
        let (code, err) = failing(&["serve", "--name", "x", "--etcd", "http://127.0.0.1:1", bad]);
        assert_eq!(code, 2, "{bad}: a usage error");
        assert!(err.contains("must be more than 0") && !err.contains("panicked"), "{bad}: {err}");
    }
}

#[test]
fn help_lists_every_backends_options_with_defaults() {
    for cmd in ["bench", "replay", "serve"] {
        let out = kvwire().args([cmd, "--help"]).output().unwrap();
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        for want in ["Transport options", "tcp:", "verbs:", "conns_per_peer", "gid_index", "(default: "] {
            assert!(text.contains(want), "{cmd} --help lacks {want:?}:\n{text}");
        }
    }
}

#[test]
fn log_lines_have_no_colour_codes_when_stderr_is_not_a_terminal() {
    // `output()` pipes stderr: plain text, with or without NO_COLOR.
    for no_color in [None, Some("1")] {
        let mut cmd = kvwire();
        cmd.args(["devices"]).env("RUST_LOG", "debug");
        if let Some(v) = no_color {
            cmd.env("NO_COLOR", v);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("DEBUG") && err.contains("started"), "a log line is printed:\n{err}");
        assert!(!err.contains('\x1b'), "ANSI escape codes in:\n{err:?}");
    }
}

/// A port nothing listens on.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A fake peer on a fresh port: accepts one connection and hands it to `f`.
fn fake_peer(f: impl FnOnce(std::net::TcpStream) + Send + 'static) -> (String, std::thread::JoinHandle<()>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (addr, std::thread::spawn(move || f(l.accept().unwrap().0)))
}

#[test]
fn connect_to_a_dead_target_says_what_it_waits_for_and_gives_up_at_the_timeout() {
    let addr = format!("127.0.0.1:{}", free_port());
    let t0 = std::time::Instant::now();
    let (code, err) = failing(&["bench", "--connect", &addr, "--connect-timeout", "1", "--blocks", "4"]);
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    assert_eq!(code, 1);
    assert!(err.contains(&format!("waiting for {addr} (up to 1 s, --connect-timeout)")), "{err}");
    assert_one_error(&err, &format!("no kvwire bench target at {addr} within 1 s (last error: Connection refused"));
    assert!(err.contains("hint: start `kvwire bench --listen"), "{err}");
    let help = kvwire().args(["bench", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--connect-timeout") && help.contains("[default: 30]"), "{help}");
}

#[test]
fn connect_to_a_silent_peer_fails_at_the_timeout() {
    let (addr, peer) = fake_peer(|s| {
        std::thread::sleep(Duration::from_secs(4));
        drop(s)
    });
    let t0 = std::time::Instant::now();
    let (_, err) = failing(&["bench", "--connect", &addr, "--connect-timeout", "1", "--blocks", "4"]);
    assert!(t0.elapsed() < Duration::from_secs(4), "took {:?}: the 120 s wait", t0.elapsed());
    assert_one_error(&err, &format!("{addr} accepted the connection but did not answer within 1 s"));
    peer.join().unwrap();
}

#[test]
fn connect_to_an_http_server_says_not_a_kvwire_peer() {
    use std::io::{Read, Write};
    let (addr, peer) = fake_peer(|mut s| {
        let _ = s.read(&mut [0u8; 256]);
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        std::thread::sleep(Duration::from_millis(500));
    });
    let (_, err) = failing(&["bench", "--connect", &addr, "--connect-timeout", "5", "--blocks", "4"]);
    assert_one_error(
        &err,
        &format!("the bench target at {addr}: not a kvwire peer: it sent \"HTTP/1.1 400 Bad Request\" instead of"),
    );
    assert!(!err.contains("exceeds the limit"), "{err}");
    peer.join().unwrap();
}

#[test]
fn a_silent_etcd_is_reported_as_not_answering_within_the_call_timeout() {
    let (addr, peer) = fake_peer(|s| {
        std::thread::sleep(Duration::from_secs(5));
        drop(s)
    });
    let url = format!("http://{addr}");
    let (_, err) = failing(&["serve", "--name", "x", "--etcd", &url]);
    assert_one_error(&err, &format!("etcd at {url} did not answer within 3 s"));
    assert!(!err.contains("Resource temporarily unavailable"), "{err}");
    peer.join().unwrap();
}

#[test]
fn zero_and_absurd_numbers_are_refused_without_panic_or_hang() {
    let etcd = ["--etcd", "http://127.0.0.1:1"];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["bench", "--pipeline", "0"], "--pipeline must be 1..=4096"),
        (vec!["bench", "--pipeline", "100000"], "--pipeline must be 1..=4096"),
        (vec!["bench", "--iters", "99999999999999", "--blocks", "4"], "--iters 99999999999999 is more than 1000000"),
        (vec!["bench", "--lat-iters", "99999999999999", "--blocks", "4"], "--lat-iters 99999999999999 is more than"),
        (vec!["bench", "--warmup", "99999999999999", "--blocks", "4"], "--warmup 99999999999999 is more than"),
        (
            vec!["bench", "--poll-wait", "--wait-sleep-us", "99999999999", "--blocks", "4"],
            "--wait-sleep-us must be at most",
        ),
        (vec!["bench", "--copy-threads", "0", "--blocks", "4"], "copy_threads must be in 1..=256"),
        (vec!["bench", "--listen", "nonsense"], "--listen nonsense (expected IP:PORT"),
        (vec!["replay", "--speed", "1e-300"], "--speed must be 0.001..=1000000"),
        (vec!["replay", "--host-tier-gib", "1e30", "--connector", "host"], "--host-tier-gib must be 0..=1048576"),
        (vec!["replay", "--decode-step-ms", "1e300"], "--decode-step-ms must be 0..=60000"),
        (vec!["replay", "--inflight", "0"], "must be at least 1"),
        (
            vec!["serve", "--name", "a", etcd[0], etcd[1], "--pull", "b", "--pages", "0"],
            "--pages must be at least 1 with --pull",
        ),
        (vec!["serve", "--name", "a", etcd[0], etcd[1], "--pull", "b,b"], "--pull names b twice"),
        (vec!["serve", "--name", "a", etcd[0], etcd[1], "--pull", "a"], "this engine's own --name"),
    ];
    for (args, want) in cases {
        let (code, err) = failing(&args);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert_one_error(&err, want);
    }
    // Far more memory than any machine has: refused with the numbers.
    let (_, err) = failing(&["serve", "--name", "a", etcd[0], etcd[1], "--buffer", "1000000GiB"]);
    assert_one_error(&err, "serve needs 1000000.0 GiB of memory (--buffer 1000000 GiB)");
}

#[test]
fn a_listener_refuses_test_flags_and_names_them() {
    let (_, err) = failing(&["bench", "--listen", "127.0.0.1:0", "--block-size", "1MiB", "--op=read"]);
    assert_one_error(&err, "--op, --block-size set the test");
    assert!(err.contains("give them to `kvwire bench --connect` instead"), "{err}");
}

#[test]
fn connect_without_a_port_says_host_port_is_expected() {
    let (_, err) = failing(&["bench", "--connect", "localhost"]);
    assert_one_error(&err, "--connect localhost: expected HOST:PORT (e.g. localhost:18515)");
}

#[test]
fn each_zero_count_names_its_flag() {
    for (flag, want) in [("--blocks", "--blocks must be at least 1"), ("--iters", "--iters must be at least 1")] {
        let (_, err) = failing(&["bench", flag, "0"]);
        assert_one_error(&err, want);
    }
}

#[test]
fn shm_towards_another_host_says_what_to_add_and_no_transport_means_tcp() {
    // 192.0.2.1 (TEST-NET-1) is another host: shm cannot reach it.
    let (_, err) = failing(&["bench", "--connect", "192.0.2.1:18515", "--transport", "shm"]);
    assert_one_error(&err, "--transport shm moves bytes within one host; the target at 192.0.2.1 is another host");
    assert!(err.contains("hint: add --transport tcp"), "{err}");
    // Without --transport the initiator picks tcp and says so.
    let (_, err) = failing(&["bench", "--connect", "192.0.2.1:18515", "--connect-timeout", "1"]);
    assert!(err.contains("the target at 192.0.2.1 is another host: using --transport tcp"), "{err}");
}

#[test]
fn a_listener_whose_initiator_left_before_measuring_says_so() {
    let addr = format!("127.0.0.1:{}", free_port());
    let target = kvwire().args(["bench", "--listen", &addr]).stderr(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // The initiator's own engine cannot start (a bad option value, found
    // after the target answered): it leaves without a transfer.
    let (_, ierr) = failing(&["bench", "--connect", &addr, "--option", "cma=maybe", "--blocks", "4"]);
    assert!(ierr.contains("cma"), "{ierr}");
    let t = target.wait_with_output().unwrap();
    assert!(!t.status.success(), "the target must not exit 0 when nothing was measured");
    let terr = String::from_utf8_lossy(&t.stderr);
    assert!(terr.contains("the initiator left before any transfer was measured"), "{terr}");
}

#[test]
fn latency_iterations_shrink_for_large_blocks_unless_given() {
    let run = |extra: &[&str]| {
        let out = kvwire()
            .args(["bench", "--block-size", "64MiB", "--blocks", "1", "--iters", "1", "--warmup", "0", "--json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        json_of(&out)["lat_iters"].as_u64()
    };
    // 2 GiB / 64 MiB = 32 (not 200 whole 64 MiB blocks)
    assert_eq!(run(&[]), Some(32));
    assert_eq!(run(&["--lat-iters", "3"]), Some(3));
}

#[test]
fn the_header_comes_first_and_long_phases_print_progress() {
    use std::io::{BufRead, BufReader};
    let mut child = kvwire()
        .args(["bench", "--block-size", "4KiB", "--blocks", "64", "--iters", "2", "--lat-iters", "20000"])
        .env("KVWIRE_PROGRESS_MS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    assert!(first.starts_with("kvwire bench: shm WRITE, 64 x 4 KiB blocks"), "{first}");
    let rest: Vec<String> = out.lines().map_while(Result::ok).collect();
    let status = child.wait().unwrap();
    assert!(status.success());
    // the table follows the header, which it no longer repeats
    assert!(rest[0].trim_start().starts_with("block"), "{rest:?}");
    assert!(!rest.iter().any(|l| l.starts_with("kvwire bench:")), "{rest:?}");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("/20000 single-block latency transfers"), "{err}");
}

#[test]
fn bind_errors_name_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (_, err) = failing(&["bench", "--listen", &addr]);
    assert_one_error(&err, &format!("--listen {addr}: bind: Address already in use"));
    let (_, err) = failing(&["replay", "--role", "decode", "--listen", &addr]);
    assert_one_error(&err, &format!("listening on {addr} (--listen): bind: Address already in use"));
    let (_, err) = failing(&["replay", "--transport", "tcp", "--option", &format!("listen={addr}"), "--requests", "1"]);
    assert_one_error(&err, &format!("transport on listen={addr}"));
    let (_, err) = failing(&["serve", "--name", "x", "--etcd", "http://127.0.0.1:1", "--listen", &addr]);
    assert_one_error(&err, &format!("starting the tcp transport on --listen {addr}"));
}

#[test]
fn a_listener_whose_initiator_never_came_says_so() {
    let t = std::time::Instant::now();
    let (_, err) = failing(&["bench", "--listen", "127.0.0.1:0", "--listen-timeout", "1"]);
    assert!(err.contains("no initiator came to 127.0.0.1:"), "{err}");
    assert!(err.contains("within 1 s (--listen-timeout)"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(30), "the listener did not give up");
    // --listen-timeout belongs to --listen
    let (_, err) = failing(&["bench", "--listen-timeout", "1"]);
    assert!(err.contains("--listen"), "{err}");
}
