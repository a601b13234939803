//! The copy ceiling of `kvwire bench`: how fast plain CPU copies move the
//! bench's page pattern on this machine, measured in the same run.
//!
//! Three figures, each over the same pages in the same order as the
//! measured transfers (source page `i` ↔ destination page `dst_of[i]`),
//! between the bench's registered buffer and a second [`HostBuffer`] (a
//! memfd `MAP_SHARED` mapping, the kind of memory the `shm` transport maps
//! from its peer: same page size, same page-table and TLB cost):
//!
//! - `memcpy_1`: one thread, `memcpy` (the bench's original baseline);
//! - `memcpy_n`: `threads` threads, `memcpy`, each a contiguous share of the pages;
//! - `stream_n`: `threads` threads, the `shm` copy core's streaming-store
//!   copy ([`HostBuffer::stream_copy_to`], the `shm` copy core's routine).
//!
//! The ceiling is the better of the two N-thread figures: what `threads`
//! cores copying flat out, with no transport around them, achieve.

use std::time::{Duration, Instant};

use anyhow::Result;
use kvwire::HostBuffer;
use kvwire::transport::Op;

/// Copy rates in GB/s (10^9 bytes/s).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ceilings {
    /// One thread, `memcpy`.
    pub memcpy_1: f64,
    /// `threads` threads, `memcpy`.
    pub memcpy_n: f64,
    /// `threads` threads, streaming stores.
    pub stream_n: f64,
}

impl Ceilings {
    /// The N-thread ceiling: the faster of the two N-thread copies.
    pub(crate) fn ceiling(&self) -> f64 {
        self.memcpy_n.max(self.stream_n)
    }
}

#[derive(Clone, Copy)]
enum Routine {
    Memcpy,
    Stream,
}

/// Measure the three rates, `iters` passes each, the three interleaved pass
/// by pass (so that machine noise hits all of them alike). `src` is the
/// bench's buffer of `dst_of.len()` pages of `block_size` bytes; for READ
/// the copy runs the other way (destination page `i` ← source page `dst_of[i]`).
///
/// # Errors
/// Allocating the second buffer failed.
pub(crate) fn measure(
    src: &HostBuffer,
    block_size: u64,
    dst_of: &[u32],
    op: Op,
    iters: usize,
    threads: usize,
) -> Result<Ceilings> {
    let mut dst = HostBuffer::new(src.len())?;
    let threads = threads.max(1);
    let mut spent = [Duration::ZERO; 3];
    // One unmeasured pass: the destination's pages are populated already,
    // this brings both mappings' TLB and page-table state to what the
    // measured transfers see after their warm-up.
    pass(src, &mut dst, block_size, dst_of, op, threads, Routine::Memcpy);
    for _ in 0..iters.max(1) {
        spent[0] += pass(src, &mut dst, block_size, dst_of, op, 1, Routine::Memcpy);
        spent[1] += pass(src, &mut dst, block_size, dst_of, op, threads, Routine::Memcpy);
        spent[2] += pass(src, &mut dst, block_size, dst_of, op, threads, Routine::Stream);
    }
    let bytes = src.len() as f64 * iters.max(1) as f64;
    let rate = |d: Duration| bytes / d.as_nanos().max(1) as f64;
    Ok(Ceilings { memcpy_1: rate(spent[0]), memcpy_n: rate(spent[1]), stream_n: rate(spent[2]) })
}

/// One pass over every page with `threads` threads (thread `t` copies the
/// `t`-th contiguous share of the pages); wall time from before the first
/// thread starts until the last one is done (building the page list is not
/// timed).
fn pass(
    src: &HostBuffer,
    dst: &mut HostBuffer,
    block_size: u64,
    dst_of: &[u32],
    op: Op,
    threads: usize,
    routine: Routine,
) -> Duration {
    let bs = block_size as usize;
    let n = dst_of.len();
    let mut pages: Vec<Option<&mut [u8]>> = dst.as_mut_slice().chunks_mut(bs).map(Some).collect();
    let mut work: Vec<(usize, &mut [u8])> = dst_of
        .iter()
        .enumerate()
        .map(|(i, &d)| {
            let (from, to) = match op {
                Op::Write => (i * bs, d as usize),
                Op::Read => (d as usize * bs, i),
            };
            (from, pages[to].take().expect("the destinations are a permutation"))
        })
        .collect();
    let copy_share = |share: &mut [(usize, &mut [u8])]| {
        for (from, out) in share.iter_mut() {
            match routine {
                Routine::Memcpy => src.copy_to(*from, out),
                Routine::Stream => src.stream_copy_to(*from, out),
            }
        }
    };
    let t0 = Instant::now();
    if threads == 1 {
        copy_share(&mut work);
    } else {
        std::thread::scope(|sc| {
            let mut shares = work.chunks_mut(n.div_ceil(threads).max(1));
            let mine = shares.next();
            for share in shares {
                let copy_share = &copy_share;
                sc.spawn(move || copy_share(share));
            }
            if let Some(share) = mine {
                copy_share(share);
            }
        });
    }
    t0.elapsed()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every routine and thread count lands each source page where the
    /// pattern says (the ceiling copies what the bench moves).
    #[test]
    fn passes_move_the_bench_pattern() {
        let (bs, n) = (4096u64, 7usize);
        let src = HostBuffer::new(bs as usize * n).unwrap();
        for i in 0..n {
            src.fill_with(i * bs as usize, bs as usize, |k| (i * 31 + k) as u8);
        }
        let dst_of: Vec<u32> = vec![3, 0, 6, 1, 5, 2, 4];
        let mut dst = HostBuffer::new(src.len()).unwrap();
        for (threads, routine) in [(1, Routine::Memcpy), (3, Routine::Memcpy), (2, Routine::Stream)] {
            dst.fill_with(0, dst.len(), |_| 0);
            pass(&src, &mut dst, bs, &dst_of, Op::Write, threads, routine);
            for (i, &d) in dst_of.iter().enumerate() {
                let at = d as usize * bs as usize;
                assert_eq!(dst.to_vec(at..at + bs as usize), src.to_vec(i * bs as usize..(i + 1) * bs as usize));
            }
        }
        let c = measure(&src, bs, &dst_of, Op::Read, 1, 2).unwrap();
        assert!(c.memcpy_1 > 0.0 && c.memcpy_n > 0.0 && c.stream_n > 0.0);
        assert_eq!(c.ceiling(), c.memcpy_n.max(c.stream_n));
    }
}
