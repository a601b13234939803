//! A target agent in a child process, driven over the side channel: the
//! two-process harness for engine integration tests.
#![allow(dead_code)]

pub(crate) mod shm_client;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::engine::{AgentMetadata, TransferEngine, TransferHandle, TransferStatus};
use kvwire::sidechannel::SideChannel;
use kvwire::transport::{MemoryDesc, MemoryKind, RawMemory, TransportConfig, TransportKind};
use serde::{Deserialize, Serialize};

/// Commands from the test (initiator) to the child (target).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Cmd {
    /// Fill region `region` with `f(i) = (i * mul + add) as u8`.
    Fill { region: usize, mul: u64, add: u64 },
    /// Return FNV-1a of `[offset, offset+len)` of `region`.
    Hash { region: usize, offset: u64, len: u64 },
    /// Wait (up to 10 s) for a notification `payload` from any agent, then hash a range at once.
    WaitNotif { payload: Vec<u8>, region: usize, offset: u64, len: u64 },
    /// Exit.
    Exit,
}

/// Answers from the child.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub(crate) enum Reply {
    /// Done.
    Ok,
    /// A hash, and the sender of the notification if any.
    Hash(u64, Option<String>),
    /// Something failed.
    Err(String),
}

/// FNV-1a, the checksum both processes compute.
pub(crate) fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// Deterministic fill used on both sides.
pub(crate) fn pattern(i: u64, mul: u64, add: u64) -> u8 {
    (i.wrapping_mul(mul).wrapping_add(add) % 251) as u8
}

/// A spawned child target.
pub(crate) struct ChildTarget {
    pub child: Child,
    pub chan: SideChannel,
    pub meta: AgentMetadata,
}

