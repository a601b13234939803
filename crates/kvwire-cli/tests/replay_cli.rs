//! The main job end to end: `kvwire replay` on the bundled trace, two real
//! processes over shm, every byte verified by the decode side.

use std::process::Command;

fn replay(args: &[&str]) -> (bool, serde_json::Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .arg("replay")
        .args(args)
        .arg("--json")
        .output()
        .expect("running kvwire replay");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let json = stdout.lines().last().and_then(|l| serde_json::from_str(l).ok()).unwrap_or(serde_json::Value::Null);
    (out.status.success(), json, stderr)
}

#[test]
fn first_200_requests_of_the_trace_arrive_intact_with_backpressure() {
    let (ok, j, err) = replay(&["--requests", "200", "--decode-pages", "2048"]);
    assert!(ok, "{err}");
    assert_eq!(j["requests"], 200);
    assert_eq!(j["verified"], true);
    assert_eq!(j["bad_pages"], 0);
    // the first 200 requests hold more pages than a 2047-page pool: decode must wait
    assert!(j["backpressured"].as_u64().unwrap() > 0, "{j}");
    assert!(j["decode_pool_high_water"].as_u64().unwrap() <= 2047);
    // Llama-3-8B, 1 layer: 2 × 8 heads × 128 dims × 2 bytes
    assert_eq!(j["bytes_per_token"], 4096);
    assert_eq!(j["bytes"].as_u64().unwrap(), j["pages"].as_u64().unwrap() * 128 * 4096);
}

#[test]
fn tp2_and_dp2_move_every_shard() {
    let (ok, j, err) = replay(&["--requests", "24", "--tp", "2", "--dp", "2", "--decode-pages", "1024"]);
    assert!(ok, "{err}");
    assert_eq!(j["verified"], true);
    assert_eq!(j["tp"], 2);
    assert_eq!(j["dp"], 2);
    // two shards of half the heads each: the same bytes per token in total
    assert_eq!(j["bytes"].as_u64().unwrap(), j["pages"].as_u64().unwrap() * 128 * 4096);
}

#[test]
fn mla_broadcast_from_tp1_to_tp4() {
    let (ok, j, err) = replay(&[
        "--requests",
        "16",
        "--model",
        "deepseek-v3",
        "--tp",
        "1",
        "--decode-tp",
        "4",
        "--decode-pages",
        "1024",
    ]);
    assert!(ok, "{err}");
    assert_eq!(j["verified"], true);
    assert_eq!(j["decode_tp"], 4);
}

#[test]
fn gqa_with_different_tp_is_refused_clearly() {
    let (ok, _, err) = replay(&["--requests", "4", "--tp", "1", "--decode-tp", "2", "--decode-pages", "1024"]);
    assert!(!ok);
    assert!(
        err.contains("GATHER_SCATTER") || err.to_lowercase().contains("not implemented") || err.contains("bytes"),
        "{err}"
    );
}

#[test]
fn a_corrupted_page_is_detected_and_fails_the_run() {
    let (ok, j, err) = replay(&["--requests", "6", "--decode-pages", "1024", "--inject-bad-page", "3"]);
    assert!(!ok, "a wrong page must fail the replay: {j}");
    assert!(err.contains("bad pages"), "{err}");
}

#[test]
fn host_tier_serves_repeated_prefixes_and_the_bytes_still_verify() {
    let (ok, j, err) =
        replay(&["--requests", "60", "--decode-pages", "2048", "--connector", "host", "--host-tier-gib", "4"]);
    assert!(ok, "{err}");
    assert_eq!(j["verified"], true);
    assert_eq!(j["connector"], "host");
    let hit = j["prefix_hit_rate"].as_f64().unwrap();
    let unlimited = j["unlimited_tier_hit_rate"].as_f64().unwrap();
    // the first 60 requests repeat ~4% of their prefix pages; a 4 GiB tier
    // holds them all, so only offloads still in flight can cost hits
    assert!(unlimited > 0.03, "{j}");
    assert!(hit > 0.5 * unlimited && hit <= unlimited + 1e-9, "{j}");
    assert_eq!(
        j["pages_loaded"].as_u64().unwrap() + j["pages_computed"].as_u64().unwrap(),
        j["pages"].as_u64().unwrap()
    );
    // loaded pages were byte-identical to computed ones: decode checked them all
    assert_eq!(j["bad_pages"], 0);
}

