//! Bounded mutation fuzzing of the shm side channel (issue 16 item 4): the
//! packet decoder ([`Msg::decode`]), packets that carry descriptors
//! (`SCM_RIGHTS`) over a real seqpacket socket, and a live target fed
//! mutated packets before and after the secret handshake.
//!
//! Seeded and deterministic like `fuzz_decoders.rs` (same mutation engine,
//! corpus in `tests/corpus/shm_wire/`, `KVWIRE_FUZZ_ITERS=N` to run longer,
//! `KVWIRE_WRITE_CORPUS=1` to rewrite the corpus files).

mod fuzz_util;

use std::fs::File;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use fuzz_util::{Rng, corpus, iters, mutate, write_corpus};
use kvwire::HostBuffer;
use kvwire::transport::auth::{self, Nonce};
use kvwire::transport::shm::ShmTransport;
use kvwire::transport::shm::wire::{
    self, Access, Channel, Listener, MAX_AGENT_NAME, MAX_HELLO_KEYS, MAX_NOTIFICATION, MAX_PACKET, Msg, ShmInfo,
};
use kvwire::transport::{
    Completion, MemoryBacking, Op, PostRequest, RemoteRegion, Segment, Transport, TransportConfig, TransportError,
    XferId,
};
use nix::sys::socket::{self, ControlMessage, MsgFlags};

/// The tests that count this process's descriptors run one at a time.
static FD_COUNTING: Mutex<()> = Mutex::new(());

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// One packet of every kind, as the corpus holds them.
fn seed_messages() -> Vec<(&'static str, Msg)> {
    vec![
        ("challenge", Msg::Challenge { nonce: Nonce([7; auth::NONCE_BYTES]) }),
        (
            "hello",
            Msg::Hello {
                agent: "initiator".into(),
                rkeys: vec![1, 2, 0xffff_ffff],
                proof: vec![0x5a; 32],
                nonce: Nonce([9; auth::NONCE_BYTES]),
            },
        ),
        ("refused", Msg::Refused { reason: "uid 65534 is not allowed".into() }),
        (
            "region_fd",
            Msg::Region { rkey: 1, addr: 0x7f00_0000_0000, len_bytes: 1 << 20, access: Access::Fd { offset: 0 } },
        ),
        ("region_cma", Msg::Region { rkey: 2, addr: 0x7f00_1000_0000, len_bytes: 4096, access: Access::Cma }),
        ("region_unknown", Msg::Region { rkey: 9, addr: 0, len_bytes: 0, access: Access::Unknown }),
        ("ready", Msg::Ready { pid: 4242, proof: vec![0x3c; 32] }),
        ("revoke", Msg::Revoke { rkey: 1 }),
        ("revoke_ack", Msg::RevokeAck { rkey: 1 }),
        ("notify", Msg::Notify { payload: b"6f1c2a7e-0d3b-4c55-9a8e-2b1f3c4d5e6f".to_vec() }),
        ("notify_ack", Msg::NotifyAck),
    ]
}

fn seeds() -> Vec<Vec<u8>> {
    for (name, m) in seed_messages() {
        write_corpus("shm_wire", &format!("{name}.bin"), &m.encode().unwrap());
    }
    corpus("shm_wire")
}

/// What a decoded packet must satisfy.
fn check_limits(m: &Msg) {
    match m {
        Msg::Hello { agent, rkeys, proof, .. } => {
            assert!(agent.len() <= MAX_AGENT_NAME && rkeys.len() <= MAX_HELLO_KEYS && proof.len() <= MAX_PACKET)
        }
        Msg::Notify { payload } => assert!(payload.len() <= MAX_NOTIFICATION),
        Msg::Refused { reason } => assert!(reason.len() <= MAX_PACKET),
        _ => {}
    }
}

#[test]
fn shm_packet_decoding_survives_mutations() {
    let seeds = seeds();
    assert_eq!(seeds.len(), seed_messages().len(), "every message kind has a corpus file");
    let mut rng = Rng(0x6b76_7769_7265_0101);
    let mut accepted = 0usize;
    for i in 0..iters(100_000) {
        let input = mutate(&mut rng, &seeds[i % seeds.len()], &seeds);
        match Msg::decode(&input) {
            Ok(m) => {
                accepted += 1;
                check_limits(&m);
                assert_eq!(Msg::decode(&m.encode().unwrap()).unwrap(), m, "accepted packets round-trip");
            }
            Err(TransportError::BadConnectionInfo(_)) => {}
            Err(e) => panic!("unexpected error {e:?}"),
        }
    }
    // The limits themselves, exactly.
    let at = |payload: usize| Msg::decode(&postcard::to_allocvec(&Msg::Notify { payload: vec![1; payload] }).unwrap());
    assert!(at(MAX_NOTIFICATION).is_ok());
    assert!(at(MAX_NOTIFICATION + 1).is_err(), "a notification over the shared limit is refused");
    let hello = |keys: usize, name: usize| {
        let m = Msg::Hello { agent: "a".repeat(name), rkeys: vec![1; keys], proof: vec![], nonce: Nonce([0; 16]) };
        Msg::decode(&postcard::to_allocvec(&m).unwrap())
    };
    assert!(hello(MAX_HELLO_KEYS, MAX_AGENT_NAME).is_ok());
    assert!(hello(MAX_HELLO_KEYS + 1, 1).is_err() && hello(1, MAX_AGENT_NAME + 1).is_err());
    assert!(Msg::decode(&vec![0; MAX_PACKET + 1]).is_err());
    // A length prefix announcing 2^32 keys allocates nothing near that.
    assert!(Msg::decode(&[1, 1, b'a', 0xff, 0xff, 0xff, 0xff, 0x0f]).is_err());
    eprintln!("shm packets: {accepted} of {} mutants accepted", iters(100_000));
}

