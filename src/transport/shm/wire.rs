//! The `shm` side channel: one `SOCK_SEQPACKET` Unix socket per peer pair,
//! one postcard-encoded [`Msg`] per packet, memfds passed with `SCM_RIGHTS`.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use nix::sys::socket::{
    self, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr, sockopt,
};
use nix::sys::time::TimeVal;
use serde::{Deserialize, Serialize};

use crate::transport::TransportError;

/// Largest packet (bytes); a notification payload must fit in it.
pub const MAX_PACKET: usize = 64 << 10;
/// Largest notification payload (bytes).
pub const MAX_NOTIFICATION: usize = MAX_PACKET - 64;
/// Most remote keys one `Hello` may ask for.
pub const MAX_HELLO_KEYS: usize = 1 << 12;

/// How the target lets the initiator reach one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Access {
    /// A memfd comes with this packet; the region starts `offset` bytes into it.
    Fd {
        /// Offset of the region start inside the file (bytes).
        offset: u64,
    },
    /// Not shareable: use cross-memory attach to the target's pid.
    Cma,
    /// The target has no region with this key.
    Unknown,
}

/// Side-channel messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// Initiator → target: who I am and which regions I want.
    Hello {
        /// Initiator agent name.
        agent: String,
        /// Remote keys from the target's metadata.
        rkeys: Vec<u32>,
    },
    /// Target → initiator: one region, as the target has it registered now.
    Region {
        /// Remote key.
        rkey: u32,
        /// Start address in the target (bytes).
        addr: u64,
        /// Length (bytes).
        len_bytes: u64,
        /// How to reach it.
        access: Access,
    },
    /// Target → initiator: end of the region list.
    Ready {
        /// Target process id (for cross-memory attach).
        pid: u32,
    },
    /// Target → initiator: the region with this key was deregistered; any
    /// later access to it must fail (as a destroyed MR's rkey does).
    Revoke {
        /// Remote key.
        rkey: u32,
    },
    /// Initiator → target: no access to `rkey` is in progress and none will
    /// start; the target's `deregister` waits for this from every initiator.
    RevokeAck {
        /// Remote key.
        rkey: u32,
    },
    /// Initiator → target: a transfer's notification, sent after its data.
    Notify {
        /// Payload.
        payload: Vec<u8>,
    },
}

fn os(call: &'static str) -> impl Fn(nix::Error) -> TransportError {
    move |e| TransportError::io(call, std::io::Error::from(e))
}

/// A connected seqpacket socket.
#[derive(Debug)]
pub struct Channel {
    fd: OwnedFd,
}

impl Channel {
    /// Wrap an accepted or connected socket.
    pub fn from_fd(fd: OwnedFd) -> Self {
        Self { fd }
    }

