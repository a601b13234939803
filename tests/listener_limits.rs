//! Issue 27 item 2: listeners that never die. Its own test binary, because
//! the tests lower this process's `RLIMIT_NOFILE` (and serialise on a lock
//! so that they never do it at the same time).
//!
//! - Each of the shm and tcp accept loops hits `EMFILE` while a peer is
//!   queued; once descriptors are free again a new peer connects. (The loops
//!   used to end on the first accept error.)
//! - An unauthenticated flood from another process, large enough to use up
//!   the target's descriptor limit, does not keep an authenticated peer out:
//!   it connects within `peer_timeout` while the flood still holds its
//!   sockets (at most `max_preauth` of them are kept).
//! - The side-channel listener of `bench --listen` and `replay --role
//!   decode` (`SideListener`) rides out `EMFILE` and accepts the next peer.
//! - So do the metrics HTTP listener (`metrics::serve_http`: the next scrape
//!   is answered) and the verbs handshake listener (on the simulated NIC: a
//!   new initiator connects).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::transport::shm::ShmTransport;
use kvwire::transport::shm::wire::{Channel, ShmInfo};
use kvwire::transport::tcp::{TcpConnectionInfo, TcpTransport};
use kvwire::transport::{MemoryBacking, RemoteRegion, Transport, TransportConfig};

static RLIMIT: Mutex<()> = Mutex::new(());

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

fn nofile() -> libc::rlimit {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `r`.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    r
}

fn set_nofile(r: libc::rlimit) {
    // SAFETY: setrlimit reads one rlimit; lowering or restoring the soft
    // limit below the hard one needs no privilege.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0, "{}", std::io::Error::last_os_error());
}

/// Lowers the soft descriptor limit; restores it on drop.
struct Lowered(libc::rlimit);

impl Lowered {
    fn to(soft: u64) -> Self {
        let old = nofile();
        set_nofile(libc::rlimit { rlim_cur: soft.min(old.rlim_max), rlim_max: old.rlim_max });
        Self(old)
    }
}

impl Drop for Lowered {
    fn drop(&mut self) {
        set_nofile(self.0);
    }
}

/// Open `/dev/null` until the process is out of descriptors.
fn exhaust() -> Vec<File> {
    let mut held = Vec::new();
    loop {
        match File::open("/dev/null") {
            Ok(f) => held.push(f),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
                return held;
            }
        }
    }
}

fn cfg(ms: u64) -> TransportConfig {
    TransportConfig { peer_timeout: Duration::from_millis(ms), ..Default::default() }
}

fn region(t: &mut dyn Transport, buf: &Arc<HostBuffer>) -> RemoteRegion {
    let r = t.register(buf.clone()).unwrap();
    let d = buf.desc();
    RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: r.rkey, kind: d.kind, device_id: 0 }
}

#[test]
fn shm_and_tcp_listeners_survive_emfile() {
    let _serial = RLIMIT.lock().unwrap_or_else(|p| p.into_inner());
    let buf = Arc::new(HostBuffer::new(1 << 16).unwrap());

    // shm
    let mut target = ShmTransport::new("target", &cfg(2000)).unwrap();
    let reg = region(&mut target, &buf);
    let info = target.connection_info();
    let socket = ShmInfo::decode(&info).unwrap().socket;
    let mut init = ShmTransport::new("init", &cfg(2000)).unwrap();
    queue_through_emfile(&socket, || Channel::connect(&socket, Duration::from_secs(2)), pause);
    let t0 = Instant::now();
    init.connect("target", &info, &[reg]).expect("shm: a new peer connects once descriptors are free");
    assert!(t0.elapsed() < Duration::from_secs(2), "shm: took {:?}", t0.elapsed());

    // tcp
    let mut target = TcpTransport::new("target", &cfg(2000)).unwrap();
    let info = target.connection_info();
    region(&mut target, &buf);
    let addr = TcpConnectionInfo::decode(&info).unwrap().addr;
    let mut init = TcpTransport::new("init", &cfg(2000)).unwrap();
    accept_through_emfile(&addr);
    let t0 = Instant::now();
    init.connect("target", &info, &[]).expect("tcp: a new peer connects once descriptors are free");
    assert!(t0.elapsed() < Duration::from_secs(2), "tcp: took {:?}", t0.elapsed());
}

