//! The command path on [`SimNic`] for the criterion bench `verbs_command`.

use super::nic::{Nic, NicQp};
use super::sim::{SimFabric, SimNic, SimQp};
use crate::verbs::WorkCompletion;

/// The command path on the simulated NIC, for the criterion bench
/// `verbs_command`: one initiator state machine with one QP to a simulated
/// target; [`post_pages`](Self::post_pages) runs a post (transfer record,
/// queueing, WR building, `post_send`), [`finish`](Self::finish) lets the
/// fabric complete it.
#[doc(hidden)]
pub struct CommandBench {
    fabric: SimFabric,
    nic: SimNic,
    st: super::state::State<SimQp>,
    done: crossbeam_channel::Receiver<crate::transport::Completion>,
    _target: SimQp,
    qpn: u32,
    src: (u64, u32),
    dst: (u64, u32),
    limits: super::state::PostLimits,
    next: u64,
    wcs: Vec<WorkCompletion>,
}

impl Default for CommandBench {
    fn default() -> Self {
        let SimPair { fabric, nic, qp, target: t, qpn, src, dst } = SimPair::new();
        let (dtx, done) = crossbeam_channel::unbounded();
        let (ntx, _) = crossbeam_channel::unbounded();
        let mut st = super::state::State::new(4096, dtx, ntx);
        st.add_send_qp(qp, crate::transport::PeerId(1));
        let limits = bench_limits(0);
        let wcs = vec![WorkCompletion::default(); 64];
        Self { fabric, nic, st, done, _target: t, qpn, src, dst, limits, next: 0, wcs }
    }
}

/// Both benches' simulated setup: an initiator NIC with one QP (depth
/// 1,024) connected to a target QP, and a 1 MiB region on each side
/// (`(address, key)`).
struct SimPair {
    fabric: SimFabric,
    nic: SimNic,
    qp: SimQp,
    target: SimQp,
    qpn: u32,
    src: (u64, u32),
    dst: (u64, u32),
}

impl SimPair {
    fn new() -> Self {
        let fabric = SimFabric::new(0);
        let nic = fabric.device(0, 4096);
        let qp = nic.create_qp(1024, 1).expect("sim QP");
        let target = fabric.device(1, 4096).create_qp(4, 64).expect("sim QP");
        let qpn = qp.qp_num();
        fabric.connect(qpn, target.qp_num());
        let src = fabric.alloc(0, 1 << 20);
        let dst = fabric.alloc(1, 1 << 20);
        Self { fabric, nic, qp, target, qpn, src, dst }
    }
}

/// The benches' posting limits; `idle_yields` differs: the state-machine
/// bench has no progress thread, the channel bench's engine idles as the
/// transport's default does.
fn bench_limits(idle_yields: u32) -> super::state::PostLimits {
    super::state::PostLimits {
        max_send_wr: 1024,
        signal_every: 32,
        max_batch: 64,
        batch_bytes: 0,
        poll_sleep_us: 50,
        idle_yields,
    }
}

/// Transfer `xfer`: a WRITE of `pages` 4 KiB pages from region `src` to
/// region `dst` (`(address, key)`), in descending order so none coalesce
/// (wrapping after 256 pages, the regions' size).
fn write_request(xfer: u64, pages: u64, src: (u64, u32), dst: (u64, u32)) -> crate::transport::PostRequest {
    use crate::transport::{LocalKey, Op, PeerId, PostRequest, RemoteKey, Segment, XferId};
    let segments = (0..pages)
        .rev()
        .map(|i| Segment {
            local_addr: src.0 + (i % 256) * 4096,
            lkey: LocalKey(src.1),
            remote_addr: dst.0 + (i % 256) * 4096,
            rkey: RemoteKey(dst.1),
            len_bytes: 4096,
        })
        .collect();
    PostRequest { xfer: XferId(xfer), op: Op::Write, peer: PeerId(1), segments, notification: None }
}

impl CommandBench {
    /// Post one WRITE of `pages` 4 KiB pages (descending, so none
    /// coalesce); the number of WRs the NIC then holds.
    pub fn post_pages(&mut self, pages: u64) -> usize {
        self.next += 1;
        let req = write_request(self.next, pages, self.src, self.dst);
        self.st.post(&req, &[super::state::Qpn(self.qpn)], "bench", &self.limits).expect("post");
        self.fabric.world().queued(self.qpn)
    }

    /// Complete everything posted and retire it (outside the measured
    /// command path).
    pub fn finish(&mut self) {
        {
            let mut w = self.fabric.world();
            // Drop the moved bytes' log: the bench never reads it.
            w.touches.clear();
            while w.step() {}
        }
        loop {
            let n = self.nic.poll_cq(&mut self.wcs).unwrap_or(0);
            if n == 0 {
                break;
            }
            for wc in &self.wcs[..n] {
                self.st.on_completion(wc, &self.limits);
            }
        }
        while self.done.try_recv().is_ok() {}
    }
}

/// The whole command path on the simulated NIC, for the criterion bench
/// `verbs_command/channel_to_nic`: the caller's [`Cmd::Post`](super::engine::Cmd)
/// over the channel to the engine on its progress thread, which queues the
/// work and hands the WRs to the NIC. [`post_pages`](Self::post_pages)
/// returns once all of them are on the simulated send queue;
/// [`finish`](Self::finish) completes them (the engine retires them).
#[doc(hidden)]
pub struct ChannelBench {
    fabric: SimFabric,
    core: super::progress::Core<SimQp>,
    _target: SimQp,
    qpn: u32,
    src: (u64, u32),
    dst: (u64, u32),
    next: u64,
}

impl Default for ChannelBench {
    fn default() -> Self {
        let SimPair { fabric, nic, qp, target: t, qpn, src, dst } = SimPair::new();
        let core = super::progress::Core::start(nic, 4096, bench_limits(192), |_| {}).expect("progress thread");
        // A first install carries the peer's link (one without is a reconnect's,
        // dropped when the peer is unknown).
        let link = Some(std::sync::Arc::new(super::state::PeerLink::default()));
        let cmd = super::engine::Cmd::Install {
            peer: crate::transport::PeerId(1),
            name: "bench".into(),
            qps: vec![qp],
            slab: None,
            link,
        };
        core.handle.send(cmd);
        Self { fabric, core, _target: t, qpn, src, dst, next: 0 }
    }
}

impl ChannelBench {
    /// Send one WRITE of `pages` (≤ 1024) 4 KiB pages to the engine and wait
    /// until the NIC holds all its WRs.
    pub fn post_pages(&mut self, pages: u64) {
        self.next += 1;
        let req = write_request(self.next, pages, self.src, self.dst);
        self.core.handle.send(super::engine::Cmd::Post(req));
        // Yield while waiting: on a machine with fewer cores than busy
        // threads, spinning here would keep the progress thread off a CPU.
        while (self.fabric.world().queued(self.qpn) as u64) < pages {
            std::thread::yield_now();
        }
    }

    /// Complete what was posted and wait for the engine to report it.
    pub fn finish(&mut self) {
        {
            let mut w = self.fabric.world();
            w.touches.clear();
            while w.step() {}
        }
        let _ = self.core.done.recv();
    }
}
