//! Discovery against a real etcd: publish/lookup/list, a lookup that waits
//! for a late publisher, watch, revocation on drop, and a crashed publisher
//! whose entry disappears when its lease expires.
//!
//! etcd comes from `KVWIRE_ETCD` (an `http://host:port` URL) or, failing
//! that, an `etcd` binary on `PATH` started on a free loopback port. The
//! tests that need etcd are `#[ignore]`d with that reason, so a plain
//! `cargo test` reports them as ignored, never as passed; `scripts/test.sh`
//! runs them with `--ignored` where etcd exists (and fails without it when
//! `KVWIRE_REQUIRE_ETCD=1`, as CI sets). Asked to run without etcd, they fail.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::engine::TransferEngine;
use kvwire::transport::{TransportConfig, TransportKind};
use kvwire_discovery::{DirectStore, EtcdStore, MetadataStore, WatchEvent};

struct Etcd {
    url: String,
    child: Option<Child>,
    _dir: Option<TempDir>,
}

struct TempDir(std::path::PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

const NEEDS_ETCD: &str = "needs etcd (apt-get install etcd-server, or set KVWIRE_ETCD=http://HOST:PORT)";

fn etcd() -> Option<Etcd> {
    if let Ok(url) = std::env::var("KVWIRE_ETCD") {
        return Some(Etcd { url, child: None, _dir: None });
    }
    let found =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join("etcd").is_file())).unwrap_or(false);
    assert!(found, "{NEEDS_ETCD}: no etcd binary on PATH");
    let (cport, pport) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("kvwire-etcd-{}-{cport}", std::process::id()));
    let curl = format!("http://127.0.0.1:{cport}");
    let purl = format!("http://127.0.0.1:{pport}");
    let child = Command::new("etcd")
        .args(["--name", "kvwire-test", "--data-dir"])
        .arg(&dir)
        .args(["--listen-client-urls", &curl, "--advertise-client-urls", &curl])
        .args(["--listen-peer-urls", &purl, "--initial-advertise-peer-urls", &purl])
        .args(["--initial-cluster", &format!("kvwire-test={purl}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawning etcd");
    let e = Etcd { url: curl, child: Some(child), _dir: Some(TempDir(dir)) };
    let t0 = Instant::now();
    while EtcdStore::connect(&e.url, "/probe/", Duration::from_secs(2)).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(20), "etcd did not come up");
        std::thread::sleep(Duration::from_millis(100));
    }
    Some(e)
}

fn unique_prefix(test: &str) -> String {
    format!("/kvwire-test/{}/{test}/{}/", std::process::id(), uuid_like())
}

fn uuid_like() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

fn engine(name: &str) -> (TransferEngine, Arc<HostBuffer>) {
    let mut e = TransferEngine::new(name, TransportKind::Tcp, &TransportConfig::default()).unwrap();
    let b = Arc::new(HostBuffer::new(1 << 16).unwrap());
    e.register(b.clone()).unwrap();
    (e, b)
}

#[test]
#[ignore = "needs etcd (scripts/test.sh runs it where etcd exists)"]
fn publish_lookup_list_and_revoke_on_drop() {
    let Some(etcd) = etcd() else { return };
    let prefix = unique_prefix("basic");
    let (a, _ba) = engine("prefill-0");
    let (b, _bb) = engine("prefill-1");
    let mut store = EtcdStore::connect(&etcd.url, &prefix, Duration::from_secs(5)).unwrap();
    store.publish(&a.metadata()).unwrap();
    store.publish(&b.metadata()).unwrap();
    let mut reader = EtcdStore::connect(&etcd.url, &prefix, Duration::from_secs(5)).unwrap();
    assert_eq!(reader.lookup("prefill-0", Duration::from_secs(1)).unwrap(), a.metadata());
    let mut names: Vec<String> = reader.list().unwrap().into_iter().map(|m| m.name).collect();
    names.sort();
    assert_eq!(names, ["prefill-0", "prefill-1"]);
    store.unpublish("prefill-1").unwrap();
    assert!(reader.get("prefill-1").unwrap().is_none());
    // A lookup of an absent name waits the whole timeout, then says so.
    let t0 = Instant::now();
    let err = reader.lookup("nobody", Duration::from_millis(600)).unwrap_err();
    assert!(matches!(err, kvwire_discovery::DiscoveryError::NotFound { .. }), "{err}");
    assert!(t0.elapsed() >= Duration::from_millis(600));
    drop(store); // revokes the lease: the entry goes at once
    assert!(reader.get("prefill-0").unwrap().is_none());
}

