//! Releasing transfers and tearing an engine down (MAX's `cleanup`).

use super::engine::KVTransferEngine;
use super::error::KvError;
use super::reqdata::TransferReqData;

impl KVTransferEngine {
    /// Release every handle of `req` on the agents of `replica` (cancelling
    /// what is still moving); failures are logged. Returns the first error.
    pub(super) fn release_handles(&mut self, req: &TransferReqData, replica: usize) -> Option<KvError> {
        let mut first = None;
        for (i, &tid) in req.transfer_ids.iter().enumerate() {
            let shard = req.local_shards_used.get(i).copied().unwrap_or(i);
            let Some(agent) = self.agents.get_mut(replica).and_then(|r| r.get_mut(shard)) else {
                continue;
            };
            if let Err(e) = agent.engine.release(crate::engine::TransferHandle(tid)) {
                tracing::warn!(engine = %self.name, transfer = %req.transfer_name, shard, error = %e, "release failed");
                first.get_or_insert(KvError::Engine(e));
            }
        }
        first
    }

    /// Release everything, as MAX's `cleanup`: in-flight sends and reads,
    /// then every peer connection, then every registration. The peers stay
    /// listed in [`KVTransferEngine::remote_connections`], as in MAX. Call it
    /// explicitly before dropping the engine.
    ///
    /// # Errors
    /// The first failure ([`KvError::Engine`]); the remaining steps still run.
    pub fn cleanup(&mut self) -> Result<(), KvError> {
        let mut first: Option<KvError> = None;
        let sends: Vec<TransferReqData> = self.inflight_send.drain().map(|(_, r)| r).collect();
        for req in sends {
            if let Some(e) = self.release_handles(&req, req.src_replica_idx) {
                first.get_or_insert(e);
            }
        }
        let reads: Vec<TransferReqData> = self.inflight_read.drain().map(|(_, r)| r).collect();
        for req in reads {
            if let Some(e) = self.release_handles(&req, req.dst_replica_idx) {
                first.get_or_insert(e);
            }
        }
        let names: Vec<String> = self.remotes.keys().cloned().collect();
        let mut kept: Vec<_> = self.remotes.values().map(|r| r.meta.clone()).collect();
        for n in names {
            if let Err(e) = self.disconnect(&n) {
                first.get_or_insert(e);
            }
        }
        for row in &mut self.agents {
            for a in row {
                for h in a.registrations.drain(..) {
                    if let Err(e) = a.engine.deregister(h) {
                        first.get_or_insert(KvError::Engine(e));
                    }
                }
            }
        }
        self.completed_recv.clear();
        self.telemetry.clear();
        // MAX's cleanup invalidates its peers' metadata but leaves
        // `remote_connections` as it was.
        kept.retain(|m| !self.cleaned_remotes.iter().any(|c| c.name == m.name));
        self.cleaned_remotes.extend(kept);
        first.map_or(Ok(()), Err)
    }
}
