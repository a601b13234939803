//! Connection setup over TCP: the target's listener thread and the
//! initiator's handshake. The initiator says hello with its agent name and
//! one [`QpEndpoint`] per QP; the target creates matching QPs with posted
//! receives for notifications, brings them to RTS and answers with its own
//! endpoints. The TCP connection stays open: when it closes (initiator gone,
//! disconnected or reconnecting), the target destroys those QPs.

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::Inner;
use super::state::{NOTIF_SLOT_BYTES, RECV_BIT, RecvQp};
use crate::sidechannel::SideChannel;
use crate::transport::TransportError;
use crate::verbs::{MemoryRegion, QpEndpoint, QueuePair};

/// Receives posted per target QP (notifications in flight per QP; more
/// make the initiator's NIC retry on RNR, never lose one).
pub const RECVS_PER_QP: u32 = 64;

/// Version of the handshake below; a target refuses any other. 2: QP
/// endpoints carry the responder READ depth (`QpEndpoint::rd_atom`).
pub const HANDSHAKE_VERSION: u32 = 2;

/// Handshake messages.
#[derive(Debug, Serialize, Deserialize)]
pub enum Handshake {
    /// Initiator → target.
    Hello {
        /// [`HANDSHAKE_VERSION`] of the initiator.
        version: u32,
        /// Initiator agent name.
        agent: String,
        /// One per QP.
        qps: Vec<QpEndpoint>,
    },
    /// Target → initiator: matching endpoints, same order.
    Accept {
        /// One per QP.
        qps: Vec<QpEndpoint>,
    },
    /// Target → initiator: refused.
    Refuse {
        /// Why.
        reason: String,
    },
}

pub(super) fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    loop {
        let conn = SideChannel::accept(&listener);
        if inner.stopping.load(Ordering::Acquire) {
            break;
        }
        let Ok(ch) = conn else { continue };
        let inner = inner.clone();
        let spawned = std::thread::Builder::new().name("kvwire-verbs-peer".into()).spawn(move || serve(&inner, ch));
        if let Err(e) = spawned {
            tracing::warn!("verbs: cannot serve a peer: {e}");
        }
    }
}

fn serve(inner: &Inner, mut ch: SideChannel) {
    let _ = ch.set_read_timeout(Some(inner.config.peer_timeout));
    let (agent, remote) = match ch.recv::<Handshake>() {
        Ok(Handshake::Hello { version, agent, .. }) if version != HANDSHAKE_VERSION => {
            let reason = format!("handshake version {version}, this side speaks {HANDSHAKE_VERSION}");
            tracing::warn!("verbs: refusing {agent}: {reason}");
            let _ = ch.send(&Handshake::Refuse { reason });
            return;
        }
        Ok(Handshake::Hello { agent, qps, .. }) => (agent, qps),
        Ok(other) => {
            tracing::warn!("verbs: expected hello, got {other:?}");
            return;
        }
        Err(e) => {
            tracing::debug!("verbs: bad hello: {e}");
            return;
        }
    };
    let mut qpns = Vec::new();
    let mut mine = Vec::new();
    let mut built = Vec::new();
    // Every posted receive can complete with a CQE on the shared CQ. An
    // initiator that reconnects closes its old connection just before, and
    // its old receives come back only once that connection's thread saw it
    // close: give them a moment before refusing.
    let cqes = RECVS_PER_QP * remote.len() as u32;
    let patience = Instant::now() + inner.config.peer_timeout.min(Duration::from_secs(2));
    let mut reserved = inner.lock().reserve_recv_cqes(cqes);
    while !reserved && Instant::now() < patience {
        std::thread::sleep(Duration::from_millis(10));
        reserved = inner.lock().reserve_recv_cqes(cqes);
    }
    if !reserved {
        let reason = format!(
            "completion queue full: no room for {cqes} more receive completions (receives may hold half of it)"
        );
        tracing::warn!("verbs: refusing {agent}: {reason}");
        let _ = ch.send(&Handshake::Refuse { reason });
        return;
    }
    let result = (|| -> Result<(), TransportError> {
        for r in &remote {
            let (qp, ep, slab) = inner.new_recv_qp()?;
            qp.connect(&ep, r, &inner.qp_options).map_err(verbs_err)?;
            mine.push(ep);
            built.push((qp, slab));
        }
        Ok(())
    })();
    if let Err(e) = result {
        inner.lock().release_recv_cqes(cqes, &inner.limits);
        let _ = ch.send(&Handshake::Refuse { reason: e.to_string() });
        return;
    }
    {
        let mut st = inner.lock();
        for (mut qp, slab) in built {
            for slot in 0..RECVS_PER_QP {
                let (wr_id, len) = (RECV_BIT | u64::from(slot), NOTIF_SLOT_BYTES as u32);
                if let Err(e) = qp.post_recv_owned(wr_id, &slab, slot as usize * NOTIF_SLOT_BYTES, len) {
                    tracing::warn!("verbs: post_recv for {agent}: {e}");
                }
            }
            qpns.push(qp.qp_num());
            st.recv_qps.insert(qp.qp_num(), RecvQp { qp, agent: agent.clone(), slab });
        }
    }
    if ch.send(&Handshake::Accept { qps: mine }).is_ok() {
        // Block until the initiator goes away.
        let _ = ch.set_read_timeout(None);
        while !inner.stopping.load(Ordering::Acquire) {
            match ch.recv::<Handshake>() {
                Ok(_) => {}
                Err(_) => break,
            }
        }
    }
    let mut st = inner.lock();
    for q in qpns {
        st.recv_qps.remove(&q);
    }
    st.release_recv_cqes(cqes, &inner.limits);
}

fn verbs_err(e: crate::verbs::VerbsError) -> TransportError {
    TransportError::Unsupported(e.to_string())
}

/// Initiator side: hello to `addr` with `local` endpoints; returns the
/// target's endpoints and the open control connection.
pub(super) fn handshake(
    addr: &str,
    agent: &str,
    local: &[QpEndpoint],
    timeout: Duration,
) -> Result<(Vec<QpEndpoint>, SideChannel), String> {
    let mut ch = SideChannel::connect(addr, timeout).map_err(|e| e.to_string())?;
    ch.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let hello = Handshake::Hello { version: HANDSHAKE_VERSION, agent: agent.to_string(), qps: local.to_vec() };
    ch.send(&hello).map_err(|e| e.to_string())?;
    match ch.recv::<Handshake>().map_err(|e| e.to_string())? {
        Handshake::Accept { qps } if qps.len() == local.len() => Ok((qps, ch)),
        Handshake::Accept { qps } => Err(format!("target answered {} QPs for {}", qps.len(), local.len())),
        Handshake::Refuse { reason } => Err(format!("target refused: {reason}")),
        Handshake::Hello { .. } => Err("unexpected hello from the target".into()),
    }
}

impl Inner {
    fn new_recv_qp(&self) -> Result<(QueuePair, QpEndpoint, Arc<MemoryRegion>), TransportError> {
        let qp = QueuePair::new(&self.pd, &self.cq, &self.cq, 4, RECVS_PER_QP).map_err(verbs_err)?;
        let ep = qp.endpoint(&self.qp_options).map_err(verbs_err)?;
        let slab = MemoryRegion::alloc(&self.pd, RECVS_PER_QP as usize * NOTIF_SLOT_BYTES)
            .map_err(|e| TransportError::Registration(e.to_string()))?;
        Ok((qp, ep, Arc::new(slab)))
    }
}