#[test]
fn a_tiny_tier_evicts_and_hits_less_than_an_unlimited_one() {
    let (ok, j, err) =
        replay(&["--requests", "60", "--decode-pages", "2048", "--connector", "host", "--host-tier-gib", "0.01"]);
    assert!(ok, "{err}");
    assert_eq!(j["verified"], true);
    assert!(j["prefix_hit_rate"].as_f64().unwrap() < j["unlimited_tier_hit_rate"].as_f64().unwrap(), "{j}");
}

#[test]
fn speed_replays_the_timestamps_in_scaled_real_time() {
    // request 29 of the trace arrives at t = 9000 ms: at 3x it may not start before 3 s
    let (ok, j, err) = replay(&["--requests", "30", "--speed", "3", "--decode-pages", "2048"]);
    assert!(ok, "{err}");
    assert_eq!(j["verified"], true);
    assert!(j["elapsed_s"].as_f64().unwrap() >= 3.0, "{j}");
}

#[test]
fn requests_zero_and_a_dead_etcd_say_what_is_wrong() {
    let (ok, _, err) = replay(&["--requests", "0"]);
    assert!(!ok);
    assert!(err.contains("error: --requests must be at least 1"), "{err}");
    // Nothing listens on port 1: the error names etcd and its URL, once.
    let (ok, _, err) = replay(&["--requests", "2", "--etcd", "http://127.0.0.1:1"]);
    assert!(!ok);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(errors[0].contains("etcd at http://127.0.0.1:1"), "{err}");
    // A tier size without the tier is refused, not ignored.
    let (ok, _, err) = replay(&["--requests", "2", "--host-tier-gib", "8"]);
    assert!(!ok);
    assert!(err.contains("--host-tier-gib sizes the host tier: it needs --connector host"), "{err}");
}

#[test]
fn a_replay_too_big_for_memory_is_refused_with_the_numbers() {
    let (ok, _, err) = replay(&["--requests", "1", "--decode-pages", "100000000"]);
    assert!(!ok);
    assert!(err.contains("error: replay needs") && err.contains("available"), "{err}");
}

#[test]
fn progress_lines_appear_when_stderr_is_not_a_terminal() {
    // `output()` pipes stderr: the header line is printed (the 5 s lines
    // need a longer run than a test should take).
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["replay", "--requests", "3"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("replay: 3 requests from") && err.contains("GB moved (1 GB = 1e9 bytes)"), "{err}");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("GB = 1e9 bytes moved and verified"), "the table explains its columns:\n{table}");
}

#[test]
fn verbose_prints_the_cause_chain_once() {
    // Both processes fail to reach etcd (the parent reports its own error),
    // or only the decode child fails (the parent reports the child's): one
    // `error:` line and one `Caused by:` section either way.
    for (args, want) in [
        (&["--etcd", "http://127.0.0.1:1"][..], "connecting to etcd at http://127.0.0.1:1"),
        (&["--decode-option", "cma=maybe"][..], "the decode process failed: shm option \"cma\""),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvwire"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["-v", "replay", "--requests", "2"])
            .args(args)
            .env_remove("RUST_BACKTRACE")
            .env_remove("RUST_LIB_BACKTRACE")
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.matches("error: ").count(), 1, "{args:?}:\n{err}");
        assert!(err.contains(want), "{args:?}:\n{err}");
        assert!(err.matches("Caused by:").count() <= 1, "{args:?}: the chain twice:\n{err}");
    }
    // The etcd case has causes: printed once.
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["-v", "replay", "--requests", "2", "--etcd", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("Caused by:").count(), 1, "{err}");
    assert_eq!(err.matches("0: connect: Connection refused").count(), 1, "{err}");
}

