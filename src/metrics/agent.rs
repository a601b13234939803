//! Agent-level series (issue 29): what an operator needs to see start-up,
//! registration and link health of every [`TransferEngine`]
//! (crate::engine::TransferEngine) in the process, beside MAX's transfer
//! series. Hot-path counters are atomics held by the engine (one relaxed add
//! per post, never a lock); the registry reads them when scraped.
//!
//! | metric | type | labels | unit |
//! |---|---|---|---|
//! | `kvwire_agent_startup_seconds` | histogram | `transport` | seconds from `TransferEngine::new` to ready |
//! | `kvwire_registrations_total` | counter | `transport` | registrations |
//! | `kvwire_registered_bytes_total` | counter | `transport` | bytes registered |
//! | `kvwire_registration_seconds_total` | counter | `transport` | seconds spent registering (divide by `kvwire_registered_bytes_total` / 2^30 for s/GiB) |
//! | `kvwire_regions` | gauge | `agent`, `transport` | regions an agent has registered now |
//! | `kvwire_memory_regions` | gauge | `agent`, `transport` | memory regions holding them (verbs MRs, shared by coalesced registrations; elsewhere equal to `kvwire_regions`) |
//! | `kvwire_region_coalescing_ratio` | gauge | `agent`, `transport` | `kvwire_regions` / `kvwire_memory_regions` (1 with no registration) |
//! | `kvwire_posted_descriptors_total` / `kvwire_posted_segments_total` | counter | `transport`, `nic` | descriptors callers posted / segments they became after coalescing (the ratio is the coalescing ratio) |
//! | `kvwire_nic_bytes_total` | counter | `transport`, `nic` | bytes posted through that NIC (verbs `device`, else the transport) |
//! | `kvwire_peer_disconnects_total` | counter | `transport`, `nic` | peers found dead |
//! | `kvwire_transfer_stalls_total` | counter | `transport`, `nic` | transfers failed because the peer made no progress within the timeout |
//! | `kvwire_doorbells_total` / `kvwire_work_requests_total` | counter | `transport`, `nic` | verbs: `ibv_post_send` calls (one doorbell each) / the work requests they chained (the ratio is WRs per doorbell, ≤ `max_batch`); 0 on shm and tcp |
//! | `kvwire_fenced_connections_total` | counter | `transport`, `nic` | target side: connections cut by the late-bytes fence (a later connection of the same initiator session named them: tcp wire v4, verbs handshake v6); 0 on shm |

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds (s) of the start-up histogram (`+Inf` follows).
pub const STARTUP_BUCKETS_S: [f64; 9] = [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];

/// Counters of one (transport, NIC) pair, shared by every engine on it and
/// kept for the life of the process (so counters never go backwards when an
/// engine is dropped).
#[derive(Debug, Default)]
pub struct LinkCounters {
    /// Descriptors posted (before coalescing).
    pub descriptors: AtomicU64,
    /// Segments posted (after coalescing).
    pub segments: AtomicU64,
    /// Bytes posted.
    pub bytes: AtomicU64,
    /// Peers found dead.
    pub disconnects: AtomicU64,
    /// Transfers failed by a peer timeout.
    pub stalls: AtomicU64,
    /// Verbs only: `ibv_post_send` calls that queued work requests (one
    /// doorbell each); 0 on shm and tcp.
    pub doorbells: AtomicU64,
    /// Verbs only: work requests those calls queued (`work_requests /
    /// doorbells` is the mean chain length, at most the transport's
    /// `max_batch`, 64 by default).
    pub work_requests: AtomicU64,
    /// Target side: connections cut by the late-bytes fence (a later
    /// connection of the same initiator session named them: tcp wire v4
    /// `FENCE`, verbs handshake v6 `replaces`); 0 on shm.
    pub fenced: AtomicU64,
}

impl LinkCounters {
    /// Count one post.
    pub fn posted(&self, descriptors: u64, segments: u64, bytes: u64) {
        self.descriptors.fetch_add(descriptors, Relaxed);
        self.segments.fetch_add(segments, Relaxed);
        self.bytes.fetch_add(bytes, Relaxed);
    }
}

#[derive(Debug, Default)]
struct Startup {
    buckets: [u64; STARTUP_BUCKETS_S.len() + 1],
    sum_s: f64,
}

#[derive(Debug, Default)]
struct Registration {
    count: u64,
    bytes: u64,
    seconds: f64,
}

/// The agent part of the registry.
#[derive(Debug, Default)]
pub(super) struct AgentState {
    startup: BTreeMap<String, Startup>,
    registration: BTreeMap<String, Registration>,
    links: BTreeMap<(String, String), Arc<LinkCounters>>,
    /// agent name -> (transport, regions now, memory regions now)
    regions: BTreeMap<String, (String, Arc<AtomicU64>, Arc<AtomicU64>)>,
}

/// What an engine holds to report into the registry (see [`super::Registry::agent`]).
#[derive(Debug, Clone)]
pub struct AgentHandle {
    /// Its link's counters.
    pub link: Arc<LinkCounters>,
    /// Its current region count.
    pub regions: Arc<AtomicU64>,
    /// The memory regions (verbs MRs) holding them now.
    pub memory_regions: Arc<AtomicU64>,
    agent: String,
    transport: String,
}

impl AgentHandle {
    /// The agent's name.
    pub fn agent(&self) -> &str {
        &self.agent
    }
}

impl super::Registry {
    /// The counters of (`transport`, `nic`), made on first use: what an
    /// engine's [`AgentHandle::link`] holds, for a transport to count into
    /// from its own threads (verbs: doorbells and work requests).
    pub fn link_counters(&self, transport: &str, nic: &str) -> Arc<LinkCounters> {
        let mut s = self.lock();
        s.agents.links.entry((transport.to_string(), nic.to_string())).or_default().clone()
    }

