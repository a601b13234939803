//! `KVCacheMemory`: one logical KV tensor (a cache's values, or its
//! quantization scales) as one byte buffer per TP shard, as MAX's
//! `max.nn.kv_cache.cache_params.KVCacheMemory`.

use std::sync::Arc;

use super::error::KvError;
use crate::HostBuffer;
use crate::transport::{MemoryBacking, MemoryKind, Union, View};

/// One TP shard's view of a KV tensor: a 2-D byte array of shape
/// `[num_pages, bytes_per_page]` (null block included in `num_pages`) that
/// starts `offset_bytes` into `backing`, rows `row_stride_bytes` apart.
///
/// A [`KVCacheMemory`] accepts only contiguous 2-D views
/// (`row_stride_bytes == bytes_per_page`); any other layout can be described
/// so that it is rejected with a precise error, as MAX does.
#[derive(Clone)]
pub struct KvBuffer {
    backing: Arc<dyn MemoryBacking>,
    offset_bytes: u64,
    shape: Vec<u64>,
    row_stride_bytes: u64,
}

impl std::fmt::Debug for KvBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("shape", &self.shape)
            .field("row_stride_bytes", &self.row_stride_bytes)
            .finish()
    }
}

impl KvBuffer {
    /// A contiguous `[num_pages, bytes_per_page]` view of `backing`, from its start.
    pub fn new(backing: Arc<dyn MemoryBacking>, num_pages: u64, bytes_per_page: u64) -> Self {
        Self { backing, offset_bytes: 0, shape: vec![num_pages, bytes_per_page], row_stride_bytes: bytes_per_page }
    }

    /// Any view of `backing`: `shape` (bytes; 2-D for a valid KV buffer),
    /// starting `offset_bytes` into it, rows `row_stride_bytes` apart.
    /// [`KVCacheMemory::new`] validates it.
    pub fn with_layout(
        backing: Arc<dyn MemoryBacking>,
        offset_bytes: u64,
        shape: Vec<u64>,
        row_stride_bytes: u64,
    ) -> Self {
        Self { backing, offset_bytes, shape, row_stride_bytes }
    }

    /// The memory this view lies in.
    pub fn backing(&self) -> &Arc<dyn MemoryBacking> {
        &self.backing
    }

    /// Shape in bytes: `[num_pages, bytes_per_page]` for a valid buffer.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Bytes between the starts of consecutive pages.
    pub fn row_stride_bytes(&self) -> u64 {
        self.row_stride_bytes
    }

    /// Offset of page 0 inside the backing (bytes).
    pub fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }

    /// `shape[0]`: pages, null block included (0 when not 2-D).
    pub fn num_pages(&self) -> u64 {
        self.shape.first().copied().unwrap_or(0)
    }

    /// `shape[1]`: bytes per page (0 when not 2-D).
    pub fn bytes_per_page(&self) -> u64 {
        self.shape.get(1).copied().unwrap_or(0)
    }

    /// Virtual address of page 0.
    pub fn addr(&self) -> u64 {
        self.backing.desc().addr.wrapping_add(self.offset_bytes)
    }

    /// `num_pages * bytes_per_page` (saturating).
    pub fn len_bytes(&self) -> u64 {
        self.num_pages().saturating_mul(self.bytes_per_page())
    }

    /// Host or device memory.
    pub fn kind(&self) -> MemoryKind {
        self.backing.desc().kind
    }

    /// Device ordinal (GPU id; 0 for host memory).
    pub fn device_id(&self) -> u32 {
        self.backing.desc().device_id
    }

    /// The exact range of this view as registrable memory (one NIXL region
    /// per group per shard, as MAX registers `data_ptr .. + nbytes`).
    ///
    /// # Errors
    /// [`KvError::BufferTooSmall`] when the view does not lie inside its
    /// backing ([`KVCacheMemory::new`] checks this for its buffers).
    pub fn registration(&self) -> Result<Arc<dyn MemoryBacking>, KvError> {
        let whole = self.backing.desc();
        if self.offset_bytes == 0 && self.len_bytes() == whole.len_bytes {
            return Ok(self.backing.clone());
        }
        match View::new(self.backing.clone(), self.offset_bytes, self.len_bytes()) {
            Some(v) => Ok(Arc::new(v)),
            None => Err(KvError::BufferTooSmall {
                shard: 0,
                offset_bytes: self.offset_bytes,
                need_bytes: self.len_bytes(),
                have_bytes: whole.len_bytes,
            }),
        }
    }
}