/// `replay --role decode --listen 127.0.0.1:0` started in the background;
/// returns the process and the address it printed.
fn decode_role(extra: &[&str]) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["replay", "--role", "decode", "--listen", "127.0.0.1:0", "--json", "--wait-s", "60"])
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting the decode role");
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    let addr = line
        .strip_prefix("replay decode: listening on ")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address announced: {line:?}"))
        .to_string();
    // keep draining stderr so the child never blocks on it
    std::thread::spawn(move || for _ in err.lines() {});
    (child, addr)
}

/// The JSON summaries a finished decode role printed, one per prefill.
fn decode_summaries(child: std::process::Child) -> (bool, Vec<serde_json::Value>) {
    let out = child.wait_with_output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout).to_string();
    (out.status.success(), s.lines().map(|l| serde_json::from_str(l).expect("one JSON object a line")).collect())
}

#[test]
fn roles_in_two_processes_over_loopback_tcp_and_shm_print_the_same_summary() {
    for transport in ["tcp", "shm"] {
        let (dec, addr) = decode_role(&["--transport", transport]);
        let (ok, j, err) = replay(&[
            "--role",
            "prefill",
            "--connect",
            &addr,
            "--transport",
            transport,
            "--requests",
            "20",
            "--decode-pages",
            "1024",
        ]);
        assert!(ok, "{transport}: {err}");
        assert_eq!(j["verified"], true, "{j}");
        assert_eq!(j["requests"], 20);
        assert_eq!(j["transport"], transport);
        let (dok, got) = decode_summaries(dec);
        assert!(dok, "{transport}: the decode role failed");
        assert_eq!(got, vec![j], "{transport}: the decode host printed a different summary");
    }
}

#[test]
fn two_decodes_served_by_two_prefills_split_the_trace_and_route_by_request() {
    let (d0, a0) = decode_role(&["--prefills", "2"]);
    let (d1, a1) = decode_role(&["--prefills", "2"]);
    let connect = format!("{a0},{a1}");
    let run = |rank: &'static str| {
        let connect = connect.clone();
        std::thread::spawn(move || {
            replay(&[
                "--role",
                "prefill",
                "--connect",
                &connect,
                "--prefills",
                "2",
                "--prefill-rank",
                rank,
                "--requests",
                "41",
                "--decode-pages",
                "1024",
            ])
        })
    };
    let (p0, p1) = (run("0"), run("1"));
    let (ok0, j0, e0) = p0.join().unwrap();
    let (ok1, j1, e1) = p1.join().unwrap();
    assert!(ok0 && ok1, "{e0}\n{e1}");
    // trace request i goes to prefill i mod 2: 21 and 20 of the first 41
    assert_eq!((j0["requests"].as_u64(), j1["requests"].as_u64()), (Some(21), Some(20)));
    assert_eq!((j0["decode_engines"].as_u64(), j0["prefills"].as_u64()), (Some(2), Some(2)));
    for (d, name) in [(d0, "decode 0"), (d1, "decode 1")] {
        let (ok, got) = decode_summaries(d);
        assert!(ok, "{name} failed");
        // each decode served both prefills and printed each one's summary
        assert_eq!(got.len(), 2, "{name}: {got:?}");
        assert!(got.contains(&j0) && got.contains(&j1), "{name}: {got:?}");
    }
}

