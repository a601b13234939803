//! `KVTransferEngine`: construction, metadata, connect and disconnect.
//! Transfers and completion live in `transfer.rs`.

use std::collections::{HashMap, HashSet};

use super::error::KvError;
use super::memory::KVCacheMemory;
use super::metadata::{KVTransferEngineMetadata, MemoryType, TensorAgentMetadata, agent_name};
use super::reqdata::TransferReqData;
use super::topology::{TransferStrategy, any_broadcast, connect_pairing, resolve_strategies};
use crate::engine::{AgentMetadata, EngineError, RegistrationHandle, TransferEngine};
use crate::transport::{MemoryKind, TransportConfig, TransportKind};

/// One agent: the transfer engine of one `(replica, tp_shard)`, with every
/// group of that shard registered on it.
pub(super) struct TensorAgent {
    pub(super) engine: TransferEngine,
    pub(super) base_addrs: Vec<u64>,
    pub(super) device_id: u32,
    pub(super) registrations: Vec<RegistrationHandle>,
}

/// A connected peer engine.
pub(super) struct RemoteConnection {
    pub(super) meta: KVTransferEngineMetadata,
    pub(super) strategies: Vec<TransferStrategy>,
    pub(super) broadcast: bool,
    /// `((local_replica, local_shard), (remote_replica, remote_shard))`, as wired.
    pub(super) pairs: Vec<((usize, usize), (usize, usize))>,
}

/// Something that names a remote engine: its name, or its metadata.
pub trait RemoteEngine {
    /// The engine's base name.
    fn engine_name(&self) -> &str;
    /// The metadata, when the caller holds it (lets replica ranges be checked
    /// before the connection, in MAX's order).
    fn engine_metadata(&self) -> Option<&KVTransferEngineMetadata> {
        None
    }
}

impl RemoteEngine for str {
    fn engine_name(&self) -> &str {
        self
    }
}

impl RemoteEngine for String {
    fn engine_name(&self) -> &str {
        self
    }
}

impl RemoteEngine for KVTransferEngineMetadata {
    fn engine_name(&self) -> &str {
        &self.name
    }
    fn engine_metadata(&self) -> Option<&KVTransferEngineMetadata> {
        Some(self)
    }
}

/// KV-cache transfer engine with data parallelism (DP replicas) and tensor
/// parallelism (TP shards), as Modular MAX's `KVTransferEngine`.
///
/// Memory is given as `[replica][group]` [`KVCacheMemory`]s, one group per
/// cache leaf (plus one per quantization-scales tensor), each holding one
/// `[num_pages, bytes_per_page]` buffer per TP shard. The engine creates one
/// [`TransferEngine`] agent per `(replica, shard)`, named
/// `{name}_{replica}_{shard}`, and registers all of that shard's groups on it.
/// Pages are addressed per leaf: page `idx` of group `g` on a shard is the
/// `bytes_per_group[g]` bytes at `base_addrs[g] + idx * bytes_per_group[g]`.
///
/// # Threading
/// Not thread-safe, by design, as MAX's: one scheduler thread drives it.
/// Both engines of a transfer must keep polling [`KVTransferEngine::is_complete`]
/// (it reports progress; the transports move the data).
///
/// # Cleanup
/// Call [`KVTransferEngine::cleanup`] explicitly at the end; dropping the
/// engine cancels what is still in flight.
pub struct KVTransferEngine {
    pub(super) name: String,
    pub(super) hostname: String,
    pub(super) memory_type: MemoryType,
    pub(super) dp: usize,
    pub(super) tp: usize,
    pub(super) leaf_ids: Vec<String>,
    pub(super) num_pages_per_group: Vec<u64>,
    pub(super) bytes_per_group: Vec<u64>,
    pub(super) replicated_per_group: Vec<bool>,
    pub(super) memory: Vec<Vec<KVCacheMemory>>,
    /// `[replica][shard]`.
    pub(super) agents: Vec<Vec<TensorAgent>>,
    pub(super) remotes: HashMap<String, RemoteConnection>,
    pub(super) remote_agent_to_engine: HashMap<String, String>,
    pub(super) inflight_send: HashMap<String, TransferReqData>,
    pub(super) inflight_read: HashMap<String, TransferReqData>,
    /// `[remote engine][transfer_name] -> notifications received`.
    pub(super) completed_recv: HashMap<String, HashMap<String, usize>>,
    /// Notifications from agents of engines never connected.
    pub(super) num_unknown_notifs: u64,
}

