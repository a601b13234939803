//! The verbs registration table: many registrations, few memory regions.
//!
//! An inference engine registers its KV cache as many tensors that are views
//! into a few large allocations (vLLM: a K and a V view per layer, ~1,265
//! tensors over ~4 buffers). One `ibv_reg_mr` per tensor costs a syscall,
//! page pinning and an MTT entry range each; NIXL's UCX backend hides that
//! behind UCX's registration cache. Here the table does it explicitly:
//!
//! - **Registrations stay individually addressable.** Each registration gets
//!   its own local key ([`LocalKey`], a table id, not the hardware lkey)
//!   that maps to its own range, its backing and the shared memory region
//!   (MR) holding it. `VerbsTransport::post` checks a segment's range against
//!   the registration its key names (issue 27's local check, unchanged) and
//!   only then swaps in the MR's hardware lkey ([`Regions::hw_lkey`]).
//! - **Containment reuses an MR.** A registration whose range lies inside a
//!   live MR of the same kind and device takes a reference on it (found in
//!   O(log n) through an index by start address).
//! - **A batch coalesces.** [`Regions::register_batch`] sorts the ranges it
//!   was given, merges overlapping and abutting ones into maximal
//!   contiguous runs, and registers one MR per run. An MR therefore only
//!   ever covers bytes that some registration of the same batch (or the
//!   one it was made for) covers: memory that was never registered is never
//!   exposed. VRAM ranges merge only when their dma-buf exports are the
//!   same file at the same base (views of one allocation).
//! - **No growth after the fact.** A later single registration that abuts
//!   (but is not inside) an MR gets an MR of its own: growing would need a
//!   new MR with a new rkey while the old rkey is already in peers' hands,
//!   and re-registering a growing union is O(n²) over many calls.
//! - **Reference counting.** An MR is deregistered (`ibv_dereg_mr`, by
//!   dropping it) when the last registration using it goes; it holds every
//!   backing that ever used it until then, so memory the NIC may still
//!   reach through the shared rkey is never freed before the MR.
//!
//! Security consequence (docs/SECURITY.md): a peer holding the shared rkey
//! can reach every byte of the MR, so the bytes of a deregistered view stay
//! reachable until the last registration of its MR goes — the behaviour of
//! UCX's registration cache. Option `coalesce=0` gives every registration
//! its own MR (the table then never shares one).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::super::{LocalKey, MemoryBacking, MemoryDesc, MemoryKind, Segment, TransportError};

/// How far back the containment lookup walks the start-address index (MRs
/// that start at or before a range): bounded, so a lookup is O(log n) even
/// with many nested MRs; a miss only costs an MR of its own.
const CONTAIN_PROBE: usize = 16;

/// A contiguous run to register as one MR.
pub(super) struct Run<'a> {
    /// The run's range (kind and device of its parts).
    pub(super) desc: MemoryDesc,
    /// The part starting at `desc.addr` (its dma-buf export, for VRAM,
    /// starts the run's too).
    pub(super) first: &'a Arc<dyn MemoryBacking>,
}

/// One registered MR and who uses it. Field order matters: `mr` drops
/// (deregisters) before `holds` releases the memory.
struct Shared<M> {
    /// Dropping it deregisters the MR.
    _mr: M,
    lkey: u32,
    rkey: u32,
    desc: MemoryDesc,
    /// Live registrations using it.
    refs: usize,
    /// Every backing that ever used it, kept alive until the MR goes.
    holds: Vec<Arc<dyn MemoryBacking>>,
}

struct Entry {
    desc: MemoryDesc,
    backing: Arc<dyn MemoryBacking>,
    mr: u64,
}

/// Index key of an MR: (kind, device, start address, MR id).
type IndexKey = (u8, u32, u64, u64);

fn kind_code(k: MemoryKind) -> u8 {
    match k {
        MemoryKind::Dram => 0,
        MemoryKind::Vram => 1,
    }
}