/// The registrations of one shard's group buffers: zero-length buffers
/// dropped, buffers whose ranges overlap merged into one [`Union`]
/// (a single buffer stays itself), in address order.
pub(crate) fn merge_registrations(parts: Vec<Arc<dyn MemoryBacking>>) -> Vec<Arc<dyn MemoryBacking>> {
    let mut parts: Vec<Arc<dyn MemoryBacking>> = parts.into_iter().filter(|p| p.desc().len_bytes > 0).collect();
    parts.sort_by_key(|p| p.desc().addr);
    let mut out: Vec<Vec<Arc<dyn MemoryBacking>>> = Vec::new();
    let mut end = 0u64;
    for p in parts {
        let d = p.desc();
        let p_end = d.addr.saturating_add(d.len_bytes);
        match out.last_mut() {
            Some(run) if d.addr < end => {
                run.push(p);
                end = end.max(p_end);
            }
            _ => {
                out.push(vec![p]);
                end = p_end;
            }
        }
    }
    out.into_iter()
        .map(|mut run| {
            if run.len() == 1 {
                return run.pop().expect("one part");
            }
            // The run overlaps by construction, so `Union::new` accepts it.
            match Union::new(run) {
                Ok(u) => Arc::new(u) as Arc<dyn MemoryBacking>,
                Err(mut parts) => parts.remove(0),
            }
        })
        .collect()
}

/// One logical `(child, kind)` KV tensor — e.g. a cache's `values` or its
/// `scales` — as one buffer per TP shard, each `[num_pages, bytes_per_page]`
/// bytes (`num_pages` includes the null block). This is one NIXL group.
///
/// `replicated` means every shard holds identical bytes (TP + MLA): the
/// transfer engine may then read any one shard (BROADCAST).
#[derive(Debug, Clone)]
pub struct KVCacheMemory {
    replicated: bool,
    buffers: Vec<KvBuffer>,
}

impl KVCacheMemory {
    /// Validate and build, as MAX's `KVCacheMemory.__post_init__`, in its order.
    ///
    /// # Errors
    /// - [`KvError::NoBuffers`]: `buffers` is empty;
    /// - [`KvError::NotTwoDimensional`]: a buffer is not 2-D;
    /// - [`KvError::NonContiguous`]: a buffer's row stride differs from its row length;
    /// - [`KvError::ShapeMismatch`]: a shard's shape differs from shard 0's;
    /// - [`KvError::ReplicatedNeedsTwoShards`]: `replicated` with fewer than 2 buffers;
    /// - kvwire additions: [`KvError::ZeroSizedBuffer`], [`KvError::BufferTooSmall`]
    ///   (the view does not fit its memory).
    pub fn new(replicated: bool, buffers: Vec<KvBuffer>) -> Result<Self, KvError> {
        if buffers.is_empty() {
            return Err(KvError::NoBuffers);
        }
        for (shard, b) in buffers.iter().enumerate() {
            if b.shape.len() != 2 {
                return Err(KvError::NotTwoDimensional { shard, ndim: b.shape.len() });
            }
        }
        for (shard, b) in buffers.iter().enumerate() {
            if b.row_stride_bytes != b.bytes_per_page() {
                return Err(KvError::NonContiguous {
                    shard,
                    row_stride_bytes: b.row_stride_bytes,
                    bytes_per_page: b.bytes_per_page(),
                });
            }
        }
        for (shard, b) in buffers.iter().enumerate().skip(1) {
            if b.shape != buffers[0].shape {
                return Err(KvError::ShapeMismatch {
                    shard,
                    expected: buffers[0].shape.clone(),
                    found: b.shape.clone(),
                });
            }
        }
        if replicated && buffers.len() < 2 {
            return Err(KvError::ReplicatedNeedsTwoShards { num_buffers: buffers.len() });
        }
        // Zero pages or zero bytes per page are accepted, as MAX builds such
        // groups; they register nothing and move nothing.
        for (shard, b) in buffers.iter().enumerate() {
            let need = b.num_pages().checked_mul(b.bytes_per_page());
            let have = b.backing.desc().len_bytes;
            let fits = need.and_then(|n| n.checked_add(b.offset_bytes)).is_some_and(|end| end <= have);
            if !fits {
                return Err(KvError::BufferTooSmall {
                    shard,
                    offset_bytes: b.offset_bytes,
                    need_bytes: need.unwrap_or(u64::MAX),
                    have_bytes: have,
                });
            }
        }
        Ok(Self { replicated, buffers })
    }

