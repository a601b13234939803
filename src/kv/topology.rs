//! Topology planning: pure functions, no transport, as
//! MAX's `resolve_transfer_strategy`, `connect_pairing` and
//! `transfer_shard_pairing`.

use super::error::KvError;

/// How one group's pages map between two engines' TP shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferStrategy {
    /// Equal TP: shard `i` ↔ shard `i`.
    Direct,
    /// TP differs and the group is replicated on either side: source shard 0
    /// fans out to every destination shard.
    Broadcast,
    /// TP differs and the group is sharded on both sides: needs a reshard,
    /// which MAX does not implement either (MXSERV-290).
    GatherScatter,
}

/// The strategy for one group, as MAX's `resolve_transfer_strategy`. A side
/// with TP 1 never counts as replicated.
pub fn resolve_transfer_strategy(
    local_tp: usize,
    local_replicated: bool,
    remote_tp: usize,
    remote_replicated: bool,
) -> TransferStrategy {
    if local_tp == remote_tp {
        return TransferStrategy::Direct;
    }
    let loc = local_replicated && local_tp > 1;
    let rem = remote_replicated && remote_tp > 1;
    if loc || rem { TransferStrategy::Broadcast } else { TransferStrategy::GatherScatter }
}

/// The strategy of every group.
///
/// # Errors
/// [`KvError::Unsupported`] when any group needs GATHER_SCATTER (MAX:
/// `NotImplementedError`, MXSERV-290).
pub fn resolve_strategies(
    local_tp: usize,
    local_replicated: &[bool],
    remote_tp: usize,
    remote_replicated: &[bool],
) -> Result<Vec<TransferStrategy>, KvError> {
    let n = local_replicated.len().max(remote_replicated.len());
    let mut out = Vec::with_capacity(n);
    for g in 0..n {
        let l = local_replicated.get(g).copied().unwrap_or(false);
        let r = remote_replicated.get(g).copied().unwrap_or(false);
        let s = resolve_transfer_strategy(local_tp, l, remote_tp, r);
        if s == TransferStrategy::GatherScatter {
            return Err(KvError::Unsupported(format!(
                "group {g} is split across TP shards on both sides (local TP {local_tp}, remote TP \
                 {remote_tp}): moving it between different TP degrees needs a reshard (MAX's GATHER_SCATTER \
                 strategy), which neither MAX nor kvwire implements; use the same TP on both sides, or a \
                 replicated (MLA) cache"
            )));
        }
        out.push(s);
    }
    Ok(out)
}

/// True when any group broadcasts (then the whole connection flattens the source).
pub fn any_broadcast(strategies: &[TransferStrategy]) -> bool {
    strategies.contains(&TransferStrategy::Broadcast)
}

/// Agent pairs to wire at connect time, as MAX's `connect_pairing`:
/// `((local_replica, local_shard), (remote_replica, remote_shard))` over the
/// full Cartesian product of DP replicas, times the diagonal `(i, i)` for
/// DIRECT or the full shard mesh for BROADCAST. Disconnect and cleanup walk
/// the same sequence.
pub fn connect_pairing(
    local_dp: usize,
    local_tp: usize,
    remote_dp: usize,
    remote_tp: usize,
    broadcast: bool,
) -> Vec<((usize, usize), (usize, usize))> {
    let mut out = Vec::new();
    for lr in 0..local_dp {
        for rr in 0..remote_dp {
            if broadcast {
                for ls in 0..local_tp {
                    for rs in 0..remote_tp {
                        out.push(((lr, ls), (rr, rs)));
                    }
                }
            } else {
                for s in 0..local_tp.min(remote_tp) {
                    out.push(((lr, s), (rr, s)));
                }
            }
        }
    }
    out
}

/// `(source_shard, destination_shard)` pairs of one transfer, as MAX's
/// `transfer_shard_pairing`: a flattened (BROADCAST) source collapses to
/// shard 0; the destination always spans all its shards; a single source
/// shard fans out to every destination shard. One request is posted per pair.
pub fn transfer_shard_pairing(flatten_source: bool, source_tp: usize, dest_tp: usize) -> Vec<(usize, usize)> {
    let source: Vec<usize> = if flatten_source { vec![0] } else { (0..source_tp).collect() };
    if source.len() == 1 && dest_tp > 1 {
        return (0..dest_tp).map(|d| (source[0], d)).collect();
    }
    source.into_iter().zip(0..dest_tp).collect()
}

#[cfg(test)]
mod tests {
    use super::TransferStrategy::*;
    use super::*;

    #[test]
    fn strategy_table() {
        for tp in [1, 2, 4] {
            for (l, r) in [(false, false), (true, false), (false, true), (true, true)] {
                assert_eq!(resolve_transfer_strategy(tp, l, tp, r), Direct);
            }
        }
        assert_eq!(resolve_transfer_strategy(1, false, 4, true), Broadcast);
        assert_eq!(resolve_transfer_strategy(4, true, 1, false), Broadcast);
        assert_eq!(resolve_transfer_strategy(2, true, 4, true), Broadcast);
        assert_eq!(resolve_transfer_strategy(2, false, 4, false), GatherScatter);
        // a TP-1 side never reports replicated
        assert_eq!(resolve_transfer_strategy(1, true, 2, false), GatherScatter);
        assert!(matches!(resolve_strategies(2, &[false], 4, &[false]), Err(KvError::Unsupported(_))));
        assert_eq!(resolve_strategies(1, &[false, false], 4, &[true, true]).unwrap(), vec![Broadcast; 2]);
        // one sharded group is enough to refuse
        assert!(resolve_strategies(1, &[false, false], 4, &[true, false]).is_err());
    }

    #[test]
    fn connect_pairing_direct_and_broadcast_with_dp() {
        for dp in [1, 2] {
            for tp in [1, 2, 4] {
                let p = connect_pairing(dp, tp, dp, tp, false);
                assert_eq!(p.len(), dp * dp * tp);
                assert!(p.iter().all(|((_, ls), (_, rs))| ls == rs));
                // every replica pair is wired
                for lr in 0..dp {
                    for rr in 0..dp {
                        assert!(p.iter().any(|((a, _), (b, _))| *a == lr && *b == rr));
                    }
                }
            }
        }
        let p = connect_pairing(2, 1, 1, 4, true);
        assert_eq!(p.len(), 2 * 4);
        assert_eq!(p[0], ((0, 0), (0, 0)));
        assert_eq!(p[7], ((1, 0), (0, 3)));
    }

    #[test]
    fn transfer_pairing_direct_and_broadcast() {
        for tp in [1, 2, 4] {
            let p = transfer_shard_pairing(false, tp, tp);
            assert_eq!(p, (0..tp).map(|i| (i, i)).collect::<Vec<_>>());
        }
        // MLA TP1 -> TP4: fan out
        assert_eq!(transfer_shard_pairing(true, 1, 4), vec![(0, 0), (0, 1), (0, 2), (0, 3)]);
        assert_eq!(transfer_shard_pairing(false, 1, 4), vec![(0, 0), (0, 1), (0, 2), (0, 3)]);
        // MLA TP4 -> TP1: flatten the source to shard 0
        assert_eq!(transfer_shard_pairing(true, 4, 1), vec![(0, 0)]);
        // MLA TP2 -> TP4
        assert_eq!(transfer_shard_pairing(true, 2, 4), vec![(0, 0), (0, 1), (0, 2), (0, 3)]);
        assert_eq!(transfer_shard_pairing(true, 4, 2), vec![(0, 0), (0, 1)]);
    }
}
