//! [`HandshakeRelay`]: a TCP relay in front of a verbs target's handshake
//! port that can hold an initiator's close (feature `sim`: tests only).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::transport::TransportError;
use crate::transport::verbs::VerbsInfo;

/// A relay in front of a verbs target's handshake port. While
/// [`hold_close`](Self::hold_close) is on, an initiator's close does not
/// reach the target: the target's side of that control connection stays
/// open (a FIN held in a stalled fabric, as the data packets are), so the
/// target keeps that connection's receive QPs in RTS. Tests of the
/// late-bytes fence (docs/VERBS.md) dial it instead of the target.
pub struct HandshakeRelay {
    addr: String,
    hold: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl HandshakeRelay {
    /// Relay to the target of connection info `info`; the relay and the
    /// connection info that names it (the same secret, its address).
    ///
    /// # Errors
    /// [`TransportError::BadConnectionInfo`] for info that is not a verbs
    /// target's; [`TransportError::Io`] when it cannot listen.
    pub fn start(info: &[u8]) -> Result<(Self, Vec<u8>), TransportError> {
        let real: VerbsInfo =
            postcard::from_bytes(info).map_err(|e| TransportError::BadConnectionInfo(e.to_string()))?;
        let l = TcpListener::bind("127.0.0.1:0").map_err(|e| TransportError::io("bind(relay)", e))?;
        let addr = l.local_addr().map_err(|e| TransportError::io("getsockname", e))?.to_string();
        let (hold, stop) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (h, s, target) = (hold.clone(), stop.clone(), real.addr);
        std::thread::spawn(move || {
            for c in l.incoming() {
                if s.load(Ordering::Acquire) {
                    return;
                }
                let (Ok(c), Ok(t)) = (c, TcpStream::connect(&target)) else { continue };
                let (Ok(c2), Ok(t2)) = (c.try_clone(), t.try_clone()) else { continue };
                let h = h.clone();
                std::thread::spawn(move || pump(c, t, Some(h)));
                std::thread::spawn(move || pump(t2, c2, None));
            }
        });
        let via = VerbsInfo { addr: addr.clone(), secret: real.secret };
        Ok((Self { addr, hold, stop }, postcard::to_allocvec(&via).expect("plain data encodes")))
    }

    /// Hold (`true`) or pass on (`false`) initiators' closes; one held
    /// passes on once this is turned off.
    pub fn hold_close(&self, on: bool) {
        self.hold.store(on, Ordering::Release);
    }
}

impl Drop for HandshakeRelay {
    fn drop(&mut self) {
        self.hold_close(false);
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees `stop`.
        let _ = TcpStream::connect(&self.addr);
    }
}

/// Copy `from` → `to`; at `from`'s end, wait while `hold` is on before
/// passing the close on.
fn pump(mut from: TcpStream, mut to: TcpStream, hold: Option<Arc<AtomicBool>>) {
    let mut buf = vec![0u8; 16 << 10];
    while let Ok(n @ 1..) = from.read(&mut buf) {
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    while hold.as_ref().is_some_and(|h| h.load(Ordering::Acquire)) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = to.shutdown(Shutdown::Write);
}
