//! `kvwire replay --metrics ADDR`: the replay's Prometheus endpoint, scraped
//! after the summary (`--metrics-linger`), counts exactly the bytes the
//! summary says moved; the exposition passes `promtool check metrics` where
//! promtool is installed (Debian's `prometheus` package).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A replay started in the background with `--metrics 127.0.0.1:0
/// --metrics-linger 300 --json`; its metrics address (from stderr) and its
/// stdout lines come through channels.
struct Running {
    child: Child,
    metrics: String,
    stdout: mpsc::Receiver<String>,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Running {
    fn start(args: &[&str]) -> Running {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvwire"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .arg("replay")
            .args(args)
            .args(["--json", "--metrics", "127.0.0.1:0", "--metrics-linger", "300"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting kvwire replay");
        let (atx, arx) = mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let err = BufReader::new(child.stderr.take().unwrap());
        let l = log.clone();
        std::thread::spawn(move || {
            for line in err.lines().map_while(Result::ok) {
                if let Some(addr) =
                    line.strip_prefix("replay: metrics at http://").and_then(|r| r.strip_suffix("/metrics"))
                {
                    let _ = atx.send(addr.to_string());
                }
                l.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let (otx, orx) = mpsc::channel();
        let out = BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let _ = otx.send(line);
            }
        });
        let metrics = match arx.recv_timeout(Duration::from_secs(120)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("no metrics address announced on stderr: {}", log.lock().unwrap());
            }
        };
        Running { child, metrics, stdout: orx, stderr: log }
    }

    /// The next JSON summary on stdout (the replay then lingers).
    fn summary(&mut self) -> serde_json::Value {
        loop {
            match self.stdout.recv_timeout(Duration::from_secs(300)) {
                Ok(l) => {
                    if let Ok(v) = serde_json::from_str::<serde_json::Value>(&l) {
                        return v;
                    }
                }
                Err(_) => {
                    let _ = self.child.kill();
                    panic!("no summary: {}", self.stderr.lock().unwrap());
                }
            }
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// GET http://addr/metrics: the body of a 200 answer.
fn scrape(addr: &str) -> String {
    let mut c = std::net::TcpStream::connect(addr).expect("connecting to --metrics");
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(c, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut resp = String::new();
    c.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.0 200"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    body.to_string()
}

/// Sum of the samples of `name` whose labels contain every `k="v"` of `want`.
fn sum(body: &str, name: &str, want: &[&str]) -> u64 {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, labels) = series.split_once('{').unwrap_or((series, ""));
            (n == name && want.iter().all(|w| labels.contains(w))).then(|| value.parse::<f64>().unwrap() as u64)
        })
        .sum()
}

/// The one lint finding accepted: MAX's transfer-latency histograms keep
/// MAX's own name (OpenTelemetry's Prometheus exporter appends the unit,
/// `ms` → `_milliseconds`), so that MAX's dashboards read kvwire unchanged;
/// promtool prefers base units. Anything else fails.
const MAX_MS: [&str; 2] = [
    "maxserve_dkv_nixl_read_latency_milliseconds use base unit \"seconds\" instead of \"milliseconds\"",
    "maxserve_dkv_nixl_write_latency_milliseconds use base unit \"seconds\" instead of \"milliseconds\"",
];

/// `promtool check metrics` on `body`: no parse error (exit 1) and no lint
/// finding but [`MAX_MS`] (exit 3); `skipped:` without promtool.
fn promtool(body: &str) {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("skipped: promtool not installed (Debian's `prometheus` package); exposition not linted");
        return;
    };
    child.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let msg = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let findings: Vec<&str> = msg.lines().filter(|l| !l.trim().is_empty()).collect();
    let accepted = out.status.code() == Some(3) && findings.iter().all(|f| MAX_MS.contains(f));
    assert!(out.status.success() || accepted, "promtool check metrics ({:?}): {msg}\n{body}", out.status.code());
}

#[test]
fn replay_counters_add_up_to_the_summarys_bytes() {
    let broadcast = ["--model", "deepseek-v3", "--tp", "1", "--decode-tp", "4"];
    for (transport, extra) in [("shm", &["--tp", "2", "--dp", "2"][..]), ("tcp", &[][..]), ("shm", &broadcast[..])] {
        let mut args = vec!["--transport", transport, "--requests", "20", "--decode-pages", "1024"];
        args.extend_from_slice(extra);
        let mut r = Running::start(&args);
        let j = r.summary();
        assert_eq!(j["verified"], true, "{transport}: {j}");
        let bytes = j["bytes"].as_u64().unwrap();
        assert!(bytes > 0, "{j}");
        if extra == broadcast {
            // BROADCAST (MLA, tp 1 -> 4): each of the 4 decode shards got a
            // copy of the page (DeepSeek-V3, 1 layer: (512 + 64) x 2 bytes a
            // token, 128 tokens a page)
            assert_eq!(bytes, j["pages"].as_u64().unwrap() * 1152 * 128 * 4, "{j}");
        }
        let body = scrape(&r.metrics);
        let t = format!("transport=\"{transport}\"");
        // the KV layer's finished writes, every peer (MAX's series)
        assert_eq!(sum(&body, "maxserve_dkv_nixl_write_bytes_total", &[]), bytes, "{transport}\n{body}");
        assert_eq!(sum(&body, "maxserve_dkv_nixl_write_transfers_total", &[]), 20, "{transport}\n{body}");
        assert_eq!(sum(&body, "maxserve_dkv_nixl_read_bytes_total", &[]), 0, "{transport}\n{body}");
        assert_eq!(sum(&body, "kvwire_transfer_failures_total", &[]), 0, "{transport}\n{body}");
        // what the agents posted through the NIC (every shard's agent)
        assert_eq!(sum(&body, "kvwire_nic_bytes_total", &[&t]), bytes, "{transport}\n{body}");
        assert_eq!(sum(&body, "kvwire_nic_bytes_total", &[]), bytes, "{transport}\n{body}");
        // the agents' start-up and registration series are there too
        let agents = if extra.len() == 4 { 4 } else { 1 };
        assert_eq!(sum(&body, "kvwire_agent_startup_seconds_count", &[&t]), agents, "{transport}\n{body}");
        assert!(sum(&body, "kvwire_registered_bytes_total", &[&t]) > 0, "{transport}\n{body}");
        assert_eq!(sum(&body, "kvwire_transfer_stalls_total", &[]), 0, "{transport}\n{body}");
        assert_eq!(sum(&body, "kvwire_peer_disconnects_total", &[]), 0, "{transport}\n{body}");
        promtool(&body);
    }
}

#[test]
fn role_split_replay_counts_the_same_bytes_on_both_hosts() {
    // decode side: `--role decode --listen 127.0.0.1:0`, its address from stderr
    let mut dec = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["replay", "--role", "decode", "--listen", "127.0.0.1:0", "--transport", "tcp", "--wait-s", "120"])
        .args(["--json", "--metrics", "127.0.0.1:0", "--metrics-linger", "300"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the decode role");
    let mut err = BufReader::new(dec.stderr.take().unwrap());
    let (mut listen, mut metrics) = (None, None);
    let mut line = String::new();
    while listen.is_none() || metrics.is_none() {
        line.clear();
        if err.read_line(&mut line).unwrap() == 0 {
            let _ = dec.kill();
            panic!("the decode role ended before announcing its addresses");
        }
        if let Some(r) = line.strip_prefix("replay decode: listening on ") {
            listen = r.split_whitespace().next().map(str::to_string);
        }
        if let Some(r) = line.trim_end().strip_prefix("replay: metrics at http://") {
            metrics = r.strip_suffix("/metrics").map(str::to_string);
        }
    }
    std::thread::spawn(move || for _ in err.lines() {});
    let dec_out = BufReader::new(dec.stdout.take().unwrap());
    let dec = Running {
        child: dec,
        metrics: metrics.unwrap(),
        stdout: {
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                for l in dec_out.lines().map_while(Result::ok) {
                    let _ = tx.send(l);
                }
            });
            rx
        },
        stderr: Default::default(),
    };
    let listen = listen.unwrap();
    let mut pre = Running::start(&[
        "--role",
        "prefill",
        "--connect",
        &listen,
        "--transport",
        "tcp",
        "--requests",
        "16",
        "--decode-pages",
        "1024",
    ]);
    let j = pre.summary();
    assert_eq!(j["verified"], true, "{j}");
    let bytes = j["bytes"].as_u64().unwrap();
    let body = scrape(&pre.metrics);
    assert_eq!(sum(&body, "maxserve_dkv_nixl_write_bytes_total", &[]), bytes, "{body}");
    assert_eq!(sum(&body, "kvwire_nic_bytes_total", &["transport=\"tcp\""]), bytes, "{body}");
    promtool(&body);
    // the decode host printed the same summary, and counted what landed on it
    let mut dec = dec;
    assert_eq!(dec.summary(), j);
    let body = scrape(&dec.metrics);
    assert_eq!(sum(&body, "kvwire_served_bytes_total", &["op=\"write\""]), bytes, "{body}");
    assert_eq!(sum(&body, "kvwire_served_requests_total", &[]), 16, "{body}");
    assert_eq!(sum(&body, "kvwire_served_bytes_total", &["op=\"read\""]), 0, "{body}");
    // the decode posts nothing itself
    assert_eq!(sum(&body, "kvwire_nic_bytes_total", &[]), 0, "{body}");
    promtool(&body);
}

#[test]
fn metrics_linger_needs_metrics_and_a_bad_address_is_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .args(["replay", "--metrics-linger", "5", "--requests", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--metrics"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .args(["replay", "--metrics", "256.0.0.1:1", "--requests", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--metrics 256.0.0.1:1"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
