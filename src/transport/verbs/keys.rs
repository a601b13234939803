//! The remote key check on the initiator (issue 27): a segment whose rkey
//! names none of the target's regions fails `RemoteAccess(UnknownKey)`, as
//! on shm and tcp, before anything is posted. The HCA reports an unknown
//! rkey and an out-of-range access alike (`IBV_WC_REM_ACCESS_ERR`, mapped to
//! `OutOfBounds`), so the initiator tells them apart from the regions the
//! target published (its metadata, passed to `connect`); a known key with a
//! range outside its region fails `RemoteAccess(OutOfBounds)` here too, so
//! the QP is not moved to the error state for it.

use crate::transport::{RemoteAccessKind, RemoteRegion, Segment, TransferFailure};

/// The target's regions by rkey, as given to `connect`.
#[derive(Debug, Default)]
pub(super) struct RemoteKeys {
    /// `(rkey, addr, len_bytes)`, sorted by rkey.
    regions: Vec<(u32, u64, u64)>,
}

impl RemoteKeys {
    pub(super) fn new(regions: &[RemoteRegion]) -> Self {
        let mut regions: Vec<(u32, u64, u64)> = regions.iter().map(|r| (r.rkey.0, r.addr, r.len_bytes)).collect();
        regions.sort_unstable();
        Self { regions }
    }

    /// Check every segment's rkey and remote range (consecutive segments of
    /// one key cost one lookup).
    pub(super) fn check(&self, segments: &[Segment]) -> Result<(), TransferFailure> {
        let mut last: Option<(u32, u64, u64)> = None;
        for s in segments {
            let key = s.rkey.0;
            if last.is_some_and(|l| l.0 == key && inside(&l, s)) {
                continue;
            }
            // The key's regions, contiguous in the sorted list and sorted by
            // address: one per key, except views of one coalesced verbs MR
            // (docs/VERBS.md, "Registration"), found by binary search.
            let lo = self.regions.partition_point(|r| r.0 < key);
            let mine = &self.regions[lo..lo + self.regions[lo..].partition_point(|r| r.0 == key)];
            if mine.is_empty() {
                return Err(TransferFailure::remote_access(
                    RemoteAccessKind::UnknownKey,
                    format!("rkey {key:#x} names no region of the target"),
                ));
            }
            let at = mine.partition_point(|r| r.1 <= s.remote_addr).checked_sub(1).map(|j| mine[j]);
            match at {
                Some(r) if inside(&r, s) => last = Some(r),
                // The engine merged descriptors of abutting regions of one
                // key (each checked on its own) into one segment.
                _ if covered(mine, s) => {}
                _ => return Err(out_of_bounds(s)),
            }
        }
        Ok(())
    }
}

/// True when `s` lies in abutting regions of one key (`regions` sorted by
/// address, not overlapping: the metadata rules).
fn covered(regions: &[(u32, u64, u64)], s: &Segment) -> bool {
    let Some(end) = s.remote_addr.checked_add(s.len_bytes) else { return false };
    let Some(mut j) = regions.partition_point(|r| r.1 <= s.remote_addr).checked_sub(1) else { return false };
    let mut reach = regions[j].1.saturating_add(regions[j].2);
    if reach <= s.remote_addr {
        return false;
    }
    while reach < end {
        j += 1;
        match regions.get(j) {
            Some(r) if r.1 == reach => reach = r.1.saturating_add(r.2),
            _ => return false,
        }
    }
    true
}

fn inside(r: &(u32, u64, u64), s: &Segment) -> bool {
    match (s.remote_addr.checked_add(s.len_bytes), r.1.checked_add(r.2)) {
        (Some(end), Some(rend)) => s.remote_addr >= r.1 && end <= rend,
        _ => false,
    }
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

    #[test]
    fn views_of_one_key_are_found_and_abutting_ones_cover_a_merged_segment() {
        let r = |addr: u64, len: u64| RemoteRegion {
            addr,
            len_bytes: len,
            rkey: RemoteKey(7),
            kind: MemoryKind::Dram,
            device_id: 0,
        };
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
}