    /// Allocate `num_shards` zeroed [`HostBuffer`]s of `[num_pages, bytes_per_page]`
    /// bytes and build the memory from them. The buffers are returned too, so
    /// the caller can fill and check pages (page `p` of shard `s` is at
    /// `buffers[s].to_vec(p * bytes_per_page..(p + 1) * bytes_per_page)`).
    ///
    /// # Errors
    /// [`KvError::Alloc`], [`KvError::ZeroSizedBuffer`] (zero `num_pages` or
    /// `bytes_per_page`), and the rules of [`KVCacheMemory::new`].
    pub fn new_host(
        num_shards: usize,
        num_pages: u64,
        bytes_per_page: u64,
        replicated: bool,
    ) -> Result<(Self, Vec<Arc<HostBuffer>>), KvError> {
        let len = num_pages.checked_mul(bytes_per_page).filter(|&l| l > 0);
        let Some(len) = len.and_then(|l| usize::try_from(l).ok()) else {
            return Err(KvError::ZeroSizedBuffer { shard: 0, shape: vec![num_pages, bytes_per_page] });
        };
        let mut hosts = Vec::with_capacity(num_shards);
        let mut buffers = Vec::with_capacity(num_shards);
        for _ in 0..num_shards {
            let h = Arc::new(HostBuffer::new(len).map_err(KvError::Alloc)?);
            buffers.push(KvBuffer::new(h.clone(), num_pages, bytes_per_page));
            hosts.push(h);
        }
        Ok((Self::new(replicated, buffers)?, hosts))
    }

    /// True when every shard holds identical bytes (TP + MLA).
    pub fn replicated(&self) -> bool {
        self.replicated
    }

    /// One view per TP shard, in device order.
    pub fn buffers(&self) -> &[KvBuffer] {
        &self.buffers
    }

    /// TP shards (`buffers.len()`, ≥ 1).
    pub fn num_shards(&self) -> usize {
        self.buffers.len()
    }

    /// `buffers[0].shape[1]`: bytes per page of one shard.
    pub fn bytes_per_page(&self) -> u64 {
        self.buffers[0].bytes_per_page()
    }

    /// `buffers[0].shape[0]`: pages, null block included.
    pub fn total_num_pages(&self) -> u64 {
        self.buffers[0].num_pages()
    }

    /// Width of one row in a host tier: `bytes_per_page * (1 if replicated
    /// else num_shards)` (a replicated unit is stored once).
    pub fn host_bytes_per_page(&self) -> u64 {
        let n = if self.replicated { 1 } else { self.buffers.len() as u64 };
        self.bytes_per_page() * n
    }