#[test]
fn side_channel_listener_survives_emfile() {
    use kvwire::sidechannel::{SideChannel, SideListener};
    let _serial = RLIMIT.lock().unwrap_or_else(|p| p.into_inner());
    let mut l = SideListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().to_string();
    queue_through_emfile(
        &addr,
        || TcpStream::connect(&addr),
        || {
            // accept fails with EMFILE: the listener backs off and stays up
            // (it used to return the error and end `bench --listen` /
            // `replay --role decode`).
            for _ in 0..3 {
                assert!(l.try_accept().expect("EMFILE must not end the listener").is_none());
            }
        },
    );
    let mut peer = SideChannel::connect(&addr, Duration::from_secs(2)).unwrap();
    peer.send(&"hello").unwrap();
    let t0 = Instant::now();
    loop {
        assert!(t0.elapsed() < Duration::from_secs(2), "no peer accepted once descriptors were free");
        let Some(mut chan) = l.try_accept().unwrap() else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        chan.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        match chan.recv::<String>() {
            Ok(m) => {
                assert_eq!(m, "hello");
                break;
            }
            Err(_) => continue, // the queued connection that was dropped meanwhile
        }
    }
}

/// Queue a connection to `addr` while this process is out of descriptors,
/// so that the listener's `accept` fails with `EMFILE` for a while, then
/// free them.
fn accept_through_emfile(addr: &str) {
    queue_through_emfile(addr, || TcpStream::connect(addr), pause);
}

/// While the listener's `accept` fails with `EMFILE`.
fn pause() {
    std::thread::sleep(Duration::from_millis(300));
}

/// Queue a connection (`connect`) to `to` while this process is out of
/// descriptors, run `while_queued` (the listener's `accept` fails with
/// `EMFILE` meanwhile), then free them.
fn queue_through_emfile<C, E: std::fmt::Display>(
    to: &str,
    connect: impl Fn() -> Result<C, E>,
    while_queued: impl FnOnce(),
) {
    let _limit = Lowered::to(open_fds() + 32);
    let mut held = exhaust();
    held.pop(); // one descriptor: our end of a connection the listener cannot accept
    // Another thread of this test process (a transport's worker, or one a
    // test before this left ending) may take the freed descriptor for a
    // moment: wait for it, and free one more only if it keeps it.
    let mut tries = 0;
    let queued = loop {
        match connect() {
            Ok(c) => break c,
            Err(e) if is_emfile(&e.to_string()) && tries < 100 => {
                tries += 1;
                if tries % 20 == 0 {
                    held.pop();
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("connect to {to} while out of descriptors: {e}"),
        }
    };
    while_queued();
    drop(queued);
    drop(held);
}

/// `EMFILE` as std (`Too many open files (os error 24)`) and nix (`EMFILE:
/// Too many open files`) print it.
fn is_emfile(error: &str) -> bool {
    error.contains("os error 24") || error.contains("EMFILE")
}

#[test]
fn metrics_listener_survives_emfile() {
    use std::io::{Read, Write};
    let _serial = RLIMIT.lock().unwrap_or_else(|p| p.into_inner());
    let addr = kvwire::metrics::serve_http("127.0.0.1:0").unwrap().to_string();
    accept_through_emfile(&addr);
    // A loop that ended on the first error dropped its listener: this
    // connect would be refused.
    let t0 = Instant::now();
    let mut c = TcpStream::connect(&addr).expect("the metrics listener is still there");
    c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut reply = String::new();
    c.read_to_string(&mut reply).expect("a scrape is answered once descriptors are free");
    assert!(reply.starts_with("HTTP/1.0 200 OK\r\n"), "{reply:?}");
    assert!(t0.elapsed() < Duration::from_secs(2), "took {:?}", t0.elapsed());
}

/// The handshake address in a verbs connection info (postcard: the
/// `addr` string first, its length a varint).
fn verbs_listen_addr(info: &[u8]) -> String {
    let (mut len, mut at) = (0usize, 0usize);
    loop {
        let b = info[at];
        len |= usize::from(b & 0x7f) << (7 * at);
        at += 1;
        if b & 0x80 == 0 {
            break;
        }
    }
    String::from_utf8(info[at..at + len].to_vec()).unwrap()
}

#[test]
fn verbs_handshake_listener_survives_emfile() {
    use kvwire::transport::verbs::VerbsTransport;
    use kvwire::transport::verbs::sim::SimFabric;
    let _serial = RLIMIT.lock().unwrap_or_else(|p| p.into_inner());
    let fabric = SimFabric::new(27);
    fabric.world().auto_step = 64;
    let tag = std::process::id();
    let mut init = VerbsTransport::on_sim(&format!("init-{tag}"), &cfg(2000), &fabric).unwrap();
    let target = VerbsTransport::on_sim(&format!("target-{tag}"), &cfg(2000), &fabric).unwrap();
    let info = target.connection_info();
    let addr = verbs_listen_addr(&info);
    assert!(addr.parse::<std::net::SocketAddr>().is_ok(), "{addr:?}");
    accept_through_emfile(&addr);
    let t0 = Instant::now();
    init.connect("target", &info, &[]).expect("verbs: a new peer connects once descriptors are free");
    assert!(t0.elapsed() < Duration::from_secs(2), "verbs: took {:?}", t0.elapsed());
}

const FLOOD_ENV: &str = "KVWIRE_TEST_FLOOD_ADDR";
const FLOOD_CONNS: usize = 600;

/// The flooding process (a re-run of this binary): open connections to the
/// target, never authenticate, report, and hold them until killed.
#[test]
fn flood_child() {
    let Ok(addr) = std::env::var(FLOOD_ENV) else { return };
    let old = nofile(); // inherited, lowered: the flood has its own budget
    set_nofile(libc::rlimit { rlim_cur: old.rlim_max.min(4096), rlim_max: old.rlim_max });
    let mut held = Vec::new();
    for _ in 0..FLOOD_CONNS {
        if let Ok(s) = TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_millis(500)) {
            held.push(s);
        }
    }
    println!("FLOODED {}", held.len());
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn unauthenticated_flood_does_not_lock_out_an_authenticated_peer() {
    let _serial = RLIMIT.lock().unwrap_or_else(|p| p.into_inner());
    let timeout = Duration::from_secs(5);
    let mut target = TcpTransport::new("target", &cfg(timeout.as_millis() as u64)).unwrap();
    let info = target.connection_info();
    let buf = Arc::new(HostBuffer::new(1 << 16).unwrap());
    region(&mut target, &buf);
    let addr = TcpConnectionInfo::decode(&info).unwrap().addr;
    let mut init = TcpTransport::new("init", &cfg(timeout.as_millis() as u64)).unwrap();
    // Two descriptors per accepted connection: the flood needs 1200, the
    // target has 300 (the 64 it keeps need 128).
    let _limit = Lowered::to(open_fds() + 300);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["flood_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(FLOOD_ENV, &addr)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let flooded = loop {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            break 0;
        }
        // (libtest may print "test flood_child ... " on the same line first)
        if let Some(at) = line.find("FLOODED ") {
            break line[at + 8..].trim().parse::<usize>().unwrap();
        }
    };
    let t0 = Instant::now();
    let got = init.connect("target", &info, &[]);
    let took = t0.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    assert!(flooded >= FLOOD_CONNS / 2, "the flood opened only {flooded} connections");
    got.expect("an authenticated peer connects during an unauthenticated flood");
    assert!(took < timeout, "took {took:?}");
}

/// Issue 27: a process whose file-size limit is below a buffer's size used
/// to die of SIGXFSZ in `HostBuffer::new` (the memfd's `ftruncate`); now it
/// gets an error and lives.
#[test]
fn host_buffer_over_the_file_size_limit_is_an_error() {
    let _serial = RLIMIT.lock().unwrap_or_else(|p| p.into_inner());
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `old`.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut old) }, 0);
    let low = libc::rlimit { rlim_cur: 1 << 20, rlim_max: old.rlim_max };
    // SAFETY: as `set_nofile`.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &low) }, 0);
    let big = HostBuffer::new(4 << 20);
    let small = HostBuffer::new(64 << 10);
    // SAFETY: as above, restoring.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &old) }, 0);
    let e = big.expect_err("over the limit");
    assert_eq!(e.kind(), std::io::ErrorKind::FileTooLarge, "{e}");
    assert!(e.to_string().contains("RLIMIT_FSIZE"), "{e}");
    small.expect("under the limit");
}

