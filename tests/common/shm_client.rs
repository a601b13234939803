//! A hand-driven shm initiator speaking the wire protocol directly, to check
//! what a target hands to a client that is not a well-behaved kvwire peer.

use std::os::fd::OwnedFd;
use std::time::Duration;

use kvwire::transport::auth::{self, AgentSecret};
use kvwire::transport::shm::wire::{self, Channel, Msg, ShmInfo};

/// Everything the target sent, and the descriptors that came with it.
#[derive(Debug, Default)]
pub struct Handshake {
    /// Messages in order (up to `Ready`, `Refused` or the end of stream).
    pub msgs: Vec<Msg>,
    /// Descriptors received with them.
    pub fds: Vec<OwnedFd>,
}

impl Handshake {
    /// True when the target refused us with a `Refused` message.
    pub fn refused(&self) -> bool {
        self.msgs.iter().any(|m| matches!(m, Msg::Refused { .. }))
    }

    /// The `Region` messages received.
    pub fn regions(&self) -> usize {
        self.msgs.iter().filter(|m| matches!(m, Msg::Region { .. })).count()
    }
}

/// Connect to the target of `info`, answer its challenge with a proof made
/// from `secret` (the real one, or a guess), ask for `rkeys` and collect
/// the answer.
pub fn hello(info: &ShmInfo, secret: &AgentSecret, agent: &str, rkeys: &[u32]) -> Handshake {
    let ch = Channel::connect(&info.socket, Duration::from_secs(5)).expect("connect to the target socket");
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
    if ch.send(&Msg::Hello { agent: agent.into(), rkeys: rkeys.to_vec(), proof }, None).is_err() {
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