#[test]
#[ignore = "needs etcd (scripts/test.sh runs it where etcd exists)"]
fn lookup_waits_for_a_late_publisher_and_watch_sees_it() {
    let Some(etcd) = etcd() else { return };
    let prefix = unique_prefix("late");
    let reader = EtcdStore::connect(&etcd.url, &prefix, Duration::from_secs(5)).unwrap();
    let mut watch = reader.watch().unwrap();
    let url = etcd.url.clone();
    let p2 = prefix.clone();
    let publisher = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(700));
        let (e, _b) = engine("decode-0");
        let mut s = EtcdStore::connect(&url, &p2, Duration::from_secs(5)).unwrap();
        s.publish(&e.metadata()).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        s.unpublish("decode-0").unwrap();
        e.metadata()
    });
    let mut reader = reader;
    let t0 = Instant::now();
    let got = reader.lookup("decode-0", Duration::from_secs(10)).unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(600), "found before it was published?");
    let published = publisher.join().unwrap();
    assert_eq!(got, published);
    assert_eq!(watch.next_event().unwrap(), Some(WatchEvent::Put(published)));
    assert_eq!(watch.next_event().unwrap(), Some(WatchEvent::Delete("decode-0".into())));
}

#[test]
#[ignore = "needs etcd (scripts/test.sh runs it where etcd exists)"]
fn crashed_publisher_disappears_when_its_lease_expires() {
    let Some(etcd) = etcd() else { return };
    let prefix = unique_prefix("crash");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_publisher", "--ignored", "--nocapture"])
        .env("KVWIRE_CHILD_ETCD", &etcd.url)
        .env("KVWIRE_CHILD_PREFIX", &prefix)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut reader = EtcdStore::connect(&etcd.url, &prefix, Duration::from_secs(5)).unwrap();
    reader.lookup("crashy", Duration::from_secs(20)).expect("child published");
    // The lease (2 s) is kept alive while the child lives.
    std::thread::sleep(Duration::from_secs(3));
    assert!(reader.get("crashy").unwrap().is_some(), "entry lost while its owner lives");
    let mut watch = reader.watch().unwrap();
    child.kill().unwrap(); // SIGKILL: no revoke, the lease must expire
    child.wait().unwrap();
    let t0 = Instant::now();
    let ev = loop {
        match watch.next_event() {
            Ok(Some(ev)) => break ev,
            Ok(None) => panic!("watch ended"),
            Err(_) => assert!(t0.elapsed() < Duration::from_secs(10), "entry still there"),
        }
    };
    assert_eq!(ev, WatchEvent::Delete("crashy".into()));
    assert!(t0.elapsed() < Duration::from_secs(5), "lease took {:?} to expire", t0.elapsed());
    assert!(reader.get("crashy").unwrap().is_none());
}

/// Child of the crash test: publish with a 2 s lease, then wait to be killed.
#[test]
#[ignore = "helper process of crashed_publisher_disappears_when_its_lease_expires"]
fn child_publisher() {
    let (Ok(url), Ok(prefix)) = (std::env::var("KVWIRE_CHILD_ETCD"), std::env::var("KVWIRE_CHILD_PREFIX")) else {
        return;
    };
    let (e, _b) = engine("crashy");
    let mut s = EtcdStore::connect(&url, &prefix, Duration::from_secs(2)).unwrap();
    s.publish(&e.metadata()).unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn direct_store_exchanges_metadata_over_the_side_channel() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let a2 = addr.clone();
    let t = std::thread::spawn(move || {
        let mut s = DirectStore::listen(&a2).unwrap();
        let (e, _b) = engine("target");
        s.publish(&e.metadata()).unwrap();
        let peer = s.lookup("initiator", Duration::from_secs(10)).unwrap();
        assert_eq!(peer.name, "initiator");
    });
    let mut c = DirectStore::connect(&addr, Duration::from_secs(10)).unwrap();
    let (mut e, _b) = engine("initiator");
    let target = c.lookup("target", Duration::from_secs(10)).unwrap();
    e.connect(&target).unwrap(); // before publishing: the target lives until it sees us
    c.publish(&e.metadata()).unwrap();
    t.join().unwrap();
    assert!(c.lookup("ghost", Duration::from_millis(200)).is_err());
}

