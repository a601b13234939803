//! NIC selection per GPU: the RDMA device whose PCIe path in sysfs shares the
//! longest prefix with the GPU's (the same PCIe switch beats the same root
//! complex beats another socket), as MAX picks `UCX_NET_DEVICES`
//! (MAX `_ucx_env.py`). Registering GPU memory only on its PCIe-local NIC also
//! avoids the multiplied registration cost of registering on every NIC
//! (7x on p5 instances, Mooncake issue #3217).
//!
//! The choice is a pure function over path strings ([`select_nic`]); the
//! sysfs reader ([`rdma_devices`], [`gpu_pci_path`]) takes the sysfs root as a
//! parameter so that tests run against a fake tree.

use std::io;
use std::path::{Path, PathBuf};

/// Environment variable that overrides the choice with one RDMA device name
/// (e.g. `mlx5_3`) for every GPU of the process.
pub const NIC_OVERRIDE_ENV: &str = "KVWIRE_RDMA_DEVICE";

/// An RDMA device and the canonical sysfs path of its PCIe function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicCandidate {
    /// Device name, as in `/sys/class/infiniband/<name>` (e.g. `mlx5_0`).
    pub name: String,
    /// Canonical path, e.g. `/sys/devices/pci0000:16/0000:16:02.0/0000:17:00.0`.
    pub pci_path: String,
}

/// Number of leading path components `a` and `b` share.
pub fn common_prefix_components(a: &str, b: &str) -> usize {
    a.split('/')
        .filter(|c| !c.is_empty())
        .zip(b.split('/').filter(|c| !c.is_empty()))
        .take_while(|(x, y)| x == y)
        .count()
}

/// The candidate whose PCIe path shares the most leading components with
/// `gpu_pci_path`; ties go to the lowest name. `None` when there is no
/// candidate.
pub fn select_nic<'a>(gpu_pci_path: &str, candidates: &'a [NicCandidate]) -> Option<&'a NicCandidate> {
    candidates.iter().min_by(|a, b| {
        let (pa, pb) =
            (common_prefix_components(gpu_pci_path, &a.pci_path), common_prefix_components(gpu_pci_path, &b.pci_path));
        pb.cmp(&pa).then_with(|| a.name.cmp(&b.name))
    })
}

/// The sysfs form of a CUDA PCIe bus id: lower-case, with a 4-digit domain
/// (`cuDeviceGetPCIBusId` gives `0000:3B:00.0`, NVML `00000000:3B:00.0`;
/// sysfs names `0000:3b:00.0`).
pub fn normalize_bus_id(bus_id: &str) -> String {
    let lower = bus_id.trim().to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 && domain[..domain.len() - 4].bytes().all(|b| b == b'0') => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => lower,
    }
}

/// Canonical sysfs path of the GPU with PCIe bus id `bus_id`:
/// `realpath(<sysfs_root>/bus/pci/devices/<bus id>)`.
///
/// # Errors
/// The I/O error of resolving the link (no such device).
pub fn gpu_pci_path(sysfs_root: &Path, bus_id: &str) -> io::Result<PathBuf> {
    sysfs_root.join("bus/pci/devices").join(normalize_bus_id(bus_id)).canonicalize()
}

