//! Devices, the device context, ports and GID tables.

use std::ffi::CStr;
use std::ptr::NonNull;

use super::ffi::*;
use super::loader::{Verbs, verbs};
use super::{VerbsError, record_drop_failure};

/// An open device (`struct ibv_context`). Closed on drop, after every object
/// created from it (they hold an `Arc<Context>`).
pub struct Context {
    pub(crate) raw: NonNull<ibv_context>,
    pub(crate) lib: &'static Verbs,
    name: String,
    attr: ibv_device_attr,
}

// SAFETY: libibverbs contexts may be used from any thread; every call that
// needs serialisation takes `&mut` on the object it serialises.
unsafe impl Send for Context {}
// SAFETY: as above; shared (`&`) use only calls thread-safe verbs.
unsafe impl Sync for Context {}

/// The names of the RDMA devices present (empty when none).
///
/// # Errors
/// [`VerbsError::Unsupported`] when libibverbs cannot be loaded.
pub fn device_names() -> Result<Vec<String>, VerbsError> {
    let lib = verbs()?;
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { (lib.get_device_list)(&mut n) };
    if list.is_null() {
        let err = VerbsError::call("ibv_get_device_list", 0);
        // ENOSYS: the kernel has no RDMA support (no ib_uverbs): no devices.
        if matches!(&err, VerbsError::Call { source, .. } if source.raw_os_error() == Some(libc::ENOSYS)) {
            return Ok(Vec::new());
        }
        return Err(err);
    }
    let mut names = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers.
        let dev = unsafe { *list.add(i) };
        // SAFETY: `dev` is valid until the list is freed; the name is a
        // NUL-terminated string inside it.
        let name = unsafe { CStr::from_ptr((lib.get_device_name)(dev)) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { (lib.free_device_list)(list) };
    Ok(names)
}

/// The error for "device `name` (or any, for `None`) is not here"; `seen`
/// lists the devices that are.
fn no_device(name: Option<&str>, seen: &[String]) -> VerbsError {
    VerbsError::Unsupported(match (name, seen.is_empty()) {
        (Some(w), true) => format!("no RDMA device named {w:?}: no RDMA device found (see `kvwire devices`)"),
        (Some(w), false) => {
            format!("no RDMA device named {w:?} (found: {}; see `kvwire devices`)", seen.join(", "))
        }
        (None, _) => "no RDMA device found (see `kvwire devices`)".into(),
    })
}

impl Context {
    /// Open device `name` (e.g. `rxe0`, `mlx5_0`), or the first one for `None`.
    ///
    /// # Errors
    /// [`VerbsError::Unsupported`] (no library, no such device),
    /// [`VerbsError::Call`] for `ibv_open_device` / `ibv_query_device`.
    pub fn open(name: Option<&str>) -> Result<Self, VerbsError> {
        let lib = verbs()?;
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed below.
        let list = unsafe { (lib.get_device_list)(&mut n) };
        if list.is_null() {
            let err = VerbsError::call("ibv_get_device_list", 0);
            // ENOSYS: the kernel has no RDMA support (no ib_uverbs): no devices.
            if matches!(&err, VerbsError::Call { source, .. } if source.raw_os_error() == Some(libc::ENOSYS)) {
                return Err(no_device(name, &[]));
            }
            return Err(err);
        }
        let mut found = None;
        let mut seen = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` valid device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: valid device, NUL-terminated name.
            let dev_name = unsafe { CStr::from_ptr((lib.get_device_name)(dev)) }.to_string_lossy().into_owned();
            if found.is_none() && name.is_none_or(|w| w == dev_name) {
                found = Some((dev, dev_name.clone()));
            }
            seen.push(dev_name);
        }
        let result = match found {
            None => Err(no_device(name, &seen)),
            Some((dev, dev_name)) => {
                // SAFETY: `dev` is valid while the list is alive (freed below,
                // which the API allows after opening).
                let ctx = unsafe { (lib.open_device)(dev) };
                match NonNull::new(ctx) {
                    None => Err(VerbsError::call("ibv_open_device", 0)),
                    Some(raw) => Ok((raw, dev_name)),
                }
            }
        };
        // SAFETY: freed once; opened contexts stay valid.
        unsafe { (lib.free_device_list)(list) };
        let (raw, name) = result?;
        // SAFETY: all-zero is a valid ibv_device_attr (plain integers).
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `raw` is an open context, `attr` a valid out-pointer.
        let rc = unsafe { (lib.query_device)(raw.as_ptr(), &mut attr) };
        let ctx = Self { raw, lib, name, attr };
        if rc != 0 {
            return Err(VerbsError::call("ibv_query_device", rc));
        }
        Ok(ctx)
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Device attributes as queried at open.
    pub fn attr(&self) -> &ibv_device_attr {
        &self.attr
    }

    /// Whether this is a software RDMA device (Soft-RoCE `rxe`, vendor id
    /// 0xffffff, or Soft-iWARP `siw`, 0x626d74), whose data path runs in the
    /// kernel: each `ibv_post_send` is a system call that runs the requester
    /// in the caller's context.
    pub fn is_software(&self) -> bool {
        matches!(self.attr.vendor_id, 0x00ff_ffff | 0x0062_6d74)
    }

    /// Query port `port` (1-based).
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_query_port`.
    pub fn query_port(&self, port: u8) -> Result<ibv_port_attr, VerbsError> {
        let mut attr = ibv_port_attr::default();
        // SAFETY: open context; `attr` is zeroed and at least as large as
        // the compat struct the IBVERBS_1.1 symbol fills.
        let rc = unsafe { (self.lib.query_port)(self.raw.as_ptr(), port, &mut attr) };
        if rc != 0 {
            return Err(VerbsError::call("ibv_query_port", rc));
        }
        Ok(attr)
    }

    /// GID `index` of `port`.
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_query_gid`.
    pub fn query_gid(&self, port: u8, index: i32) -> Result<ibv_gid, VerbsError> {
        let mut gid = ibv_gid::default();
        // SAFETY: open context, valid out-pointer.
        let rc = unsafe { (self.lib.query_gid)(self.raw.as_ptr(), port, index, &mut gid) };
        if rc != 0 {
            return Err(VerbsError::call("ibv_query_gid", rc));
        }
        Ok(gid)
    }

    /// The GID table of `port` with each entry's type from sysfs.
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_query_port`.
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>, VerbsError> {
        let attr = self.query_port(port)?;
        let mut out = Vec::new();
        for index in 0..attr.gid_tbl_len.max(0) {
            let Ok(gid) = self.query_gid(port, index) else {
                continue;
            };
            if gid.raw == [0; 16] {
                continue;
            }
            let kind = std::fs::read_to_string(format!(
                "/sys/class/infiniband/{}/ports/{port}/gid_attrs/types/{index}",
                self.name
            ))
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
            let netdev = std::fs::read_to_string(format!(
                "/sys/class/infiniband/{}/ports/{port}/gid_attrs/ndevs/{index}",
                self.name
            ))
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
            out.push(GidEntry { index: index as u32, gid, kind, netdev });
        }
        Ok(out)
    }

    /// Pick the GID index for RoCE: a RoCE v2 entry holding an IPv4-mapped
    /// address, else any RoCE v2 entry, else the first valid one.
    ///
    /// # Errors
    /// [`VerbsError::Unsupported`] when the table is empty.
    pub fn auto_gid_index(&self, port: u8) -> Result<u32, VerbsError> {
        let table = self.gid_table(port)?;
        let v2 = |e: &&GidEntry| e.kind.eq_ignore_ascii_case("RoCE v2");
        table
            .iter()
            .filter(v2)
            .find(|e| e.is_ipv4_mapped())
            .or_else(|| table.iter().find(v2))
            .or_else(|| table.first())
            .map(|e| e.index)
            .ok_or_else(|| VerbsError::Unsupported(format!("{} port {port} has no valid GID", self.name)))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every child object holds an Arc<Context>, so none is alive.
        let rc = unsafe { (self.lib.close_device)(self.raw.as_ptr()) };
        if rc != 0 {
            record_drop_failure("ibv_close_device", rc);
        }
    }
}

/// One GID table entry.
#[derive(Debug, Clone)]
pub struct GidEntry {
    /// Index in the port's table.
    pub index: u32,
    /// The GID.
    pub gid: ibv_gid,
    /// `IB/RoCE v1` or `RoCE v2` (sysfs `gid_attrs/types`), empty if unknown.
    pub kind: String,
    /// Network device of a RoCE GID (sysfs `gid_attrs/ndevs`).
    pub netdev: String,
}

impl GidEntry {
    /// True for `::ffff:a.b.c.d`.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.gid.raw[..10] == [0; 10] && self.gid.raw[10..12] == [0xff, 0xff]
    }

    /// The GID as IPv6 text (`fe80::...`, `::ffff:192.0.2.1`).
    pub fn to_ip_string(&self) -> String {
        std::net::Ipv6Addr::from(self.gid.raw).to_string()
    }
}

/// A port summary for `kvwire devices`.
#[derive(Debug, Clone)]
pub struct PortInfo {
    /// 1-based port number.
    pub port: u8,
    /// The port attributes.
    pub attr: ibv_port_attr,
    /// The GID table.
    pub gids: Vec<GidEntry>,
}

/// A device summary for `kvwire devices`.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Device name.
    pub name: String,
    /// Firmware version.
    pub fw_ver: String,
    /// Node GUID (host order).
    pub node_guid: u64,
    /// Device attributes.
    pub attr: ibv_device_attr,
    /// Its ports.
    pub ports: Vec<PortInfo>,
}