#[test]
#[ignore = "needs etcd (scripts/test.sh runs it where etcd exists)"]
fn a_name_published_by_another_live_engine_is_refused() {
    let Some(etcd) = etcd() else { return };
    let prefix = unique_prefix("dupe");
    let (a, _ba) = engine("dupe");
    let (b, _bb) = engine("dupe");
    let mut first = EtcdStore::connect(&etcd.url, &prefix, Duration::from_secs(5)).unwrap();
    first.publish(&a.metadata()).unwrap();
    // the owner may republish (e.g. after registering more memory)
    first.publish(&a.metadata()).unwrap();
    let mut second = EtcdStore::connect(&etcd.url, &prefix, Duration::from_secs(5)).unwrap();
    let err = second.publish(&b.metadata()).unwrap_err();
    assert!(matches!(err, kvwire_discovery::DiscoveryError::NameTaken(ref n) if n == "dupe"), "{err}");
    drop(second);
    // the first engine's entry survived the attempt
    let mut reader = EtcdStore::connect(&etcd.url, &prefix, Duration::from_secs(5)).unwrap();
    assert_eq!(reader.lookup("dupe", Duration::from_secs(1)).unwrap(), a.metadata());
    // once the owner is gone, the name is free again
    drop(first);
    second = EtcdStore::connect(&etcd.url, &prefix, Duration::from_secs(5)).unwrap();
    second.publish(&b.metadata()).unwrap();
}

#[test]
#[ignore = "needs etcd (scripts/test.sh runs it where etcd exists)"]
fn replay_discovers_the_decode_engine_through_etcd() {
    let Some(etcd) = etcd() else { return };
    let prefix = unique_prefix("replay");
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["replay", "--requests", "12", "--decode-pages", "1024", "--json"])
        .args(["--etcd", &etcd.url, "--etcd-prefix", &prefix])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(j["verified"], true);
    assert_eq!(j["requests"], 12);
    // both engines withdrew their entries (leases revoked) when they exited
    let reader = EtcdStore::connect(&etcd.url, &prefix, Duration::from_secs(5)).unwrap();
    assert!(reader.get_bytes("decode").unwrap().is_none());
    assert!(reader.get_bytes("prefill").unwrap().is_none());
}

