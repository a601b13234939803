//! Issue 27 item 4: shm revocation without the peer's consent. A peer that
//! acknowledges `Revoke` but keeps its mapping of the memfd it was handed
//! (or maps it only later) must reach nothing of the owner's buffer once
//! `deregister` returns, while the owner's buffer keeps its contents.

mod common;

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use common::shm_client::hello_and_stay;
use kvwire::HostBuffer;
use kvwire::transport::shm::ShmTransport;
use kvwire::transport::shm::wire::{Channel, Msg, ShmInfo};
use kvwire::transport::{Registration, Transport, TransportConfig};

const LEN: usize = 1 << 20;

fn target() -> (ShmTransport, Arc<HostBuffer>, Registration, ShmInfo) {
    let mut t = ShmTransport::new("target", &TransportConfig::default()).unwrap();
    let buf = Arc::new(HostBuffer::new(LEN).unwrap());
    buf.fill_with(0, LEN, |i| (i % 251) as u8);
    let reg = t.register(buf.clone()).unwrap();
    let info = ShmInfo::decode(&t.connection_info()).unwrap();
    (t, buf, reg, info)
}

/// The peer's own shared, writable mapping of a memfd it was handed.
struct PeerMap {
    ptr: *mut u8,
    len: usize,
}

impl PeerMap {
    fn new(fd: &OwnedFd, len: usize) -> Self {
        // SAFETY: a fresh shared mapping of a memfd we hold, at an address of
        // the kernel's choosing; unmapped in drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        Self { ptr: p.cast(), len }
    }

    fn read(&self, off: usize, n: usize) -> Vec<u8> {
        assert!(off + n <= self.len);
        let mut out = vec![0u8; n];
        // SAFETY: inside our own live mapping; volatile-free plain copy of bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), out.as_mut_ptr(), n) };
        out
    }

    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: inside our own live, writable mapping.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
    }
}

impl Drop for PeerMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping, mapped in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Answer every `Revoke` with `RevokeAck` (and nothing else), as a peer
/// that claims to let go, until the target closes the connection.
fn ack_revokes(ch: Channel) -> std::thread::JoinHandle<Vec<u32>> {
    std::thread::spawn(move || {
        let mut acked = Vec::new();
        while let Ok(Some((m, _))) = ch.recv() {
            if let Msg::Revoke { rkey } = m {
                ch.send(&Msg::RevokeAck { rkey }, None).unwrap();
                acked.push(rkey);
            }
        }
        acked
    })
}

fn pattern(off: usize, n: usize) -> Vec<u8> {
    (off..off + n).map(|i| (i % 251) as u8).collect()
}

#[test]
fn a_peer_that_keeps_its_mapping_after_revoke_ack_reaches_nothing() {
    let (mut t, buf, reg, info) = target();
    let (h, ch) = hello_and_stay(&info, &info.secret, "keeper", &[reg.rkey.0]);
    assert_eq!(h.fds.len(), 1, "{:?}", h.msgs);
    // A second handed-out copy that the peer maps only after deregister.
    let (late, ch2) = hello_and_stay(&info, &info.secret, "late", &[reg.rkey.0]);
    assert_eq!(late.fds.len(), 1, "{:?}", late.msgs);
    let acks = [ack_revokes(ch), ack_revokes(ch2)];

    // Before: the mapping is the owner's memory, both ways (the test can fail).
    let map = PeerMap::new(&h.fds[0], LEN);
    assert_eq!(map.read(4096, 64), pattern(4096, 64));
    map.write(100, b"peer-before");
    assert_eq!(buf.to_vec(100..111), b"peer-before");
    buf.write(200, b"owner-before");
    assert_eq!(map.read(200, 12), b"owner-before");

    t.deregister(reg.lkey).unwrap();

    // The owner's buffer kept its contents, the peer's write included.
    assert_eq!(buf.to_vec(100..111), b"peer-before");
    assert_eq!(buf.to_vec(200..212), b"owner-before");
    assert!(buf.eq_at(4096, &pattern(4096, LEN - 4096)));
    // Later owner writes are not visible through the kept mapping…
    buf.write(300, b"owner-after");
    assert_ne!(map.read(300, 11), b"owner-after");
    assert_ne!(map.read(4096, 64), pattern(4096, 64), "the kept mapping still shows the owner's bytes");
    // …and the peer's writes through it do not reach the owner.
    map.write(400, b"peer-after!");
    map.write(0, &[0xEE; 4096]);
    assert_eq!(buf.to_vec(400..411), pattern(400, 11));
    assert_eq!(buf.to_vec(100..111), b"peer-before");
    // A peer that maps its descriptor only now sees nothing either.
    let late_map = PeerMap::new(&late.fds[0], LEN);
    assert!(late_map.read(0, LEN).iter().all(|&b| b == 0 || b == 0xEE), "late mapping reached the owner's bytes");
    late_map.write(8192, b"late-peer");
    assert_eq!(buf.to_vec(8192..8201), pattern(8192, 9));
    assert_eq!(buf.to_vec(300..311), b"owner-after");

    drop(t);
    for a in acks {
        assert_eq!(a.join().unwrap(), vec![reg.rkey.0]);
    }
}

