//! The copy core of the `shm` backend: worker threads that move segments
//! with `memcpy` through peer mappings, or with cross-memory attach
//! (`process_vm_readv`/`writev`) where the peer's memory is not shareable.
//!
//! Transfers larger than the last-level cache are copied with non-temporal
//! (streaming) stores (`super::stream`): the destination cannot stay cached
//! anyway, and streaming stores skip the read-for-ownership of every
//! destination line that a cached store pays (3 memory passes become 2).

use std::collections::VecDeque;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::stream::{copy_bytes, store_fence, streams};

use crossbeam_channel::{Receiver, Sender};
use memmap2::MmapRaw;

use crate::transport::inflight::XferState;
use crate::transport::{Completion, Op, RemoteAccessKind, Segment, TransferFailure, TransportError};

/// How the initiator reaches one region of a peer.
#[derive(Debug)]
pub(super) enum PeerMem {
    /// Mapped here; `base` is the local address of the region's first byte.
    Mapped {
        /// Local address of the region start.
        base: usize,
        /// Keeps the mapping alive.
        _map: Arc<MmapRaw>,
    },
    /// Reached with cross-memory attach to this pid.
    Cma {
        /// Target process id.
        pid: i32,
    },
}

/// A peer region as the target reported it at connect time.
#[derive(Debug)]
pub(super) struct PeerRegion {
    /// Start address in the target (bytes).
    pub addr: u64,
    /// Length (bytes).
    pub len_bytes: u64,
    /// How to reach it.
    pub mem: PeerMem,
    /// Set when the target deregistered the region.
    pub revoked: AtomicBool,
    /// Copies into or out of this region in progress. A revocation sets
    /// `revoked`, then waits for this to reach 0 before acknowledging, so
    /// once the target's `deregister` returns nothing touches the region.
    pub active: AtomicUsize,
}

