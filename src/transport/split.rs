//! The one segment splitter of the transport layer: cutting segments into
//! pieces no longer than a backend's limit (a shm worker's share, a tcp
//! request, a verbs WR) and grouping consecutive pieces into the units a
//! backend hands out (shm chunks, tcp requests). No backend has an
//! alignment rule: pieces start where the previous one ended.

use std::ops::Range;

use super::Segment;

/// The pieces of `s`, in order, each at most `max` bytes (`max` > 0) and
/// together covering every byte of `s` once; a zero-length segment has none.
pub(crate) fn split(s: Segment, max: u64) -> impl Iterator<Item = Segment> {
    debug_assert!(max > 0, "a zero split size");
    let mut off = 0;
    std::iter::from_fn(move || {
        if off >= s.len_bytes {
            return None;
        }
        let n = (s.len_bytes - off).min(max);
        let piece = Segment { local_addr: s.local_addr + off, remote_addr: s.remote_addr + off, len_bytes: n, ..s };
        off += n;
        Some(piece)
    })
}

/// Every segment [`split`] to at most `max` bytes.
pub(crate) fn split_all(segments: Vec<Segment>, max: u64) -> Vec<Segment> {
    let mut out = Vec::with_capacity(segments.len() + 16);
    for s in segments {
        out.extend(split(s, max));
    }
    out
}

/// How [`group`] closes a group of consecutive segments.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Fill {
    /// Once it holds at least this many bytes (shm: chunks of *about* a
    /// size, for workers to share); an empty list is one empty group.
    AtLeast(u64),
    /// Before it would exceed `bytes` or `segments` (tcp: one request's
    /// limits); a segment longer than `bytes` is a group of its own. An
    /// empty list has no group.
    AtMost { bytes: u64, segments: usize },
}

/// Consecutive index ranges of `segments`, in order, covering each once.
pub(crate) fn group(segments: &[Segment], fill: Fill) -> Vec<Range<usize>> {
    let mut ranges = Vec::new();
    let (mut start, mut acc) = (0usize, 0u64);
    match fill {
        Fill::AtLeast(bytes) => {
            for (i, s) in segments.iter().enumerate() {
                acc += s.len_bytes;
                if acc >= bytes {
                    ranges.push(start..i + 1);
                    start = i + 1;
                    acc = 0;
                }
            }
            if start < segments.len() || ranges.is_empty() {
                ranges.push(start..segments.len());
            }
        }
        Fill::AtMost { bytes, segments: max_segments } => {
            for (i, s) in segments.iter().enumerate() {
                if i > start && (acc + s.len_bytes > bytes || i - start == max_segments) {
                    ranges.push(start..i);
                    start = i;
                    acc = 0;
                }
                acc += s.len_bytes;
            }
            if start < segments.len() {
                ranges.push(start..segments.len());
            }
        }
    }
    ranges
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::transport::{LocalKey, RemoteKey};

    fn seg(local: u64, remote: u64, len: u64) -> Segment {
        Segment { local_addr: local, remote_addr: remote, len_bytes: len, lkey: LocalKey(7), rkey: RemoteKey(9) }
    }

    /// Segments at distinct, non-overlapping addresses (so a byte's address
    /// names it), some empty.
    fn segments() -> impl Strategy<Value = Vec<Segment>> {
        proptest::collection::vec((0u64..5000, 0u64..64), 0..40).prop_map(|v| {
            let mut at = 1 << 20;
            v.into_iter()
                .map(|(len, gap)| {
                    let s = seg(at, (at << 4) + 3, len);
                    at += len + gap;
                    s
                })
                .collect()
        })
    }

    /// Every (local, remote) byte address pair of `segs`, in order.
    fn bytes(segs: &[Segment]) -> Vec<(u64, u64)> {
        segs.iter().flat_map(|s| (0..s.len_bytes).map(move |o| (s.local_addr + o, s.remote_addr + o))).collect()
    }

    proptest! {
        #[test]
        fn split_covers_every_byte_once_within_the_limit(segs in segments(), max in 1u64..3000) {
            let out = split_all(segs.clone(), max);
            prop_assert_eq!(bytes(&out), bytes(&segs));
            for p in &out {
                prop_assert!(p.len_bytes >= 1 && p.len_bytes <= max, "{p:?}");
                prop_assert_eq!((p.lkey, p.rkey), (LocalKey(7), RemoteKey(9)));
            }
            // Only the last piece of a segment is shorter than `max`.
            let pieces: usize = segs.iter().map(|s| s.len_bytes.div_ceil(max) as usize).sum();
            prop_assert_eq!(out.len(), pieces);
        }

        #[test]
        fn at_most_groups_partition_within_both_limits(
            segs in segments(), max in 1u64..3000, bytes_cap in 1u64..9000, count in 1usize..8,
        ) {
            let segs = split_all(segs, max);
            let r = group(&segs, Fill::AtMost { bytes: bytes_cap, segments: count });
            prop_assert_eq!(r.iter().flat_map(|r| r.clone()).collect::<Vec<_>>(), (0..segs.len()).collect::<Vec<_>>());
            for g in &r {
                prop_assert!(!g.is_empty() && g.len() <= count);
                let total: u64 = segs[g.clone()].iter().map(|s| s.len_bytes).sum();
                prop_assert!(total <= bytes_cap || g.len() == 1, "{g:?} holds {total}");
            }
            // Greedy: the next segment would not have fit.
            for w in r.windows(2) {
                let total: u64 = segs[w[0].start..=w[1].start].iter().map(|s| s.len_bytes).sum();
                prop_assert!(total > bytes_cap || w[0].len() == count);
            }
        }

        #[test]
        fn at_least_groups_partition_and_close_at_the_size(segs in segments(), cap in 1u64..9000) {
            let r = group(&segs, Fill::AtLeast(cap));
            prop_assert!(!r.is_empty());
            prop_assert_eq!(r.iter().flat_map(|r| r.clone()).collect::<Vec<_>>(), (0..segs.len()).collect::<Vec<_>>());
            for (i, g) in r.iter().enumerate() {
                let total: u64 = segs[g.clone()].iter().map(|s| s.len_bytes).sum();
                let before_last: u64 = segs[g.start..g.end.saturating_sub(1).max(g.start)].iter().map(|s| s.len_bytes).sum();
                prop_assert!(before_last < cap, "{g:?} closed late");
                if i + 1 < r.len() {
                    prop_assert!(total >= cap, "{g:?} closed early with {total}");
                }
            }
        }
    }

    #[test]
    fn edges() {
        assert_eq!(split(seg(0, 0, 0), 4).count(), 0);
        let p: Vec<_> = split(seg(10, 100, 10), 4).map(|s| (s.local_addr, s.remote_addr, s.len_bytes)).collect();
        assert_eq!(p, [(10, 100, 4), (14, 104, 4), (18, 108, 2)]);
        let one_empty: Vec<Range<usize>> = vec![Range { start: 0, end: 0 }];
        assert_eq!(group(&[], Fill::AtLeast(8)), one_empty);
        assert!(group(&[], Fill::AtMost { bytes: 8, segments: 2 }).is_empty());
    }
}