/// The table (see the module docs). `M` is the MR type (`MemoryRegion`
/// for the device; tests use a fake that records what was registered).
pub(super) struct Regions<M> {
    regs: HashMap<u32, Entry>,
    mrs: HashMap<u64, Shared<M>>,
    /// Live MRs by start; value: one past the end.
    index: BTreeMap<IndexKey, u64>,
    next_key: u32,
    next_mr: u64,
    coalesce: bool,
}

/// The result of a registration: its key and the MR's remote key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Keys {
    pub(super) lkey: LocalKey,
    pub(super) rkey: u32,
}

impl<M> Regions<M> {
    /// An empty table; `coalesce = false` gives every registration its own MR.
    pub(super) fn new(coalesce: bool) -> Self {
        Self { regs: HashMap::new(), mrs: HashMap::new(), index: BTreeMap::new(), next_key: 1, next_mr: 1, coalesce }
    }

    /// Live registrations.
    #[cfg(test)]
    pub(super) fn registrations(&self) -> usize {
        self.regs.len()
    }

    /// Live memory regions (MRs).
    pub(super) fn memory_regions(&self) -> usize {
        self.mrs.len()
    }

    /// The range and backing of registration `key`, for the local check.
    pub(super) fn lookup(&self, key: u32) -> Option<(MemoryDesc, Arc<dyn MemoryBacking>)> {
        self.regs.get(&key).map(|e| (e.desc, e.backing.clone()))
    }

    /// The hardware lkey of the MR holding registration `key`.
    pub(super) fn hw_lkey(&self, key: u32) -> Option<u32> {
        self.regs.get(&key).and_then(|e| self.mrs.get(&e.mr)).map(|s| s.lkey)
    }

    /// Check a post's local side and make it postable: each segment's range
    /// must lie inside the registration its key names (not merely inside
    /// the MR: [`super::super::check_local`], as an HCA checks an SGE),
    /// then its key becomes the MR's hardware lkey.
    ///
    /// # Errors
    /// [`TransportError::UnknownLocalKey`], [`TransportError::LocalOutOfBounds`];
    /// the segments are unchanged then.
    pub(super) fn resolve(&self, segments: &mut [Segment]) -> Result<(), TransportError> {
        super::super::check_local(segments, |k| self.lookup(k))?;
        // Key 0 is never a registration's: the first segment looks up.
        let mut last = (0u32, 0u32);
        for s in segments {
            if s.lkey.0 != last.0 {
                last = (s.lkey.0, self.hw_lkey(s.lkey.0).ok_or(TransportError::UnknownLocalKey(s.lkey))?);
            }
            s.lkey = LocalKey(last.1);
        }
        Ok(())
    }

    /// The MR (its hardware lkey, rkey and range) holding registration `key`.
    #[cfg(test)]
    pub(super) fn mr_of(&self, key: u32) -> Option<(u32, u32, MemoryDesc)> {
        self.regs.get(&key).and_then(|e| self.mrs.get(&e.mr)).map(|s| (s.lkey, s.rkey, s.desc))
    }

    /// The live MR that contains `d` (same kind and device), if the bounded
    /// probe finds one.
    fn containing(&self, d: &MemoryDesc) -> Option<u64> {
        let end = d.end()?;
        let k = kind_code(d.kind);
        self.index
            .range(..=(k, d.device_id, d.addr, u64::MAX))
            .rev()
            .take(CONTAIN_PROBE)
            .take_while(|((kk, dev, _, _), _)| *kk == k && *dev == d.device_id)
            .find(|(_, e)| **e >= end)
            .map(|((_, _, _, id), _)| *id)
    }

    fn fresh_key(&mut self) -> u32 {
        loop {
            let k = self.next_key;
            self.next_key = self.next_key.wrapping_add(1).max(1);
            if !self.regs.contains_key(&k) {
                return k;
            }
        }
    }