impl PeerRegion {
    /// Start an access: false (and nothing held) when the region is revoked.
    /// `SeqCst` pairs with [`PeerRegion::revoke`]: either the revoker sees
    /// our count, or we see its flag.
    pub(super) fn enter(&self) -> bool {
        self.active.fetch_add(1, Ordering::SeqCst);
        if self.revoked.load(Ordering::SeqCst) {
            self.active.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// End an access started by a successful [`PeerRegion::enter`].
    pub(super) fn exit(&self) {
        self.active.fetch_sub(1, Ordering::SeqCst);
    }

    /// Revoke: refuse new accesses, wait for those in progress, then drop
    /// the mapping of the target's memory (issue 18 item 8: a deregistered
    /// region must not stay mapped, and pinned, in every initiator).
    pub(super) fn revoke(&self) {
        self.revoked.store(true, Ordering::SeqCst);
        crate::transport::wait_until(|| self.active.load(Ordering::SeqCst) == 0);
        if let PeerMem::Mapped { _map, .. } = &self.mem {
            // SAFETY: replaces our own mapping of the target's memfd with an
            // inaccessible anonymous one of the same range (MAP_FIXED over
            // an existing mapping is atomic), so the target's pages are no
            // longer referenced and the address range stays reserved until
            // `_map` unmaps it on drop. Nothing reads the old mapping any
            // more: `revoked` is set and no access is active (`enter`
            // refuses new ones).
            let p = unsafe {
                libc::mmap(
                    _map.as_mut_ptr().cast(),
                    _map.len(),
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                tracing::warn!("shm: unmapping a revoked region failed: {}", std::io::Error::last_os_error());
            }
        }
    }
}

/// One connected peer, shared by the engine thread and the workers.
#[derive(Debug)]
pub(super) struct PeerShared {
    /// Agent name.
    pub name: String,
    /// Side channel (notifications go out on it).
    pub channel: super::wire::Channel,
    /// Regions by remote key.
    pub regions: std::collections::HashMap<u32, PeerRegion>,
    /// Set when the peer closed its socket (it died or disconnected).
    pub dead: AtomicBool,
    /// Notifications waiting to be sent or acknowledged.
    pub outbox: Outbox,
}

/// A posted transfer being copied.
#[derive(Debug)]
pub(super) struct XferShared {
    /// Id, op, notification, chunks not yet finished (one per entry of
    /// `chunks`), cancel flag and first failure.
    pub core: XferState,
    /// The peer.
    pub peer: Arc<PeerShared>,
    /// Segments, already checked against the peer's regions.
    pub segments: Vec<Segment>,
    /// Segment ranges of about `CHUNK_BYTES`, claimed by workers in order.
    pub chunks: Vec<std::ops::Range<usize>>,
    /// Next chunk to claim.
    pub next_chunk: AtomicUsize,
    /// Where `segments` goes when the transfer is dropped, for the next post
    /// to refill (see [`SpareSegments`]).
    pub spare: Option<Arc<SpareSegments>>,
    /// The local registrations the segments use, alive until the transfer
    /// is dropped (a deregistration meanwhile cannot free them).
    pub _local: Vec<Arc<dyn crate::transport::MemoryBacking>>,
}

impl Drop for XferShared {
    fn drop(&mut self) {
        if let Some(spare) = &self.spare {
            spare.put(std::mem::take(&mut self.segments));
        }
    }
}

/// Segment lists of finished transfers, kept for the next posts. A fresh
/// list of 65,536 segments is 2 MiB whose first touch costs ~500 page faults,
/// which were most of `post`'s CPU time (16 vs 7 ns/desc, measured from
/// Python at 65,536 descriptors) wherever the allocator had returned the
/// previous list to the kernel.
#[derive(Debug, Default)]
pub(super) struct SpareSegments(Mutex<Vec<Vec<Segment>>>);

impl SpareSegments {
    /// How many lists are kept: enough for a few transfers finishing
    /// between posts (not tuned; each kept list is at most the largest
    /// recent post's, 2 MiB at 65,536 segments).
    pub(crate) const KEEP: usize = 4;
    /// Lists shorter than this (128 KiB, glibc's default mmap threshold) come
    /// from pages the allocator keeps anyway: not worth keeping.
    pub(crate) const MIN_CAPACITY: usize = 4096;

    /// Keep `v` (cleared) unless enough are kept already.
    pub(super) fn put(&self, mut v: Vec<Segment>) {
        if v.capacity() < Self::MIN_CAPACITY {
            return;
        }
        v.clear();
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() < Self::KEEP {
            kept.push(v);
        }
    }

    /// A kept list, empty, if any.
    pub(super) fn take(&self) -> Option<Vec<Segment>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }
}

impl AsRef<XferState> for XferShared {
    fn as_ref(&self) -> &XferState {
        &self.core
    }
}

/// A transfer for a worker to help with: it claims chunks until none are left.
/// At most one job per worker is queued per transfer, so a transfer wakes
/// at most `copy_threads` threads whatever its size.
pub(super) struct Job {
    /// The transfer.
    pub xfer: Arc<XferShared>,
    /// Where the transfer's completion goes (its transport's queue).
    pub done: Sender<Completion>,
}

/// The process-wide copy pool shared by every `shm` transport: with one
/// pool per agent, a TP=8 engine in one process would run 16 copy threads
/// on a machine with fewer cores, and every post would wake threads that
/// preempt the poster. It grows to the largest `copy_threads` any transport
/// asked for; its threads sleep on the job queue when idle.
struct SharedPool {
    jobs: Sender<Queued>,
    queue: Receiver<Queued>,
    threads: Mutex<usize>,
}

/// A job in the pool's queue, with how many more workers the one that
/// takes it should wake for the same transfer.
struct Queued {
    job: Job,
    more: usize,
}

static POOL: std::sync::OnceLock<SharedPool> = std::sync::OnceLock::new();

/// A handle on the shared pool, making sure it has at least `threads` workers.
pub(super) struct CopyPool {
    jobs: Sender<Queued>,
}

impl CopyPool {
    /// The shared pool, grown to `threads` workers if it has fewer.
    ///
    /// # Errors
    /// Spawning a worker failed.
    pub(super) fn new(threads: usize) -> std::io::Result<Self> {
        let pool = POOL.get_or_init(|| {
            let (jobs, queue) = crossbeam_channel::unbounded::<Queued>();
            SharedPool { jobs, queue, threads: Mutex::new(0) }
        });
        let mut have = pool.threads.lock().unwrap_or_else(|p| p.into_inner());
        while *have < threads.max(1) {
            let (queue, jobs) = (pool.queue.clone(), pool.jobs.clone());
            std::thread::Builder::new().name(format!("kvwire-shm-copy-{have}")).spawn(move || {
                for Queued { job, more } in queue.iter() {
                    if more > 0 {
                        // Wake the next helper from here, not from `post`.
                        let next = Job { xfer: job.xfer.clone(), done: job.done.clone() };
                        let _ = jobs.send(Queued { job: next, more: more - 1 });
                    }
                    run_job(job);
                }
            })?;
            *have += 1;
        }
        Ok(Self { jobs: pool.jobs.clone() })
    }

    /// Queue a job.
    pub(super) fn submit(&self, job: Job) {
        self.submit_helpers(job, 1);
    }

    /// Queue `job` for `helpers` workers (at least 1). The posting thread
    /// wakes one, which lands on an idle core; each woken worker wakes the
    /// next before it starts copying. Waking them all from `post` lets the
    /// last wake-up preempt the poster where there are no more cores than
    /// copy threads, and `post` then returns only after the woken worker's
    /// time slice: the bench's wall prep+post exceeded its CPU time by a
    /// median 3.0 ns/page at 65,536 4 KiB pages (0–7.5, 4 runs), 0.5 with
    /// this chained wake-up (0.1–1.3, the same 4 interleaved runs; machine
    /// under load 12–16, where other processes preempt the poster too).
    pub(super) fn submit_helpers(&self, job: Job, helpers: usize) {
        // The shared pool's workers never stop, so the queue stays open.
        let _ = self.jobs.send(Queued { job, more: helpers.max(1) - 1 });
    }
}

/// Copy `job`'s chunks until none is left, then finish the transfer: what
/// each copy worker does, and what `post` does itself for a small transfer
/// (`super::INLINE_BYTES`).
pub(super) fn run_job(job: Job) {
    let (x, done) = (&job.xfer, &job.done);
    let stream = streams(x.chunks.len());
    loop {
        let idx = x.next_chunk.fetch_add(1, Ordering::AcqRel);
        let Some(range) = x.chunks.get(idx) else { return };
        if x.core.live() {
            if x.peer.dead.load(Ordering::Acquire) {
                x.core.fail(TransferFailure::peer_died(format!("peer {} disconnected", x.peer.name)));
            } else if let Err(why) = copy_segments(x, &x.segments[range.clone()], stream) {
                x.core.fail(why);
            }
            if stream {
                // Streaming stores are weakly ordered: make them globally
                // visible before the chunk counts as done (the completion and
                // the notification are published after `chunk_done`).
                store_fence();
            }
        }
        if x.core.chunk_done() {
            finish(x, done);
            return;
        }
    }
}

/// After the last chunk: the peer must still be alive; a notification goes
/// to the peer's outbox, which reports the transfer once the target
/// acknowledged it (never a blocking send on this shared thread).
fn finish(x: &Arc<XferShared>, done: &Sender<Completion>) {
    let dead = x.peer.dead.load(Ordering::Acquire);
    if x.core.live() && !dead && x.core.notification.is_some() {
        x.peer.notify(x.clone(), done.clone());
        return;
    }
    x.core.complete(done, || {
        if dead {
            return Err(TransferFailure::peer_died(format!("peer {} disconnected", x.peer.name)));
        }
        Ok(())
    });
}

fn copy_segments(x: &XferShared, segs: &[Segment], stream: bool) -> Result<(), TransferFailure> {
    let mut held: Option<(u32, &PeerRegion)> = None;
    let result = copy_held(x, segs, stream, &mut held);
    if let Some((_, r)) = held {
        r.exit();
    }
    result
}

/// Copy `segs`, holding an access on the region in use (`held`) so that a
/// revocation waits for the copy; the caller releases the last one.
fn copy_held<'a>(
    x: &'a XferShared,
    segs: &[Segment],
    stream: bool,
    held: &mut Option<(u32, &'a PeerRegion)>,
) -> Result<(), TransferFailure> {
    let mut cma: Vec<(libc::iovec, libc::iovec)> = Vec::new();
    let mut cma_pid = 0;
    for s in segs {
        let region = match *held {
            Some((k, r)) if k == s.rkey.0 => r,
            _ => {
                // Switching regions: finish what the old one batched, release it.
                cma_flush(x.core.op, cma_pid, &mut cma)?;
                if let Some((_, old)) = held.take() {
                    old.exit();
                }
                let Some(region) = x.peer.regions.get(&s.rkey.0) else {
                    return Err(TransferFailure::remote_access(
                        RemoteAccessKind::UnknownKey,
                        format!("unknown rkey {}", s.rkey.0),
                    ));
                };
                if !region.enter() {
                    return Err(deregistered(s.rkey.0));
                }
                *held = Some((s.rkey.0, region));
                region
            }
        };
        if region.revoked.load(Ordering::Relaxed) {
            // A revocation is waiting for us: stop here.
            cma_flush(x.core.op, cma_pid, &mut cma)?;
            return Err(deregistered(s.rkey.0));
        }
        let off = (s.remote_addr - region.addr) as usize;
        match &region.mem {
            PeerMem::Mapped { base, .. } => {
                let remote = (base + off) as *mut u8;
                let local = s.local_addr as *mut u8;
                let (src, dst) = match x.core.op {
                    Op::Write => (local as *const u8, remote),
                    Op::Read => (remote as *const u8, local),
                };
                // SAFETY: the engine checked the local range against a live
                // registration (whose backing it keeps alive), and `post`
                // checked the remote range against this region, which is
                // mapped for `len_bytes` and kept alive by `_map`; the held
                // access keeps the target's deregister waiting until we are
                // done. The ranges are in different registrations' memory or
                // different mappings, so they do not overlap.
                unsafe { copy_bytes(src, dst, s.len_bytes as usize, stream) };
            }
            PeerMem::Cma { pid } => {
                cma_pid = *pid;
                let l = libc::iovec { iov_base: s.local_addr as *mut libc::c_void, iov_len: s.len_bytes as usize };
                let r = libc::iovec { iov_base: s.remote_addr as *mut libc::c_void, iov_len: s.len_bytes as usize };
                cma.push((l, r));
                if cma.len() == 512 {
                    cma_flush(x.core.op, cma_pid, &mut cma)?;
                }
            }
        }
        if x.core.cancelled.load(Ordering::Relaxed) {
            return cma_flush(x.core.op, cma_pid, &mut cma);
        }
    }
    cma_flush(x.core.op, cma_pid, &mut cma)
}

/// The target revoked `rkey` (deregistered it) before or during the copy.
fn deregistered(rkey: u32) -> TransferFailure {
    TransferFailure::remote_access(RemoteAccessKind::UnknownKey, format!("rkey {rkey} was deregistered by the target"))
}

fn cma_flush(op: Op, pid: i32, batch: &mut Vec<(libc::iovec, libc::iovec)>) -> Result<(), TransferFailure> {
    if batch.is_empty() {
        return Ok(());
    }
    let (local, remote): (Vec<libc::iovec>, Vec<libc::iovec>) = batch.drain(..).unzip();
    let want: usize = local.iter().map(|v| v.iov_len).sum();
    // SAFETY: every local iovec lies in a live local registration (checked by
    // the engine); the kernel checks the remote iovecs against the target's
    // address space and fails with EFAULT instead of touching anything else.
    let n = unsafe {
        match op {
            Op::Write => {
                libc::process_vm_writev(pid, local.as_ptr(), local.len() as _, remote.as_ptr(), remote.len() as _, 0)
            }
            Op::Read => {
                libc::process_vm_readv(pid, local.as_ptr(), local.len() as _, remote.as_ptr(), remote.len() as _, 0)
            }
        }
    };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ESRCH) => TransferFailure::from_io(&e, "peer process is gone"),
            Some(libc::EFAULT) => TransferFailure::remote_access(
                RemoteAccessKind::OutOfBounds,
                format!("cross-memory attach: {e} (range not mapped in the target)"),
            ),
            Some(libc::EPERM) => TransferFailure::remote_access(
                RemoteAccessKind::Denied,
                format!("cross-memory attach not permitted: {e}"),
            ),
            _ => TransferFailure::from_io(&e, "cross-memory attach failed"),
        });
    }
    if n as usize != want {
        return Err(TransferFailure::remote_access(
            RemoteAccessKind::OutOfBounds,
            format!("cross-memory attach moved {n} of {want} bytes"),
        ));
    }
    Ok(())
}

