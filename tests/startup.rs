//! Many agents started at once (issue 29): 16 threads of one process each
//! create an engine at the same instant (a barrier), register memory and
//! publish metadata; then one engine connects to every other and writes a
//! distinct pattern into each, verified. On shm and tcp. No timing is
//! asserted (start-up cost is measured by `bench/compare/startup.sh`); what
//! is checked is that concurrent creation neither fails nor collides
//! (names, shm segments, listener ports, secrets).

use std::sync::{Arc, Barrier};

use kvwire::HostBuffer;
use kvwire::engine::{Desc, TransferEngine, TransferStatus};
use kvwire::transport::{Op, TransportConfig, TransportKind};

const AGENTS: usize = 16;
const LEN: usize = 64 << 10;

fn sixteen_at_once(kind: TransportKind) {
    let barrier = Arc::new(Barrier::new(AGENTS));
    let tag = format!("{}-{}", std::process::id(), kind);
    let threads: Vec<_> = (0..AGENTS)
        .map(|i| {
            let b = barrier.clone();
            let tag = tag.clone();
            std::thread::spawn(move || {
                b.wait();
                let mut e = TransferEngine::new(&format!("start-{tag}-{i}"), kind, &TransportConfig::default())
                    .unwrap_or_else(|err| panic!("agent {i}: {err}"));
                let buf = Arc::new(HostBuffer::new(LEN).unwrap());
                e.register(buf.clone()).unwrap();
                (e, buf)
            })
        })
        .collect();
    let mut agents: Vec<_> = threads.into_iter().map(|t| t.join().expect("agent thread")).collect();
    let (mut first, src) = agents.remove(0);
    for (i, (peer, _)) in agents.iter().enumerate() {
        first.connect(&peer.metadata()).unwrap_or_else(|e| panic!("{kind}: connect to agent {}: {e}", i + 1));
    }
    for (i, (peer, dst)) in agents.iter().enumerate() {
        src.fill_with(0, LEN, |x| (x as u8).wrapping_mul(3).wrapping_add(i as u8));
        let name = peer.metadata().name;
        let h = first
            .post(Op::Write, &[Desc::new(src.addr(), LEN as u64)], &name, &[Desc::new(dst.addr(), LEN as u64)], None)
            .unwrap();
        let st = first.wait(h, std::time::Duration::from_secs(30)).unwrap();
        assert_eq!(st, TransferStatus::Done, "{kind}: agent {}", i + 1);
        first.release(h).unwrap();
        assert_eq!(dst.to_vec(..), src.to_vec(..), "{kind}: agent {}", i + 1);
    }
}

#[test]
fn sixteen_agents_start_at_once_over_shm() {
    sixteen_at_once(TransportKind::Shm);
}

#[test]
fn sixteen_agents_start_at_once_over_tcp() {
    sixteen_at_once(TransportKind::Tcp);
}