    /// Register an engine: `agent` on `transport` through `nic` (the verbs
    /// device, or the transport's name), ready after `startup`.
    pub fn agent(&self, agent: &str, transport: &str, nic: &str, startup: Duration) -> AgentHandle {
        let mut s = self.lock();
        let a = &mut s.agents;
        let st = a.startup.entry(transport.to_string()).or_default();
        let secs = startup.as_secs_f64();
        let b = super::bucket_of(&STARTUP_BUCKETS_S, secs);
        st.buckets[b] += 1;
        st.sum_s += secs;
        let link = a.links.entry((transport.to_string(), nic.to_string())).or_default().clone();
        let regions = Arc::new(AtomicU64::new(0));
        let memory_regions = Arc::new(AtomicU64::new(0));
        a.regions.insert(agent.to_string(), (transport.to_string(), regions.clone(), memory_regions.clone()));
        AgentHandle { link, regions, memory_regions, agent: agent.to_string(), transport: transport.to_string() }
    }

    /// Count one registration of `bytes` on `h`'s transport that took `took`.
    pub fn registered(&self, h: &AgentHandle, bytes: u64, took: Duration) {
        self.registered_many(h, 1, bytes, took);
    }

    /// Count `count` registrations of `bytes` in all, made together in `took`.
    pub fn registered_many(&self, h: &AgentHandle, count: u64, bytes: u64, took: Duration) {
        let mut s = self.lock();
        let r = s.agents.registration.entry(h.transport.clone()).or_default();
        r.count += count;
        r.bytes = r.bytes.saturating_add(bytes);
        r.seconds += took.as_secs_f64();
    }

    /// The engine `h` is gone: its region gauge goes (its counters stay).
    pub fn agent_dropped(&self, h: &AgentHandle) {
        let mut s = self.lock();
        if s.agents.regions.get(&h.agent).is_some_and(|(_, r, _)| Arc::ptr_eq(r, &h.regions)) {
            s.agents.regions.remove(&h.agent);
        }
    }
}

pub(super) fn render(a: &AgentState, fams: &mut super::Families) {
    use super::escape;
    let h = "kvwire_agent_startup_seconds";
    let help = "Seconds from TransferEngine::new to a ready agent.";
    for (t, st) in &a.startup {
        let labels = format!("transport=\"{}\"", escape(t));
        fams.histogram(h, help, &labels, &STARTUP_BUCKETS_S, &st.buckets, st.sum_s);
    }
    for (t, r) in &a.registration {
        let t = escape(t);
        let n = "kvwire_registrations_total";
        fams.add(n, "counter", "Memory registrations.", format!("{n}{{transport=\"{t}\"}} {}", r.count));
        let n = "kvwire_registered_bytes_total";
        fams.add(n, "counter", "Bytes registered.", format!("{n}{{transport=\"{t}\"}} {}", r.bytes));
        let n = "kvwire_registration_seconds_total";
        fams.add(n, "counter", "Seconds spent registering memory.", format!("{n}{{transport=\"{t}\"}} {}", r.seconds));
    }
    for (agent, (t, n, m)) in &a.regions {
        let l = format!("agent=\"{}\",transport=\"{}\"", escape(agent), escape(t));
        let (n, m) = (n.load(Relaxed), m.load(Relaxed));
        let g = "kvwire_regions";
        fams.add(g, "gauge", "Memory regions an agent has registered now.", format!("{g}{{{l}}} {n}"));
        let g = "kvwire_memory_regions";
        let help = "Memory regions (verbs MRs) holding an agent's registrations now.";
        fams.add(g, "gauge", help, format!("{g}{{{l}}} {m}"));
        let g = "kvwire_region_coalescing_ratio";
        let ratio = if m == 0 { 1.0 } else { n as f64 / m as f64 };
        let help = "Registrations per memory region (kvwire_regions / kvwire_memory_regions).";
        fams.add(g, "gauge", help, format!("{g}{{{l}}} {ratio}"));
    }
    for ((t, nic), c) in &a.links {
        let l = format!("transport=\"{}\",nic=\"{}\"", escape(t), escape(nic));
        for (name, help, v) in [
            ("kvwire_posted_descriptors_total", "Descriptors posted, before coalescing.", &c.descriptors),
            ("kvwire_posted_segments_total", "Segments posted, after coalescing.", &c.segments),
            ("kvwire_nic_bytes_total", "Bytes posted through the NIC (verbs device, else the transport).", &c.bytes),
            ("kvwire_peer_disconnects_total", "Peers found dead.", &c.disconnects),
            ("kvwire_transfer_stalls_total", "Transfers failed because the peer made no progress in time.", &c.stalls),
            (
                "kvwire_doorbells_total",
                "ibv_post_send calls that queued work requests (verbs; 0 elsewhere).",
                &c.doorbells,
            ),
            (
                "kvwire_work_requests_total",
                "Work requests queued by those calls (verbs; 0 elsewhere).",
                &c.work_requests,
            ),
            (
                "kvwire_fenced_connections_total",
                "Connections cut by the late-bytes fence (target side; tcp and verbs).",
                &c.fenced,
            ),
        ] {
            fams.add(name, "counter", help, format!("{name}{{{l}}} {}", v.load(Relaxed)));
        }
    }
}

/// Process-wide lock-free accessor for tests: the counters of (transport, nic).
pub fn link(transport: &str, nic: &str) -> Option<Arc<LinkCounters>> {
    let s = super::global().lock();
    s.agents.links.get(&(transport.to_string(), nic.to_string())).cloned()
}