/// A checked transfer: [`plan`]'s result.
pub(super) struct Plan {
    /// The segments (those longer than a chunk split).
    pub segments: Vec<Segment>,
    /// Segment ranges of about [`super::CHUNK_BYTES`].
    pub chunks: Vec<Range<usize>>,
    /// Total bytes of the transfer.
    pub bytes: u64,
}

/// Check a transfer's segments against the target's regions, as an HCA
/// checks an rkey (known key, not revoked, every byte inside the region the
/// target reported), and cut them into chunks of about
/// [`super::CHUNK_BYTES`], in one pass over the segments. `post` pays this
/// per page: with three passes (check, any-too-large, chunking) it was a
/// third of the engine's prep+post CPU time at 65,536 scattered 4 KiB pages
/// (`perf record` of `kvwire bench`); one pass took the bench's
/// prep+post CPU time from 25.0–26.8 to 17.3–19.2 ns/page (3 interleaved
/// pairs, 2-vCPU EPYC guest). Segments longer than a chunk are
/// split (a second pass, only for transfers that have one).
///
/// # Errors
/// The first violation, as the remote-access failure the transfer fails with.
pub(super) fn plan(peer: &PeerShared, segments: Vec<Segment>) -> Result<Plan, TransferFailure> {
    let mut last: Option<(u32, u64, u64)> = None;
    let mut chunks = Vec::with_capacity(segments.len() / 64 + 1);
    let (mut start, mut acc, mut total, mut large) = (0usize, 0u64, 0u64, false);
    for (i, s) in segments.iter().enumerate() {
        let (addr, len) = match last {
            Some((k, a, l)) if k == s.rkey.0 => (a, l),
            _ => match peer.regions.get(&s.rkey.0) {
                Some(r) if r.revoked.load(Ordering::Acquire) => {
                    return Err(TransferFailure::remote_access(
                        RemoteAccessKind::UnknownKey,
                        format!("rkey {} was deregistered by the target", s.rkey.0),
                    ));
                }
                Some(r) => {
                    last = Some((s.rkey.0, r.addr, r.len_bytes));
                    (r.addr, r.len_bytes)
                }
                None => {
                    return Err(TransferFailure::remote_access(
                        RemoteAccessKind::UnknownKey,
                        format!("unknown rkey {}", s.rkey.0),
                    ));
                }
            },
        };
        let inside = s.remote_addr >= addr && s.remote_addr.checked_add(s.len_bytes).is_some_and(|e| e <= addr + len);
        if !inside {
            return Err(TransferFailure::remote_access(
                RemoteAccessKind::OutOfBounds,
                format!("{:#x}+{} outside rkey {} ({:#x}+{len})", s.remote_addr, s.len_bytes, s.rkey.0, addr),
            ));
        }
        large |= s.len_bytes > super::CHUNK_BYTES;
        acc += s.len_bytes;
        total += s.len_bytes;
        if acc >= super::CHUNK_BYTES {
            chunks.push(start..i + 1);
            start = i + 1;
            acc = 0;
        }
    }
    if large {
        // Segments longer than a chunk are split so that threads can share them.
        use crate::transport::split::{Fill, group, split_all};
        let segments = split_all(segments, super::CHUNK_BYTES);
        let chunks = group(&segments, Fill::AtLeast(super::CHUNK_BYTES));
        return Ok(Plan { segments, chunks, bytes: total });
    }
    if start < segments.len() || chunks.is_empty() {
        chunks.push(start..segments.len());
    }
    Ok(Plan { segments, chunks, bytes: total })
}