/// Send `body` with `fds` attached (the kernel duplicates them for the
/// receiver).
fn send_raw(ch: &Channel, body: &[u8], fds: &[RawFd]) -> nix::Result<usize> {
    let cmsgs = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsgs };
    socket::sendmsg::<()>(ch.as_fd().as_raw_fd(), &[IoSlice::new(body)], cmsgs, MsgFlags::MSG_NOSIGNAL, None)
}

/// Mutated packets with 0 to 10 descriptors over a real socket: `recv`
/// gives exactly what `Msg::decode` gives, at most one descriptor (only
/// with a packet it accepts), and every descriptor the kernel installed
/// is closed (none leak), including those past the 8 the control buffer
/// has room for.
#[test]
fn shm_packets_with_descriptors_survive_mutations() {
    let _one_at_a_time = FD_COUNTING.lock().unwrap_or_else(|p| p.into_inner());
    let seeds = seeds();
    let files: Vec<File> = (0..10).map(|_| File::open("/dev/null").unwrap()).collect();
    let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
    let name = format!("kvwire-fuzz-shm-{}", std::process::id());
    let l = Listener::bind(&name).unwrap();
    let tx = Channel::connect(&name, Duration::from_secs(5)).unwrap();
    let rx = l.accept().unwrap();
    rx.set_timeouts(Duration::from_secs(5)).unwrap();
    let before = fd_count();
    let mut rng = Rng(0x6b76_7769_7265_0102);
    let (mut with_fd, mut refused) = (0usize, 0usize);
    for i in 0..iters(3_000) {
        let body = mutate(&mut rng, &seeds[i % seeds.len()], &seeds);
        if body.is_empty() || body.len() > MAX_PACKET + 64 {
            continue; // an empty seqpacket reads as end of stream; huge ones cost time
        }
        let n = [0, 0, 1, 1, 2, 8, 9, 10][rng.below(8)];
        send_raw(&tx, &body, &raw[..n]).unwrap();
        let fits = n <= 8 && body.len() <= MAX_PACKET;
        match rx.recv() {
            Ok(Some((m, fd))) => {
                assert!(fits, "a truncated packet ({} bytes, {n} fds) was accepted", body.len());
                assert_eq!(Msg::decode(&body).ok(), Some(m), "recv and decode disagree");
                assert_eq!(fd.is_some(), n > 0);
                with_fd += usize::from(fd.is_some());
            }
            Ok(None) => panic!("a {}-byte packet read as end of stream", body.len()),
            Err(_) => {
                refused += 1;
                assert!(!fits || Msg::decode(&body).is_err(), "recv refused a packet decode accepts");
            }
        }
    }
    drop((tx, rx, l));
    let after = fd_count();
    assert!(after <= before + 2, "received descriptors leaked: {before} open before, {after} after");
    eprintln!("shm packets with fds: {with_fd} accepted with a descriptor, {refused} refused");
}

fn region_of(
    t: &mut ShmTransport,
    buf: &std::sync::Arc<HostBuffer>,
) -> (kvwire::transport::Registration, RemoteRegion) {
    let reg = t.register(buf.clone()).unwrap();
    let d = buf.desc();
    (reg, RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: reg.rkey, kind: d.kind, device_id: 0 })
}

/// Connect and take the challenge; when `prove`, also pass the handshake
/// asking for `rkey`. Returns the channel, the messages and the number of
/// descriptors received.
fn handshake(info: &ShmInfo, prove: bool, rkey: u32) -> Option<(Channel, Vec<Msg>, usize)> {
    let ch = Channel::connect(&info.socket, Duration::from_secs(2)).ok()?;
    let Ok(Some((Msg::Challenge { nonce }, None))) = ch.recv() else { return None };
    if !prove {
        return Some((ch, vec![Msg::Challenge { nonce }], 0));
    }
    let proof = auth::prove(&info.secret, &nonce, &wire::proof_context("fuzz")).to_vec();
    ch.send(&Msg::Hello { agent: "fuzz".into(), rkeys: vec![rkey], proof, nonce }, None).ok()?;
    let (mut msgs, mut fds) = (Vec::new(), 0);
    while let Ok(Some((m, fd))) = ch.recv() {
        fds += usize::from(fd.is_some());
        let ready = matches!(m, Msg::Ready { .. });
        msgs.push(m);
        if ready {
            return Some((ch, msgs, fds));
        }
    }
    None
}

