//! The remote key check on the initiator (issue 27): a segment whose rkey
//! names none of the target's regions fails `RemoteAccess(UnknownKey)`, as
//! on shm and tcp, before anything is posted. The HCA reports an unknown
//! rkey and an out-of-range access alike (`IBV_WC_REM_ACCESS_ERR`, mapped to
//! `OutOfBounds`), so the initiator tells them apart from the regions the
//! target published (its metadata, passed to `connect`); a known key with a
//! range outside its region fails `RemoteAccess(OutOfBounds)` here too, so
//! the QP is not moved to the error state for it.

use crate::transport::{RemoteAccessKind, RemoteRegion, Segment, TransferFailure};

/// Remote addresses `[start, end)` of key `rkey`. Ordered by key, then
/// start, then end (the field order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct KeyRun {
    rkey: u32,
    start: u64,
    end: u64,
}

/// The target's regions by rkey, as given to `connect`.
#[derive(Debug, Default)]
pub(super) struct RemoteKeys {
    /// Per key, the union of its regions as maximal runs (overlapping and
    /// abutting regions merged), sorted by key, then start; the runs of one
    /// key are disjoint.
    runs: Vec<KeyRun>,
}

impl RemoteKeys {
    /// Index `regions`. Several regions share a key when they are views of
    /// one coalesced MR (docs/VERBS.md, "Registration"), and they may
    /// overlap or repeat (overlapping registrations, as NIXL accepts them):
    /// the engine has already placed each descriptor inside one region and
    /// merges descriptors of one key only when they are contiguous, so a
    /// segment lies inside one run of its key; the HCA checks the MR.
    pub(super) fn new(regions: &[RemoteRegion]) -> Self {
        let mut all: Vec<KeyRun> = regions
            .iter()
            .map(|r| KeyRun { rkey: r.rkey.0, start: r.addr, end: r.addr.saturating_add(r.len_bytes) })
            .collect();
        all.sort_unstable();
        let mut runs: Vec<KeyRun> = Vec::with_capacity(all.len());
        for r in all {
            match runs.last_mut() {
                Some(last) if last.rkey == r.rkey && r.start <= last.end => last.end = last.end.max(r.end),
                _ => runs.push(r),
            }
        }
        Self { runs }
    }

    /// Check every segment's rkey and remote range (consecutive segments of
    /// one run cost one lookup).
    pub(super) fn check(&self, segments: &[Segment]) -> Result<(), TransferFailure> {
        let mut last: Option<KeyRun> = None;
        for s in segments {
            let key = s.rkey.0;
            if last.is_some_and(|l| l.rkey == key && inside(&l, s)) {
                continue;
            }
            let lo = self.runs.partition_point(|r| r.rkey < key);
            let mine = &self.runs[lo..lo + self.runs[lo..].partition_point(|r| r.rkey == key)];
            if mine.is_empty() {
                return Err(TransferFailure::remote_access(
                    RemoteAccessKind::UnknownKey,
                    format!("rkey {key:#x} names no region of the target"),
                ));
            }
            match mine.partition_point(|r| r.start <= s.remote_addr).checked_sub(1).map(|j| mine[j]) {
                Some(r) if inside(&r, s) => last = Some(r),
                _ => return Err(out_of_bounds(s)),
            }
        }
        Ok(())
    }
}

fn inside(r: &KeyRun, s: &Segment) -> bool {
    s.remote_addr.checked_add(s.len_bytes).is_some_and(|end| s.remote_addr >= r.start && end <= r.end)
}