    fn attach(&mut self, mr: u64, backing: Arc<dyn MemoryBacking>) -> Keys {
        let desc = backing.desc();
        let s = self.mrs.get_mut(&mr).expect("live MR");
        s.refs += 1;
        s.holds.push(backing.clone());
        let rkey = s.rkey;
        let key = self.fresh_key();
        self.regs.insert(key, Entry { desc, backing, mr });
        Keys { lkey: LocalKey(key), rkey }
    }

    fn add_mr(&mut self, mr: M, lkey: u32, rkey: u32, desc: MemoryDesc) -> u64 {
        let id = self.next_mr;
        self.next_mr += 1;
        let end = desc.addr + desc.len_bytes;
        self.index.insert((kind_code(desc.kind), desc.device_id, desc.addr, id), end);
        self.mrs.insert(id, Shared { _mr: mr, lkey, rkey, desc, refs: 0, holds: Vec::new() });
        id
    }

    /// Register `parts` (in the order given; the keys come back in that
    /// order). `make` registers one run as an MR and returns it with its
    /// hardware lkey and rkey. On an error nothing of the batch stays
    /// registered.
    ///
    /// # Errors
    /// [`TransportError::Registration`] for an empty or wrapping range, and
    /// whatever `make` returns.
    pub(super) fn register_batch(
        &mut self,
        parts: Vec<Arc<dyn MemoryBacking>>,
        mut make: impl FnMut(&Run<'_>) -> Result<(M, u32, u32), TransportError>,
    ) -> Result<Vec<Keys>, TransportError> {
        for p in &parts {
            let d = p.desc();
            if d.len_bytes == 0 || d.end().is_none() || usize::try_from(d.len_bytes).is_err() {
                return Err(TransportError::Registration(format!(
                    "range {:#x}+{} is empty or too large",
                    d.addr, d.len_bytes
                )));
            }
        }
        // Which MR each part goes to: an existing one containing it, or a
        // run registered now.
        let mut target: Vec<Option<u64>> = vec![None; parts.len()];
        let mut rest: Vec<usize> = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            match self.coalesce.then(|| self.containing(&p.desc())).flatten() {
                Some(id) => target[i] = Some(id),
                None => rest.push(i),
            }
        }
        let descs: Vec<MemoryDesc> = parts.iter().map(|p| p.desc()).collect();
        rest.sort_by_key(|&i| (kind_code(descs[i].kind), descs[i].device_id, descs[i].addr));
        let mut made: Vec<u64> = Vec::new();
        let mut start = 0;
        while start < rest.len() {
            let first = rest[start];
            let base = dmabuf_base(&parts[first]);
            let mut end = descs[first].addr + descs[first].len_bytes;
            let mut stop = start + 1;
            while self.coalesce && stop < rest.len() {
                let (a, b) = (&descs[first], &descs[rest[stop]]);
                let same = a.kind == b.kind && a.device_id == b.device_id && b.addr <= end;
                let mergeable = match a.kind {
                    MemoryKind::Dram => true,
                    MemoryKind::Vram => base.is_some() && dmabuf_base(&parts[rest[stop]]) == base,
                };
                if !(same && mergeable) {
                    break;
                }
                end = end.max(b.addr + b.len_bytes);
                stop += 1;
            }
            let desc = MemoryDesc { len_bytes: end - descs[first].addr, ..descs[first] };
            match make(&Run { desc, first: &parts[first] }) {
                Ok((mr, lkey, rkey)) => {
                    let id = self.add_mr(mr, lkey, rkey, desc);
                    made.push(id);
                    rest[start..stop].iter().for_each(|&i| target[i] = Some(id));
                }
                Err(e) => {
                    for id in made {
                        self.drop_mr(id);
                    }
                    return Err(e);
                }
            }
            start = stop;
        }
        Ok(parts.into_iter().zip(target).map(|(p, t)| self.attach(t.expect("every part placed"), p)).collect())
    }

    fn drop_mr(&mut self, id: u64) {
        if let Some(s) = self.mrs.remove(&id) {
            self.index.remove(&(kind_code(s.desc.kind), s.desc.device_id, s.desc.addr, id));
            drop(s);
        }
    }

