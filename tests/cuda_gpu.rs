//! GPU tests, `#[ignore]`d: a plain `cargo test` reports them as ignored
//! with the reason. `scripts/gpu-check.sh` runs them with `--include-ignored`
//! on a GPU machine (or with `FAKE=1` against the fake driver). Run without a
//! GPU they print `skipped: no CUDA driver` (straight to stderr, so it shows
//! without `--nocapture`); with `KVWIRE_REQUIRE_GPU=1` (set by
//! `scripts/gpu-check.sh`) a missing GPU fails instead.
#![cfg(feature = "cuda")]

use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::connector::{
    BlockHash, BlockId, DevicePages, HostTierConnector, KVCacheGroupId, KVConnector, KVTransfer, LeafId, PerLeaf,
    VramPages,
};
use kvwire::cuda::{self, CopyStreams, CudaError, DeviceBuffer, PinnedHostBuffer, RegistrationPath};
use kvwire::kv::{KVCacheMemory, KVTransferEngine, KvBuffer, KvError};
use kvwire::transport::{MemoryBacking, MemoryKind, TransportConfig, TransportKind};

/// The first GPU's info, or `None` after printing why the test is skipped.
fn gpu_or_skip(test: &str) -> Option<cuda::GpuInfo> {
    let r = cuda::probe();
    if let Some(d) = r.devices.first() {
        return Some(d.clone());
    }
    let why = r.unavailable.unwrap_or_default();
    if std::env::var("KVWIRE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("{test}: KVWIRE_REQUIRE_GPU=1 but no GPU: {why}");
    }
    // Straight to fd 2, not eprintln!: libtest captures the print macros of
    // passing tests, and a skip must be visible in every CI log.
    let line = format!("{test}: skipped: no CUDA driver [{why}]\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
    None
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh runs it; FAKE=1 against the fake driver)"]
fn device_buffer_round_trip() {
    let Some(gpu) = gpu_or_skip("device_buffer_round_trip") else { return };
    let len = (1 << 20) + 3;
    let buf = DeviceBuffer::new(gpu.ordinal, len as u64).unwrap();
    let d = buf.desc();
    assert_eq!((d.kind, d.device_id, d.len_bytes), (MemoryKind::Vram, gpu.ordinal, len as u64));
    let mut back = vec![1u8; len];
    buf.copy_to_host(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0), "zero-filled");
    let data = pattern(len, 7);
    buf.copy_from_host(0, &data).unwrap();
    buf.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, data);
    assert!(matches!(buf.copy_from_host(len as u64 - 1, &[0, 0]), Err(CudaError::OutOfBounds { .. })));
    assert!(matches!(DeviceBuffer::new(gpu.ordinal, 0), Err(CudaError::Unsupported(_))));
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh runs it; FAKE=1 against the fake driver)"]
fn async_copies_complete_by_event_query() {
    let Some(gpu) = gpu_or_skip("async_copies_complete_by_event_query") else { return };
    let dev = Arc::new(DeviceBuffer::new(gpu.ordinal, 8 << 20).unwrap());
    let streams = CopyStreams::new(dev.context()).unwrap();
    let mut up = PinnedHostBuffer::new(dev.context(), 4 << 20).unwrap();
    up.as_mut_slice().copy_from_slice(&pattern(4 << 20, 3));
    let pending = streams.upload(up, &dev, 1 << 20).unwrap();
    let t0 = Instant::now();
    while !pending.is_complete().unwrap() {
        assert!(t0.elapsed() < Duration::from_secs(10), "upload never completed");
        std::thread::yield_now();
    }
    let up = pending.wait().unwrap();
    let down = PinnedHostBuffer::new(dev.context(), 4 << 20).unwrap();
    let down = streams.download(&dev, 1 << 20, down).unwrap().wait().unwrap();
    assert_eq!(down.as_slice(), up.as_slice());
    let small = PinnedHostBuffer::new(dev.context(), 4096).unwrap();
    assert!(matches!(streams.download(&dev, (8 << 20) - 100, small), Err(CudaError::OutOfBounds { .. })));
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh runs it; FAKE=1 against the fake driver)"]
fn dmabuf_export_and_registration_chain() {
    let Some(gpu) = gpu_or_skip("dmabuf_export_and_registration_chain") else { return };
    let buf = Arc::new(DeviceBuffer::new(gpu.ordinal, 3 << 20).unwrap());
    match buf.dmabuf() {
        Ok((fd, offset)) => {
            assert!(gpu.dma_buf_supported, "export worked although the attribute says unsupported");
            assert!(fd.as_raw_fd() >= 0);
            assert_eq!(offset, 0, "allocations are 2 MiB aligned");
            eprintln!("dma-buf export: ok (fd {}, offset {offset})", fd.as_raw_fd());
        }
        Err(e) => {
            assert!(!gpu.dma_buf_supported, "attribute says supported but export failed: {e}");
            assert!(matches!(e, CudaError::Unsupported(_)), "{e}");
            eprintln!("dma-buf export: unsupported on this GPU ({e})");
        }
    }
    // The chain with stand-in verbs calls: dma-buf first with iova = address.
    let addr = buf.addr();
    let fd = buf.dmabuf_fd().ok_or_else(|| "the memory exports no dma-buf".to_string());
    let (_, path) = cuda::register_with_fallback(
        addr,
        buf.len_bytes(),
        fd,
        |_fd, off, len, iova| {
            assert_eq!((off, len, iova), (0, 3 << 20, addr));
            Ok::<_, String>("dmabuf-mr")
        },
        |_, _| Ok::<_, String>("peermem-mr"),
    )
    .unwrap();
    let want = if gpu.dma_buf_supported { RegistrationPath::DmaBuf } else { RegistrationPath::PeerMem };
    assert_eq!(path, want);
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh runs it; FAKE=1 against the fake driver)"]
fn vram_pages_serve_a_host_tier() {
    let Some(gpu) = gpu_or_skip("vram_pages_serve_a_host_tier") else { return };
    const BPP: usize = 4096;
    let g = gpu.ordinal;
    let full = Arc::new(VramPages::alloc(&[g, g], false, 16, BPP).unwrap());
    let mla = Arc::new(VramPages::alloc(&[g, g], true, 16, BPP).unwrap());
    let pages: BTreeMap<LeafId, Arc<dyn DevicePages>> = [
        (LeafId::from("full"), full.clone() as Arc<dyn DevicePages>),
        (LeafId::from("mla"), mla.clone() as Arc<dyn DevicePages>),
    ]
    .into();
    let leaves: BTreeMap<LeafId, KVCacheGroupId> = pages.keys().map(|l| (l.clone(), KVCacheGroupId::full())).collect();
    let conn = HostTierConnector::new(leaves.clone(), vec![pages], 1 << 20).unwrap();
    let content = |leaf: u8, shard: usize, block: u32| pattern(BPP, leaf ^ (shard as u8) << 3 ^ (block as u8) << 5);
    for block in [1u32, 2, 3] {
        for shard in 0..2 {
            full.write_page(shard, BlockId(block), &content(1, shard, block)).unwrap();
            mla.write_page(shard, BlockId(block), &content(2, 0, block)).unwrap();
        }
    }
    let per_leaf = |v: Vec<u32>| -> PerLeaf<BlockId> {
        leaves.keys().map(|l| (l.clone(), v.iter().map(|&b| BlockId(b)).collect())).collect()
    };
    let hashes = |v: Vec<u64>| -> PerLeaf<BlockHash> {
        leaves.keys().map(|l| (l.clone(), v.iter().map(|&h| BlockHash::from_u64(h)).collect())).collect()
    };
    conn.offload(&per_leaf(vec![1, 2, 3]), &hashes(vec![11, 12, 13]), 0).unwrap().synchronize().unwrap();
    // Clobber, then load the tier back into other pages.
    for shard in 0..2 {
        full.write_page(shard, BlockId(5), &vec![0xee; BPP]).unwrap();
    }
    let all: Vec<BlockHash> = [11u64, 12, 13].iter().map(|&h| BlockHash::from_u64(h)).collect();
    let masks = conn.lookup(&all, 0, None).unwrap();
    assert!(masks.values().all(|m| m.iter().all(|&x| x)), "{masks:?}");
    conn.load(&per_leaf(vec![5, 6, 7]), &hashes(vec![11, 12, 13]), 0, None).unwrap().synchronize().unwrap();
    let mut out = vec![0u8; BPP];
    for (i, block) in [1u32, 2, 3].into_iter().enumerate() {
        for shard in 0..2 {
            full.read_page(shard, BlockId(5 + i as u32), &mut out).unwrap();
            assert_eq!(out, content(1, shard, block), "full shard {shard} block {block}");
            mla.read_page(shard, BlockId(5 + i as u32), &mut out).unwrap();
            assert_eq!(out, content(2, 0, block), "mla shard {shard} (broadcast) block {block}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh runs it; FAKE=1 against the fake driver)"]
fn kv_engine_validates_vram_shard_buffers() {
    let Some(gpu) = gpu_or_skip("kv_engine_validates_vram_shard_buffers") else { return };
    let pages = VramPages::alloc(&[gpu.ordinal, gpu.ordinal], false, 8, 256).unwrap();
    let g = pages.kv_memory().unwrap();
    assert_eq!(g.memory_kind(), Some(MemoryKind::Vram));
    let cfg = TransportConfig::default();
    let name = format!("vram{}", std::process::id());
    // Valid VRAM groups reach registration; shm moves DRAM only.
    let e = KVTransferEngine::new(&name, vec![vec![g]], None, TransportKind::Shm, &cfg).unwrap_err();
    assert!(matches!(e, KvError::Engine(_)), "{e:?}");
    // A real device buffer beside a host buffer in one group: MixedDeviceKinds.
    let host: Arc<dyn MemoryBacking> = Arc::new(HostBuffer::new(2048).unwrap());
    let mixed =
        KVCacheMemory::new(false, vec![KvBuffer::new(host, 8, 256), KvBuffer::new(pages.shard(0).clone(), 8, 256)])
            .unwrap();
    let e = KVTransferEngine::new(&format!("{name}m"), vec![vec![mixed]], None, TransportKind::Shm, &cfg);
    assert!(matches!(e, Err(KvError::MixedDeviceKinds { replica: 0, group: 0 })), "{e:?}");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh runs it; FAKE=1 against the fake driver)"]
fn nic_for_each_gpu() {
    let Some(_) = gpu_or_skip("nic_for_each_gpu") else { return };
    for d in cuda::probe().devices {
        match cuda::nic::nic_for_gpu(&d.pci_bus_id, None) {
            Ok(nic) => eprintln!("GPU {} ({}): RDMA device {nic:?}", d.ordinal, d.pci_bus_id),
            Err(e) => panic!("GPU {} bus id {} not in sysfs: {e}", d.ordinal, d.pci_bus_id),
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh runs it; FAKE=1 against the fake driver)"]
fn external_memory_exports_its_page_aligned_cover() {
    let Some(gpu) = gpu_or_skip("external_memory_exports_its_page_aligned_cover") else { return };
    let owner = DeviceBuffer::new(gpu.ordinal, 4 << 20).unwrap();
    let page = cuda::dmabuf::host_page_bytes();
    let addr = owner.addr() + page + 100;
    // SAFETY: a sub-range of `owner`, which outlives `ext`.
    let ext = unsafe { cuda::ExternalDeviceMemory::new(owner.context(), addr, 3 * page) };
    assert_eq!(ext.desc().kind, MemoryKind::Vram);
    match ext.dmabuf() {
        Ok((_fd, offset)) => assert_eq!(offset, 100, "offset of addr in its page-aligned cover"),
        Err(e) => assert!(!gpu.dma_buf_supported && matches!(e, CudaError::Unsupported(_)), "{e}"),
    }
    // SAFETY: as above; past the end of `owner`'s allocation.
    let past = unsafe { cuda::ExternalDeviceMemory::new(owner.context(), owner.addr() + (4 << 20) - 10, 20) };
    assert!(past.dmabuf().is_err());
}
