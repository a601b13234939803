//! Typed backend options: each backend declares the `key=value` options it
//! understands ([`OptionSpec`], with unit and default), and
//! [`OptionSet::parse`] refuses unknown keys and bad values with the list of
//! valid keys before the backend does anything.
//!
//! The CLI's `--help`, the docs and the Python/C layers list options from
//! [`specs`]. Values come from [`TransportConfig::options`] (`--option`,
//! Python `options=`, C `kvwire_options`).

use std::str::FromStr;

use super::{TransportConfig, TransportError, TransportKind};

/// One option a backend understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionSpec {
    /// The key, as in `key=value`.
    pub key: &'static str,
    /// What the value is, with its unit (`bytes`, `ms`, a count, an address).
    pub value: &'static str,
    /// The default, as a person reads it.
    pub default: &'static str,
    /// One line on what it does.
    pub help: &'static str,
}

const fn spec(key: &'static str, value: &'static str, default: &'static str, help: &'static str) -> OptionSpec {
    OptionSpec { key, value, default, help }
}

/// Options of the `shm` backend.
pub const SHM_OPTIONS: &[OptionSpec] = &[
    spec(
        "allow_uids",
        "comma-separated uids",
        "none (only the agent's own uid)",
        "other uids allowed to connect (SO_PEERCRED); they still need the agent's secret",
    ),
    spec(
        "cma",
        "allow or deny",
        "allow",
        "reach memory without a whole sealed memfd by cross-memory attach (the peer can then reach the whole process)",
    ),
    NOTIF_QUEUE_COUNT,
    NOTIF_QUEUE_BYTES,
];

/// Options of the `tcp` backend.
pub const TCP_OPTIONS: &[OptionSpec] = &[
    spec(
        "listen",
        "IP:PORT",
        "$KVWIRE_TCP_LISTEN, else 0.0.0.0:0 (127.0.0.1:0 on a loopback-only host)",
        "address the target listens on",
    ),
    spec(
        "advertise",
        "IP or IP:PORT",
        "the listen address; on 0.0.0.0 the default-route interface's address",
        "address published to peers in the agent metadata",
    ),
    spec(
        "conns_per_peer",
        "count 1..=64",
        "half the cores, 2..=8",
        "TCP connections (and worker threads) per connected peer",
    ),
    spec(
        "max_preauth",
        "count >= 1",
        "64",
        "connections that have not yet proved the agent secret, at most (the oldest is dropped for a new one)",
    ),
    NOTIF_QUEUE_COUNT,
    NOTIF_QUEUE_BYTES,
];

const NOTIF_QUEUE_COUNT: OptionSpec = spec(
    "notif_queue_count",
    "count >= 1",
    "65536",
    "notifications held until take_notifications; more are refused (sender: overloaded)",
);
const NOTIF_QUEUE_BYTES: OptionSpec = spec(
    "notif_queue_bytes",
    "bytes >= 1",
    "67108864 (64 MiB)",
    "notification payload bytes held until take_notifications; more are refused (sender: overloaded)",
);

/// Options of the `verbs` backend.
pub const VERBS_OPTIONS: &[OptionSpec] = &[
    spec("device", "name", "$KVWIRE_RDMA_DEVICE, else the first active device", "RDMA device (see `kvwire devices`)"),
    spec("port", "port number", "1", "HCA port"),
    spec("gid_index", "index", "auto (RoCE v2 IPv4-mapped GID)", "GID table index (RoCE)"),
    spec("listen", "IP", "the GID's IPv4 address, else 127.0.0.1", "address of the connection handshake listener"),
    spec("timeout", "4.096 µs × 2^value, 0..=31", "14 (≈ 67 ms); 18 (≈ 1 s) on rxe/siw", "QP local ACK timeout"),
    spec("retry_cnt", "count 0..=7", "6", "QP transport retries (7 = forever on rxe)"),
    spec(
        "progress_timeout_ms",
        "ms, > 0",
        "2 × peer_timeout",
        "a QP with work in flight and no completion for this long fails its transfers",
    ),
    spec("max_send_wr", "work requests", "1024", "send queue depth per QP"),
    spec("signal_every", "work requests", "32", "request a completion every N WRs"),
    spec("post_list", "work requests", "64", "most WRs chained into one ibv_post_send"),
    spec("post_bytes", "bytes (0 = no limit)", "65536 on software devices, else 0", "bytes per ibv_post_send"),
    spec("poll_sleep_us", "µs", "50", "progress thread sleep when idle"),
    spec("idle_yields", "count", "192; 5000 on software devices", "yields before the progress thread sleeps"),
    spec("qps_per_peer", "count 1..=64", "1", "queue pairs per connected peer"),
    spec("cq_size", "entries", "device max, 256..=65536", "completion queue entries"),
    spec("cq_events", "0 or 1", "1", "sleep on completion events instead of polling"),
    spec(
        "coalesce",
        "0 or 1",
        "1",
        "registrations inside a live memory region, or abutting in one list, share one MR (docs/VERBS.md)",
    ),
    spec(
        "notif_queue_count",
        "count >= 1",
        "1024 per connected peer",
        "a peer's notifications held until take_notifications; past it its receives are not reposted and its SENDs wait (RNR), its later posts fail overloaded",
    ),
    spec(
        "notif_queue_bytes",
        "bytes >= 1",
        "4194304 (4 MiB) per connected peer",
        "a peer's notification payload bytes held until take_notifications; as notif_queue_count",
    ),
    spec(
        "max_preauth",
        "count >= 1",
        "64",
        "handshake connections that have not yet proved the agent secret, at most (the oldest is closed for a new one)",
    ),
];

