//! `kvwire devices`: RDMA devices, ports, state, active MTU, link layer and
//! GID tables with their RoCE version (like `ibv_devinfo -v` / `show_gids`).

use anyhow::Result;
use clap::Args;
use kvwire::verbs::ffi::{IBV_LINK_LAYER_ETHERNET, IBV_LINK_LAYER_INFINIBAND};
use kvwire::verbs::{self, DeviceInfo};

/// Arguments of `kvwire devices`.
#[derive(Debug, Args)]
pub struct DevicesArgs {
    /// Only this device (e.g. rxe0, mlx5_0).
    #[arg(long)]
    pub device: Option<String>,
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
/// Never for a missing library or device (a message is printed instead).
pub fn run(args: &DevicesArgs) -> Result<()> {
    let devices = match verbs::list_devices() {
        Ok(d) => d,
        Err(e) => {
            println!("no RDMA support here: {e}");
            return Ok(());
        }
    };
    if devices.is_empty() {
        println!(
            "no RDMA devices found (libibverbs loaded; load a driver or add a Soft-RoCE link: rdma link add rxe0 type rxe netdev eth0)"
        );
        return Ok(());
    }
    let mut shown = 0;
    for d in devices {
        match d {
            Ok(d) if args.device.as_deref().is_none_or(|w| w == d.name) => {
                print_device(&d);
                shown += 1;
            }
            Ok(_) => {}
            Err(e) => println!("(device failed to open: {e})"),
        }
    }
    if shown == 0
        && let Some(w) = &args.device
    {
        println!("no RDMA device named {w}");
    }
    Ok(())
}