// ---- the outbox: notifications the copy threads queue and the peer thread sends ----

/// A transfer whose data is in place, waiting for its notification to be
/// sent and acknowledged.
pub(super) struct Pending {
    pub(super) xfer: Arc<XferShared>,
    pub(super) done: Sender<Completion>,
    pub(super) deadline: Instant,
}

impl Pending {
    pub(super) fn finish(self, result: Result<(), TransferFailure>) {
        self.xfer.core.complete(&self.done, || result);
    }
}

pub(super) enum Out {
    Notify(Pending),
    RevokeAck(u32),
}

#[derive(Default)]
pub(super) struct OutboxState {
    /// Not sent yet, in order.
    pub(super) queued: VecDeque<Out>,
    /// Sent, waiting for a `NotifyAck` each (acknowledged in order);
    /// `None` for one already failed by its deadline.
    pub(super) unacked: VecDeque<Option<Pending>>,
    /// The peer thread ended: nothing more will be sent.
    pub(super) closed: bool,
}

/// What the copy threads and the peer thread share for sending.
pub(super) struct Outbox {
    state: Mutex<OutboxState>,
    /// eventfd that wakes the peer thread.
    pub(super) wake: OwnedFd,
    /// Set by `disconnect`.
    pub(super) stop: AtomicBool,
    pub(super) timeout: Duration,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

impl Outbox {
    /// An empty outbox whose notifications fail after `timeout`.
    ///
    /// # Errors
    /// `eventfd` failure.
    pub(super) fn new(timeout: Duration) -> Result<Self, TransportError> {
        // SAFETY: eventfd takes integer arguments and returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(TransportError::io("eventfd", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        let wake = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self { state: Mutex::default(), wake, stop: AtomicBool::new(false), timeout })
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, OutboxState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn wake(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd. A full
        // counter (EAGAIN) already means "wake up".
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    pub(super) fn drain_wake(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd.
        unsafe { libc::read(self.wake.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }

    /// Ask the peer thread to stop (disconnect); it fails what is pending.
    pub(super) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spare_segment_lists_are_kept_cleared_and_bounded() {
        let spare = SpareSegments::default();
        spare.put(Vec::with_capacity(16)); // small: not kept
        assert!(spare.take().is_none());
        let seg = Segment {
            local_addr: 1,
            remote_addr: 2,
            len_bytes: 3,
            lkey: crate::transport::LocalKey(1),
            rkey: crate::transport::RemoteKey(1),
        };
        for _ in 0..SpareSegments::KEEP + 2 {
            let mut v = Vec::with_capacity(SpareSegments::MIN_CAPACITY);
            v.push(seg);
            spare.put(v);
        }
        let mut kept = 0;
        while let Some(v) = spare.take() {
            assert!(v.is_empty() && v.capacity() >= SpareSegments::MIN_CAPACITY);
            kept += 1;
        }
        assert_eq!(kept, SpareSegments::KEEP);
    }
}
