//! Access control of the shm backend (issue 16 item 2, issue 18 item 5):
//! who may connect, what a peer that proved the secret receives, and what
//! it can do with it. Tests run as root here; the other-uid test drops
//! privileges in a child process.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::Arc;

use common::shm_client::hello;
use kvwire::HostBuffer;
use kvwire::transport::auth::AgentSecret;
use kvwire::transport::shm::ShmTransport;
use kvwire::transport::shm::wire::{Access, Msg, ShmInfo};
use kvwire::transport::{MemoryBacking, Registration, RemoteRegion, Transport, TransportConfig, TransportError, View};

const NOBODY: u32 = 65534;

fn target(options: &[(&str, &str)], len: usize) -> (ShmTransport, Arc<HostBuffer>, Registration, ShmInfo) {
    let cfg = TransportConfig {
        options: options.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        ..TransportConfig::default()
    };
    let mut t = ShmTransport::new("target", &cfg).unwrap();
    let buf = std::sync::Arc::new(HostBuffer::new(len).unwrap());
    let reg = t.register(buf.clone()).unwrap();
    let info = ShmInfo::decode(&t.connection_info()).unwrap();
    (t, buf, reg, info)
}

/// Entry point of the unprivileged child: the connection info comes in the
/// environment, the result goes to stdout.
#[test]
#[ignore = "child process entry point, started by the other-uid test"]
fn other_uid_child_entry() {
    let Ok(info) = std::env::var("KVWIRE_SHM_INFO") else {
        eprintln!("skipped: runs only as a child process of another test");
        return;
    };
    let bytes: Vec<u8> = serde_json::from_str(&info).unwrap();
    let rkey: u32 = std::env::var("KVWIRE_SHM_RKEY").unwrap().parse().unwrap();
    let info = ShmInfo::decode(&bytes).unwrap();
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let h = hello(&info, &info.secret, "intruder", &[rkey]);
    println!("RESULT uid={uid} regions={} fds={} refused={}", h.regions(), h.fds.len(), h.refused());
}

/// Run `other_uid_child_entry` as uid/gid 65534 (nobody) against `info`.
fn as_nobody(info: &ShmInfo, rkey: u32) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "other_uid_child_entry", "--ignored", "--nocapture", "--test-threads=1"])
        .env("KVWIRE_SHM_INFO", serde_json::to_string(&info.encode()).unwrap())
        .env("KVWIRE_SHM_RKEY", rkey.to_string())
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let line = stdout.lines().find_map(|l| l.find("RESULT").map(|i| &l[i..]));
    line.unwrap_or_else(|| panic!("child said: {stdout} {out:?}")).to_string()
}

#[test]
fn a_process_of_another_uid_is_refused_and_receives_no_fd() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: dropping privileges to another uid needs root");
        return;
    }
    // It knows the secret (it has the metadata), but runs as another uid.
    let (_t, _buf, reg, info) = target(&[], 1 << 20);
    let got = as_nobody(&info, reg.rkey.0);
    assert_eq!(got, format!("RESULT uid={NOBODY} regions=0 fds=0 refused=true"));
    // The same process is served once its uid is allowed: the check is real.
    let (_t, _buf, reg, info) = target(&[("allow_uids", &NOBODY.to_string())], 1 << 20);
    let got = as_nobody(&info, reg.rkey.0);
    assert_eq!(got, format!("RESULT uid={NOBODY} regions=1 fds=1 refused=false"));
}

#[test]
fn a_peer_without_the_secret_is_refused_and_receives_no_fd() {
    let (t, buf, reg, info) = target(&[], 1 << 20);
    let guess = AgentSecret::random().unwrap();
    let h = hello(&info, &guess, "intruder", &[reg.rkey.0]);
    assert!(h.refused(), "{:?}", h.msgs);
    assert_eq!((h.regions(), h.fds.len()), (0, 0), "{:?}", h.msgs);
    // The right secret gets the region and its memfd.
    let h = hello(&info, &info.secret, "peer", &[reg.rkey.0]);
    assert_eq!((h.regions(), h.fds.len(), h.refused()), (1, 1, false), "{:?}", h.msgs);
    // A kvwire initiator with forged connection info fails to connect.
    let forged = ShmInfo { secret: guess, ..info };
    let mut init = ShmTransport::new("initiator", &TransportConfig::default()).unwrap();
    let d = buf.desc();
    let region = RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: reg.rkey, kind: d.kind, device_id: 0 };
    let err = init.connect("target", &forged.encode(), &[region]).unwrap_err();
    assert!(matches!(err, TransportError::Connect { .. }) && err.to_string().contains("refused"), "{err}");
    init.connect("target", &t.connection_info(), &[region]).unwrap();
}

/// Issue 18 item 5: a peer could `ftruncate` the target's memfd (the target
/// then died of SIGBUS) and reach bytes around a registered view.
#[test]
fn exported_memfds_hold_only_the_region_and_cannot_be_resized() {
    let len = 10_000usize; // not a page multiple
    let (_t, _buf, reg, info) = target(&[], len);
    let h = hello(&info, &info.secret, "peer", &[reg.rkey.0]);
    assert_eq!(h.fds.len(), 1, "{:?}", h.msgs);
    let fd = h.fds[0].as_raw_fd();
    let st = nix::sys::stat::fstat(&h.fds[0]).unwrap();
    assert_eq!(st.st_size as usize, len.div_ceil(4096) * 4096, "the memfd holds the region's pages only");
    // SAFETY: ftruncate on a descriptor we own.
    unsafe {
        assert_ne!(libc::ftruncate(fd, 0), 0, "a peer shrank the target's memory");
        assert_ne!(libc::ftruncate(fd, 1 << 30), 0, "a peer grew the target's memory");
        // F_SEAL_SEAL: a peer cannot add seals either (F_SEAL_FUTURE_WRITE
        // would stop the target's own writes).
        assert_eq!(
            libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_FUTURE_WRITE),
            -1,
            "a peer sealed the target's memory"
        );
    }
}

#[test]
fn a_view_inside_a_larger_buffer_never_hands_out_the_whole_memfd() {
    let big = Arc::new(HostBuffer::new(1 << 20).unwrap());
    let view = std::sync::Arc::new(View::new(big.clone(), 4096, 4096).unwrap());
    // With cross-memory attach allowed (the default) the view is reached
    // through it: no memfd (which would expose the other 1020 KiB) is sent.
    let mut t = ShmTransport::new("target", &TransportConfig::default()).unwrap();
    let reg = t.register(view.clone()).unwrap();
    let info = ShmInfo::decode(&t.connection_info()).unwrap();
    let h = hello(&info, &info.secret, "peer", &[reg.rkey.0]);
    assert!(h.fds.is_empty(), "{:?}", h.msgs);
    assert!(h.msgs.iter().any(|m| matches!(m, Msg::Region { access: Access::Cma, .. })), "{:?}", h.msgs);
    // With cma=deny such memory cannot be registered at all.
    let cfg = TransportConfig { options: vec![("cma".into(), "deny".into())], ..TransportConfig::default() };
    let mut t = ShmTransport::new("target", &cfg).unwrap();
    let err = t.register(view.clone()).unwrap_err();
    assert!(matches!(err, TransportError::Registration(_)) && err.to_string().contains("cma=deny"), "{err}");
    t.register(big.clone()).unwrap();
}
