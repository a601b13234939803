//! Descriptor validation and coalescing: the hot path of `post`.
//!
//! Every local descriptor must lie inside one local registration and every
//! remote one inside one region of the peer; pairs must have equal lengths
//! (NIXL `createXferReq` rules). Registrations may overlap, as NIXL 1.5.1
//! accepts them: a descriptor inside any one of them is valid, one that
//! spans two overlapping registrations without lying inside either is not. Runs of pairs that are adjacent on *both*
//! sides and in the same registrations are merged into one [`Segment`], so
//! a contiguous run of pages becomes one work request.

use super::error::EngineError;
use crate::transport::{LocalKey, RemoteRegion, Segment};

/// A transfer descriptor: `len_bytes` bytes at virtual address `addr`
/// (NIXL's `nixlBasicDesc` without the device id, which the registration carries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Desc {
    /// Start virtual address (bytes).
    pub addr: u64,
    /// Length (bytes).
    pub len_bytes: u64,
}

impl Desc {
    /// Shorthand constructor.
    pub const fn new(addr: u64, len_bytes: u64) -> Self {
        Self { addr, len_bytes }
    }
}

/// A local registration as the validator sees it: `[addr, end)` and its key.
#[derive(Debug, Clone, Copy)]
pub struct LocalSpan {
    /// Start address.
    pub addr: u64,
    /// One past the end.
    pub end: u64,
    /// Local key.
    pub lkey: LocalKey,
}

/// Index of an entry of `items` (sorted by start address, `bounds` giving
/// each one's `[start, end)`) that covers `[addr, end)`, trying `*hint`
/// first and leaving the index found there.
///
/// Registrations may overlap (NIXL accepts them), so the entry that starts
/// nearest below `addr` need not be the one covering the range: the search
/// walks back from it to the nearest entry that covers it. Without overlaps
/// that is the first one tried; a miss walks to the list's start (once per
/// refused post). NIXL's own lookup (`nixlSecDescList::getCoveringIndex`)
/// tries only the entry at `lower_bound` and the one before it, so it
/// misses a descriptor covered by an outer registration when a shorter one
/// starts between them; this one finds it.
fn covering<T>(items: &[T], addr: u64, end: u64, hint: &mut usize, bounds: impl Fn(&T) -> (u64, u64)) -> Option<usize> {
    if let Some(s) = items.get(*hint) {
        let (start, stop) = bounds(s);
        if addr >= start && end <= stop {
            return Some(*hint);
        }
    }
    let below = items.partition_point(|s| bounds(s).0 <= addr);
    let idx = items[..below].iter().rposition(|s| end <= bounds(s).1)?;
    *hint = idx;
    Some(idx)
}

fn find_span(spans: &[LocalSpan], addr: u64, end: u64, hint: &mut usize) -> Option<LocalKey> {
    covering(spans, addr, end, hint, |s| (s.addr, s.end)).map(|i| spans[i].lkey)
}

fn find_region(regions: &[RemoteRegion], addr: u64, end: u64, hint: &mut usize) -> Option<u32> {
    // `addr + len_bytes` does not wrap: metadata validation refuses such regions.
    covering(regions, addr, end, hint, |r| (r.addr, r.addr.saturating_add(r.len_bytes))).map(|i| regions[i].rkey.0)
}

/// Check that each descriptor is non-empty and inside one local span.
///
/// # Errors
/// [`EngineError::EmptyDescriptor`], [`EngineError::LocalOutOfBounds`].
pub fn check_local_descs(descs: &[Desc], spans: &[LocalSpan]) -> Result<(), EngineError> {
    let mut hint = 0usize;
    for (index, d) in descs.iter().enumerate() {
        if d.len_bytes == 0 {
            return Err(EngineError::EmptyDescriptor { index });
        }
        if d.addr.checked_add(d.len_bytes).and_then(|end| find_span(spans, d.addr, end, &mut hint)).is_none() {
            return Err(EngineError::LocalOutOfBounds { index, addr: d.addr, len_bytes: d.len_bytes });
        }
    }
    Ok(())
}

/// Check that each descriptor is non-empty and inside one of `agent`'s regions.
///
/// # Errors
/// [`EngineError::EmptyDescriptor`], [`EngineError::RemoteOutOfBounds`].
pub fn check_remote_descs(descs: &[Desc], regions: &[RemoteRegion], agent: &str) -> Result<(), EngineError> {
    let mut hint = 0usize;
    for (index, d) in descs.iter().enumerate() {
        if d.len_bytes == 0 {
            return Err(EngineError::EmptyDescriptor { index });
        }
        if d.addr.checked_add(d.len_bytes).and_then(|end| find_region(regions, d.addr, end, &mut hint)).is_none() {
            return Err(EngineError::RemoteOutOfBounds {
                index,
                addr: d.addr,
                len_bytes: d.len_bytes,
                agent: agent.to_string(),
            });
        }
    }
    Ok(())
}

