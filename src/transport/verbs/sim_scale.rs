//! The descriptor-count scale bench (issue 29: 112,000 descriptors, vLLM's
//! shape for large models) on the simulated NIC, for `benches/verbs_scale.rs`:
//! the caller hands one transfer of N segments to the verbs engine on its
//! progress thread (the command `VerbsTransport::post` sends), the engine
//! chains them into `post_send` calls, the simulated fabric executes them
//! as `poll_cq` runs (`auto_step`), and the fabric counts every `post_send`
//! (one doorbell each) and the WRs it carried.

use std::time::{Duration, Instant};

use super::engine::Cmd;
use super::nic::{Nic, NicQp};
use super::progress::Core;
use super::sim::{SimFabric, SimQp};
use crate::transport::{Completion, LocalKey, Op, PeerId, PostRequest, RemoteKey, Segment, XferId};

/// Bytes of each of the two simulated regions (local and remote).
pub const REGION_BYTES: u64 = 1 << 20;

/// What the fabric counted since the rig was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Doorbells {
    /// `post_send` calls (one doorbell each).
    pub post_sends: u64,
    /// WRs they carried.
    pub wrs: u64,
    /// Most WRs one `post_send` carried.
    pub max_chain: u64,
}

/// One initiator engine (progress thread, transport defaults for hardware:
/// send queue 1,024, `post_list` 64, signal every 32, no byte bound) with
/// one QP to a simulated target, and a [`REGION_BYTES`] region on each side.
#[doc(hidden)]
pub struct ScaleRig {
    fabric: SimFabric,
    core: Core<SimQp>,
    _target: SimQp,
    /// Local region (address, lkey).
    pub src: (u64, u32),
    /// Remote region (address, rkey).
    pub dst: (u64, u32),
    next: u64,
}

impl Default for ScaleRig {
    fn default() -> Self {
        let fabric = SimFabric::new(0);
        // each poll_cq of the progress thread executes up to 256 WRs
        fabric.world().auto_step = 256;
        let nic = fabric.device(0, 4096);
        let qp = nic.create_qp(1024, 1).expect("sim QP");
        let target = fabric.device(1, 4096).create_qp(4, 64).expect("sim QP");
        fabric.connect(qp.qp_num(), target.qp_num());
        let src = fabric.alloc(0, REGION_BYTES as usize);
        let dst = fabric.alloc(1, REGION_BYTES as usize);
        let limits = super::state::PostLimits {
            max_send_wr: 1024,
            signal_every: 32,
            max_batch: 64,
            batch_bytes: 0,
            poll_sleep_us: 50,
            idle_yields: 0,
        };
        let core = Core::start(nic, 4096, limits, |_| {}).expect("progress thread");
        // A first install carries the peer's link (one without is a reconnect's,
        // dropped when the peer is unknown).
        let link = Some(std::sync::Arc::new(super::state::PeerLink::default()));
        core.handle.send(Cmd::Install { peer: PeerId(1), name: "target".into(), qps: vec![qp], slab: None, link });
        Self { fabric, core, _target: target, src, dst, next: 0 }
    }
}

impl ScaleRig {
    /// Hand one WRITE of `segments` to the engine (what
    /// `VerbsTransport::post` does on the caller's thread); returns at once.
    pub fn post(&mut self, segments: Vec<Segment>) {
        self.next += 1;
        let req = PostRequest { xfer: XferId(self.next), op: Op::Write, peer: PeerId(1), segments, notification: None };
        self.core.handle.send(Cmd::Post(req));
    }

    /// Wait (up to `timeout`) for the engine to report the last post done.
    pub fn wait(&self, timeout: Duration) -> Option<Completion> {
        self.core.done.recv_timeout(timeout).ok()
    }

    /// The fabric's doorbell counts so far; clears its log of memory
    /// accesses (never read here).
    pub fn doorbells(&self) -> Doorbells {
        let mut w = self.fabric.world();
        w.touches.clear();
        Doorbells { post_sends: w.post_sends, wrs: w.posted_wrs, max_chain: w.max_chain }
    }

    /// Segments for `n` 4 KiB pages, wrapping over the regions, with
    /// destinations scattered by a fixed odd stride (none coalesce).
    pub fn segments(&self, n: u64) -> Vec<Segment> {
        let pages = REGION_BYTES / 4096;
        (0..n)
            .map(|i| Segment {
                local_addr: self.src.0 + (i % pages) * 4096,
                lkey: LocalKey(self.src.1),
                remote_addr: self.dst.0 + (i * 7919 % pages) * 4096,
                rkey: RemoteKey(self.dst.1),
                len_bytes: 4096,
            })
            .collect()
    }

    /// Time from `t0` until the completion of the last post (`None`: none
    /// within `timeout`).
    pub fn done_after(&self, t0: Instant, timeout: Duration) -> Option<(Duration, Completion)> {
        let c = self.wait(timeout)?;
        Some((t0.elapsed(), c))
    }
}
