//! `kvwire devices`: RDMA devices, ports, state, active MTU, link layer and
//! GID tables with their RoCE version (like `ibv_devinfo -v` / `show_gids`),
//! then the GPUs the CUDA driver reports (`kvwire::cuda::probe`) with the
//! PCIe-local RDMA device of each.

use anyhow::{Result, bail};
use clap::Args;
use kvwire::cuda;
use kvwire::verbs::ffi::{IBV_LINK_LAYER_ETHERNET, IBV_LINK_LAYER_INFINIBAND};
use kvwire::verbs::{self, DeviceInfo};

use crate::failure::user_error;
use crate::units::human;

/// Arguments of `kvwire devices`.
#[derive(Debug, Args)]
pub(crate) struct DevicesArgs {
    /// Only this RDMA device (e.g. rxe0, mlx5_0); fails when it is not there.
    #[arg(long)]
    pub device: Option<String>,
    /// Only this GPU (CUDA ordinal); fails when it is not there.
    #[arg(long)]
    pub gpu: Option<u32>,
}

fn port_state(s: u32) -> &'static str {
    match s {
        0 => "NOP",
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "?",
    }
}

fn link_layer(l: u8) -> &'static str {
    match l {
        IBV_LINK_LAYER_INFINIBAND => "InfiniBand",
        IBV_LINK_LAYER_ETHERNET => "Ethernet",
        _ => "unspecified",
    }
}

fn print_device(d: &DeviceInfo) {
    println!("{}", d.name);
    println!("  fw_ver: {}  node_guid: {:016x}  phys_port_cnt: {}", d.fw_ver, d.node_guid, d.attr.phys_port_cnt);
    println!(
        "  max_qp: {}  max_qp_wr: {}  max_cqe: {}  max_mr_size: {}  max_qp_rd_atom: {}",
        d.attr.max_qp, d.attr.max_qp_wr, d.attr.max_cqe, d.attr.max_mr_size, d.attr.max_qp_rd_atom
    );
    for p in &d.ports {
        let a = &p.attr;
        println!(
            "  port {}: state {} ({})  active_mtu {} ({})  max_mtu {}  link_layer {}  lid {}  gid_tbl_len {}",
            p.port,
            port_state(a.state),
            a.state,
            verbs::context::mtu_bytes(a.active_mtu),
            a.active_mtu,
            verbs::context::mtu_bytes(a.max_mtu),
            link_layer(a.link_layer),
            a.lid,
            a.gid_tbl_len
        );
        if p.gids.is_empty() {
            println!("    (no valid GID)");
        }
        for g in &p.gids {
            let kind = if g.kind.is_empty() { "?" } else { g.kind.as_str() };
            let v4 = if g.is_ipv4_mapped() { "  (IPv4-mapped)" } else { "" };
            println!("    GID[{:3}] {:<40} {:<12} {}{}", g.index, g.to_ip_string(), kind, g.netdev, v4);
        }
    }
}

/// Run `kvwire devices`.
///
/// # Errors
/// `--device` names an RDMA device that is not there, or `--gpu` a GPU that
/// is not there. A machine without RDMA or GPUs is not an error: it says so.
pub(crate) fn run(args: &DevicesArgs) -> Result<()> {
    let all = args.device.is_none() && args.gpu.is_none();
    if args.device.is_some() || all {
        rdma(args.device.as_deref())?;
    }
    if args.gpu.is_some() || all {
        gpus(args.gpu)?;
    }
    Ok(())
}

fn rdma(only: Option<&str>) -> Result<()> {
    let devices = match verbs::list_devices() {
        Ok(d) => d,
        Err(e) => {
            if let Some(w) = only {
                return Err(user_error(
                    format!("no RDMA device {w:?}: RDMA is not available here ({e})"),
                    "install rdma-core and a provider (apt-get install rdma-core ibverbs-providers), or use --transport tcp",
                ));
            }
            println!("RDMA: none ({e})");
            return Ok(());
        }
    };
    let mut names = Vec::new();
    let mut shown = 0;
    for d in devices {
        match d {
            Ok(d) => {
                if only.is_none_or(|w| w == d.name) {
                    print_device(&d);
                    shown += 1;
                }
                names.push(d.name);
            }
            Err(e) => println!("(an RDMA device failed to open: {e})"),
        }
    }
    match only {
        Some(w) if shown == 0 => Err(user_error(
            format!(
                "no RDMA device named {w:?} (found: {})",
                if names.is_empty() { "none".into() } else { names.join(", ") }
            ),
            "`kvwire devices` lists them; Soft-RoCE adds one: rdma link add rxe0 type rxe netdev eth0",
        )),
        None if names.is_empty() => {
            println!(
                "RDMA: no device found (libibverbs loaded; load a driver or add a Soft-RoCE link: rdma link add rxe0 type rxe netdev eth0)"
            );
            Ok(())
        }
        _ => Ok(()),
    }
}

fn gpus(only: Option<u32>) -> Result<()> {
    let r = cuda::probe();
    let found: Vec<&cuda::GpuInfo> = r.devices.iter().filter(|g| only.is_none_or(|o| o == g.ordinal)).collect();
    if let Some(o) = only
        && found.is_empty()
    {
        let why = r
            .unavailable
            .clone()
            .unwrap_or_else(|| format!("{} GPU(s), ordinals 0..{}", r.devices.len(), r.devices.len()));
        bail!("no GPU {o} ({why})");
    }
    if r.devices.is_empty() {
        println!("GPU: none ({})", r.unavailable.unwrap_or_else(|| "the driver lists no device".into()));
        return Ok(());
    }
    if let Some((major, minor)) = r.driver_version {
        println!("CUDA driver {major}.{minor}");
    }
    for g in found {
        let nic = match cuda::nic::nic_for_gpu(&g.pci_bus_id, None) {
            Ok(Some(n)) => n,
            Ok(None) => "none".into(),
            Err(e) => format!("unknown ({e})"),
        };
        println!(
            "GPU {}: {}  pci {}  memory {}  dma-buf {}  GPUDirect RDMA {}  nearest RDMA device {}",
            g.ordinal,
            g.name,
            g.pci_bus_id,
            human(g.total_mem_bytes),
            if g.dma_buf_supported { "yes" } else { "no" },
            if g.gpudirect_rdma_supported { "yes" } else { "no" },
            nic
        );
    }
    Ok(())
}
