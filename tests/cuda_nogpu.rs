//! GPU-layer behaviour that every CI run checks, with or without a GPU: the
//! probe is consistent and never panics, VRAM constructors fail with a clear
//! error where there is no driver, and KV validation of VRAM shard buffers
//! (a fake VRAM backing over host memory) follows MAX.

use std::sync::Arc;

use kvwire::HostBuffer;
use kvwire::connector::{BlockId, DevicePages};
use kvwire::cuda;
use kvwire::kv::{KVCacheMemory, KVTransferEngine, KvBuffer, KvError};
use kvwire::transport::{MemoryBacking, MemoryDesc, MemoryKind, TransportConfig, TransportKind};

fn uniq(base: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    format!("{base}{}x{}", std::process::id(), NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// Host memory that says it is VRAM on GPU 3.
struct FakeVram(HostBuffer);

// SAFETY: the range is the HostBuffer's, alive as long as this value; only
// the kind differs, and no test hands it to a device.
unsafe impl MemoryBacking for FakeVram {
    fn desc(&self) -> MemoryDesc {
        MemoryDesc { kind: MemoryKind::Vram, device_id: 3, ..self.0.desc() }
    }
}

fn fake_vram(len: usize) -> Arc<dyn MemoryBacking> {
    Arc::new(FakeVram(HostBuffer::new(len).unwrap()))
}

#[test]
fn probe_is_consistent_and_says_why_when_empty() {
    let r = cuda::probe();
    assert_eq!(r.devices.is_empty(), r.unavailable.is_some(), "{r:?}");
    match &r.unavailable {
        Some(why) => eprintln!("cuda::probe: no GPU ({why})"),
        None => eprintln!("cuda::probe: {} GPU(s), driver {:?}: {:?}", r.devices.len(), r.driver_version, r.devices),
    }
    for (i, d) in r.devices.iter().enumerate() {
        assert_eq!(d.ordinal as usize, i);
        assert!(!d.pci_bus_id.is_empty() && d.total_mem_bytes > 0, "{d:?}");
    }
    assert_eq!(cuda::probe(), r, "probing twice gives the same answer");
}

#[cfg(feature = "cuda")]
#[test]
fn vram_paths_fail_clearly_without_a_device() {
    let r = cuda::probe();
    let past = r.devices.len() as u32;
    use kvwire::cuda::CudaError;
    let e = cuda::DeviceBuffer::new(past, 4096).unwrap_err();
    match (&e, r.driver_version) {
        (CudaError::NoDriver { reason }, None) => assert!(!reason.is_empty()),
        (CudaError::NoDevice { ordinal, num_devices }, Some(_)) => assert_eq!((*ordinal, *num_devices), (past, past)),
        other => panic!("unexpected {other:?}"),
    }
    eprintln!("DeviceBuffer::new(GPU {past}): {e}");
    let e = kvwire::connector::VramPages::alloc(&[past], false, 4, 64).unwrap_err();
    assert!(e.to_string().contains("no CUDA"), "{e}");
    assert!(cuda::GpuContext::new(past).is_err());
}

#[cfg(not(feature = "cuda"))]
#[test]
fn without_the_feature_the_probe_says_so() {
    assert!(!cuda::compiled_in());
    assert!(cuda::probe().unavailable.unwrap().contains("without the `cuda` feature"));
}

#[test]
fn mixed_host_and_vram_shards_are_refused_as_max_does() {
    let host: Arc<dyn MemoryBacking> = Arc::new(HostBuffer::new(256).unwrap());
    let vram = fake_vram(256);
    let mixed = KVCacheMemory::new(false, vec![KvBuffer::new(host.clone(), 4, 64), KvBuffer::new(vram.clone(), 4, 64)])
        .unwrap();
    assert_eq!(mixed.memory_kind(), None);
    let e =
        KVTransferEngine::new(&uniq("mx"), vec![vec![mixed]], None, TransportKind::Shm, &TransportConfig::default());
    assert!(matches!(e, Err(KvError::MixedDeviceKinds { replica: 0, group: 0 })), "{e:?}");
    // host group + VRAM group: one memory type overall
    let g0 = KVCacheMemory::new(false, vec![KvBuffer::new(host, 4, 64)]).unwrap();
    let g1 = KVCacheMemory::new(false, vec![KvBuffer::new(vram, 4, 64)]).unwrap();
    let e =
        KVTransferEngine::new(&uniq("mx"), vec![vec![g0, g1]], None, TransportKind::Shm, &TransportConfig::default());
    assert!(matches!(e, Err(KvError::MixedMemoryTypes)), "{e:?}");
}

#[test]
fn all_vram_groups_pass_validation_and_shm_refuses_to_register_them() {
    let g = KVCacheMemory::new(true, vec![KvBuffer::new(fake_vram(256), 4, 64), KvBuffer::new(fake_vram(256), 4, 64)])
        .unwrap();
    assert_eq!(g.memory_kind(), Some(MemoryKind::Vram));
    let e = KVTransferEngine::new(
        &uniq("vr"),
        vec![vec![g.clone()]],
        None,
        TransportKind::Shm,
        &TransportConfig::default(),
    )
    .unwrap_err();
    assert!(matches!(e, KvError::Engine(_)), "{e:?}");
    assert!(e.to_string().contains("DRAM"), "{e}");
    // host-tier copies through the KVCacheMemory pages need the GPU layer
    let mut out = [0u8; 64];
    let e = DevicePages::read_page(&g, 0, BlockId(1), &mut out).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::Unsupported, "{e}");
}
