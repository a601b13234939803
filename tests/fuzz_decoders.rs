//! Bounded mutation fuzzing of every decoder a peer speaks to: agent
//! metadata (binary and JSON), MAX's engine metadata and `TransferReqData`
//! (msgspec JSON and msgpack), the tcp wire frames (the decoder, and a live
//! target fed mutated frames) and the side channel. The shm wire packets
//! are in `fuzz_shm.rs`.
//!
//! Each target starts from the committed corpus (`tests/corpus/<target>/`)
//! plus encodings made here, applies a fixed number of seeded mutations
//! (deterministic: the same inputs on every run, a few seconds each) and
//! checks that decoding never panics, never allocates past the documented
//! bounds, and that whatever it accepts obeys the rules. Set
//! `KVWIRE_FUZZ_ITERS=N` to run longer locally.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

mod fuzz_util;
mod tcp_util;

use fuzz_util::{Rng, corpus, iters, mutate};
use kvwire::HostBuffer;
use kvwire::engine::metadata::{AgentMetadata, MAX_METADATA_BYTES};
use kvwire::kv::{KVCacheMemory, KVTransferEngine, KVTransferEngineMetadata, KvError, TransferReqData};
use kvwire::sidechannel::{MAX_MESSAGE_BYTES, SideChannel, SideChannelError};
use kvwire::transport::tcp::{TcpTransport, wire};
use kvwire::transport::{RemoteKey, RemoteRegion, Transport, TransportConfig, TransportKind};

fn region(addr: u64, rkey: u32) -> RemoteRegion {
    RemoteRegion {
        addr,
        len_bytes: 4096,
        rkey: RemoteKey(rkey),
        kind: kvwire::transport::MemoryKind::Dram,
        device_id: 0,
    }
}

#[test]
fn agent_metadata_decoding_survives_mutations() {
    let loopback = TransportConfig { options: vec![("listen".into(), "127.0.0.1:0".into())], ..Default::default() };
    let tcp = TcpTransport::new("prefill-0", &loopback).unwrap();
    let m = AgentMetadata {
        name: "prefill-0".into(),
        hostname: "host-a".into(),
        transport: TransportKind::Tcp,
        generation: 3,
        connection_info: tcp.connection_info(),
        regions: vec![region(0x10000, 1), region(0x20000, 2), region(0x40000, 7)],
    };
    if std::env::var_os("KVWIRE_WRITE_CORPUS").is_some() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/metadata");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tcp_agent.bin"), m.to_bytes()).unwrap();
        std::fs::write(dir.join("tcp_agent.json"), m.to_json()).unwrap();
    }
    let mut seeds = corpus("metadata");
    seeds.push(m.to_bytes());
    seeds.push(m.to_json().into_bytes());
    let mut rng = Rng(0x6b76_7769_7265_0001);
    let mut accepted = 0usize;
    for i in 0..iters(30_000) {
        let input = mutate(&mut rng, &seeds[i % seeds.len()], &seeds);
        let decoded = AgentMetadata::from_bytes(&input).or_else(|_| {
            std::str::from_utf8(&input)
                .map_err(|_| ())
                .and_then(|t| AgentMetadata::from_json(t).map_err(|_| ()))
                .map_err(|_| ())
        });
        if let Ok(d) = decoded {
            accepted += 1;
            d.validate().expect("what decodes obeys the rules");
            assert!(input.len() <= MAX_METADATA_BYTES);
            assert_eq!(AgentMetadata::from_bytes(&d.to_bytes()).unwrap(), d, "accepted metadata round-trips");
        }
    }
    assert!(AgentMetadata::from_bytes(&vec![0u8; MAX_METADATA_BYTES + 1]).is_err());
    eprintln!("metadata: {accepted} of {} mutants accepted", iters(30_000));
}

#[test]
fn transfer_req_data_json_decoding_survives_mutations() {
    let seeds = corpus("reqdata");
    let mut rng = Rng(0x6b76_7769_7265_0002);
    let mut accepted = 0usize;
    for i in 0..iters(30_000) {
        let input = mutate(&mut rng, &seeds[i % seeds.len()], &seeds);
        if let Ok(r) = TransferReqData::from_bytes(&input) {
            accepted += 1;
            assert_eq!(TransferReqData::from_json(&r.to_json()).unwrap(), r, "accepted requests round-trip");
        }
    }
    // Deep nesting is refused, not a stack overflow.
    let deep = "[".repeat(100_000);
    assert!(TransferReqData::from_json(&deep).is_err());
    eprintln!("reqdata: {accepted} accepted");
}