/// Mutated packets (with descriptors) sent to a live target, in place of
/// the `Hello` and after a real handshake: before the secret is proved no
/// region and no descriptor is ever sent back; afterwards the target only
/// answers notifications; it keeps serving a real initiator and leaks no
/// descriptors.
#[test]
fn a_live_shm_target_survives_mutated_packets() {
    let _one_at_a_time = FD_COUNTING.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = TransportConfig { peer_timeout: Duration::from_millis(300), ..Default::default() };
    let mut target = ShmTransport::new("target", &cfg).unwrap();
    let buf = std::sync::Arc::new(HostBuffer::new(1 << 16).unwrap());
    let (reg, region) = region_of(&mut target, &buf);
    let info = ShmInfo::decode(&target.connection_info()).unwrap();
    let mut seeds = seeds();
    seeds.push(Msg::RevokeAck { rkey: reg.rkey.0 }.encode().unwrap());
    let files: Vec<File> = (0..10).map(|_| File::open("/dev/null").unwrap()).collect();
    let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
    let before = fd_count();
    let mut rng = Rng(0x6b76_7769_7265_0103);
    let (mut sent, mut acks) = (0usize, 0usize);
    for i in 0..iters(300) {
        let authed = i % 3 != 0;
        let Some((ch, msgs, fds)) = handshake(&info, authed, reg.rkey.0) else { continue };
        if authed {
            assert_eq!(fds, 1, "the proved peer gets the region's memfd: {msgs:?}");
        }
        for _ in 0..if authed { 8 } else { 1 } {
            let seed = rng.below(seeds.len());
            let body = mutate(&mut rng, &seeds[seed], &seeds);
            if body.is_empty() || body.len() > MAX_PACKET {
                continue;
            }
            let n = [0, 0, 0, 1, 3, 9][rng.below(6)];
            if send_raw(&ch, &body, &raw[..n]).is_err() {
                break; // the target closed the connection
            }
            sent += 1;
            ch.set_timeouts(Duration::from_millis(20)).unwrap();
            while let Ok(Some((m, fd))) = ch.recv() {
                assert!(fd.is_none(), "the target sent a descriptor after the handshake: {m:?}");
                assert!(authed || matches!(m, Msg::Refused { .. }), "unproved peer got {m:?}");
                assert!(!matches!(m, Msg::Region { .. }), "a region was sent: {m:?}");
                acks += usize::from(m == Msg::NotifyAck);
            }
        }
    }
    // Notifications the fuzzed peers managed to send are queued, bounded.
    let mut notes = Vec::new();
    target.take_notifications(&mut notes);
    assert!(notes.iter().all(|n| n.payload.len() <= MAX_NOTIFICATION && n.from_agent == "fuzz"));
    eprintln!("live shm target: {sent} mutated packets, {acks} notifications acknowledged");

    // A real initiator still connects, writes and notifies.
    let mut init = ShmTransport::new("init", &cfg).unwrap();
    let src = std::sync::Arc::new(HostBuffer::new(4096).unwrap());
    src.fill_with(0, 4096, |_| 0x5a);
    let l = init.register(src.clone()).unwrap();
    let peer = init.connect("target", &target.connection_info(), &[region]).unwrap();
    let seg =
        Segment { local_addr: src.addr(), remote_addr: region.addr, len_bytes: 4096, lkey: l.lkey, rkey: reg.rkey };
    let req =
        PostRequest { xfer: XferId(1), op: Op::Write, peer, segments: vec![seg], notification: Some(b"ok".into()) };
    init.post(req).unwrap();
    let t0 = Instant::now();
    let mut out: Vec<Completion> = Vec::new();
    while out.is_empty() && t0.elapsed() < Duration::from_secs(10) {
        init.poll(&mut out);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(out.pop().map(|c| c.result), Some(Ok(())));
    assert!(buf.eq_at(0, &[0x5a; 4096]));
    target.take_notifications(&mut notes);
    assert!(notes.iter().any(|n| n.from_agent == "init" && n.payload == b"ok"));
    drop(init);
    // Per-peer threads of dropped connections end; their descriptors close.
    let deadline = Instant::now() + Duration::from_secs(5);
    while fd_count() > before + 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(fd_count() <= before + 2, "fds {before} -> {}: the target leaks connections", fd_count());
    target.deregister(reg.lkey).unwrap();
}
