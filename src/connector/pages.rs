//! Device-side pages a connector copies to and from: per leaf and DP replica,
//! one `[num_pages, bytes_per_page]` byte buffer per TP shard (MAX `KVCacheMemory`, `cache_params.py`).

use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::{BlockId, ConnectorError};
use crate::HostBuffer;
use crate::kv::KVCacheMemory;

/// One leaf's pages on one DP replica: `num_shards` buffers (TP shards, in
/// canonical device order), each `[num_pages, bytes_per_page]` bytes, page 0
/// being the null block. Implemented for host memory ([`HostPages`], standing
/// in for the GPU) and, through the GPU layer, for VRAM.
///
/// `read_page`/`write_page` are called from a connector's worker thread while
/// the caller keeps the page pinned; they may block.
pub trait DevicePages: Send + Sync + fmt::Debug {
    /// Number of TP shards (buffers), at least 1.
    fn num_shards(&self) -> usize;

    /// True when all shards hold identical bytes (TP + MLA); the host tier then
    /// stores one shard's page and broadcasts it on load.
    fn replicated(&self) -> bool;

    /// Bytes of one page of one shard (the row stride).
    fn bytes_per_page(&self) -> usize;

    /// Pages per shard, null block included (`total_num_pages`).
    fn num_pages(&self) -> usize;

    /// Copy page `page` of shard `shard` into `out` (`bytes_per_page` bytes).
    ///
    /// # Errors
    /// The failing copy, as an I/O error.
    fn read_page(&self, shard: usize, page: BlockId, out: &mut [u8]) -> io::Result<()>;

    /// Copy `data` (`bytes_per_page` bytes) into page `page` of shard `shard`.
    ///
    /// # Errors
    /// The failing copy, as an I/O error.
    fn write_page(&self, shard: usize, page: BlockId, data: &[u8]) -> io::Result<()>;

    /// Width in bytes of this leaf's row in a host tier (MAX
    /// `host_bytes_per_page`): `bytes_per_page * (1 if replicated else num_shards)`.
    fn host_bytes_per_page(&self) -> usize {
        self.bytes_per_page() * if self.replicated() { 1 } else { self.num_shards() }
    }
}

/// The shape [`HostPages`] and the VRAM pages validate and index by:
/// `num_shards` buffers of `[num_pages, bytes_per_page]` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PageGeometry {
    pub replicated: bool,
    pub num_shards: usize,
    pub bytes_per_page: usize,
    pub num_pages: usize,
}

impl PageGeometry {
    /// From the shard buffers' lengths (bytes), with `num_pages = len /
    /// bytes_per_page`.
    ///
    /// # Errors
    /// [`ConnectorError::InvalidPages`] when there is no shard, the stride is
    /// 0, shards differ in length, or a replicated leaf has fewer than 2 shards.
    pub(crate) fn new(replicated: bool, shard_lens: &[u64], bytes_per_page: usize) -> Result<Self, ConnectorError> {
        let invalid = |reason: &str| Err(ConnectorError::InvalidPages { reason: reason.into() });
        let Some(&len) = shard_lens.first() else {
            return invalid("no shard buffers");
        };
        if bytes_per_page == 0 {
            return invalid("bytes_per_page is 0");
        }
        if shard_lens.iter().any(|&l| l != len) {
            return invalid("shard buffers differ in length");
        }
        if replicated && shard_lens.len() < 2 {
            return invalid("replicated with fewer than 2 shards");
        }
        let num_pages = usize::try_from(len / bytes_per_page as u64).unwrap_or(usize::MAX);
        Ok(Self { replicated, num_shards: shard_lens.len(), bytes_per_page, num_pages })
    }

    /// Byte offset of `page` within shard `shard`'s buffer.
    ///
    /// # Errors
    /// `InvalidInput` when the shard or the page is out of range.
    pub(crate) fn offset(&self, shard: usize, page: BlockId) -> io::Result<usize> {
        let bad = |m: String| Err(io::Error::new(io::ErrorKind::InvalidInput, m));
        if shard >= self.num_shards {
            return bad(format!("shard {shard} past {}", self.num_shards));
        }
        if page.index() >= self.num_pages {
            return bad(format!("page {} past {} pages", page.0, self.num_pages));
        }
        Ok(page.index() * self.bytes_per_page)
    }

    /// # Errors
    /// `InvalidInput` unless `len` is one page (`bytes_per_page` bytes).
    pub(crate) fn check_len(&self, len: usize) -> io::Result<()> {
        if len != self.bytes_per_page {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{len}-byte copy of a {}-byte page", self.bytes_per_page),
            ));
        }
        Ok(())
    }
}

/// [`DevicePages`] in host memory: one [`HostBuffer`] per TP shard, each
/// holding `num_pages * bytes_per_page` bytes (trailing bytes unused).
#[derive(Debug, Clone)]
pub struct HostPages {
    geometry: PageGeometry,
    shards: Vec<Arc<HostBuffer>>,
}

