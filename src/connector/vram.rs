//! [`DevicePages`] in GPU memory: one [`DeviceBuffer`] per TP shard, pages
//! copied through pinned staging buffers on each GPU's dedicated copy streams
//! ([`CopyStreams`]), completion by event query.

use std::io;
use std::sync::{Arc, Mutex};

use super::pages::PageGeometry;
use super::{BlockId, ConnectorError, DevicePages};
use crate::cuda::{CopyStreams, CudaError, DeviceBuffer, PendingCopy, PinnedHostBuffer};
use crate::kv::{KVCacheMemory, KvBuffer, KvError};
use crate::transport::MemoryBacking;

/// One leaf's pages on one DP replica in VRAM: `num_shards` device buffers
/// (TP shards in canonical device order, typically one per GPU), each
/// `[num_pages, bytes_per_page]` bytes, page 0 being the null block.
///
/// `read_page`/`write_page` block until their copy finished (the connector
/// worker's contract); [`download_page`](Self::download_page) and
/// [`upload_page`](Self::upload_page) return the [`PendingCopy`] instead, to
/// poll with `is_complete`.
#[derive(Debug)]
pub struct VramPages {
    geometry: PageGeometry,
    shards: Vec<Arc<DeviceBuffer>>,
    /// Per shard: its GPU's copy streams.
    copies: Vec<CopyStreams>,
    /// Per shard: idle `bytes_per_page` pinned staging buffers.
    staging: Mutex<Vec<Vec<PinnedHostBuffer>>>,
}