#[test]
fn a_decode_role_whose_prefill_never_came_says_so() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .args(["replay", "--role", "decode", "--listen", "127.0.0.1:0", "--wait-s", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no prefill connected to 127.0.0.1:") && err.contains("0 of 1 came"), "{err}");
}

#[test]
fn role_flags_are_checked_before_anything_runs() {
    for (args, want) in [
        (&["--role", "prefill"][..], "--role prefill needs --connect HOST:PORT"),
        (&["--role", "prefill", "--connect", "localhost"][..], "--connect localhost: expected HOST:PORT"),
        (&["--role", "decode"][..], "--role decode needs --listen IP:PORT"),
        (&["--connect", "127.0.0.1:1"][..], "add --role decode or --role prefill"),
        (
            &["--role", "prefill", "--connect", "127.0.0.1:1", "--prefills", "2", "--prefill-rank", "2"][..],
            "--prefill-rank must be 0..2",
        ),
        (&["--role", "decode", "--listen", "256.0.0.1:1"][..], "listening on 256.0.0.1:1 (--listen)"),
    ] {
        let (ok, _, err) = replay(args);
        assert!(!ok, "{args:?}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn copy_threads_zero_fails_at_once_naming_the_flag() {
    for (flag, want) in [
        ("--copy-threads", "--copy-threads must be at least 1"),
        ("--inflight", "--inflight must be at least 1"),
        ("--dp", "--dp must be at least 1"),
    ] {
        let t0 = std::time::Instant::now();
        let (ok, _, err) = replay(&[flag, "0"]);
        assert!(!ok);
        assert!(err.contains(want), "{err}");
        // validated before the trace is read or any pool allocated
        assert!(t0.elapsed() < std::time::Duration::from_secs(3), "{flag} 0 took {:?}", t0.elapsed());
    }
}

#[test]
fn a_corrupted_page_fails_the_decode_host_too() {
    let (dec, addr) = decode_role(&[]);
    let (ok, _, err) = replay(&[
        "--role",
        "prefill",
        "--connect",
        &addr,
        "--requests",
        "6",
        "--decode-pages",
        "1024",
        "--inject-bad-page",
        "3",
    ]);
    assert!(!ok && err.contains("bad pages"), "{err}");
    let out = dec.wait_with_output().unwrap();
    assert!(!out.status.success(), "the decode host verified the bytes: it must fail too");
}

#[test]
fn internal_subcommands_are_never_suggested_for_a_typo() {
    for typo in ["replay-dec", "bench-targ"] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvwire")).arg(typo).output().unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("unrecognized subcommand"), "{err}");
        assert!(!err.contains("replay-decode") && !err.contains("bench-target"), "{typo}: {err}");
    }
    // still reachable for the parent process that starts them
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire")).args(["replay-decode", "--help"]).output().unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("--connect"));
}

#[test]
fn a_bad_trace_line_is_reported_at_one_location() {
    let dir = std::env::temp_dir().join(format!("kvwire-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\":0,\"input_length\":10,\"output_length\":1,\"hash_ids\":[1]}\n{\"timestamp\":1,\"input_length\":\"x\"}\n",
    )
    .unwrap();
    let (ok, _, err) = replay(&["--trace", path.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!ok);
    let want =
        format!("error: {}:2:33: not a trace record: invalid type: string \"x\", expected u64\n", path.display());
    assert!(err.contains(&want), "{err}");
    assert!(!err.contains("at line 1"), "a second location: {err}");
}

/// Start `kvwire ARGS`, wait for `ready` on its stderr, then `wait` more,
/// send SIGINT (Ctrl-C) to it alone, and return (exit ok, stderr, seconds from SIGINT to exit).
fn interrupt(args: &[&str], ready: &str, wait: std::time::Duration) -> (bool, String, f64) {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    while !seen.contains(ready) {
        assert!(err.read_line(&mut seen).unwrap() > 0, "exited before {ready:?}: {seen}");
    }
    std::thread::sleep(wait);
    let t0 = std::time::Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    let status = child.wait().unwrap();
    (status.success(), seen + &rest, t0.elapsed().as_secs_f64())
}

#[test]
fn ctrl_c_prints_a_one_line_partial_summary() {
    // 200 requests at real-time speed take minutes: interrupted after 2 s.
    let (ok, err, secs) = interrupt(
        &["replay", "--requests", "200", "--speed", "1", "--decode-pages", "2048"],
        "replay: 200 requests from",
        std::time::Duration::from_secs(2),
    );
    assert!(!ok);
    assert!(secs < 10.0, "took {secs} s to stop");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(errors[0].contains("interrupted (Ctrl-C) after") && errors[0].contains("/200 requests verified"), "{err}");
    // the same for bench, in its long latency phase
    let (ok, err, _) = interrupt(
        // a progress line (after 2 s) shows it is in the latency phase
        &["bench", "--block-size", "1MiB", "--blocks", "8", "--iters", "1", "--lat-iters", "1000000"],
        "single-block latency transfers",
        std::time::Duration::ZERO,
    );
    assert!(!ok);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(
        errors[0].contains("interrupted (Ctrl-C) after") && errors[0].contains("/1000000 single-block latency"),
        "{err}"
    );
}