/// After re-homing, the buffer registers again and is shared live again:
/// the memfd a new peer gets is the one the owner now maps.
#[test]
fn a_rehomed_buffer_registers_and_shares_again() {
    let (mut t, buf, reg, info) = target();
    let (h, ch) = hello_and_stay(&info, &info.secret, "first", &[reg.rkey.0]);
    assert_eq!(h.fds.len(), 1);
    let ack = ack_revokes(ch);
    t.deregister(reg.lkey).unwrap();
    let reg2 = t.register(buf.clone()).unwrap();
    let (h2, _ch2) = hello_and_stay(&info, &info.secret, "second", &[reg2.rkey.0]);
    assert_eq!(h2.fds.len(), 1, "{:?}", h2.msgs);
    let map = PeerMap::new(&h2.fds[0], LEN);
    assert_eq!(map.read(0, 4096), pattern(0, 4096));
    map.write(10, b"shared");
    assert_eq!(buf.to_vec(10..16), b"shared");
    buf.write(20, b"again");
    assert_eq!(map.read(20, 5), b"again");
    drop(t);
    assert_eq!(ack.join().unwrap(), vec![reg.rkey.0]);
}

/// Only one registration at a time hands out a buffer's memfd (re-homing
/// for one would cut off the other's peers): a second one is reached by
/// cross-memory attach, and keeps working after the first ends.
#[test]
fn a_buffer_registered_twice_is_exported_once() {
    let (mut t, buf, reg, info) = target();
    let mut t2 = ShmTransport::new("target2", &TransportConfig::default()).unwrap();
    let reg2 = t2.register(buf.clone()).unwrap();
    let info2 = ShmInfo::decode(&t2.connection_info()).unwrap();
    let (h2, _c2) = hello_and_stay(&info2, &info2.secret, "p", &[reg2.rkey.0]);
    assert!(h2.fds.is_empty(), "{:?}", h2.msgs);
    let (h, ch) = hello_and_stay(&info, &info.secret, "q", &[reg.rkey.0]);
    assert_eq!(h.fds.len(), 1);
    let ack = ack_revokes(ch);
    t.deregister(reg.lkey).unwrap();
    // The second registration still moves the owner's bytes (a real
    // initiator over cross-memory attach).
    let mut init = ShmTransport::new("init", &TransportConfig::default()).unwrap();
    let local = Arc::new(HostBuffer::new(4096).unwrap());
    let lreg = init.register(local.clone()).unwrap();
    let d = kvwire::transport::MemoryBacking::desc(&*buf);
    let region = kvwire::transport::RemoteRegion {
        addr: d.addr,
        len_bytes: d.len_bytes,
        rkey: reg2.rkey,
        kind: d.kind,
        device_id: 0,
    };
    let peer = init.connect("target2", &t2.connection_info(), &[region]).unwrap();
    buf.write(0, b"after-first-ended");
    let seg = kvwire::transport::Segment {
        local_addr: local.addr(),
        lkey: lreg.lkey,
        remote_addr: d.addr,
        rkey: reg2.rkey,
        len_bytes: 17,
    };
    init.post(kvwire::transport::PostRequest {
        xfer: kvwire::transport::XferId(1),
        peer,
        op: kvwire::transport::Op::Read,
        segments: vec![seg],
        notification: None,
    })
    .unwrap();
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while out.is_empty() && std::time::Instant::now() < deadline {
        init.wait(&mut out, Duration::from_millis(100));
    }
    assert!(out[0].result.is_ok(), "{:?}", out[0]);
    assert_eq!(local.to_vec(..17), b"after-first-ended");
    drop(t);
    assert_eq!(ack.join().unwrap(), vec![reg.rkey.0]);
}

