//! The host tier's table: entries keyed by `(leaf, hash)`, sized in bytes,
//! evicted least recently used first. Pure bookkeeping; the worker copies.
//!
//! Entry life: `admit` reserves room for a *pending* entry (an offload in
//! flight: invisible to lookups, not evictable), `install` makes it *ready*,
//! `abort` drops it. A ready entry with `readers > 0` (a pending load reads
//! it) is never evicted.
//!
//! Recency: one call refreshes its sequence so that position 0 (the root) ends
//! most recent, so eviction takes a sequence's tail first and keeps prefixes
//! reachable; see [`Tier::ticks`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::connector::BlockHash;

/// `(leaf index in leaf-name order, hash)`.
pub(crate) type Key = (u32, BlockHash);

#[derive(Debug)]
enum Slot {
    Pending,
    Ready(Arc<[u8]>),
}

#[derive(Debug)]
struct Entry {
    len_bytes: u64,
    tick: u64,
    readers: u32,
    slot: Slot,
    /// Dropped by `reset` while in use: removed once no longer in use.
    doomed: bool,
}

impl Entry {
    fn evictable(&self) -> bool {
        matches!(self.slot, Slot::Ready(_)) && self.readers == 0
    }
}

/// Outcome of [`Tier::admit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Held already (ready or pending); recency refreshed, nothing to copy.
    AlreadyHeld,
    /// Room reserved; the caller copies and then installs or aborts.
    Admitted,
    /// No room even after evicting every evictable entry; dropped.
    NoRoom,
}

/// The table. Invariants: `used_bytes` = sum over entries; `evictable_bytes` =
/// sum over ready, unread, non-doomed entries; `lru` maps each entry's tick
/// to its key.
#[derive(Debug)]
pub(crate) struct Tier {
    capacity_bytes: u64,
    used_bytes: u64,
    evictable_bytes: u64,
    entries: HashMap<Key, Entry>,
    lru: BTreeMap<u64, Key>,
    tick: u64,
}

impl Tier {
    pub(crate) fn new(capacity_bytes: u64) -> Self {
        Self {
            capacity_bytes,
            used_bytes: 0,
            evictable_bytes: 0,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
        }
    }

    pub(crate) fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    pub(crate) fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// Ticks for a call over `n` rows in prefix order: row `i` gets
    /// `base + n-1-i`, so row 0 is the most recent of the call.
    pub(crate) fn ticks(&mut self, n: usize) -> impl Fn(usize) -> u64 + use<> {
        let base = self.tick;
        self.tick += n as u64;
        move |i| base + (n - 1 - i) as u64
    }

    /// True when `key` can be read (ready, not doomed).
    pub(crate) fn is_ready(&self, key: &Key) -> bool {
        self.entries.get(key).is_some_and(|e| matches!(e.slot, Slot::Ready(_)) && !e.doomed)
    }

    /// Refresh `key`'s recency to `tick` when held. Recency only grows:
    /// ticks rise across calls, and within one call a hash named twice keeps
    /// its first (most recent) position, in `touch`, `load` and `offload` alike.
    pub(crate) fn touch(&mut self, key: &Key, tick: u64) {
        if let Some(e) = self.entries.get_mut(key)
            && tick > e.tick
        {
            self.lru.remove(&e.tick);
            e.tick = tick;
            self.lru.insert(tick, *key);
        }
    }

    /// Admit one block's rows, `(key, len_bytes, tick)` per leaf, whole or
    /// not at all: keys held already (ready or pending) are refreshed to their
    /// tick; the others get room by evicting least recently used evictable
    /// entries and become pending, unless even evicting every evictable entry
    /// would not make room for all of them, in which case nothing is evicted
    /// and they are all dropped. Returns one [`Admit`] per row, in order.
    pub(crate) fn admit_group(&mut self, rows: &[(Key, u64, u64)]) -> Vec<Admit> {
        let mut out = Vec::with_capacity(rows.len());
        let mut needed = 0u64;
        for &(key, len_bytes, tick) in rows {
            match self.entries.get(&key) {
                Some(e) if !e.doomed => {
                    self.touch(&key, tick);
                    out.push(Admit::AlreadyHeld);
                }
                Some(_) => out.push(Admit::NoRoom),
                None => {
                    needed += len_bytes;
                    out.push(Admit::Admitted);
                }
            }
        }
        let free = self.capacity_bytes - self.used_bytes;
        if needed > free + self.evictable_bytes {
            out.iter_mut().filter(|a| **a == Admit::Admitted).for_each(|a| *a = Admit::NoRoom);
            return out;
        }
        for (&(key, len_bytes, tick), a) in rows.iter().zip(&out) {
            if *a != Admit::Admitted {
                continue;
            }
            while self.capacity_bytes - self.used_bytes < len_bytes {
                let victim = self.lru.values().copied().find(|k| self.entries[k].evictable());
                self.remove(&victim.expect("evictable bytes account for a victim"));
            }
            self.used_bytes += len_bytes;
            self.entries.insert(key, Entry { len_bytes, tick, readers: 0, slot: Slot::Pending, doomed: false });
            self.lru.insert(tick, key);
        }
        out
    }

    /// Make a pending entry ready with its bytes (removed instead if doomed).
    pub(crate) fn install(&mut self, key: &Key, data: Arc<[u8]>) {
        let Some(e) = self.entries.get_mut(key) else {
            return;
        };
        e.slot = Slot::Ready(data);
        if e.doomed {
            self.remove(key);
        } else {
            self.evictable_bytes += e.len_bytes;
        }
    }

    /// Drop a pending entry whose copy failed.
    pub(crate) fn abort(&mut self, key: &Key) {
        if self.entries.get(key).is_some_and(|e| matches!(e.slot, Slot::Pending)) {
            self.remove(key);
        }
    }

    /// Pin a ready entry for a load and return its bytes, or `None` when it
    /// is not ready.
    pub(crate) fn pin(&mut self, key: &Key) -> Option<Arc<[u8]>> {
        let e = self.entries.get_mut(key).filter(|e| !e.doomed)?;
        let Slot::Ready(data) = &e.slot else {
            return None;
        };
        if e.readers == 0 {
            self.evictable_bytes -= e.len_bytes;
        }
        e.readers += 1;
        Some(data.clone())
    }

    /// Release one pin taken by [`pin`](Self::pin).
    pub(crate) fn unpin(&mut self, key: &Key) {
        let Some(e) = self.entries.get_mut(key) else {
            return;
        };
        e.readers = e.readers.saturating_sub(1);
        if e.readers == 0 {
            if e.doomed {
                self.remove(key);
            } else {
                self.evictable_bytes += e.len_bytes;
            }
        }
    }

    /// Drop every entry: evictable ones now, the others (pending, or read by
    /// a pending load) once they are no longer in use.
    pub(crate) fn reset(&mut self) {
        let keys: Vec<Key> = self.entries.keys().copied().collect();
        for k in keys {
            if self.entries[&k].evictable() {
                self.remove(&k);
            } else if let Some(e) = self.entries.get_mut(&k) {
                e.doomed = true;
            }
        }
    }

    fn remove(&mut self, key: &Key) {
        if let Some(e) = self.entries.remove(key) {
            self.lru.remove(&e.tick);
            self.used_bytes -= e.len_bytes;
            if e.evictable() && !e.doomed {
                self.evictable_bytes -= e.len_bytes;
            }
        }
    }
}