/// Validate `local`/`remote` descriptor pairs and return coalesced segments.
///
/// `spans` are the local registrations sorted by start address; `regions`
/// the peer's, sorted by start address (as [`super::AgentMetadata`] keeps
/// them). Either may overlap.
///
/// # Errors
/// [`EngineError::DescCountMismatch`], [`EngineError::EmptyDescriptor`],
/// [`EngineError::LengthMismatch`], [`EngineError::LocalOutOfBounds`],
/// [`EngineError::RemoteOutOfBounds`] — the first broken rule, by index.
pub fn build_segments(
    local: &[Desc],
    remote: &[Desc],
    spans: &[LocalSpan],
    regions: &[RemoteRegion],
    remote_agent: &str,
    out: &mut Vec<Segment>,
) -> Result<(), EngineError> {
    if local.len() != remote.len() {
        return Err(EngineError::DescCountMismatch { local: local.len(), remote: remote.len() });
    }
    out.clear();
    out.reserve(local.len());
    let (mut lh, mut rh) = (0usize, 0usize);
    for (index, (l, r)) in local.iter().zip(remote).enumerate() {
        if l.len_bytes != r.len_bytes {
            return Err(EngineError::LengthMismatch { index, local: l.len_bytes, remote: r.len_bytes });
        }
        if l.len_bytes == 0 {
            return Err(EngineError::EmptyDescriptor { index });
        }
        let lkey = l
            .addr
            .checked_add(l.len_bytes)
            .and_then(|end| find_span(spans, l.addr, end, &mut lh))
            .ok_or(EngineError::LocalOutOfBounds { index, addr: l.addr, len_bytes: l.len_bytes })?;
        let rkey =
            r.addr.checked_add(r.len_bytes).and_then(|end| find_region(regions, r.addr, end, &mut rh)).ok_or_else(
                || EngineError::RemoteOutOfBounds {
                    index,
                    addr: r.addr,
                    len_bytes: r.len_bytes,
                    agent: remote_agent.to_string(),
                },
            )?;
        if let Some(last) = out.last_mut()
            && last.lkey == lkey
            && last.rkey.0 == rkey
            && last.local_addr + last.len_bytes == l.addr
            && last.remote_addr + last.len_bytes == r.addr
        {
            last.len_bytes += l.len_bytes;
            continue;
        }
        out.push(Segment {
            local_addr: l.addr,
            remote_addr: r.addr,
            len_bytes: l.len_bytes,
            lkey,
            rkey: crate::transport::RemoteKey(rkey),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{MemoryKind, RemoteKey};

    fn spans() -> Vec<LocalSpan> {
        vec![
            LocalSpan { addr: 0x1000, end: 0x9000, lkey: LocalKey(1) },
            LocalSpan { addr: 0x9000, end: 0xa000, lkey: LocalKey(2) },
        ]
    }
    fn regions() -> Vec<RemoteRegion> {
        vec![RemoteRegion {
            addr: 0x10_0000,
            len_bytes: 0x10_000,
            rkey: RemoteKey(7),
            kind: MemoryKind::Dram,
            device_id: 0,
        }]
    }
    fn run(local: &[Desc], remote: &[Desc]) -> Result<Vec<Segment>, EngineError> {
        let mut out = Vec::new();
        build_segments(local, remote, &spans(), &regions(), "peer", &mut out).map(|_| out)
    }

    #[test]
    fn merges_runs_adjacent_on_both_sides_only() {
        let l =
            [Desc::new(0x1000, 0x100), Desc::new(0x1100, 0x100), Desc::new(0x1200, 0x100), Desc::new(0x1300, 0x100)];
        let r = [
            Desc::new(0x10_0000, 0x100),
            Desc::new(0x10_0100, 0x100),
            Desc::new(0x10_0900, 0x100),
            Desc::new(0x10_0a00, 0x100),
        ];
        let segs = run(&l, &r).unwrap();
        assert_eq!(segs.len(), 2);
        assert_eq!((segs[0].local_addr, segs[0].remote_addr, segs[0].len_bytes), (0x1000, 0x10_0000, 0x200));
        assert_eq!((segs[1].local_addr, segs[1].remote_addr, segs[1].len_bytes), (0x1200, 0x10_0900, 0x200));
        assert_eq!(segs[0].rkey, RemoteKey(7));
    }

    #[test]
    fn never_merges_across_registrations() {
        let l = [Desc::new(0x8f00, 0x100), Desc::new(0x9000, 0x100)];
        let r = [Desc::new(0x10_0000, 0x100), Desc::new(0x10_0100, 0x100)];
        let segs = run(&l, &r).unwrap();
        assert_eq!(segs.len(), 2);
        assert_eq!(segs[0].lkey, LocalKey(1));
        assert_eq!(segs[1].lkey, LocalKey(2));
    }

    #[test]
    fn overlapping_registrations_each_cover_their_own_range() {
        // A, then B = [0x1000, 0x9000), C nested in B, D overlapping B's end.
        let spans = [
            LocalSpan { addr: 0x0, end: 0x100, lkey: LocalKey(9) },
            LocalSpan { addr: 0x1000, end: 0x9000, lkey: LocalKey(1) },
            LocalSpan { addr: 0x2000, end: 0x2100, lkey: LocalKey(3) },
            LocalSpan { addr: 0x8000, end: 0xa000, lkey: LocalKey(4) },
        ];
        let region = |addr: u64, end: u64, rkey| RemoteRegion {
            addr,
            len_bytes: end - addr,
            rkey: RemoteKey(rkey),
            kind: MemoryKind::Dram,
            device_id: 0,
        };
        let regions = [
            region(0x0, 0x100, 19),
            region(0x1000, 0x9000, 11),
            region(0x2000, 0x2100, 13),
            region(0x8000, 0xa000, 14),
        ];
        let run = |l: u64, r: u64, len: u64| {
            let mut out = Vec::new();
            build_segments(&[Desc::new(l, len)], &[Desc::new(r, len)], &spans, &regions, "peer", &mut out)
                .map(|()| (out[0].lkey.0, out[0].rkey.0))
        };
        // Past the nested one, inside the one starting before it.
        assert_eq!(run(0x3000, 0x3000, 0x100).unwrap(), (1, 11));
        assert_eq!(run(0x2000, 0x2000, 0x100).unwrap(), (3, 13));
        // Inside the overlap, and past B inside D.
        assert_eq!(run(0x8800, 0x8800, 0x100).unwrap().0, 4);
        assert_eq!(run(0x8f00, 0x8f00, 0x200).unwrap(), (4, 14));
        // Across B and D, inside neither.
        assert!(matches!(run(0x7f00, 0x1000, 0x1200), Err(EngineError::LocalOutOfBounds { .. })));
        assert!(matches!(run(0x1000, 0x7f00, 0x1200), Err(EngineError::RemoteOutOfBounds { .. })));
        // Across A's end: nothing covers it.
        assert!(matches!(run(0xf0, 0x1000, 0x20), Err(EngineError::LocalOutOfBounds { .. })));
        assert!(check_local_descs(&[Desc::new(0x3000, 8), Desc::new(0x9500, 8)], &spans).is_ok());
        assert!(check_remote_descs(&[Desc::new(0x2080, 0x100)], &regions, "peer").is_ok());
        assert!(check_remote_descs(&[Desc::new(0x8f00, 0x1200)], &regions, "peer").is_err());
    }

    #[test]
    fn each_rule_has_its_error() {
        let r1 = [Desc::new(0x10_0000, 0x100)];
        assert!(matches!(run(&[], &r1), Err(EngineError::DescCountMismatch { local: 0, remote: 1 })));
        assert!(matches!(run(&[Desc::new(0x1000, 0x80)], &r1), Err(EngineError::LengthMismatch { index: 0, .. })));
        assert!(matches!(
            run(&[Desc::new(0x1000, 0)], &[Desc::new(0x10_0000, 0)]),
            Err(EngineError::EmptyDescriptor { index: 0 })
        ));
        // straddles two local registrations
        assert!(matches!(run(&[Desc::new(0x8f80, 0x100)], &r1), Err(EngineError::LocalOutOfBounds { index: 0, .. })));
        assert!(matches!(run(&[Desc::new(0x0, 0x100)], &r1), Err(EngineError::LocalOutOfBounds { .. })));
        assert!(matches!(run(&[Desc::new(u64::MAX - 4, 0x100)], &r1), Err(EngineError::LocalOutOfBounds { .. })));
        // one byte past the remote region
        let l = [Desc::new(0x1000, 0x100)];
        assert!(matches!(
            run(&l, &[Desc::new(0x10_ff01, 0x100)]),
            Err(EngineError::RemoteOutOfBounds { index: 0, .. })
        ));
        assert!(matches!(run(&l, &[Desc::new(u64::MAX - 8, 0x100)]), Err(EngineError::RemoteOutOfBounds { .. })));
        // the last valid byte is fine
        assert!(run(&l, &[Desc::new(0x10_ff00, 0x100)]).is_ok());
    }
}