#[test]
#[ignore = "needs etcd (scripts/test.sh runs it where etcd exists)"]
fn serve_pull_of_a_name_never_published_says_so_without_blaming_etcd() {
    let Some(etcd) = etcd() else { return };
    let prefix = unique_prefix("never-published");
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .args(["serve", "--name", "puller", "--etcd", &etcd.url, "--prefix", &prefix])
        .args(["--pull", "nobody", "--lookup-timeout", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let want =
        format!("error: agent \"nobody\" was not published under {prefix}nobody in etcd at {} within 1 s", etcd.url);
    assert!(err.contains(&want), "{err}");
    assert!(!err.contains("is etcd running"), "etcd is up: no such hint:\n{err}");
    assert!(err.contains("hint: start `kvwire serve --name nobody"), "{err}");
}

#[test]
#[ignore = "needs etcd (scripts/test.sh runs it where etcd exists)"]
fn serve_pull_names_a_killed_peer_once_in_its_failure_line() {
    use std::io::BufRead;
    let Some(etcd) = etcd() else { return };
    let prefix = unique_prefix("killed-peer");
    let kvwire = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvwire"));
        c.args(["serve", "--etcd", &etcd.url, "--prefix", &prefix]);
        c
    };
    let mut a = kvwire().args(["--name", "srv-a", "--duration", "60"]).stdout(Stdio::null()).spawn().unwrap();
    let mut b = kvwire()
        .args(["--name", "srv-b", "--pull", "srv-a", "--rounds", "1000000", "--pages", "4", "--ttl", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(b.stdout.take().unwrap()).lines().map_while(Result::ok);
    assert!(lines.by_ref().any(|l| l.starts_with("round 2:")), "srv-b never pulled from srv-a");
    a.kill().unwrap();
    a.wait().unwrap();
    let failed = lines.find(|l| l.starts_with("peer srv-a failed after")).expect("a failure line for srv-a");
    b.wait().unwrap();
    assert_eq!(failed.matches("srv-a").count(), 1, "the peer named twice: {failed}");
    for bad in ["peer peer", "died: peer", "peer died: peer"] {
        assert!(!failed.contains(bad), "{bad:?} in {failed}");
    }
    assert!(failed.contains("(peer died)") || failed.contains("(peer timed out)"), "{failed}");
}

/// `GET /metrics` from `addr`: the body.
fn get_metrics(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut s = String::new();
    c.read_to_string(&mut s).unwrap();
    s.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default()
}

#[test]
#[ignore = "needs etcd (scripts/test.sh runs it where etcd exists)"]
fn serve_metrics_export_what_the_target_served() {
    use std::io::BufRead;
    let Some(etcd) = etcd() else { return };
    let prefix = unique_prefix("served-metrics");
    let kvwire = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvwire"));
        c.args(["serve", "--etcd", &etcd.url, "--prefix", &prefix]);
        c
    };
    // no --listen: the tcp transport's own default address rule
    let mut a = kvwire()
        .args(["--name", "srv-a", "--duration", "60", "--metrics", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(a.stdout.take().unwrap()).lines().map_while(Result::ok);
    let first = lines.next().unwrap();
    let addr = first
        .strip_prefix("metrics at http://")
        .and_then(|r| r.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("{first}"))
        .to_string();
    assert!(lines.next().unwrap().starts_with("serving srv-a"));
    let b = kvwire().args(["--name", "srv-b", "--pull", "srv-a", "--rounds", "3", "--pages", "16"]).output().unwrap();
    assert!(b.status.success(), "{}", String::from_utf8_lossy(&b.stderr));
    // the third WRITE notification reached srv-a: its metrics count it
    assert!(lines.by_ref().any(|l| l.contains("srv-b-round-2")), "srv-a never got round 2");
    let body = get_metrics(&addr);
    let _ = a.kill();
    let _ = a.wait();
    let page = 64 * 1024;
    for want in [
        "kvwire_served_peers 1".to_string(),
        "kvwire_served_requests_total{peer=\"srv-b\"} 3".to_string(),
        format!("kvwire_served_bytes_total{{op=\"read\",peer=\"srv-b\"}} {}", 3 * 2 * 16 * page),
        format!("kvwire_served_bytes_total{{op=\"write\",peer=\"srv-b\"}} {}", 3 * 16 * page),
    ] {
        assert!(body.lines().any(|l| l == want), "missing {want:?} in:\n{body}");
    }
}

#[test]
#[ignore = "needs etcd (scripts/test.sh runs it where etcd exists)"]
fn replay_roles_exchange_engine_metadata_through_etcd() {
    use std::io::BufRead;
    let Some(etcd) = etcd() else { return };
    let prefix = unique_prefix("replay-roles");
    let mut dec = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .args(["replay", "--role", "decode", "--listen", "127.0.0.1:0", "--transport", "tcp", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(dec.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    let addr = line.strip_prefix("replay decode: listening on ").and_then(|r| r.split_whitespace().next()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["replay", "--role", "prefill", "--connect", addr, "--transport", "tcp", "--requests", "8"])
        .args(["--decode-pages", "1024", "--json", "--etcd", &etcd.url, "--etcd-prefix", &prefix])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let d = dec.wait_with_output().unwrap();
    assert!(d.status.success());
    let (p, d) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&d.stdout));
    assert_eq!(p.lines().last(), d.lines().last(), "the same summary on both sides");
    assert!(p.contains("\"verified\":true"), "{p}");
    // the metadata went through etcd (the side channel carried empty Meta
    // messages); both entries were withdrawn when the engines exited
    let reader = EtcdStore::connect(&etcd.url, &prefix, Duration::from_secs(5)).unwrap();
    assert!(reader.get_bytes("decode0-p0").unwrap().is_none());
    assert!(reader.get_bytes("prefill0").unwrap().is_none());
}