fn out_of_bounds(s: &Segment) -> TransferFailure {
    TransferFailure::remote_access(
        RemoteAccessKind::OutOfBounds,
        format!("{:#x}+{} outside the region of rkey {:#x}", s.remote_addr, s.len_bytes, s.rkey.0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{FailureKind, LocalKey, MemoryKind, RemoteKey};

    fn seg(rkey: u32, addr: u64, len: u64) -> Segment {
        Segment { local_addr: 0x1000, remote_addr: addr, len_bytes: len, lkey: LocalKey(1), rkey: RemoteKey(rkey) }
    }

    fn kind(r: Result<(), TransferFailure>) -> Option<FailureKind> {
        r.err().map(|f| f.kind)
    }

    #[test]
    fn unknown_keys_and_out_of_range_are_told_apart() {
        let region = |rkey, addr, len| RemoteRegion {
            addr,
            len_bytes: len,
            rkey: RemoteKey(rkey),
            kind: MemoryKind::Dram,
            device_id: 0,
        };
        let keys = RemoteKeys::new(&[region(7, 0x10_000, 0x4000), region(3, 0x90_000, 0x1000)]);
        assert_eq!(kind(keys.check(&[seg(7, 0x10_000, 0x4000), seg(3, 0x90_800, 0x800)])), None);
        assert_eq!(kind(keys.check(&[])), None);
        let unknown = Some(FailureKind::RemoteAccess(RemoteAccessKind::UnknownKey));
        let oob = Some(FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds));
        assert_eq!(kind(keys.check(&[seg(7 ^ 0x5a5a00, 0x10_000, 8)])), unknown);
        assert_eq!(kind(keys.check(&[seg(7, 0x10_000, 8), seg(5, 0x10_000, 8)])), unknown);
        assert_eq!(kind(keys.check(&[seg(7, 0x13_000, 0x2000)])), oob);
        assert_eq!(kind(keys.check(&[seg(7, 0x10_000, 8), seg(7, 0xf_000, 8)])), oob);
        assert_eq!(kind(keys.check(&[seg(3, u64::MAX - 4, 8)])), oob);
        assert_eq!(kind(RemoteKeys::new(&[]).check(&[seg(7, 0x10_000, 8)])), unknown);
    }

    /// A view of rkey 7.
    fn r(addr: u64, len: u64) -> RemoteRegion {
        RemoteRegion { addr, len_bytes: len, rkey: RemoteKey(7), kind: MemoryKind::Dram, device_id: 0 }
    }

    #[test]
    fn views_of_one_key_are_found_and_abutting_ones_cover_a_merged_segment() {
        // Three views sharing rkey 7: two abutting, then a gap.
        let k = RemoteKeys::new(&[r(0x1000, 0x1000), r(0x2000, 0x1000), r(0x4000, 0x1000)]);
        // Alternating views in one post (the cache must not refuse them).
        let segs = [seg(7, 0x2000, 0x100), seg(7, 0x1000, 0x100), seg(7, 0x4f00, 0x100)];
        assert_eq!(k.check(&segs), Ok(()));
        // One segment over the two abutting views (merged by the engine).
        assert_eq!(k.check(&[seg(7, 0x1800, 0x1000)]), Ok(()));
        // Over the gap, or past the last view: out of bounds.
        let oob = Some(FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds));
        assert_eq!(k.check(&[seg(7, 0x2800, 0x1000)]).err().map(|f| f.kind), oob);
        assert_eq!(k.check(&[seg(7, 0x4f00, 0x200)]).err().map(|f| f.kind), oob);
        assert_eq!(k.check(&[seg(7, 0x3000, 0x10)]).err().map(|f| f.kind), oob);
    }

    #[test]
    fn overlapping_and_repeated_views_of_one_key_are_found() {
        // [0x1000, 0x3000) and, inside it, [0x1400, 0x1500) twice; then
        // [0x5000, 0x6000) and [0x5800, 0x7000) overlapping it.
        let k = RemoteKeys::new(&[
            r(0x1400, 0x100),
            r(0x1000, 0x2000),
            r(0x1400, 0x100),
            r(0x5800, 0x1800),
            r(0x5000, 0x1000),
        ]);
        // Past the inner view, inside the outer one that starts before it.
        assert_eq!(k.check(&[seg(7, 0x2000, 0x800)]), Ok(()));
        assert_eq!(k.check(&[seg(7, 0x1400, 0x100), seg(7, 0x1600, 0x100)]), Ok(()));
        // Inside each of two overlapping views, and over the overlap.
        assert_eq!(k.check(&[seg(7, 0x5000, 0x800), seg(7, 0x6800, 0x800), seg(7, 0x5f00, 0x200)]), Ok(()));
        let oob = Some(FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds));
        assert_eq!(k.check(&[seg(7, 0x2f00, 0x200)]).err().map(|f| f.kind), oob);
        assert_eq!(k.check(&[seg(7, 0x4f00, 0x200)]).err().map(|f| f.kind), oob);
        assert_eq!(k.check(&[seg(7, 0x6f00, 0x200)]).err().map(|f| f.kind), oob);
    }
}
