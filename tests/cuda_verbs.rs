//! VRAM over the verbs transport: GPU memory registered through dma-buf
//! first, then nvidia-peermem (the order of NIXL's UCX/libfabric backends and
//! of Mooncake's `rdma_context.cpp`), and moved with one-sided WRITE/READ.
//! Needs a CUDA driver and an RDMA device, so every test is `#[ignore]`d with
//! that reason; the hardware scripts run them with `--include-ignored`, and
//! where the hardware is still missing each prints why it is skipped
//! (straight to stderr, visible without `--nocapture`).
//! `KVWIRE_REQUIRE_GPU=1` turns a missing GPU into a failure, and
//! `KVWIRE_REQUIRE_RDMA=1` a missing RDMA device.
//!
//! Runs for real on a GPU host with a NIC (`scripts/gpu-check.sh`), and in
//! the Soft-RoCE guest against the fake driver
//! (`scripts/cuda-softroce-check.sh`), where the fake "VRAM" is host memory:
//! the dma-buf registration fails (a memfd is no dma-buf) and the chain falls
//! back to `ibv_reg_mr`.
#![cfg(feature = "cuda")]

use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::cuda::{self, DeviceBuffer};
use kvwire::engine::{Desc, TransferEngine, TransferHandle, TransferStatus};
use kvwire::kv::{KVCacheMemory, KVTransferEngine, KvBuffer};
use kvwire::transport::{MemoryBacking, Op, TransportConfig, TransportKind};