/// RDMA devices under `<sysfs_root>/class/infiniband`, each with the
/// canonical path of its `device` link, sorted by name. With `require_active`,
/// only devices with at least one port whose `state` reads `ACTIVE`.
///
/// # Errors
/// The I/O error of listing the class directory; a missing directory (no
/// RDMA stack) is an empty list, not an error.
pub fn rdma_devices(sysfs_root: &Path, require_active: bool) -> io::Result<Vec<NicCandidate>> {
    let class = sysfs_root.join("class/infiniband");
    let entries = match std::fs::read_dir(&class) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(path) = entry.path().join("device").canonicalize() else { continue };
        if require_active && !has_active_port(&entry.path()) {
            continue;
        }
        out.push(NicCandidate { name, pci_path: path.to_string_lossy().into_owned() });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

fn has_active_port(dev: &Path) -> bool {
    let Ok(ports) = std::fs::read_dir(dev.join("ports")) else { return false };
    ports.flatten().any(|p| std::fs::read_to_string(p.path().join("state")).is_ok_and(|s| s.contains("ACTIVE")))
}

/// The RDMA device for the GPU with PCIe bus id `bus_id`: `override_name` if
/// given, else `$KVWIRE_RDMA_DEVICE` if set, else the closest device with an
/// active port in `/sys` ([`select_nic`]). `None` when there is none.
///
/// # Errors
/// The I/O error of reading sysfs (the GPU's bus id not found there).
pub fn nic_for_gpu(bus_id: &str, override_name: Option<&str>) -> io::Result<Option<String>> {
    if let Some(name) = override_name {
        return Ok(Some(name.to_owned()));
    }
    if let Ok(name) = std::env::var(NIC_OVERRIDE_ENV)
        && !name.trim().is_empty()
    {
        return Ok(Some(name.trim().to_owned()));
    }
    nic_for_gpu_in(Path::new("/sys"), bus_id)
}

/// The RDMA device for the GPU with CUDA ordinal `ordinal`: [`nic_for_gpu`]
/// (overrides included) on its PCIe bus id from [`probe`](super::probe).
/// `None` when there is no such GPU (no driver, no feature), no RDMA device
/// with an active port, or sysfs cannot resolve the GPU.
pub fn nic_for_gpu_ordinal(ordinal: u32) -> Option<String> {
    let report = super::probe();
    let gpu = report.devices.iter().find(|g| g.ordinal == ordinal)?;
    match nic_for_gpu(&gpu.pci_bus_id, None) {
        Ok(nic) => nic,
        Err(e) => {
            tracing::debug!("no NIC for GPU {ordinal} ({}): {e}", gpu.pci_bus_id);
            None
        }
    }
}

/// [`nic_for_gpu`] without overrides, against the sysfs tree at `sysfs_root`.
///
/// # Errors
/// As [`nic_for_gpu`].
pub fn nic_for_gpu_in(sysfs_root: &Path, bus_id: &str) -> io::Result<Option<String>> {
    let candidates = rdma_devices(sysfs_root, true)?;
    if candidates.is_empty() {
        return Ok(None);
    }
    let gpu = gpu_pci_path(sysfs_root, bus_id)?;
    Ok(select_nic(&gpu.to_string_lossy(), &candidates).map(|c| c.name.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(name: &str, path: &str) -> NicCandidate {
        NicCandidate { name: name.into(), pci_path: path.into() }
    }

    #[test]
    fn longest_prefix_wins_ties_to_lowest_name() {
        let gpu = "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0";
        let nics = [
            cand("mlx5_0", "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0"),
            cand("mlx5_2", "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0"),
            cand("mlx5_1", "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:02.0/0000:1a:00.0"),
            cand("mlx5_3", "/sys/devices/pci0000:15/0000:15:02.0/0000:20:00.0"),
        ];
        assert_eq!(select_nic(gpu, &nics).unwrap().name, "mlx5_1");
        assert_eq!(select_nic(gpu, &nics[..1]).unwrap().name, "mlx5_0");
        assert_eq!(select_nic(gpu, &nics[2..]).unwrap().name, "mlx5_1");
        assert!(select_nic(gpu, &[]).is_none());
        assert_eq!(common_prefix_components("/a/b/c", "/a/b/d"), 2);
        assert_eq!(common_prefix_components("/a/b", "/a/bc"), 1);
    }

    #[test]
    fn bus_ids_normalize_to_sysfs_names() {
        assert_eq!(normalize_bus_id("0000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_bus_id("0001:3b:00.0"), "0001:3b:00.0");
    }

    #[test]
    fn fake_sysfs_tree() {
        use std::os::unix::fs::symlink;
        let root = std::env::temp_dir().join(format!("kvwire-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dev = |p: &str| {
            let d = root.join("devices").join(p);
            std::fs::create_dir_all(&d).unwrap();
            d
        };
        let gpu = dev("pci0000:15/0000:15:01.0/0000:16:00.0/0000:18:00.0");
        let near = dev("pci0000:15/0000:15:01.0/0000:16:00.0/0000:19:00.0");
        let far = dev("pci0000:00/0000:00:01.0/0000:01:00.0");
        let down = dev("pci0000:15/0000:15:01.0/0000:16:00.0/0000:1a:00.0");
        std::fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
        symlink(&gpu, root.join("bus/pci/devices/0000:18:00.0")).unwrap();
        for (name, target, state) in
            [("mlx5_0", &far, "4: ACTIVE"), ("mlx5_1", &near, "4: ACTIVE"), ("mlx5_2", &down, "1: DOWN")]
        {
            let d = root.join("class/infiniband").join(name);
            std::fs::create_dir_all(d.join("ports/1")).unwrap();
            std::fs::write(d.join("ports/1/state"), state).unwrap();
            symlink(target, d.join("device")).unwrap();
        }
        assert_eq!(rdma_devices(&root, false).unwrap().len(), 3);
        assert_eq!(rdma_devices(&root, true).unwrap().len(), 2);
        assert_eq!(nic_for_gpu_in(&root, "00000000:18:00.0").unwrap().as_deref(), Some("mlx5_1"));
        assert!(nic_for_gpu_in(&root, "0000:99:00.0").is_err());
        assert_eq!(nic_for_gpu("0000:99:00.0", Some("mlx5_9")).unwrap().as_deref(), Some("mlx5_9"));
        assert_eq!(nic_for_gpu_in(&root.join("nonexistent"), "0000:18:00.0").unwrap(), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