/// Issue 27 item 2: a peer that left is pruned at once, not at the next
/// accept: the target's descriptors for it close as soon as it is gone
/// (they used to stay open until another peer connected).
#[test]
fn peers_that_left_are_pruned_without_a_new_accept() {
    let _serial = RLIMIT.lock().unwrap_or_else(|p| p.into_inner());
    let buf = Arc::new(HostBuffer::new(1 << 16).unwrap());
    let settle = |baseline: u64, what: &str| {
        let t0 = Instant::now();
        while open_fds() > baseline {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "{what}: {} descriptors open, {baseline} before",
                open_fds()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut target = ShmTransport::new("target", &cfg(2000)).unwrap();
    let reg = region(&mut target, &buf);
    let info = target.connection_info();
    let baseline = open_fds();
    {
        let mut init = ShmTransport::new("init", &cfg(2000)).unwrap();
        init.connect("target", &info, &[reg]).unwrap();
    }
    settle(baseline, "shm");

    let mut target = TcpTransport::new("target", &cfg(2000)).unwrap();
    region(&mut target, &buf);
    let info = target.connection_info();
    let baseline = open_fds();
    {
        let mut init = TcpTransport::new("init", &cfg(2000)).unwrap();
        init.connect("target", &info, &[]).unwrap();
    }
    settle(baseline, "tcp");
}