impl ChildTarget {
    /// Send `sig` to the child; for `SIGSTOP`, return once every one of
    /// its threads stopped (`kill` returns before they all have).
    pub(crate) fn signal(&self, sig: libc::c_int) {
        let pid = self.child.id();
        // SAFETY: kill with integer arguments on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0);
        if sig == libc::SIGSTOP {
            let stopped = || {
                std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().all(|t| {
                    let stat = std::fs::read_to_string(t.unwrap().path().join("stat")).unwrap_or_default();
                    stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('T'))
                })
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            while !stopped() {
                assert!(Instant::now() < deadline, "child {pid} did not stop");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// Spawn this test binary's `child_entry` test as the target. `regions`
    /// are (len_bytes, memfd?) pairs: memfd-backed HostBuffers or plain heap
    /// memory (reached with cross-memory attach).
    pub(crate) fn spawn(regions: &[(usize, bool)]) -> Self {
        Self::spawn_named("target", regions)
    }

    /// [`ChildTarget::spawn`] with agent name `name`.
    pub(crate) fn spawn_named(name: &str, regions: &[(usize, bool)]) -> Self {
        Self::spawn_on(TransportKind::Shm, name, regions)
    }

    /// [`ChildTarget::spawn_named`] over transport `kind` (shm or tcp; tcp
    /// registers every region, memfd or not, as plain memory is reached).
    pub(crate) fn spawn_on(kind: TransportKind, name: &str, regions: &[(usize, bool)]) -> Self {
        let (l, addr) = SideChannel::bind("127.0.0.1:0").unwrap();
        let spec = serde_json::to_string(regions).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_entry", "--ignored", "--nocapture", "--test-threads=1"])
            .env("KVWIRE_CHILD_ADDR", addr.to_string())
            .env("KVWIRE_CHILD_REGIONS", spec)
            .env("KVWIRE_CHILD_NAME", name)
            .env("KVWIRE_CHILD_TRANSPORT", kind.to_string())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let mut chan = SideChannel::accept(&l).unwrap();
        chan.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let bytes: Vec<u8> = chan.recv().unwrap();
        let meta = AgentMetadata::from_bytes(&bytes).unwrap();
        Self { child, chan, meta }
    }

    /// Send a command and get the reply.
    pub(crate) fn call(&mut self, cmd: &Cmd) -> Reply {
        self.chan.send(cmd).unwrap();
        self.chan.recv().unwrap()
    }
}

impl Drop for ChildTarget {
    fn drop(&mut self) {
        let _ = self.chan.send(&Cmd::Exit);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Body of the child process. Call from an `#[ignore]`d test named `child_entry`.
pub(crate) fn child_main() {
    let Ok(addr) = std::env::var("KVWIRE_CHILD_ADDR") else {
        eprintln!("skipped: child_entry only runs as a child process of another test");
        return;
    };
    let spec: Vec<(usize, bool)> = serde_json::from_str(&std::env::var("KVWIRE_CHILD_REGIONS").unwrap()).unwrap();
    let name = std::env::var("KVWIRE_CHILD_NAME").unwrap_or_else(|_| "target".into());
    let kind = match std::env::var("KVWIRE_CHILD_TRANSPORT").as_deref() {
        Ok("tcp") => TransportKind::Tcp,
        _ => TransportKind::Shm,
    };
    let mut engine = TransferEngine::new(&name, kind, &TransportConfig::default()).unwrap();
    let mut host: Vec<Option<Arc<HostBuffer>>> = Vec::new();
    let mut heap: Vec<Option<Arc<Vec<u8>>>> = Vec::new();
    for &(len, memfd) in &spec {
        if memfd {
            let b = Arc::new(HostBuffer::new(len).unwrap());
            engine.register(b.clone()).unwrap();
            host.push(Some(b));
            heap.push(None);
        } else {
            let v = Arc::new(vec![0u8; len]);
            let desc =
                MemoryDesc { addr: v.as_ptr() as u64, len_bytes: len as u64, kind: MemoryKind::Dram, device_id: 0 };
            // SAFETY: `v` is kept alive in `heap` until the process exits,
            // longer than the engine that holds the registration.
            let raw = unsafe { RawMemory::new(desc) };
            engine.register(Arc::new(raw)).unwrap();
            host.push(None);
            heap.push(Some(v));
        }
    }
    let bytes_of = |i: usize, offset: u64, len: u64| -> Vec<u8> {
        let r = offset as usize..(offset + len) as usize;
        match (&host[i], &heap[i]) {
            (Some(b), _) => b.to_vec(r),
            (_, Some(v)) => v[r].to_vec(),
            _ => unreachable!(),
        }
    };
    let mut chan = SideChannel::connect(&addr, Duration::from_secs(10)).unwrap();
    chan.send(&engine.metadata().to_bytes()).unwrap();
    loop {
        let cmd: Cmd = match chan.recv() {
            Ok(c) => c,
            Err(_) => return,
        };
        let reply = match cmd {
            Cmd::Exit => return,
            Cmd::Fill { region, mul, add } => match &host[region] {
                Some(b) => {
                    b.fill_with(0, b.len(), |i| pattern(i as u64, mul, add));
                    Reply::Ok
                }
                None => Reply::Err("fill supports HostBuffer regions only".into()),
            },
            Cmd::Hash { region, offset, len } => Reply::Hash(fnv(&bytes_of(region, offset, len)), None),
            Cmd::WaitNotif { payload, region, offset, len } => {
                let deadline = Instant::now() + Duration::from_secs(10);
                let mut found = None;
                while found.is_none() && Instant::now() < deadline {
                    for (agent, msgs) in engine.get_notifs() {
                        if msgs.contains(&payload) {
                            found = Some(agent);
                        }
                    }
                    if found.is_none() {
                        std::thread::yield_now();
                    }
                }
                match found {
                    Some(agent) => Reply::Hash(fnv(&bytes_of(region, offset, len)), Some(agent)),
                    None => Reply::Err("no notification within 10 s".into()),
                }
            }
        };
        if chan.send(&reply).is_err() {
            return;
        }
    }
}

/// Poll `h` until it leaves `InProgress` or `limit` passes; its last status.
pub(crate) fn wait(e: &mut TransferEngine, h: TransferHandle, limit: Duration) -> TransferStatus {
    let deadline = Instant::now() + limit;
    loop {
        let s = e.status(h).unwrap();
        if s != TransferStatus::InProgress || Instant::now() > deadline {
            return s;
        }
        std::thread::yield_now();
    }
}
