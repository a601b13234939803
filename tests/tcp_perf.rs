//! Throughput of the `tcp` transport against a plain single-stream socket
//! copy of the same scattered pages, measured in the same run on loopback.
//! Ignored by default (it moves GiBs); run it with
//! `cargo test --release --test tcp_perf -- --ignored --nocapture`
//! (`KVWIRE_PERF_MIB` sets the bytes per transfer, default 256;
//! `KVWIRE_PERF_CONNS` a comma list of connection counts, default 1,2,4).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::engine::{Desc, TransferEngine, TransferStatus};
use kvwire::transport::{Op, TransportConfig, TransportKind};

/// A permutation of `0..n` (xorshift Fisher-Yates): destination page of each source page.
fn permutation(n: usize, mut s: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.swap(i, (s % (i as u64 + 1)) as usize);
    }
    v
}

/// Bytes per second of a plain socket: one connection, one `write` per
/// source page and one `read_exact` per destination page.
fn socket_copy(src: &HostBuffer, dst: &HostBuffer, page: usize, perm: &[usize], iters: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let total = src.len();
    let src_slice: &'static [u8] = Box::leak(src.to_vec(..).into_boxed_slice());
    let perm2 = perm.to_vec();
    let sender = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        for _ in 0..iters {
            for i in 0..perm2.len() {
                s.write_all(&src_slice[i * page..(i + 1) * page]).unwrap();
            }
        }
    });
    let (mut r, _) = l.accept().unwrap();
    let mut out = vec![0u8; dst.len()];
    let t0 = Instant::now();
    for _ in 0..iters {
        for &d in perm {
            r.read_exact(&mut out[d * page..(d + 1) * page]).unwrap();
        }
    }
    let t = t0.elapsed();
    sender.join().unwrap();
    dst.write(0, &out);
    (total * iters) as f64 / t.as_secs_f64()
}

fn transport_copy(conns: usize, src: &Arc<HostBuffer>, page: usize, perm: &[usize], iters: usize) -> f64 {
    let cfg = TransportConfig {
        options: vec![("conns_per_peer".into(), conns.to_string())],
        peer_timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let mut target = TransferEngine::new("perf-target", TransportKind::Tcp, &cfg).unwrap();
    let mut init = TransferEngine::new("perf-init", TransportKind::Tcp, &cfg).unwrap();
    let dst = Arc::new(HostBuffer::new(src.len()).unwrap());
    init.register(src.clone()).unwrap();
    target.register(dst.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();
    let p = page as u64;
    let local: Vec<Desc> = (0..perm.len() as u64).map(|i| Desc::new(src.addr() + i * p, p)).collect();
    let remote: Vec<Desc> = perm.iter().map(|&d| Desc::new(dst.addr() + d as u64 * p, p)).collect();
    let mut best = Duration::MAX;
    let mut sum = Duration::ZERO;
    for it in 0..iters + 1 {
        let t0 = Instant::now();
        let h = init.post(Op::Write, &local, "perf-target", &remote, Some(b"n".to_vec())).unwrap();
        while init.status(h).unwrap() == TransferStatus::InProgress {
            std::thread::sleep(Duration::from_micros(20));
        }
        assert_eq!(init.status(h).unwrap(), TransferStatus::Done);
        init.release(h).unwrap();
        let t = t0.elapsed();
        if it > 0 {
            sum += t;
            best = best.min(t);
        }
    }
    for (i, &d) in perm.iter().enumerate().step_by(97) {
        assert_eq!(dst.to_vec(d * page..(d + 1) * page), src.to_vec(i * page..(i + 1) * page));
    }
    (src.len() * iters) as f64 / sum.as_secs_f64()
}

#[test]
#[ignore = "benchmark: run with --release -- --ignored --nocapture"]
fn tcp_transport_vs_single_stream_socket() {
    let mib: usize = std::env::var("KVWIRE_PERF_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(256);
    let conns: Vec<usize> = std::env::var("KVWIRE_PERF_CONNS")
        .unwrap_or_else(|_| "1,2,4".into())
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    let total = mib << 20;
    let src = Arc::new(HostBuffer::new(total).unwrap());
    src.fill_with(0, total, |i| (i as u64).wrapping_mul(0x9E37_79B9).to_le_bytes()[3]);
    let iters = 3;
    println!("{mib} MiB of scattered pages per transfer, WRITE, {iters} iterations, loopback");
    println!("{:>8} {:>14} tcp transport GB/s (ratio) per conns_per_peer", "page", "socket GB/s");
    for page in [4usize << 10, 64 << 10, 1 << 20] {
        let perm = permutation(total / page, 42);
        let dst = HostBuffer::new(total).unwrap();
        let sock = socket_copy(&src, &dst, page, &perm, iters);
        let mut line = format!("{:>7}K {:>14.2}", page >> 10, sock / 1e9);
        for &c in &conns {
            let t = transport_copy(c, &src, page, &perm, iters);
            line += &format!("   {c}: {:.2} ({:.0}%)", t / 1e9, 100.0 * t / sock);
        }
        println!("{line}");
    }
}