    /// Forget registration `key`; its MR goes with its last registration.
    ///
    /// # Errors
    /// [`TransportError::UnknownLocalKey`].
    pub(super) fn deregister(&mut self, key: LocalKey) -> Result<(), TransportError> {
        let e = self.regs.remove(&key.0).ok_or(TransportError::UnknownLocalKey(key))?;
        let s = self.mrs.get_mut(&e.mr).expect("live MR");
        s.refs -= 1;
        if s.refs == 0 {
            self.drop_mr(e.mr);
        }
        Ok(())
    }
}

/// For a VRAM part with a dma-buf export: (fd, address of the file's byte
/// 0), equal for views of one export.
fn dmabuf_base(b: &Arc<dyn MemoryBacking>) -> Option<(i32, u64)> {
    let d = b.desc();
    b.dmabuf_fd().map(|(fd, off)| (fd.as_raw_fd(), d.addr.wrapping_sub(off)))
}

/// The table alone, for `benches/registration.rs`: its MRs are tokens that
/// cost nothing to make, so the figures are the table's own work (the cost
/// of `ibv_reg_mr` itself is measured on a device).
#[cfg(any(test, feature = "sim"))]
#[doc(hidden)]
pub mod bench {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::{Keys, Regions};
    use crate::transport::{MemoryBacking, TransportError};

    /// A registration table over token MRs.
    pub struct TableBench {
        t: Regions<u32>,
        keys: Vec<Keys>,
        next: u32,
    }

    impl TableBench {
        /// Coalescing or not (option `coalesce`).
        pub fn new(coalesce: bool) -> Self {
            Self { t: Regions::new(coalesce), keys: Vec::new(), next: 1 }
        }

        /// Register `parts` as one list: how long it took.
        ///
        /// # Errors
        /// The table's registration error.
        pub fn register_batch(&mut self, parts: Vec<Arc<dyn MemoryBacking>>) -> Result<Duration, TransportError> {
            let next = &mut self.next;
            let t0 = Instant::now();
            let keys = self.t.register_batch(parts, |_| {
                *next += 1;
                Ok((*next, *next, *next))
            })?;
            let took = t0.elapsed();
            self.keys.extend(keys);
            Ok(took)
        }

        /// Deregister the newest `n` registrations.
        pub fn deregister_last(&mut self, n: usize) {
            for _ in 0..n {
                if let Some(k) = self.keys.pop() {
                    self.t.deregister(k.lkey).expect("registered");
                }
            }
        }