impl HostPages {
    /// View `shards` as `[num_pages, bytes_per_page]` each, with `num_pages =
    /// len / bytes_per_page` of the shortest shard.
    ///
    /// # Errors
    /// [`ConnectorError::InvalidPages`] when there is no shard, the stride is
    /// 0, shards differ in length, or a replicated leaf has fewer than 2 shards.
    pub fn new(replicated: bool, shards: Vec<Arc<HostBuffer>>, bytes_per_page: usize) -> Result<Self, ConnectorError> {
        let lens: Vec<u64> = shards.iter().map(|s| s.len() as u64).collect();
        Ok(Self { geometry: PageGeometry::new(replicated, &lens, bytes_per_page)?, shards })
    }

    /// Allocate `num_shards` zeroed buffers of `[num_pages, bytes_per_page]`.
    ///
    /// # Errors
    /// As [`new`](Self::new); [`ConnectorError::InvalidPages`] when allocation fails.
    pub fn alloc(
        num_shards: usize,
        replicated: bool,
        num_pages: usize,
        bytes_per_page: usize,
    ) -> Result<Self, ConnectorError> {
        let len = num_pages.checked_mul(bytes_per_page).unwrap_or(0);
        let shards = (0..num_shards)
            .map(|_| HostBuffer::new(len).map(Arc::new))
            .collect::<io::Result<Vec<_>>>()
            .map_err(|e| ConnectorError::InvalidPages { reason: format!("HostBuffer::new({len}): {e}") })?;
        Self::new(replicated, shards, bytes_per_page)
    }

    /// Shard `i`'s buffer.
    ///
    /// # Panics
    /// When `i >= num_shards`.
    pub fn shard(&self, i: usize) -> &Arc<HostBuffer> {
        &self.shards[i]
    }

    /// A copy of page `page` of shard `shard` (the bytes are unspecified
    /// where a copy writes them meanwhile).
    ///
    /// # Panics
    /// When either index is out of range.
    pub fn page(&self, shard: usize, page: BlockId) -> Vec<u8> {
        let off = self.geometry.offset(shard, page).expect("page out of range");
        self.shards[shard].to_vec(off..off + self.geometry.bytes_per_page)
    }
}

impl DevicePages for HostPages {
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
        let off = self.geometry.offset(shard, page)?;
        self.shards[shard].copy_to(off, out);
        Ok(())
    }

    fn write_page(&self, shard: usize, page: BlockId, data: &[u8]) -> io::Result<()> {
        self.geometry.check_len(data.len())?;
        let off = self.geometry.offset(shard, page)?;
        self.shards[shard].write(off, data);
        Ok(())
    }
}

/// [`KVCacheMemory`] as device pages, for host-memory buffers that expose a
/// shared file descriptor (every [`HostBuffer`]): pages are copied with
/// `pread`/`pwrite` on that descriptor, which aliases the mapping. Buffers
/// without one (VRAM) fail each copy with `Unsupported` until the GPU layer
/// provides its own [`DevicePages`].
impl DevicePages for KVCacheMemory {
    fn num_shards(&self) -> usize {
        KVCacheMemory::num_shards(self)
    }

    fn replicated(&self) -> bool {
        KVCacheMemory::replicated(self)
    }

    fn bytes_per_page(&self) -> usize {
        KVCacheMemory::bytes_per_page(self) as usize
    }

    fn num_pages(&self) -> usize {
        self.total_num_pages() as usize
    }

    fn read_page(&self, shard: usize, page: BlockId, out: &mut [u8]) -> io::Result<()> {
        let (file, off) = shard_file(self, shard, page, out.len())?;
        file.read_exact_at(out, off)
    }

    fn write_page(&self, shard: usize, page: BlockId, data: &[u8]) -> io::Result<()> {
        let (file, off) = shard_file(self, shard, page, data.len())?;
        file.write_all_at(data, off)
    }
}

/// The shared file of `shard`'s backing and the file offset of `page`.
fn shard_file(mem: &KVCacheMemory, shard: usize, page: BlockId, len: usize) -> io::Result<(File, u64)> {
    let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
    let buf = mem.buffers().get(shard).ok_or_else(|| invalid(format!("shard {shard} past {}", mem.num_shards())))?;
    if page.0 as u64 >= buf.num_pages() {
        return Err(invalid(format!("page {} past {} pages", page.0, buf.num_pages())));
    }
    if len as u64 != buf.bytes_per_page() {
        return Err(invalid(format!("{len}-byte copy of a {}-byte page", buf.bytes_per_page())));
    }
    let (fd, fd_off) = buf.backing().shared_fd().ok_or_else(|| {
        io::Error::new(io::ErrorKind::Unsupported, "KV buffer without a shared fd (device memory needs the GPU layer)")
    })?;
    let off = fd_off + buf.offset_bytes() + page.0 as u64 * buf.row_stride_bytes();
    Ok((File::from(fd.try_clone_to_owned()?), off))
}
