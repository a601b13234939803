//! Work-completion statuses and verbs errors as typed transfer failures,
//! keeping the status (`enum ibv_wc_status`, `<infiniband/verbs.h>`) or the
//! errno as the source.

use crate::transport::{FailureKind, FailureSource, RemoteAccessKind, TransferFailure};
use crate::verbs::{VerbsError, WcStatus, WorkCompletion};

/// The typed failure for an error work completion, keeping its status and
/// vendor syndrome as the source (`enum ibv_wc_status`, verbs.h).
pub(super) fn wc_failure(wc: &WorkCompletion) -> TransferFailure {
    let kind = match wc.wc_status() {
        Some(s) if s.is_local_protection() => FailureKind::LocalProtection,
        Some(WcStatus::RemAccessErr) => FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds),
        Some(WcStatus::RemInvReqErr | WcStatus::RemInvRdReqErr) => FailureKind::RemoteAccess(RemoteAccessKind::Denied),
        Some(s) if s.is_peer_gone() => FailureKind::PeerDied,
        // A flush with no earlier error: the QP was flushed by us.
        Some(WcStatus::WrFlushErr) => FailureKind::Cancelled,
        _ => FailureKind::Transport,
    };
    TransferFailure {
        kind,
        source: FailureSource::WorkCompletion { status: wc.status, vendor_err: wc.vendor_err },
        detail: format!("{} (vendor error {:#x}) on QP {}", wc.status_name(), wc.vendor_err, wc.qp_num),
    }
}

/// The typed failure for an `ibv_post_send` that returned an error: a
/// transport error with the errno as the source (`ENOMEM`: the send queue
/// is full; `EINVAL`: a bad WR, as rdma-core's providers return them).
pub(super) fn post_failure(e: &VerbsError) -> TransferFailure {
    let errno = match e {
        VerbsError::Call { source, .. } => source.raw_os_error(),
        _ => None,
    };
    TransferFailure {
        kind: FailureKind::Transport,
        source: errno.map_or(FailureSource::None, FailureSource::Os),
        detail: format!("ibv_post_send: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wc(status: u32) -> WorkCompletion {
        WorkCompletion { status, vendor_err: 0x81, qp_num: 17, ..Default::default() }
    }

    #[test]
    fn wc_statuses_map_to_kinds_and_keep_the_status() {
        for (status, kind) in [
            (10, FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds)),
            (9, FailureKind::RemoteAccess(RemoteAccessKind::Denied)),
            (12, FailureKind::PeerDied),
            (13, FailureKind::PeerDied),
            (4, FailureKind::LocalProtection),
            (1, FailureKind::LocalProtection),
            (5, FailureKind::Cancelled),
            (19, FailureKind::Transport),
        ] {
            let f = wc_failure(&wc(status));
            assert_eq!(f.kind, kind, "status {status}");
            assert_eq!(f.source, FailureSource::WorkCompletion { status, vendor_err: 0x81 });
            assert!(f.detail.contains("QP 17"), "{f}");
        }
    }

    #[test]
    fn post_errors_keep_the_errno() {
        let e = VerbsError::call("ibv_post_send", libc::ENOMEM);
        let f = post_failure(&e);
        assert_eq!(f.kind, FailureKind::Transport);
        assert_eq!(f.source, FailureSource::Os(libc::ENOMEM));
    }
}
