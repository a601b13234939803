//! `enum ibv_wc_status` (`<infiniband/verbs.h>`) as one typed table: the
//! value, the name and the classification every user of a work completion
//! needs (the transport's failure kinds, the simulated NIC, log lines).

use crate::cq::WorkCompletion;

macro_rules! wc_statuses {
    ($($(#[$doc:meta])* $variant:ident = $value:literal => $name:literal,)*) => {
        /// A work completion's status (`enum ibv_wc_status`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum WcStatus {
            $($(#[$doc])* $variant = $value,)*
        }

        impl WcStatus {
            /// Every status, indexed by its value.
            pub const ALL: &'static [WcStatus] = &[$(WcStatus::$variant,)*];

            /// The C name, e.g. `"IBV_WC_REM_ACCESS_ERR"`.
            pub const fn name(self) -> &'static str {
                match self {
                    $(WcStatus::$variant => $name,)*
                }
            }
        }
    };
}

wc_statuses! {
    /// The WR completed.
    Success = 0 => "IBV_WC_SUCCESS",
    /// Local length error (a receive too small, an SGE too long).
    LocLenErr = 1 => "IBV_WC_LOC_LEN_ERR",
    /// Local QP operation error.
    LocQpOpErr = 2 => "IBV_WC_LOC_QP_OP_ERR",
    /// Local EE context operation error.
    LocEecOpErr = 3 => "IBV_WC_LOC_EEC_OP_ERR",
    /// Local protection error (lkey or local range).
    LocProtErr = 4 => "IBV_WC_LOC_PROT_ERR",
    /// Flushed: the QP was in error when the WR was processed.
    WrFlushErr = 5 => "IBV_WC_WR_FLUSH_ERR",
    /// Memory-window bind error.
    MwBindErr = 6 => "IBV_WC_MW_BIND_ERR",
    /// Bad response from the responder.
    BadRespErr = 7 => "IBV_WC_BAD_RESP_ERR",
    /// Local access error.
    LocAccessErr = 8 => "IBV_WC_LOC_ACCESS_ERR",
    /// The responder found the request invalid.
    RemInvReqErr = 9 => "IBV_WC_REM_INV_REQ_ERR",
    /// Remote access error (rkey or remote range).
    RemAccessErr = 10 => "IBV_WC_REM_ACCESS_ERR",
    /// Remote operation error.
    RemOpErr = 11 => "IBV_WC_REM_OP_ERR",
    /// Transport retries exhausted (the peer does not answer).
    RetryExcErr = 12 => "IBV_WC_RETRY_EXC_ERR",
    /// Receiver-not-ready retries exhausted.
    RnrRetryExcErr = 13 => "IBV_WC_RNR_RETRY_EXC_ERR",
    /// Local RDD violation.
    LocRddViolErr = 14 => "IBV_WC_LOC_RDD_VIOL_ERR",
    /// The responder found the RDMA READ request invalid.
    RemInvRdReqErr = 15 => "IBV_WC_REM_INV_RD_REQ_ERR",
    /// The responder aborted the operation.
    RemAbortErr = 16 => "IBV_WC_REM_ABORT_ERR",
    /// Invalid EE context number.
    InvEecnErr = 17 => "IBV_WC_INV_EECN_ERR",
    /// Invalid EE context state.
    InvEecStateErr = 18 => "IBV_WC_INV_EEC_STATE_ERR",
    /// Fatal error.
    FatalErr = 19 => "IBV_WC_FATAL_ERR",
    /// Response timeout.
    RespTimeoutErr = 20 => "IBV_WC_RESP_TIMEOUT_ERR",
    /// General error.
    GeneralErr = 21 => "IBV_WC_GENERAL_ERR",
    /// Tag-matching error.
    TmErr = 22 => "IBV_WC_TM_ERR",
    /// Tag-matching rendezvous incomplete.
    TmRndvIncomplete = 23 => "IBV_WC_TM_RNDV_INCOMPLETE",
}

impl WcStatus {
    /// The status of raw value `raw`; `None` for a value verbs.h does not define.
    pub fn from_raw(raw: u32) -> Option<Self> {
        Self::ALL.get(raw as usize).copied()
    }

    /// The raw `enum ibv_wc_status` value (what `ibv_wc.status` holds).
    pub const fn raw(self) -> u32 {
        self as u32
    }

    /// The name of raw status `raw` ([`WcStatus::name`]), `"IBV_WC_UNKNOWN"`
    /// for a value verbs.h does not define.
    pub fn name_of(raw: u32) -> &'static str {
        Self::from_raw(raw).map_or("IBV_WC_UNKNOWN", Self::name)
    }

    /// Whether the WR completed.
    pub const fn is_success(self) -> bool {
        matches!(self, Self::Success)
    }

    /// Whether the WR was flushed (the QP was already in error): not a
    /// failure of this WR itself.
    pub const fn is_flush(self) -> bool {
        matches!(self, Self::WrFlushErr)
    }

    /// A local fault in what was posted (length, QP op, lkey, local access).
    pub const fn is_local_protection(self) -> bool {
        matches!(self, Self::LocLenErr | Self::LocQpOpErr | Self::LocProtErr | Self::LocAccessErr)
    }

    /// The peer stopped answering (transport or RNR retries exhausted,
    /// response timeout): the connection, not the request, is at fault, so
    /// a reconnect may succeed.
    pub const fn is_peer_gone(self) -> bool {
        matches!(self, Self::RetryExcErr | Self::RnrRetryExcErr | Self::RespTimeoutErr)
    }
}

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl WorkCompletion {
    /// This completion's status, typed; `None` for a value verbs.h does not define.
    pub fn wc_status(&self) -> Option<WcStatus> {
        WcStatus::from_raw(self.status)
    }

    /// The name of this completion's status ([`WcStatus::name_of`]).
    pub fn status_name(&self) -> &'static str {
        WcStatus::name_of(self.status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_indexed_by_value_and_round_trips() {
        assert_eq!(WcStatus::ALL.len(), 24);
        for (i, s) in WcStatus::ALL.iter().enumerate() {
            assert_eq!(s.raw() as usize, i, "{s}");
            assert_eq!(WcStatus::from_raw(i as u32), Some(*s));
            assert!(s.name().starts_with("IBV_WC_"), "{s}");
        }
        assert_eq!(WcStatus::from_raw(24), None);
        assert_eq!(WcStatus::name_of(10), "IBV_WC_REM_ACCESS_ERR");
        assert_eq!(WcStatus::name_of(5), "IBV_WC_WR_FLUSH_ERR");
        assert_eq!(WcStatus::name_of(999), "IBV_WC_UNKNOWN");
        assert_eq!(WcStatus::RetryExcErr.to_string(), "IBV_WC_RETRY_EXC_ERR");
    }

    #[test]
    fn classification() {
        assert!(WcStatus::Success.is_success() && !WcStatus::WrFlushErr.is_success());
        assert!(WcStatus::WrFlushErr.is_flush() && !WcStatus::RemAccessErr.is_flush());
        let local: Vec<_> = WcStatus::ALL.iter().filter(|s| s.is_local_protection()).map(|s| s.raw()).collect();
        assert_eq!(local, [1, 2, 4, 8]);
        let gone: Vec<_> = WcStatus::ALL.iter().filter(|s| s.is_peer_gone()).map(|s| s.raw()).collect();
        assert_eq!(gone, [12, 13, 20]);
        let wc = WorkCompletion { status: 13, ..Default::default() };
        assert_eq!(wc.wc_status(), Some(WcStatus::RnrRetryExcErr));
        assert_eq!(wc.status_name(), "IBV_WC_RNR_RETRY_EXC_ERR");
    }
}
