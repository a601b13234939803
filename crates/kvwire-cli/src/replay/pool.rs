//! A page free list, as a paged KV cache manager keeps one per pool.

/// Free pages of one pool (page 0, the null block, is never handed out).
#[derive(Debug)]
pub(crate) struct PagePool {
    free: Vec<u64>,
    total: u64,
    high_water: u64,
}

impl PagePool {
    /// A pool of `num_pages` pages including the null block.
    pub(crate) fn new(num_pages: u64) -> Self {
        // Hand pages out in a shuffled order so that requests get
        // non-contiguous pages, as a long-running cache does.
        let mut free: Vec<u64> = (1..num_pages).collect();
        let mut s = 0x5eed_u64;
        for i in (1..free.len()).rev() {
            s = crate::pattern::mix(s);
            free.swap(i, (s % (i as u64 + 1)) as usize);
        }
        Self { free, total: num_pages.saturating_sub(1), high_water: 0 }
    }

    /// Take `n` pages, or `None` (taking nothing) when fewer are free.
    pub(crate) fn alloc(&mut self, n: u64) -> Option<Vec<u64>> {
        if n as usize > self.free.len() {
            return None;
        }
        let pages = self.free.split_off(self.free.len() - n as usize);
        self.high_water = self.high_water.max(self.in_use());
        Some(pages)
    }

    /// Return pages.
    pub(crate) fn free(&mut self, pages: Vec<u64>) {
        self.free.extend(pages);
    }

    /// Usable pages (without the null block).
    pub(crate) fn capacity(&self) -> u64 {
        self.total
    }

    /// Pages handed out now.
    pub(crate) fn in_use(&self) -> u64 {
        self.total - self.free.len() as u64
    }

    /// Most pages ever handed out at once.
    pub(crate) fn high_water(&self) -> u64 {
        self.high_water
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_without_the_null_block_and_tracks_high_water() {
        let mut p = PagePool::new(11);
        assert_eq!(p.capacity(), 10);
        let a = p.alloc(6).unwrap();
        assert!(!a.contains(&0));
        assert!(p.alloc(5).is_none());
        assert_eq!(p.in_use(), 6);
        let b = p.alloc(4).unwrap();
        p.free(a);
        assert_eq!(p.in_use(), 4);
        assert_eq!(p.high_water(), 10);
        let mut all = p.alloc(6).unwrap();
        all.extend(b);
        all.sort();
        assert_eq!(all, (1..11).collect::<Vec<u64>>());
    }
}