/// `TransferReqData` as MAX sends it over ZMQ (msgspec msgpack): mutants of
/// the committed msgpack corpus (and of the JSON corpus re-encoded) decode
/// or fail with a typed error, never panic, and what decodes round-trips.
#[test]
fn transfer_req_data_msgpack_decoding_survives_mutations() {
    for name in ["full", "tag_last"] {
        let json =
            std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/corpus/reqdata/{name}.json")));
        let r = TransferReqData::from_bytes(&json.unwrap()).unwrap();
        fuzz_util::write_corpus("reqdata_msgpack", &format!("{name}.msgpack"), &r.to_msgpack());
    }
    let seeds = corpus("reqdata_msgpack");
    let mut rng = Rng(0x6b76_7769_7265_0006);
    let mut accepted = 0usize;
    for i in 0..iters(30_000) {
        let input = mutate(&mut rng, &seeds[i % seeds.len()], &seeds);
        match TransferReqData::from_msgpack(&input) {
            Ok(r) => {
                accepted += 1;
                assert_eq!(TransferReqData::from_msgpack(&r.to_msgpack()).unwrap(), r, "accepted requests round-trip");
            }
            Err(KvError::Decode(_) | KvError::Validation(_) | KvError::InvalidRequest(_)) => {}
            Err(e) => panic!("unexpected error class {e:?}"),
        }
    }
    // Deep nesting (fixarray of one, 100,000 deep) and a huge announced
    // length are refused, not a stack overflow or a huge allocation.
    assert!(TransferReqData::from_msgpack(&[0x91; 100_000]).is_err());
    assert!(TransferReqData::from_msgpack(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
    eprintln!("reqdata msgpack: {accepted} accepted");
}

/// MAX's `KVTransferEngineMetadata` (msgspec JSON and msgpack), from a real
/// engine's metadata: mutants never panic, and what decodes validates and
/// round-trips.
#[test]
fn kv_engine_metadata_decoding_survives_mutations() {
    let cfg = TransportConfig { options: vec![("listen".into(), "127.0.0.1:0".into())], ..Default::default() };
    let (mem, _bufs) = KVCacheMemory::new_host(2, 4, 256, false).unwrap();
    let e = KVTransferEngine::new("fuzz-engine", vec![vec![mem]], None, TransportKind::Tcp, &cfg).unwrap();
    let m = e.metadata();
    let mut seeds = vec![m.to_bytes(), m.to_msgpack()];
    let mut rng = Rng(0x6b76_7769_7265_0007);
    let mut accepted = 0usize;
    for i in 0..iters(10_000) {
        let input = mutate(&mut rng, &seeds[i % 2], &seeds);
        let decoded = if i % 2 == 0 {
            KVTransferEngineMetadata::from_bytes(&input)
        } else {
            KVTransferEngineMetadata::from_msgpack(&input)
        };
        if let Ok(d) = decoded {
            accepted += 1;
            assert_eq!(KVTransferEngineMetadata::from_msgpack(&d.to_msgpack()).unwrap(), d, "round-trips");
            if accepted < 8 {
                seeds.push(input);
            }
        }
    }
    eprintln!("kv engine metadata: {accepted} accepted");
}

#[test]
fn tcp_frame_decoding_survives_mutations() {
    let seeds = corpus("tcp_frames");
    let mut rng = Rng(0x6b76_7769_7265_0003);
    let mut segs = Vec::new();
    for i in 0..iters(100_000) {
        let input = mutate(&mut rng, &seeds[i % seeds.len()], &seeds);
        if input.len() < wire::HEADER_BYTES {
            continue;
        }
        let Ok(h) = wire::Header::decode(input[..wire::HEADER_BYTES].try_into().unwrap()) else { continue };
        // Whatever a header announces stays within the documented limits.
        assert!(h.body_bytes() <= wire::MAX_NOTIFICATION_BYTES as usize + wire::PROOF_BYTES);
        assert!(h.len <= wire::MAX_REQUEST_BYTES);
        let body = &input[wire::HEADER_BYTES..];
        if matches!(h.kind, wire::Kind::Write | wire::Kind::Read)
            && body.len() >= h.body_bytes()
            && wire::decode_segments(&h, &body[..h.body_bytes()], &mut segs).is_ok()
        {
            assert_eq!(segs.len(), h.count as usize);
            assert_eq!(segs.iter().map(|s| s.len_bytes).sum::<u64>(), h.len);
        }
    }
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Mutated frames sent to a live target over an authenticated connection:
/// the target never writes outside the registered range, keeps serving
/// legitimate peers, and does not leak connections.
#[test]
fn a_live_tcp_target_survives_mutated_frames() {
    let cfg = TransportConfig { peer_timeout: Duration::from_millis(300), ..Default::default() };
    let mut target = TcpTransport::new("target", &cfg).unwrap();
    // 192 KiB filled with a guard byte; only the middle 64 KiB is registered.
    let buf = HostBuffer::new(3 << 16).unwrap();
    buf.fill_with(0, buf.len(), |_| 0xee);
    let mid = buf.addr() + (1 << 16);
    let desc = kvwire::transport::MemoryDesc {
        addr: mid,
        len_bytes: 1 << 16,
        kind: kvwire::transport::MemoryKind::Dram,
        device_id: 0,
    };
    // SAFETY: the range lies inside `buf`, which outlives the registration
    // (deregistered below before `buf` drops).
    let view = std::sync::Arc::new(unsafe { kvwire::transport::RawMemory::new(desc) });
    let reg = target.register(view.clone()).unwrap();
    let info_bytes = target.connection_info();
    // Seeds aimed at the registered region, so mutants reach the data path.
    let mut seeds = corpus("tcp_frames");
    for (kind, len) in [(wire::Kind::Write, 512u64), (wire::Kind::Read, 512)] {
        let mut f = wire::Header { kind, count: 1, id: 1, len }.encode().to_vec();
        wire::encode_segments([wire::SegmentDesc { rkey: reg.rkey.0, addr: mid + 1000, len_bytes: len }], &mut f);
        if kind == wire::Kind::Write {
            f.extend(std::iter::repeat_n(0x42u8, len as usize));
        }
        seeds.push(f);
    }
    let connect = || {
        let s = tcp_util::authed_client(&info_bytes, "fuzz");
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        s
    };
    let fds_before = fd_count();
    let mut rng = Rng(0x6b76_7769_7265_0004);
    let mut s = connect();
    let mut scratch = vec![0u8; 1 << 16];
    for i in 0..iters(600) {
        let frame = mutate(&mut rng, &seeds[i % seeds.len()], &seeds);
        if s.write_all(&frame).is_err() {
            s = connect();
            continue;
        }
        // Drain whatever comes back; a dropped connection is replaced.
        match s.read(&mut scratch) {
            Ok(0) => s = connect(),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                // An incomplete frame: the target waits for the rest; start over.
                s = connect();
            }
            Err(_) => s = connect(),
        }
    }
    drop(s);
    let guard = buf.to_vec(..);
    assert!(guard[..1 << 16].iter().all(|&b| b == 0xee), "bytes before the region were written");
    assert!(guard[2 << 16..].iter().all(|&b| b == 0xee), "bytes after the region were written");
    // The target still serves a legitimate peer.
    let mut init = TcpTransport::new("init", &cfg).unwrap();
    let src = std::sync::Arc::new(HostBuffer::new(4096).unwrap());
    src.fill_with(0, 4096, |_| 0x5a);
    let l = init.register(src.clone()).unwrap();
    let peer = init.connect("target", &target.connection_info(), &[]).unwrap();
    let seg = kvwire::transport::Segment {
        local_addr: src.addr(),
        remote_addr: mid,
        len_bytes: 4096,
        lkey: l.lkey,
        rkey: reg.rkey,
    };
    init.post(kvwire::transport::PostRequest {
        xfer: kvwire::transport::XferId(1),
        op: kvwire::transport::Op::Write,
        peer,
        segments: vec![seg],
        notification: None,
    })
    .unwrap();
    let t0 = std::time::Instant::now();
    let mut out = Vec::new();
    while out.is_empty() && t0.elapsed() < Duration::from_secs(10) {
        init.poll(&mut out);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(out.pop().map(|c| c.result), Some(Ok(())));
    assert!(buf.to_vec(1 << 16..(1 << 16) + 4096).iter().all(|&b| b == 0x5a));
    drop(init);
    // Service threads of dropped connections end within peer_timeout.
    std::thread::sleep(Duration::from_millis(800));
    let fds_after = fd_count();
    assert!(fds_after <= fds_before + 8, "fds {fds_before} -> {fds_after}: the target leaks connections");
    target.deregister(reg.lkey).unwrap();
}

#[test]
fn side_channel_decoding_survives_mutations() {
    let seeds = corpus("sidechannel");
    let mut rng = Rng(0x6b76_7769_7265_0005);
    for i in 0..iters(30_000) {
        let input = mutate(&mut rng, &seeds[i % seeds.len()], &seeds);
        let body = input.get(4..).unwrap_or_default();
        let _ = SideChannel::decode::<serde_json::Value>(body);
    }
    // Framing over a real connection: mutated length prefixes are refused
    // past the limit and a short body is "closed", never a huge allocation.
    let (l, addr) = SideChannel::bind("127.0.0.1:0").unwrap();
    let n = 200;
    let frames: Vec<Vec<u8>> = (0..n).map(|i| mutate(&mut rng, &seeds[i % seeds.len()], &seeds)).collect();
    let sender = std::thread::spawn(move || {
        for f in frames {
            let mut s = TcpStream::connect(addr).unwrap();
            let _ = s.write_all(&f);
        }
    });
    for _ in 0..n {
        let mut c = SideChannel::accept(&l).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        match c.recv::<serde_json::Value>() {
            Ok(_) | Err(SideChannelError::Closed | SideChannelError::Decode(_) | SideChannelError::Io { .. }) => {}
            Err(SideChannelError::TooLarge(len)) => assert!(len > MAX_MESSAGE_BYTES),
            // A length over the limit: reported as another program talking.
            Err(SideChannelError::NotKvwire(_)) => {}
            Err(e) => panic!("unexpected side-channel error {e}"),
        }
    }
    sender.join().unwrap();
}