fn skip(test: &str, why: &str) {
    let line = format!("{test}: skipped: {why}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// `(gpu ordinal, target device, initiator device)`, or `None` after saying why.
fn setup(test: &str) -> Option<(u32, String, String)> {
    let r = cuda::probe();
    let Some(gpu) = r.devices.first() else {
        let why = r.unavailable.unwrap_or_default();
        if std::env::var("KVWIRE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            panic!("{test}: KVWIRE_REQUIRE_GPU=1 but no GPU: {why}");
        }
        skip(test, &format!("no CUDA driver [{why}]"));
        return None;
    };
    let devs: Vec<String> = match std::env::var("SOFTROCE_DEVS") {
        Ok(d) => d.split_whitespace().map(String::from).collect(),
        Err(_) => match cuda::nic::nic_for_gpu(&gpu.pci_bus_id, None) {
            Ok(Some(nic)) => vec![nic],
            Ok(None) => kvwire::verbs::device_names().unwrap_or_default(),
            Err(e) => {
                skip(test, &format!("GPU {} not found in sysfs: {e}", gpu.pci_bus_id));
                return None;
            }
        },
    };
    match devs.as_slice() {
        [] => {
            if std::env::var("KVWIRE_REQUIRE_RDMA").is_ok_and(|v| v == "1") {
                panic!("{test}: KVWIRE_REQUIRE_RDMA=1 but no RDMA device");
            }
            skip(test, "no RDMA device");
            None
        }
        [one] => Some((gpu.ordinal, one.clone(), one.clone())),
        [t, i, ..] => Some((gpu.ordinal, t.clone(), i.clone())),
    }
}

fn config(device: &str) -> TransportConfig {
    let mut c = TransportConfig::default();
    c.options.push(("device".into(), device.into()));
    if let Ok(i) = std::env::var("SOFTROCE_GID_IDX") {
        c.options.push(("gid_index".into(), i));
    }
    c
}

fn wait(e: &mut TransferEngine, h: TransferHandle) -> TransferStatus {
    let t0 = Instant::now();
    loop {
        let s = e.status(h).unwrap();
        if s != TransferStatus::InProgress || t0.elapsed() > Duration::from_secs(60) {
            return s;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
#[ignore = "needs a CUDA GPU and an RDMA device (scripts/gpu-check.sh; scripts/cuda-softroce-check.sh with the fake driver)"]
fn vram_write_and_read_over_verbs() {
    let Some((gpu, tdev, idev)) = setup("vram_write_and_read_over_verbs") else { return };
    const LEN: usize = 1 << 20;
    let vram = Arc::new(DeviceBuffer::new(gpu, LEN as u64).unwrap());
    let data: Vec<u8> = (0..LEN).map(|i| (i * 13 + 5) as u8).collect();
    vram.copy_from_host(0, &data).unwrap();
    // Ordering before the NIC: the copy above completed on return; work on
    // another stream would need `stream.record()?.synchronize()` here.
    let host = Arc::new(HostBuffer::new(LEN).unwrap());
    let mut target = TransferEngine::new("cv-target", TransportKind::Verbs, &config(&tdev)).unwrap();
    let mut init = TransferEngine::new("cv-init", TransportKind::Verbs, &config(&idev)).unwrap();
    target.register(host.clone()).unwrap();
    init.register(vram.clone() as Arc<dyn MemoryBacking>).expect("VRAM registration (dma-buf or peermem)");
    init.connect(&target.metadata()).unwrap();

    // VRAM -> host
    let h = init.post(
        Op::Write,
        &[Desc::new(vram.addr(), LEN as u64)],
        "cv-target",
        &[Desc::new(host.addr(), LEN as u64)],
        None,
    );
    let h = h.unwrap();
    assert_eq!(wait(&mut init, h), TransferStatus::Done);
    init.release(h).unwrap();
    assert_eq!(host.to_vec(..), &data[..]);

    // host -> VRAM (READ into the upper half)
    host.fill_with(0, LEN / 2, |i| (i * 7) as u8);
    let half = (LEN / 2) as u64;
    let h =
        init.post(Op::Read, &[Desc::new(vram.addr() + half, half)], "cv-target", &[Desc::new(host.addr(), half)], None);
    let h = h.unwrap();
    assert_eq!(wait(&mut init, h), TransferStatus::Done);
    init.release(h).unwrap();
    vram.context().flush_rdma_writes().unwrap();
    let mut back = vec![0u8; LEN / 2];
    vram.copy_to_host(half, &mut back).unwrap();
    assert_eq!(&back[..], host.to_vec(..LEN / 2));
}

#[test]
#[ignore = "needs a CUDA GPU and an RDMA device (scripts/gpu-check.sh; scripts/cuda-softroce-check.sh with the fake driver)"]
fn kv_engine_registers_vram_groups_over_verbs() {
    let Some((gpu, tdev, _)) = setup("kv_engine_registers_vram_groups_over_verbs") else { return };
    let shards: Vec<KvBuffer> =
        (0..2).map(|_| KvBuffer::new(Arc::new(DeviceBuffer::new(gpu, 16 * 4096).unwrap()), 16, 4096)).collect();
    let g = KVCacheMemory::new(false, shards).unwrap();
    let e = KVTransferEngine::new("cv-kv", vec![vec![g]], None, TransportKind::Verbs, &config(&tdev)).unwrap();
    assert_eq!(e.metadata().memory_type, kvwire::kv::MemoryType::Vram);
}

#[test]
#[ignore = "needs a CUDA GPU and an RDMA device (scripts/gpu-check.sh; scripts/cuda-softroce-check.sh with the fake driver)"]
fn registration_path_is_reported() {
    use kvwire::cuda::{RegistrationPath, register_with_fallback};
    use kvwire::verbs::{Context, MemoryRegion, ProtectionDomain};
    let Some((gpu, dev, _)) = setup("registration_path_is_reported") else { return };
    let pd = ProtectionDomain::new(&Arc::new(Context::open(Some(&dev)).unwrap())).unwrap();
    let buf = Arc::new(DeviceBuffer::new(gpu, 4 << 20).unwrap());
    let len = buf.len_bytes() as usize;
    // The chain `VerbsTransport::register` runs for VRAM.
    let d = buf.desc();
    let fd = buf.dmabuf_fd().ok_or_else(|| "the memory exports no dma-buf".to_string());
    let (mr, path) = register_with_fallback(
        d.addr,
        d.len_bytes,
        fd,
        // SAFETY: `buf` outlives `mr`, dropped first at the end of the test.
        |fd, off, _, iova| unsafe { MemoryRegion::register_dmabuf(&pd, fd, off, len, iova) },
        // SAFETY: as above.
        |addr, _| unsafe { MemoryRegion::register(&pd, addr, len) },
    )
    .unwrap();
    assert_eq!(mr.addr(), buf.addr());
    let line = format!("registration_path_is_reported: GPU {gpu} on {dev}: {path:?}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
    let info = &cuda::probe().devices[0];
    if info.dma_buf_supported && info.name != "kvwire fake GPU" {
        // A real GPU that exports dma-bufs should register that way.
        assert_eq!(path, RegistrationPath::DmaBuf);
    }
    drop(mr);
}