/// The options backend `kind` understands.
pub fn specs(kind: TransportKind) -> &'static [OptionSpec] {
    match kind {
        TransportKind::Shm => SHM_OPTIONS,
        TransportKind::Tcp => TCP_OPTIONS,
        TransportKind::Verbs => VERBS_OPTIONS,
    }
}

/// The options given to one backend, checked against its specs.
#[derive(Debug)]
pub struct OptionSet<'a> {
    backend: TransportKind,
    given: &'a [(String, String)],
}

fn valid_keys(specs: &[OptionSpec]) -> String {
    if specs.is_empty() {
        return "none".to_string();
    }
    specs.iter().map(|s| s.key).collect::<Vec<_>>().join(", ")
}

impl<'a> OptionSet<'a> {
    /// Check `config.options` against `kind`'s specs.
    ///
    /// # Errors
    /// [`TransportError::InvalidOption`] for a key the backend does not
    /// know (the message lists the valid keys).
    pub fn parse(kind: TransportKind, config: &'a TransportConfig) -> Result<Self, TransportError> {
        let specs = specs(kind);
        for (k, _) in &config.options {
            if !specs.iter().any(|s| s.key == k) {
                return Err(TransportError::InvalidOption {
                    backend: kind,
                    key: k.clone(),
                    reason: format!("unknown option (valid {kind} options: {})", valid_keys(specs)),
                });
            }
        }
        Ok(Self { backend: kind, given: &config.options })
    }

    /// The raw value of `key` (the last one given wins).
    pub fn raw(&self, key: &str) -> Option<&'a str> {
        self.given.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// `key` parsed as `T`, `None` when not given.
    ///
    /// # Errors
    /// [`TransportError::InvalidOption`] naming the key, the value and what
    /// was expected (from the spec).
    pub fn get<T: FromStr>(&self, key: &str) -> Result<Option<T>, TransportError> {
        let Some(v) = self.raw(key) else { return Ok(None) };
        v.trim().parse().map(Some).map_err(|_| self.invalid(key, v, None))
    }

    /// `key` parsed as `T` and checked by `ok`, or `default` when not given.
    ///
    /// # Errors
    /// [`TransportError::InvalidOption`] when it does not parse or `ok` refuses it.
    pub fn get_checked<T: FromStr>(&self, key: &str, default: T, ok: impl Fn(&T) -> bool) -> Result<T, TransportError> {
        match self.get::<T>(key)? {
            None => Ok(default),
            Some(v) if ok(&v) => Ok(v),
            Some(_) => Err(self.invalid(key, self.raw(key).unwrap_or_default(), Some("out of range"))),
        }
    }

    /// The error for `key=value`.
    pub fn invalid(&self, key: &str, value: &str, why: Option<&str>) -> TransportError {
        let expected = specs(self.backend).iter().find(|s| s.key == key).map_or("?", |s| s.value);
        let why = why.map(|w| format!("{w}; ")).unwrap_or_default();
        TransportError::InvalidOption {
            backend: self.backend,
            key: key.to_string(),
            reason: format!("value {value:?} is not valid ({why}expected {expected})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(opts: &[(&str, &str)]) -> TransportConfig {
        TransportConfig {
            options: opts.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..TransportConfig::default()
        }
    }

    #[test]
    fn unknown_keys_are_refused_with_the_valid_list() {
        let c = cfg(&[("conn_per_peer", "4")]);
        let e = OptionSet::parse(TransportKind::Tcp, &c).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, TransportError::InvalidOption { ref key, .. } if key == "conn_per_peer"), "{msg}");
        assert!(msg.contains("conns_per_peer") && msg.contains("listen"), "{msg}");
        let c = cfg(&[("anything", "1")]);
        assert!(OptionSet::parse(TransportKind::Shm, &c).unwrap_err().to_string().contains("allow_uids"));
    }

    #[test]
    fn values_parse_or_name_the_key_and_expectation() {
        let c = cfg(&[("retry_cnt", "9"), ("port", "x"), ("qps_per_peer", "2"), ("qps_per_peer", "3")]);
        let o = OptionSet::parse(TransportKind::Verbs, &c).unwrap();
        assert_eq!(o.get::<u32>("qps_per_peer").unwrap(), Some(3), "last one wins");
        assert_eq!(o.get::<u32>("cq_size").unwrap(), None);
        let e = o.get::<u8>("port").unwrap_err().to_string();
        assert!(e.contains("port") && e.contains("\"x\""), "{e}");
        let e = o.get_checked::<u8>("retry_cnt", 7, |v| *v <= 7).unwrap_err().to_string();
        assert!(e.contains("out of range") && e.contains("0..=7"), "{e}");
        assert_eq!(o.get_checked::<u32>("max_send_wr", 1024, |_| true).unwrap(), 1024);
    }
}
