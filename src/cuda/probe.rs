//! [`probe`]: what GPUs this process can use, without ever panicking.

use serde::Serialize;

/// One GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuInfo {
    /// CUDA ordinal.
    pub ordinal: u32,
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuDeviceGetPCIBusId`, e.g. `0000:3B:00.0` (see
    /// [`normalize_bus_id`](super::nic::normalize_bus_id) for the sysfs form).
    pub pci_bus_id: String,
    /// `cuDeviceTotalMem`.
    pub total_mem_bytes: u64,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: dma-buf export works (the
    /// preferred RDMA registration path, as NVIDIA's GPUDirect RDMA docs say).
    pub dma_buf_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpudirect_rdma_supported: bool,
}

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProbeReport {
    /// `(major, minor)` of `cuDriverGetVersion`; `None` without a driver.
    pub driver_version: Option<(u32, u32)>,
    /// Usable GPUs, by ordinal (empty without a driver or GPU).
    pub devices: Vec<GpuInfo>,
    /// Why there is no GPU, when `devices` is empty (no driver, no device,
    /// built without the `cuda` feature).
    pub unavailable: Option<String>,
}

/// Devices, driver version, PCIe bus ids and dma-buf support. Never panics:
/// without `libcuda` (or without the `cuda` feature) it reports no device and
/// says why in [`ProbeReport::unavailable`].
pub fn probe() -> ProbeReport {
    imp::probe()
}

#[cfg(not(feature = "cuda"))]
mod imp {
    pub(super) fn probe() -> super::ProbeReport {
        super::ProbeReport {
            driver_version: None,
            devices: Vec::new(),
            unavailable: Some("kvwire was built without the `cuda` feature".into()),
        }
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::ffi::{CStr, c_char};

    use cudarc::driver::sys;

    use super::{GpuInfo, ProbeReport};
    use crate::cuda::CudaError;
    use crate::cuda::driver::{check, driver};

    pub(super) fn probe() -> ProbeReport {
        let st = match driver() {
            Ok(st) => st,
            Err(e) => {
                return ProbeReport { driver_version: None, devices: Vec::new(), unavailable: Some(e.to_string()) };
            }
        };
        let driver_version = Some((st.version as u32 / 1000, (st.version as u32 % 1000) / 10));
        let mut devices = Vec::new();
        let mut errors = Vec::new();
        for ordinal in 0..st.num_devices {
            match device_info(ordinal) {
                Ok(d) => devices.push(d),
                Err(e) => errors.push(format!("GPU {ordinal}: {e}")),
            }
        }
        let unavailable = match (devices.is_empty(), errors.is_empty()) {
            (false, _) => None,
            (true, true) => Some(CudaError::NoDevice { ordinal: 0, num_devices: 0 }.to_string()),
            (true, false) => Some(errors.join("; ")),
        };
        ProbeReport { driver_version, devices, unavailable }
    }

    /// One device's attribute, as `bool` (non-zero).
    pub(crate) fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32, CudaError> {
        let mut v = 0;
        // SAFETY: initialised driver, valid device, out-pointer valid.
        check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) })?;
        Ok(v)
    }

    fn device_info(ordinal: u32) -> Result<GpuInfo, CudaError> {
        let mut dev = 0;
        // SAFETY: initialised driver (checked by the caller), ordinal < count.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) })?;
        let mut name = [0 as c_char; 256];
        // SAFETY: buffer and its length match.
        check("cuDeviceGetName", unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev) })?;
        let mut bus = [0 as c_char; 64];
        // SAFETY: as above.
        check("cuDeviceGetPCIBusId", unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev) })?;
        let mut total = 0usize;
        // SAFETY: out-pointer valid.
        check("cuDeviceTotalMem_v2", unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) })?;
        use sys::CUdevice_attribute as A;
        Ok(GpuInfo {
            ordinal,
            // SAFETY: the driver NUL-terminates within the given length.
            name: unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned(),
            // SAFETY: as above.
            pci_bus_id: unsafe { CStr::from_ptr(bus.as_ptr()) }.to_string_lossy().into_owned(),
            total_mem_bytes: total as u64,
            // Older drivers reject attributes they do not know: report false.
            dma_buf_supported: attribute(dev, A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED).unwrap_or(0) != 0,
            gpudirect_rdma_supported: attribute(dev, A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED).unwrap_or(0)
                != 0,
        })
    }
}

#[cfg(feature = "cuda")]
pub(crate) use imp::attribute;