/// Open every device and describe it.
///
/// # Errors
/// [`VerbsError::Unsupported`] when libibverbs is missing.
pub fn list_devices() -> Result<Vec<Result<DeviceInfo, VerbsError>>, VerbsError> {
    let names = device_names()?;
    Ok(names
        .iter()
        .map(|n| {
            let ctx = Context::open(Some(n))?;
            let attr = *ctx.attr();
            // SAFETY: fw_ver is a NUL-terminated C string within its array.
            let fw_ver = unsafe { CStr::from_ptr(attr.fw_ver.as_ptr()) }.to_string_lossy().into_owned();
            let mut ports = Vec::new();
            for port in 1..=attr.phys_port_cnt {
                let pattr = ctx.query_port(port)?;
                let gids = ctx.gid_table(port).unwrap_or_default();
                ports.push(PortInfo { port, attr: pattr, gids });
            }
            Ok(DeviceInfo { name: n.clone(), fw_ver, node_guid: u64::from_be(attr.node_guid), attr, ports })
        })
        .collect())
}

/// Bytes of an `enum ibv_mtu` value (0 when unknown).
pub fn mtu_bytes(mtu: u32) -> u32 {
    if (1..=5).contains(&mtu) { 128 << mtu } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_device_says_so_and_points_to_kvwire_devices() {
        let none = no_device(None, &[]).to_string();
        assert_eq!(none, "no RDMA device found (see `kvwire devices`)");
        let named = no_device(Some("mlx5_9"), &["rxe0".into(), "siw0".into()]).to_string();
        assert_eq!(named, "no RDMA device named \"mlx5_9\" (found: rxe0, siw0; see `kvwire devices`)");
        assert!(no_device(Some("mlx5_9"), &[]).to_string().ends_with("no RDMA device found (see `kvwire devices`)"));
    }
}