    /// The memory kind of every buffer, or `None` when host and device mix.
    pub fn memory_kind(&self) -> Option<MemoryKind> {
        let k = self.buffers[0].kind();
        self.buffers.iter().all(|b| b.kind() == k).then_some(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(len: usize) -> Arc<dyn MemoryBacking> {
        Arc::new(HostBuffer::new(len).unwrap())
    }

    #[test]
    fn properties_follow_max() {
        let (m, hosts) = KVCacheMemory::new_host(4, 10, 256, false).unwrap();
        assert_eq!(hosts.len(), 4);
        assert_eq!(m.bytes_per_page(), 256);
        assert_eq!(m.total_num_pages(), 10);
        assert_eq!(m.host_bytes_per_page(), 1024);
        assert_eq!(m.num_shards(), 4);
        let (m, _) = KVCacheMemory::new_host(4, 10, 256, true).unwrap();
        assert_eq!(m.host_bytes_per_page(), 256);
        assert_eq!(m.memory_kind(), Some(MemoryKind::Dram));
    }

    #[test]
    fn each_rule_has_its_error_in_max_order() {
        assert!(matches!(KVCacheMemory::new(false, vec![]), Err(KvError::NoBuffers)));
        let b = host(4096);
        let three_d = KvBuffer::with_layout(b.clone(), 0, vec![4, 4, 4], 4);
        assert!(matches!(
            KVCacheMemory::new(false, vec![three_d]),
            Err(KvError::NotTwoDimensional { shard: 0, ndim: 3 })
        ));
        let padded = KvBuffer::with_layout(b.clone(), 0, vec![4, 100], 128);
        assert!(matches!(
            KVCacheMemory::new(false, vec![KvBuffer::new(b.clone(), 4, 100), padded]),
            Err(KvError::NonContiguous { shard: 1, row_stride_bytes: 128, bytes_per_page: 100 })
        ));
        let other = host(4096);
        assert!(matches!(
            KVCacheMemory::new(false, vec![KvBuffer::new(b.clone(), 4, 100), KvBuffer::new(other, 5, 100)]),
            Err(KvError::ShapeMismatch { shard: 1, .. })
        ));
        assert!(matches!(
            KVCacheMemory::new(true, vec![KvBuffer::new(b.clone(), 4, 100)]),
            Err(KvError::ReplicatedNeedsTwoShards { num_buffers: 1 })
        ));
        // Zero pages / zero bytes per page: MAX builds such groups.
        let empty = KVCacheMemory::new(false, vec![KvBuffer::new(b.clone(), 0, 100)]).unwrap();
        assert_eq!((empty.total_num_pages(), empty.bytes_per_page()), (0, 100));
        assert!(KVCacheMemory::new(false, vec![KvBuffer::new(b.clone(), 4, 0)]).is_ok());
        // Overlapping views of one slab register their union once.
        let view =
            |off: u64, pages: u64| KvBuffer::with_layout(b.clone(), off, vec![pages, 100], 100).registration().unwrap();
        let merged = merge_registrations(vec![view(0, 10), view(3000, 1), view(500, 10), view(64, 0)]);
        let descs: Vec<(u64, u64)> =
            merged.iter().map(|r| (r.desc().addr - b.desc().addr, r.desc().len_bytes)).collect();
        assert_eq!(descs, vec![(0, 1500), (3000, 100)]);
        assert!(matches!(
            KVCacheMemory::new(false, vec![KvBuffer::new(b.clone(), 5, 1000)]),
            Err(KvError::BufferTooSmall { shard: 0, need_bytes: 5000, have_bytes: 4096, .. })
        ));
        let offset = KvBuffer::with_layout(b.clone(), 4000, vec![1, 100], 100);
        assert!(matches!(KVCacheMemory::new(false, vec![offset]), Err(KvError::BufferTooSmall { .. })));
        let huge = KvBuffer::new(b.clone(), u64::MAX, 2);
        assert!(matches!(KVCacheMemory::new(false, vec![huge]), Err(KvError::BufferTooSmall { .. })));
        assert!(KVCacheMemory::new_host(1, 0, 8, false).is_err());
    }

    #[test]
    fn views_register_exactly_their_range() {
        let b = host(8192);
        let v = KvBuffer::with_layout(b.clone(), 4096, vec![4, 512], 512);
        let m = KVCacheMemory::new(false, vec![v]).unwrap();
        let r = m.buffers()[0].registration().unwrap();
        assert_eq!(r.desc().addr, b.desc().addr + 4096);
        assert_eq!(r.desc().len_bytes, 2048);
        assert_eq!(r.shared_fd().unwrap().1, 4096);
        let whole = KvBuffer::new(b.clone(), 2, 4096).registration().unwrap();
        assert_eq!(whole.desc(), b.desc());
    }
}