/// A transport dropped with the registration in place ends it the same way:
/// the owner keeps using its buffer, the peer's kept mapping reaches none of it.
#[test]
fn dropping_the_transport_cuts_off_a_kept_mapping() {
    let (t, buf, reg, info) = target();
    let (h, _ch) = hello_and_stay(&info, &info.secret, "keeper", &[reg.rkey.0]);
    assert_eq!(h.fds.len(), 1, "{:?}", h.msgs);
    let map = PeerMap::new(&h.fds[0], LEN);
    buf.write(64, b"shared-now");
    assert_eq!(map.read(64, 10), b"shared-now");
    drop(t);
    assert_eq!(buf.to_vec(64..74), b"shared-now");
    buf.write(64, b"owner-only");
    assert_ne!(map.read(64, 10), b"owner-only");
    map.write(128, b"peer-write");
    assert_eq!(buf.to_vec(128..138), pattern(128, 10));
}

/// The registration held the last reference to its backing, a `View`
/// covering the whole buffer, while the owner keeps the buffer itself: the
/// buffer lives on, so it is re-homed all the same.
#[test]
fn a_whole_view_registered_alone_is_rehomed_while_the_buffer_lives() {
    let mut t = ShmTransport::new("target", &TransportConfig::default()).unwrap();
    let buf = Arc::new(HostBuffer::new(LEN).unwrap());
    buf.fill_with(0, LEN, |i| (i % 251) as u8);
    let view = kvwire::transport::View::new(buf.clone(), 0, LEN as u64).unwrap();
    let reg = t.register(Arc::new(view)).unwrap();
    let info = ShmInfo::decode(&t.connection_info()).unwrap();
    let (h, ch) = hello_and_stay(&info, &info.secret, "keeper", &[reg.rkey.0]);
    assert_eq!(h.fds.len(), 1, "{:?}", h.msgs);
    let ack = ack_revokes(ch);
    let map = PeerMap::new(&h.fds[0], LEN);
    buf.write(0, b"before");
    assert_eq!(map.read(0, 6), b"before");
    t.deregister(reg.lkey).unwrap();
    buf.write(0, b"after!");
    assert_ne!(map.read(0, 6), b"after!");
    map.write(4096, b"peer");
    assert_eq!(buf.to_vec(4096..4100), pattern(4096, 4));
    drop(t);
    assert_eq!(ack.join().unwrap(), vec![reg.rkey.0]);
}

/// Revocation without consent (issue 27 item 4): a live peer that never
/// answers `Revoke` does not keep the memory registered. `deregister`
/// returns after `peer_timeout`, the silent peer is cut off, and its kept
/// mapping reaches nothing of the owner's.
#[test]
fn a_peer_that_never_acknowledges_cannot_hold_the_memory() {
    let cfg = TransportConfig { peer_timeout: Duration::from_millis(300), ..TransportConfig::default() };
    let mut t = ShmTransport::new("target", &cfg).unwrap();
    let buf = Arc::new(HostBuffer::new(LEN).unwrap());
    buf.fill_with(0, LEN, |i| (i % 251) as u8);
    let reg = t.register(buf.clone()).unwrap();
    let info = ShmInfo::decode(&t.connection_info()).unwrap();
    let (h, ch) = hello_and_stay(&info, &info.secret, "silent", &[reg.rkey.0]);
    assert_eq!(h.fds.len(), 1, "{:?}", h.msgs);
    let map = PeerMap::new(&h.fds[0], LEN);
    assert_eq!(map.read(0, 64), pattern(0, 64));

    t.deregister(reg.lkey).expect("a silent peer must not keep the memory registered");

    buf.write(64, b"owner-after");
    assert_ne!(map.read(64, 11), b"owner-after");
    assert_ne!(map.read(4096, 64), pattern(4096, 64), "the silent peer's mapping still shows the owner's bytes");
    map.write(128, b"silent-write");
    assert_eq!(buf.to_vec(128..140), pattern(128, 12));
    // The silent peer was cut off: its connection is closed.
    let mut closed = false;
    for _ in 0..50 {
        match ch.recv() {
            Ok(None) | Err(_) => {
                closed = true;
                break;
            }
            Ok(Some(_)) => {}
        }
    }
    assert!(closed, "the silent peer is still connected");
}