    /// Connect to the abstract socket `name`, with send/receive timeouts.
    ///
    /// # Errors
    /// The failing call as [`TransportError::Io`].
    pub fn connect(name: &str, timeout: Duration) -> Result<Self, TransportError> {
        let fd = socket::socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)
            .map_err(os("socket"))?;
        let addr = UnixAddr::new_abstract(name.as_bytes()).map_err(os("UnixAddr"))?;
        socket::connect(fd.as_raw_fd(), &addr).map_err(os("connect"))?;
        let ch = Self { fd };
        ch.set_timeouts(timeout)?;
        Ok(ch)
    }

    /// Set `SO_SNDTIMEO` and `SO_RCVTIMEO`.
    ///
    /// # Errors
    /// `setsockopt` failure.
    pub fn set_timeouts(&self, timeout: Duration) -> Result<(), TransportError> {
        let tv = TimeVal::new(timeout.as_secs() as i64, timeout.subsec_micros() as i64);
        socket::setsockopt(&self.fd, sockopt::SendTimeout, &tv).map_err(os("setsockopt(SO_SNDTIMEO)"))?;
        socket::setsockopt(&self.fd, sockopt::ReceiveTimeout, &tv).map_err(os("setsockopt(SO_RCVTIMEO)"))
    }

    /// Clear the receive timeout (a monitor blocks until the peer goes away).
    ///
    /// # Errors
    /// `setsockopt` failure.
    pub fn block_receives(&self) -> Result<(), TransportError> {
        let tv = TimeVal::new(0, 0);
        socket::setsockopt(&self.fd, sockopt::ReceiveTimeout, &tv).map_err(os("setsockopt(SO_RCVTIMEO)"))
    }

    /// Send one message, with an optional file descriptor.
    ///
    /// # Errors
    /// `sendmsg` failure (a dead peer gives `EPIPE`/`ECONNRESET`), or a
    /// message larger than [`MAX_PACKET`].
    pub fn send(&self, msg: &Msg, fd: Option<RawFd>) -> Result<(), TransportError> {
        let buf = postcard::to_allocvec(msg).map_err(|e| TransportError::Post(e.to_string()))?;
        if buf.len() > MAX_PACKET {
            return Err(TransportError::Post(format!("{}-byte packet exceeds {MAX_PACKET}", buf.len())));
        }
        let fds;
        let cmsgs: &[ControlMessage] = match fd {
            Some(f) => {
                fds = [f];
                &[ControlMessage::ScmRights(&fds)]
            }
            None => &[],
        };
        socket::sendmsg::<()>(self.fd.as_raw_fd(), &[IoSlice::new(&buf)], cmsgs, MsgFlags::MSG_NOSIGNAL, None)
            .map_err(os("sendmsg"))?;
        Ok(())
    }

    /// Receive one message and the descriptor that came with it, if any.
    /// `Ok(None)` means the peer closed the connection.
    ///
    /// # Errors
    /// `recvmsg` failure or timeout, truncated or undecodable packets.
    pub fn recv(&self) -> Result<Option<(Msg, Option<OwnedFd>)>, TransportError> {
        let mut buf = vec![0u8; MAX_PACKET];
        let mut space = nix::cmsg_space!([RawFd; 4]);
        let (n, truncated, fd) = {
            let mut iov = [IoSliceMut::new(&mut buf)];
            let msg =
                socket::recvmsg::<()>(self.fd.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
                    .map_err(os("recvmsg"))?;
            let mut fd = None;
            for c in msg.cmsgs().map_err(os("recvmsg(cmsgs)"))? {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    for (i, raw) in fds.into_iter().enumerate() {
                        // SAFETY: the kernel just installed `raw` in our table
                        // for us (SCM_RIGHTS); nothing else owns it.
                        let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                        if i == 0 && fd.is_none() {
                            fd = Some(owned);
                        }
                    }
                }
            }
            (msg.bytes, msg.flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC), fd)
        };
        if n == 0 {
            return Ok(None);
        }
        if truncated {
            return Err(TransportError::BadConnectionInfo("truncated packet".into()));
        }
        let msg: Msg = postcard::from_bytes(&buf[..n]).map_err(|e| TransportError::BadConnectionInfo(e.to_string()))?;
        if let Msg::Hello { rkeys, .. } = &msg
            && rkeys.len() > MAX_HELLO_KEYS
        {
            return Err(TransportError::BadConnectionInfo("too many keys in hello".into()));
        }
        Ok(Some((msg, fd)))
    }

    /// Shut the socket down both ways (wakes a thread blocked in `recv`).
    pub fn shutdown(&self) {
        let _ = socket::shutdown(self.fd.as_raw_fd(), socket::Shutdown::Both);
    }
}

/// A listening abstract seqpacket socket.
#[derive(Debug)]
pub struct Listener {
    fd: OwnedFd,
}

impl Listener {
    /// Bind and listen on abstract name `name`.
    ///
    /// # Errors
    /// `socket`/`bind`/`listen` failure.
    pub fn bind(name: &str) -> Result<Self, TransportError> {
        let fd = socket::socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)
            .map_err(os("socket"))?;
        let addr = UnixAddr::new_abstract(name.as_bytes()).map_err(os("UnixAddr"))?;
        socket::bind(fd.as_raw_fd(), &addr).map_err(os("bind"))?;
        socket::listen(&fd, socket::Backlog::new(128).map_err(os("listen"))?).map_err(os("listen"))?;
        Ok(Self { fd })
    }

    /// Accept one connection.
    ///
    /// # Errors
    /// `accept` failure (including after [`Listener::shutdown`]).
    pub fn accept(&self) -> Result<Channel, TransportError> {
        let fd = socket::accept4(&self.fd, SockFlag::SOCK_CLOEXEC).map_err(os("accept"))?;
        Ok(Channel::from_fd(fd))
    }

    /// Wake a thread blocked in `accept` (it then returns an error).
    pub fn shutdown(&self) {
        let _ = socket::shutdown(self.fd.as_raw_fd(), socket::Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_fds_cross_a_socket() {
        let name = format!("kvwire-test-{}", std::process::id());
        let l = Listener::bind(&name).unwrap();
        let c = Channel::connect(&name, Duration::from_secs(2)).unwrap();
        let s = l.accept().unwrap();
        c.send(&Msg::Hello { agent: "a".into(), rkeys: vec![1, 2] }, None).unwrap();
        let (m, fd) = s.recv().unwrap().unwrap();
        assert_eq!(m, Msg::Hello { agent: "a".into(), rkeys: vec![1, 2] });
        assert!(fd.is_none());
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        s.send(&Msg::Ready { pid: 1 }, Some(f.as_raw_fd())).unwrap();
        let (m, fd) = c.recv().unwrap().unwrap();
        assert_eq!(m, Msg::Ready { pid: 1 });
        assert!(fd.is_some());
        drop(s);
        assert!(c.recv().unwrap().is_none());
        assert!(c.send(&Msg::Notify { payload: vec![0; MAX_PACKET] }, None).is_err());
    }
}