impl std::fmt::Debug for KVTransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KVTransferEngine")
            .field("name", &self.name)
            .field("dp", &self.dp)
            .field("tp", &self.tp)
            .field("leaf_ids", &self.leaf_ids)
            .field("bytes_per_group", &self.bytes_per_group)
            .field("remotes", &self.remotes.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl KVTransferEngine {
    /// Build the engine from producer-authored groups `memory[replica][group]`.
    /// `leaf_ids` names each group (default `"0"`, `"1"`, ...); transfers
    /// address pages by these ids.
    ///
    /// # Errors
    /// As MAX's `KVTransferEngine.__init__` validation, in its order:
    /// [`KvError::InvalidName`] (empty or over 200 bytes; kvwire),
    /// [`KvError::NoReplicas`], [`KvError::EmptyReplica`] (replica 0),
    /// [`KvError::LeafIdCount`], [`KvError::DuplicateLeafId`],
    /// [`KvError::EmptyReplica`] / [`KvError::GroupCountMismatch`] /
    /// [`KvError::PageCountMismatch`] (per replica against replica 0),
    /// [`KvError::ReplicationMismatch`], [`KvError::ShardCountMismatch`],
    /// [`KvError::MixedDeviceKinds`], [`KvError::BytesPerPageMismatch`],
    /// [`KvError::MixedMemoryTypes`]; then [`KvError::Engine`] when the
    /// transport cannot be created or refuses a registration.
    pub fn new(
        name: &str,
        memory: Vec<Vec<KVCacheMemory>>,
        leaf_ids: Option<Vec<String>>,
        transport: TransportKind,
        cfg: &TransportConfig,
    ) -> Result<Self, KvError> {
        if name.is_empty() || name.len() > 200 {
            return Err(KvError::InvalidName(name.to_string()));
        }
        // 1.
        let Some(first) = memory.first() else {
            return Err(KvError::NoReplicas);
        };
        if first.is_empty() {
            return Err(KvError::EmptyReplica { replica: 0 });
        }
        let num_groups = first.len();
        // 2.
        let leaf_ids = leaf_ids.unwrap_or_else(|| (0..num_groups).map(|g| g.to_string()).collect());
        if leaf_ids.len() != num_groups {
            return Err(KvError::LeafIdCount { expected: num_groups, found: leaf_ids.len() });
        }
        let mut seen = HashSet::new();
        for id in &leaf_ids {
            if !seen.insert(id) {
                return Err(KvError::DuplicateLeafId(id.clone()));
            }
        }
        // 3.
        for (replica, groups) in memory.iter().enumerate() {
            if groups.is_empty() {
                return Err(KvError::EmptyReplica { replica });
            }
            if groups.len() != num_groups {
                return Err(KvError::GroupCountMismatch { replica, expected: num_groups, found: groups.len() });
            }
            for (group, m) in groups.iter().enumerate() {
                if m.total_num_pages() != first[group].total_num_pages() {
                    return Err(KvError::PageCountMismatch {
                        replica,
                        group,
                        expected: first[group].total_num_pages(),
                        found: m.total_num_pages(),
                    });
                }
            }
        }
        let num_pages_per_group: Vec<u64> = first.iter().map(KVCacheMemory::total_num_pages).collect();
        // 4.
        for (replica, groups) in memory.iter().enumerate() {
            for (group, m) in groups.iter().enumerate() {
                if m.replicated() != first[group].replicated() {
                    return Err(KvError::ReplicationMismatch {
                        replica,
                        group,
                        expected: first[group].replicated(),
                        found: m.replicated(),
                    });
                }
            }
        }
        // 5.
        let tp = first[0].num_shards();
        for (replica, groups) in memory.iter().enumerate() {
            for (group, m) in groups.iter().enumerate() {
                if m.num_shards() != tp {
                    return Err(KvError::ShardCountMismatch { replica, group, expected: tp, found: m.num_shards() });
                }
            }
        }
        // 6. (shapes and contiguity are guaranteed by KVCacheMemory::new)
        for (replica, groups) in memory.iter().enumerate() {
            for (group, m) in groups.iter().enumerate() {
                if m.memory_kind().is_none() {
                    return Err(KvError::MixedDeviceKinds { replica, group });
                }
            }
        }
        // 7.
        for (replica, groups) in memory.iter().enumerate() {
            for (group, m) in groups.iter().enumerate() {
                if m.bytes_per_page() != first[group].bytes_per_page() {
                    return Err(KvError::BytesPerPageMismatch {
                        replica,
                        group,
                        expected: first[group].bytes_per_page(),
                        found: m.bytes_per_page(),
                    });
                }
            }
        }
        let kinds: HashSet<MemoryKind> = memory.iter().flatten().filter_map(KVCacheMemory::memory_kind).collect();
        if kinds.len() != 1 {
            return Err(KvError::MixedMemoryTypes);
        }
        let memory_type = if kinds.contains(&MemoryKind::Dram) { MemoryType::Dram } else { MemoryType::Vram };
        let bytes_per_group: Vec<u64> = first.iter().map(KVCacheMemory::bytes_per_page).collect();
        // 9.
        let replicated_per_group: Vec<bool> = first.iter().map(KVCacheMemory::replicated).collect();
        // 8. One agent per (replica, shard), groups registered group-major.
        let mut agents = Vec::with_capacity(memory.len());
        for (replica, groups) in memory.iter().enumerate() {
            let mut row = Vec::with_capacity(tp);
            for shard in 0..tp {
                let device_id = groups[0].buffers()[shard].device_id();
                let agent_cfg =
                    agent_config(cfg, transport, memory_type, device_id, crate::cuda::nic::nic_for_gpu_ordinal);
                let mut engine = TransferEngine::new(&agent_name(name, replica, shard), transport, &agent_cfg)?;
                let mut base_addrs = Vec::with_capacity(num_groups);
                let mut registrations = Vec::with_capacity(num_groups);
                for m in groups {
                    let b = &m.buffers()[shard];
                    registrations.push(engine.register(b.registration()?)?);
                    base_addrs.push(b.addr());
                }
                row.push(TensorAgent { engine, base_addrs, device_id, registrations });
            }
            agents.push(row);
        }
        Ok(Self {
            name: name.to_string(),
            hostname: crate::engine::metadata::hostname(),
            memory_type,
            dp: memory.len(),
            tp,
            leaf_ids,
            num_pages_per_group,
            bytes_per_group,
            replicated_per_group,
            memory,
            agents,
            remotes: HashMap::new(),
            remote_agent_to_engine: HashMap::new(),
            inflight_send: HashMap::new(),
            inflight_read: HashMap::new(),
            completed_recv: HashMap::new(),
            num_unknown_notifs: 0,
        })
    }

    /// Base name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// DP replicas.
    pub fn dp(&self) -> usize {
        self.dp
    }

    /// TP shards per replica.
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// Id of each group.
    pub fn leaf_ids(&self) -> &[String] {
        &self.leaf_ids
    }

    /// Pages of each group, null block included.
    pub fn num_pages_per_group(&self) -> &[u64] {
        &self.num_pages_per_group
    }

    /// Bytes per page of each group (one shard).
    pub fn bytes_per_group(&self) -> &[u64] {
        &self.bytes_per_group
    }

    /// Whether each group is replicated across TP shards.
    pub fn replicated_per_group(&self) -> &[bool] {
        &self.replicated_per_group
    }

    /// The memory given at construction, `[replica][group]`.
    pub fn memory(&self) -> &[Vec<KVCacheMemory>] {
        &self.memory
    }

    /// True when engine `name` is connected.
    pub fn is_connected(&self, name: &str) -> bool {
        self.remotes.contains_key(name)
    }

    /// The per-group strategies chosen at `connect` for engine `name`.
    pub fn strategies(&self, name: &str) -> Option<&[TransferStrategy]> {
        self.remotes.get(name).map(|r| r.strategies.as_slice())
    }

    /// Transfers this engine initiated and has not cleaned up.
    pub fn num_inflight(&self) -> usize {
        self.inflight_send.len() + self.inflight_read.len()
    }

    /// Notifications received from agents of engines never connected.
    pub fn num_unknown_notifications(&self) -> u64 {
        self.num_unknown_notifs
    }

    /// The metadata peers need to connect (take it after construction; send it
    /// with [`KVTransferEngineMetadata::to_bytes`]).
    pub fn metadata(&self) -> KVTransferEngineMetadata {
        KVTransferEngineMetadata {
            name: self.name.clone(),
            memory_type: self.memory_type,
            hostname: self.hostname.clone(),
            agents_meta: self
                .agents
                .iter()
                .enumerate()
                .map(|(r, row)| {
                    row.iter()
                        .enumerate()
                        .map(|(s, a)| TensorAgentMetadata {
                            agent_name: agent_name(&self.name, r, s),
                            metadata: a.engine.metadata().to_bytes(),
                            base_addrs: a.base_addrs.clone(),
                            device_id: a.device_id,
                        })
                        .collect()
                })
                .collect(),
            leaf_ids: self.leaf_ids.clone(),
            num_pages_per_group: self.num_pages_per_group.clone(),
            bytes_per_group: self.bytes_per_group.clone(),
            replicated_per_group: self.replicated_per_group.clone(),
        }
    }

    /// Connect to a peer engine, as MAX's `connect`: pick the strategy per
    /// group (MAX `transfer_engine.py`), check geometry, and wire every agent pair over the full
    /// DP Cartesian product (diagonal shards for DIRECT, full shard mesh for
    /// BROADCAST). Either every pair is wired or none is.
    ///
    /// # Errors
    /// In order: [`KvError::AlreadyConnected`]; [`KvError::BadMetadata`]
    /// (inconsistent metadata, an agent blob naming another agent, a group
    /// outside the agent's registered memory; checked before any wiring);
    /// [`KvError::Unsupported`] (GATHER_SCATTER); [`KvError::BytesPerGroupMismatch`];
    /// [`KvError::LeafMismatch`]; [`KvError::Engine`] (own name, transport
    /// mismatch, the transport refused a connection).
    pub fn connect(&mut self, remote: &KVTransferEngineMetadata) -> Result<(), KvError> {
        if self.remotes.contains_key(&remote.name) {
            return Err(KvError::AlreadyConnected(remote.name.clone()));
        }
        remote.validate()?;
        if remote.name == self.name {
            return Err(EngineError::SelfConnect(remote.name.clone()).into());
        }
        let remote_replicated: Vec<bool> = (0..remote.num_groups()).map(|g| remote.replicated(g)).collect();
        let strategies = resolve_strategies(self.tp, &self.replicated_per_group, remote.tp(), &remote_replicated)?;
        if remote.bytes_per_group != self.bytes_per_group {
            return Err(KvError::BytesPerGroupMismatch {
                local: self.bytes_per_group.clone(),
                remote: remote.bytes_per_group.clone(),
            });
        }
        if remote.leaf_ids != self.leaf_ids {
            return Err(KvError::LeafMismatch { local: self.leaf_ids.clone(), remote: remote.leaf_ids.clone() });
        }
        let broadcast = any_broadcast(&strategies);
        let pairs = connect_pairing(self.dp, self.tp, remote.dp(), remote.tp(), broadcast);
        // Decode every agent blob before touching a transport.
        let mut decoded: Vec<Vec<AgentMetadata>> = Vec::with_capacity(remote.dp());
        for row in &remote.agents_meta {
            let mut out = Vec::with_capacity(row.len());
            for a in row {
                let m = AgentMetadata::from_bytes(&a.metadata)
                    .map_err(|e| KvError::BadMetadata(format!("agent {:?}: {e}", a.agent_name)))?;
                if m.name != a.agent_name {
                    return Err(KvError::BadMetadata(format!(
                        "metadata loading failed: blob of agent {:?} names {:?}",
                        a.agent_name, m.name
                    )));
                }
                // Every group's pages must lie in memory the agent registered.
                for (g, &base) in a.base_addrs.iter().enumerate() {
                    let len = remote.num_pages_per_group[g] * remote.bytes_per_group[g];
                    if m.find_region(base, len).is_none() {
                        return Err(KvError::BadMetadata(format!(
                            "group {g} of agent {:?} ({base:#x}+{len}) is not in a registered region",
                            a.agent_name
                        )));
                    }
                }
                out.push(m);
            }
            decoded.push(out);
        }
        for (i, &((lr, ls), (rr, rs))) in pairs.iter().enumerate() {
            if let Err(e) = self.agents[lr][ls].engine.connect(&decoded[rr][rs]) {
                for &((lr, ls), (rr, rs)) in &pairs[..i] {
                    let _ = self.agents[lr][ls].engine.disconnect(&remote.agents_meta[rr][rs].agent_name);
                }
                return Err(e.into());
            }
        }
        for row in &remote.agents_meta {
            for a in row {
                self.remote_agent_to_engine.insert(a.agent_name.clone(), remote.name.clone());
            }
        }
        self.remotes
            .insert(remote.name.clone(), RemoteConnection { meta: remote.clone(), strategies, broadcast, pairs });
        Ok(())
    }

    /// Disconnect a peer engine, as MAX's `disconnect`: release in-flight
    /// sends to it and reads from it (failures only logged), drop the agent
    /// connections and the notification counters of that peer. `connect`
    /// accepts the name again afterwards.
    ///
    /// # Errors
    /// [`KvError::NotConnected`].
    pub fn disconnect(&mut self, name: &str) -> Result<(), KvError> {
        let conn = self.remotes.remove(name).ok_or_else(|| KvError::NotConnected(name.to_string()))?;
        let sends: Vec<String> =
            self.inflight_send.iter().filter(|(_, r)| r.dst_name == name).map(|(k, _)| k.clone()).collect();
        for k in sends {
            if let Some(req) = self.inflight_send.remove(&k) {
                self.release_handles(&req, req.src_replica_idx);
            }
        }
        let reads: Vec<String> =
            self.inflight_read.iter().filter(|(_, r)| r.src_name == name).map(|(k, _)| k.clone()).collect();
        for k in reads {
            if let Some(req) = self.inflight_read.remove(&k) {
                self.release_handles(&req, req.dst_replica_idx);
            }
        }
        for &((lr, ls), (rr, rs)) in &conn.pairs {
            let agent = &conn.meta.agents_meta[rr][rs].agent_name;
            if let Err(e) = self.agents[lr][ls].engine.disconnect(agent) {
                tracing::warn!(engine = %self.name, peer = %agent, error = %e, "disconnect failed");
            }
        }
        self.remote_agent_to_engine.retain(|_, e| e != name);
        self.completed_recv.remove(name);
        Ok(())
    }
}

/// The transport configuration of the agent of one TP shard: `cfg`, plus,
/// for the verbs transport over GPU memory when `cfg` names no `device`,
/// the RDMA device `nic_for_gpu` picks for the shard's GPU `device_id` (the
/// PCIe-closest NIC, [`crate::cuda::nic`]; MAX sets `UCX_NET_DEVICES` the
/// same way). An explicit `device` option, host memory, another transport or
/// no answer leave `cfg` as it is.
pub(crate) fn agent_config(
    cfg: &TransportConfig,
    transport: TransportKind,
    memory_type: MemoryType,
    device_id: u32,
    nic_for_gpu: impl Fn(u32) -> Option<String>,
) -> TransportConfig {
    let mut agent = cfg.clone();
    if transport == TransportKind::Verbs
        && memory_type == MemoryType::Vram
        && cfg.option("device").is_none()
        && let Some(nic) = nic_for_gpu(device_id)
    {
        tracing::info!("verbs: GPU {device_id} uses RDMA device {nic} (PCIe-closest)");
        agent.options.push(("device".into(), nic));
    }
    agent
}