        /// (registrations, memory regions) now.
        pub fn counts(&self) -> (usize, usize) {
            (self.keys.len(), self.t.memory_regions())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::View;

    /// A fake MR: its range, and a log of live MRs shared with the test.
    struct FakeMr {
        live: Arc<std::sync::Mutex<Vec<(u64, u64)>>>,
        range: (u64, u64),
    }
    impl Drop for FakeMr {
        fn drop(&mut self) {
            let mut l = self.live.lock().unwrap();
            let i = l.iter().position(|r| *r == self.range).unwrap();
            l.remove(i);
        }
    }

    struct Fake {
        live: Arc<std::sync::Mutex<Vec<(u64, u64)>>>,
        made: usize,
        next: u32,
    }
    impl Fake {
        fn new() -> Self {
            Self { live: Arc::default(), made: 0, next: 100 }
        }
        fn make(&mut self) -> impl FnMut(&Run<'_>) -> Result<(FakeMr, u32, u32), TransportError> + '_ {
            |r| {
                self.made += 1;
                self.next += 1;
                let range = (r.desc.addr, r.desc.addr + r.desc.len_bytes);
                self.live.lock().unwrap().push(range);
                Ok((FakeMr { live: self.live.clone(), range }, self.next, self.next + 1000))
            }
        }
    }

    fn views(buf: &Arc<dyn MemoryBacking>, n: u64, each: u64) -> Vec<Arc<dyn MemoryBacking>> {
        (0..n).map(|i| Arc::new(View::new(buf.clone(), i * each, each).unwrap()) as Arc<dyn MemoryBacking>).collect()
    }

    fn host(len: usize) -> Arc<dyn MemoryBacking> {
        Arc::new(crate::HostBuffer::new(len).unwrap())
    }

    #[test]
    fn views_of_few_allocations_share_one_region_each() {
        let bufs: Vec<_> = (0..4).map(|_| host(64 << 10)).collect();
        let mut parts = Vec::new();
        for b in &bufs {
            parts.extend(views(b, 16, 4096));
        }
        // Interleave allocations as an engine listing layers would.
        parts.reverse();
        let mut f = Fake::new();
        let mut t = Regions::new(true);
        let keys = t.register_batch(parts.clone(), f.make()).unwrap();
        assert_eq!(keys.len(), 64);
        // At most one MR per allocation (fewer where the allocator placed
        // two buffers back to back: abutting ranges merge too).
        assert!((1..=4).contains(&t.memory_regions()), "{} MRs", t.memory_regions());
        assert_eq!(f.made, t.memory_regions());
        // The MRs cover exactly the registered bytes.
        let covered: u64 = f.live.lock().unwrap().iter().map(|(a, b)| b - a).sum();
        assert_eq!(covered, 4 * (64 << 10));
        // Each key names its own range, inside its MR.
        for (k, p) in keys.iter().zip(&parts) {
            assert_eq!(t.lookup(k.lkey.0).unwrap().0, p.desc());
            let (_, rkey, mr) = t.mr_of(k.lkey.0).unwrap();
            assert_eq!(rkey, k.rkey);
            assert!(mr.contains(p.desc().addr, p.desc().len_bytes));
            assert!(mr.len_bytes >= 64 << 10 && mr.len_bytes % (64 << 10) == 0);
        }
        let distinct: std::collections::HashSet<_> = keys.iter().map(|k| k.lkey).collect();
        assert_eq!(distinct.len(), 64, "registrations stay individually addressable");
    }

    #[test]
    fn deregister_in_any_order_keeps_the_region_until_the_last() {
        let b = host(64 << 10);
        let parts = views(&b, 16, 4096);
        let mut f = Fake::new();
        let live = f.live.clone();
        let mut t = Regions::new(true);
        let keys = t.register_batch(parts, f.make()).unwrap();
        // An order that is neither forward nor backward.
        let mut order: Vec<usize> = (0..16).map(|i| (i * 7) % 16).collect();
        let last = order.pop().unwrap();
        for i in order {
            t.deregister(keys[i].lkey).unwrap();
            assert_eq!(live.lock().unwrap().len(), 1, "MR stays while a registration uses it");
            assert!(t.lookup(keys[i].lkey.0).is_none());
            assert!(matches!(t.deregister(keys[i].lkey), Err(TransportError::UnknownLocalKey(_))));
        }
        assert_eq!(t.hw_lkey(keys[last].lkey.0), Some(101));
        t.deregister(keys[last].lkey).unwrap();
        assert!(live.lock().unwrap().is_empty(), "last registration deregisters the MR");
        assert_eq!(t.memory_regions(), 0);
    }

    #[test]
    fn contained_single_registration_reuses_and_abutting_one_does_not_grow() {
        let b = host(64 << 10);
        let mut f = Fake::new();
        let mut t = Regions::new(true);
        let whole = t.register_batch(vec![b.clone()], f.make()).unwrap()[0];
        let inner = t.register_batch(views(&b, 2, 4096), f.make()).unwrap();
        assert_eq!(f.made, 1, "contained ranges reuse the MR");
        assert!(inner.iter().all(|k| k.rkey == whole.rkey));
        // A neighbour allocation registered later: its own MR (no growth).
        let big = host(128 << 10);
        let lo: Arc<dyn MemoryBacking> = Arc::new(View::new(big.clone(), 0, 4096).unwrap());
        let hi: Arc<dyn MemoryBacking> = Arc::new(View::new(big.clone(), 4096, 4096).unwrap());
        let k_lo = t.register_batch(vec![lo], f.make()).unwrap()[0];
        let k_hi = t.register_batch(vec![hi], f.make()).unwrap()[0];
        assert_eq!(f.made, 3);
        assert_ne!(k_lo.rkey, k_hi.rkey);
        assert_eq!(t.mr_of(k_hi.lkey.0).unwrap().2.len_bytes, 4096, "no memory beyond the registration");
    }

    #[test]
    fn overlapping_ranges_merge_and_never_cover_unregistered_bytes() {
        let b = host(64 << 10);
        let mut f = Fake::new();
        let live = f.live.clone();
        let mut t = Regions::new(true);
        let parts: Vec<Arc<dyn MemoryBacking>> = vec![
            Arc::new(View::new(b.clone(), 0, 8192).unwrap()),
            Arc::new(View::new(b.clone(), 4096, 8192).unwrap()),
            // A gap of 4 KiB, then another run.
            Arc::new(View::new(b.clone(), 16384, 4096).unwrap()),
        ];
        let keys = t.register_batch(parts, f.make()).unwrap();
        assert_eq!(t.memory_regions(), 2);
        let base = b.desc().addr;
        let mut l = live.lock().unwrap().clone();
        l.sort();
        assert_eq!(l, vec![(base, base + 12288), (base + 16384, base + 20480)]);
        assert_eq!(keys[0].rkey, keys[1].rkey);
        assert_ne!(keys[0].rkey, keys[2].rkey);
    }

    #[test]
    fn coalesce_off_gives_each_registration_its_own_region() {
        let b = host(64 << 10);
        let mut f = Fake::new();
        let mut t = Regions::new(false);
        t.register_batch(vec![b.clone()], f.make()).unwrap();
        t.register_batch(views(&b, 16, 4096), f.make()).unwrap();
        assert_eq!(t.memory_regions(), 17);
        assert_eq!(f.made, 17);
    }

    #[test]
    fn failed_batch_leaves_nothing_registered() {
        // Two runs (a gap between them), the second failing.
        let buf = host(4 * 4096);
        let a: Arc<dyn MemoryBacking> = Arc::new(View::new(buf.clone(), 0, 4096).unwrap());
        let b: Arc<dyn MemoryBacking> = Arc::new(View::new(buf.clone(), 8192, 4096).unwrap());
        let mut t: Regions<FakeMr> = Regions::new(true);
        let live: Arc<std::sync::Mutex<Vec<(u64, u64)>>> = Arc::default();
        let mut n = 0;
        let r = t.register_batch(vec![a, b], |r| {
            n += 1;
            if n == 2 {
                return Err(TransportError::Registration("no".into()));
            }
            let range = (r.desc.addr, r.desc.addr + r.desc.len_bytes);
            live.lock().unwrap().push(range);
            Ok((FakeMr { live: live.clone(), range }, 1, 2))
        });
        assert!(matches!(r, Err(TransportError::Registration(_))));
        assert_eq!((t.registrations(), t.memory_regions()), (0, 0));
        assert!(live.lock().unwrap().is_empty());
        let empty: Arc<dyn MemoryBacking> = Arc::new(View::new(host(4096), 0, 0).unwrap());
        assert!(matches!(t.register_batch(vec![empty], |_| unreachable!()), Err(TransportError::Registration(_))));
    }

    #[test]
    fn register_deregister_cycles_leave_nothing_behind() {
        let b = host(64 << 10);
        let mut f = Fake::new();
        let mut t = Regions::new(true);
        for _ in 0..1000 {
            let k = t.register_batch(views(&b, 4, 4096), f.make()).unwrap();
            for k in k {
                t.deregister(k.lkey).unwrap();
            }
        }
        assert_eq!((t.registrations(), t.memory_regions(), t.index.len()), (0, 0, 0));
    }
}
