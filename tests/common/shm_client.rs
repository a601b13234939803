//! A hand-driven shm initiator speaking the wire protocol directly, to check
//! what a target hands to a client that is not a well-behaved kvwire peer.

use std::os::fd::OwnedFd;
use std::time::Duration;

use kvwire::transport::auth::{self, AgentSecret};
use kvwire::transport::shm::wire::{self, Channel, Msg, ShmInfo};

/// Everything the target sent, and the descriptors that came with it.
#[derive(Debug, Default)]
pub(crate) struct Handshake {
    /// Messages in order (up to `Ready`, `Refused` or the end of stream).
    pub msgs: Vec<Msg>,
    /// Descriptors received with them.
    pub fds: Vec<OwnedFd>,
}

impl Handshake {
    /// True when the target refused us with a `Refused` message.
    pub(crate) fn refused(&self) -> bool {
        self.msgs.iter().any(|m| matches!(m, Msg::Refused { .. }))
    }

    /// The `Region` messages received.
    pub(crate) fn regions(&self) -> usize {
        self.msgs.iter().filter(|m| matches!(m, Msg::Region { .. })).count()
    }
}

/// Connect to the target of `info`, answer its challenge with a proof made
/// from `secret` (the real one, or a guess), ask for `rkeys` and collect
/// the answer.
pub(crate) fn hello(info: &ShmInfo, secret: &AgentSecret, agent: &str, rkeys: &[u32]) -> Handshake {
    hello_and_stay(info, secret, agent, rkeys).0
}

/// As [`hello`], and keep the connection: the caller holds an initiator
/// that the target counts as live but that answers nothing further.
pub(crate) fn hello_and_stay(info: &ShmInfo, secret: &AgentSecret, agent: &str, rkeys: &[u32]) -> (Handshake, Channel) {
    let ch = Channel::connect(&info.socket, Duration::from_secs(5)).expect("connect to the target socket");
    let out = handshake(&ch, secret, agent, rkeys);
    (out, ch)
}

fn handshake(ch: &Channel, secret: &AgentSecret, agent: &str, rkeys: &[u32]) -> Handshake {
    let mut out = Handshake::default();
    let nonce = match ch.recv() {
        Ok(Some((Msg::Challenge { nonce }, fd))) => {
            out.fds.extend(fd);
            nonce
        }
        Ok(Some((m, fd))) => {
            out.fds.extend(fd);
            out.msgs.push(m);
            return out;
        }
        _ => return out,
    };
    let proof = auth::prove(secret, &nonce, &wire::proof_context(agent)).to_vec();
    if ch.send(&Msg::Hello { agent: agent.into(), rkeys: rkeys.to_vec(), proof, nonce }, None).is_err() {
        return out;
    }
    while let Ok(Some((m, fd))) = ch.recv() {
        out.fds.extend(fd);
        let last = matches!(m, Msg::Ready { .. } | Msg::Refused { .. });
        out.msgs.push(m);
        if last {
            break;
        }
    }
    // Whatever else arrives before the target closes counts too.
    if out.refused() {
        while let Ok(Some((m, fd))) = ch.recv() {
            out.fds.extend(fd);
            out.msgs.push(m);
        }
    }
    out
}

/// Send raw bytes with `fds` attached (SCM_RIGHTS), as a hostile local
/// process would.
pub(crate) fn send_with_fds(ch: &Channel, body: &[u8], fds: &[std::os::fd::RawFd]) {
    use std::os::fd::AsRawFd;
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec { iov_base: body.as_ptr() as *mut libc::c_void, iov_len: body.len() };
    // SAFETY: all-zero msghdr is valid; then pointed at live buffers.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    mh.msg_control = control.as_mut_ptr().cast();
    mh.msg_controllen = space as _;
    // SAFETY: `control` has room for one cmsghdr with `fds`; the macros stay inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&mh);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
        assert!(libc::sendmsg(ch.as_fd().as_raw_fd(), &mh, libc::MSG_NOSIGNAL) >= 0);
    }
}