fn io_err(e: CudaError) -> io::Error {
    let kind = match e {
        CudaError::OutOfBounds { .. } => io::ErrorKind::InvalidInput,
        CudaError::NoDriver { .. } | CudaError::NoDevice { .. } | CudaError::Unsupported(_) => {
            io::ErrorKind::Unsupported
        }
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

impl VramPages {
    /// View `shards` as `[num_pages, bytes_per_page]` each, with `num_pages =
    /// len / bytes_per_page`.
    ///
    /// # Errors
    /// [`ConnectorError::InvalidPages`] when there is no shard, the stride is
    /// 0, shards differ in length, a replicated leaf has fewer than 2 shards,
    /// or a GPU's copy streams cannot be created.
    pub fn new(
        replicated: bool,
        shards: Vec<Arc<DeviceBuffer>>,
        bytes_per_page: usize,
    ) -> Result<Self, ConnectorError> {
        let lens: Vec<u64> = shards.iter().map(|s| s.len_bytes()).collect();
        let geometry = PageGeometry::new(replicated, &lens, bytes_per_page)?;
        let copies = shards
            .iter()
            .map(|s| CopyStreams::new(s.context()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ConnectorError::InvalidPages { reason: format!("copy streams: {e}") })?;
        let staging = Mutex::new(shards.iter().map(|_| Vec::new()).collect());
        Ok(Self { geometry, shards, copies, staging })
    }

    /// Allocate one zeroed `[num_pages, bytes_per_page]` buffer per GPU in
    /// `gpus` (TP shard `i` on GPU `gpus[i]`).
    ///
    /// # Errors
    /// As [`new`](Self::new); [`ConnectorError::InvalidPages`] naming the
    /// [`CudaError`] when allocation fails (no driver, no such GPU, out of
    /// memory).
    pub fn alloc(
        gpus: &[u32],
        replicated: bool,
        num_pages: usize,
        bytes_per_page: usize,
    ) -> Result<Self, ConnectorError> {
        let len = num_pages.checked_mul(bytes_per_page).unwrap_or(0) as u64;
        let shards = gpus
            .iter()
            .map(|&g| DeviceBuffer::new(g, len).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ConnectorError::InvalidPages { reason: format!("DeviceBuffer::new({len}): {e}") })?;
        Self::new(replicated, shards, bytes_per_page)
    }

    /// Shard `i`'s buffer.
    ///
    /// # Panics
    /// When `i >= num_shards`.
    pub fn shard(&self, i: usize) -> &Arc<DeviceBuffer> {
        &self.shards[i]
    }

    /// The same memory as a [`KVCacheMemory`] group (`kind: Vram`), for a
    /// `KVTransferEngine`.
    ///
    /// # Errors
    /// As [`KVCacheMemory::new`].
    pub fn kv_memory(&self) -> Result<KVCacheMemory, KvError> {
        let bufs = self
            .shards
            .iter()
            .map(|s| {
                let g = &self.geometry;
                KvBuffer::new(s.clone() as Arc<dyn MemoryBacking>, g.num_pages as u64, g.bytes_per_page as u64)
            })
            .collect();
        KVCacheMemory::new(self.geometry.replicated, bufs)
    }

    fn locate(&self, shard: usize, page: BlockId) -> io::Result<u64> {
        self.geometry.offset(shard, page).map(|o| o as u64)
    }

    fn take_staging(&self, shard: usize) -> io::Result<PinnedHostBuffer> {
        let pooled = self.staging.lock().unwrap_or_else(|p| p.into_inner())[shard].pop();
        match pooled {
            Some(b) => Ok(b),
            None => PinnedHostBuffer::new(self.shards[shard].context(), self.geometry.bytes_per_page).map_err(io_err),
        }
    }

    /// Return a staging buffer (from a finished copy) to the pool.
    pub fn recycle(&self, shard: usize, staging: PinnedHostBuffer) {
        if staging.len() == self.geometry.bytes_per_page
            && let Some(pool) = self.staging.lock().unwrap_or_else(|p| p.into_inner()).get_mut(shard)
        {
            pool.push(staging);
        }
    }

    /// Start copying page `page` of shard `shard` to pinned host memory;
    /// the finished copy's [`wait`](PendingCopy::wait) yields the bytes.
    ///
    /// # Errors
    /// Out-of-range indices; the failing CUDA call.
    pub fn download_page(&self, shard: usize, page: BlockId) -> io::Result<PendingCopy> {
        let off = self.locate(shard, page)?;
        let staging = self.take_staging(shard)?;
        self.copies[shard].download(&self.shards[shard], off, staging).map_err(io_err)
    }

    /// Start copying `data` (`bytes_per_page` bytes) into page `page` of
    /// shard `shard`.
    ///
    /// # Errors
    /// Wrong length, out-of-range indices; the failing CUDA call.
    pub fn upload_page(&self, shard: usize, page: BlockId, data: &[u8]) -> io::Result<PendingCopy> {
        self.geometry.check_len(data.len())?;
        let off = self.locate(shard, page)?;
        let mut staging = self.take_staging(shard)?;
        staging.as_mut_slice().copy_from_slice(data);
        self.copies[shard].upload(staging, &self.shards[shard], off).map_err(io_err)
    }
}

impl DevicePages for VramPages {
    fn num_shards(&self) -> usize {
        self.geometry.num_shards
    }

    fn replicated(&self) -> bool {
        self.geometry.replicated
    }

    fn bytes_per_page(&self) -> usize {
        self.geometry.bytes_per_page
    }

    fn num_pages(&self) -> usize {
        self.geometry.num_pages
    }

    fn read_page(&self, shard: usize, page: BlockId, out: &mut [u8]) -> io::Result<()> {
        self.geometry.check_len(out.len())?;
        let staging = self.download_page(shard, page)?.wait().map_err(io_err)?;
        out.copy_from_slice(staging.as_slice());
        self.recycle(shard, staging);
        Ok(())
    }

    fn write_page(&self, shard: usize, page: BlockId, data: &[u8]) -> io::Result<()> {
        let staging = self.upload_page(shard, page, data)?.wait().map_err(io_err)?;
        self.recycle(shard, staging);
        Ok(())
    }
}
