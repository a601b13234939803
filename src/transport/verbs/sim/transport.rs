//! The verbs transport over the simulated NIC: [`VerbsTransport::on_sim`]
//! (feature `sim`; see the parent module for what the fabric models).

use std::time::Duration;

use super::{DEFAULT_READ_DEPTH, SimFabric, SimNic};
use crate::transport::auth::AgentSecret;
use crate::transport::verbs::state::PostLimits;
use crate::transport::verbs::{Given, Setup, VerbsTransport};
use crate::transport::{TransportConfig, TransportError};
use crate::verbs::QpOptions;

impl VerbsTransport<SimNic> {
    /// The transport over a new device of the simulated `fabric` (feature
    /// `sim`: tests and benches only; the CLI, the Python wheel and the C
    /// library never link it): the same connection handshake, liveness
    /// channel, reconnects, registration table and progress engine as over
    /// libibverbs, two transports on one fabric connecting their QPs by the
    /// QP numbers the handshake exchanged. Registered host memory is moved
    /// for real (`SimFabric::register_host`); keys, bounds and faults are
    /// the simulator's (`IBV_WC_REM_ACCESS_ERR`, ...), and so is progress:
    /// the fabric moves only when someone steps it, so give it
    /// `World::auto_step` > 0 (each `poll_cq` of a progress thread then runs
    /// that many steps).
    ///
    /// Options as for [`new`](VerbsTransport::new); those naming hardware
    /// (`device`, `port`, `gid_index`, `timeout`, `cq_events`) are checked
    /// and otherwise ignored. Defaults: `cq_size` 4096, `post_bytes` 0,
    /// `idle_yields` 192; the listener binds `listen` (default 127.0.0.1).
    /// VRAM cannot be registered.
    ///
    /// # Errors
    /// [`TransportError::InvalidOption`] for an unknown key or a bad value;
    /// [`TransportError::Io`] for the listener and the threads.
    pub fn on_sim(agent: &str, config: &TransportConfig, fabric: &SimFabric) -> Result<Self, TransportError> {
        config.validate()?;
        let o = Given::parse(config)?;
        let secret = AgentSecret::random()?;
        let max_send_wr = o.max_send_wr.clamp(1, 1 << 15);
        let limits = PostLimits {
            max_send_wr,
            signal_every: o.signal_every.clamp(1, max_send_wr),
            max_batch: o.post_list.clamp(1, 1024),
            batch_bytes: o.post_bytes.unwrap_or(0),
            poll_sleep_us: o.poll_sleep_us.clamp(1, 100_000),
            idle_yields: o.idle_yields.unwrap_or(192).min(1_000_000),
        };
        let read_depth = DEFAULT_READ_DEPTH as u8;
        let qp_options = QpOptions {
            port: o.port,
            gid_index: o.gid_index,
            timeout: o.timeout.unwrap_or(14),
            retry_cnt: o.retry_cnt,
            rnr_retry: 7,
            max_rd_atomic: read_depth,
            max_dest_rd_atomic: read_depth,
            min_rnr_timer: 12,
        };
        let num_cqe = o.cq_size.unwrap_or(4096).clamp(128, 1 << 20);
        let setup = Setup {
            nic: fabric.new_device(num_cqe as usize),
            secret,
            qp_options,
            limits,
            num_cqe: num_cqe as u32,
            listen_ip: o.listen.clone().unwrap_or_else(|| "127.0.0.1".into()),
            progress_timeout: match o.progress_timeout_ms {
                None => config.peer_timeout.saturating_mul(2),
                Some(ms) => Duration::from_millis(ms),
            },
            qps_per_peer: o.qps_per_peer.clamp(1, 64),
            max_send_wr,
            coalesce: o.coalesce,
            notif_bounds: o.notif_bounds,
            max_preauth: o.max_preauth,
        };
        VerbsTransport::start(agent, config, setup)
    }
}
