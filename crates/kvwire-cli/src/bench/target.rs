//! The target side of `kvwire bench`: the `bench-target` child, or
//! `kvwire bench --listen` on another host. It registers one buffer (filled
//! for READ), sends its metadata, and on the initiator's `Verify` counts the
//! notifications and checks the written blocks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Args;
use kvwire::HostBuffer;
use kvwire::engine::TransferEngine;
use kvwire::sidechannel::{SideChannel, SideListener};
use kvwire::transport::Op;

use super::{Ctl, config, count_bad, destinations, fill_blocks};

/// Options of the hidden `bench-target` child.
#[derive(Args, Debug)]
pub(crate) struct TargetArgs {
    /// Side-channel address of the initiator.
    #[arg(long)]
    connect: String,
}

/// `kvwire bench-target`: the child started by `kvwire bench`.
pub(crate) fn run_target(a: TargetArgs) -> Result<()> {
    let mut chan = SideChannel::connect(&a.connect, Duration::from_secs(10))?;
    let setup = chan.recv()?;
    serve(chan, setup)
}

/// How long a `--listen` target waits for a new connection's Setup message
/// before it drops that connection and waits for the next one.
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// `bench --listen`: accept connections until one is a kvwire bench
/// initiator (its first message is a Setup within [`SETUP_TIMEOUT`]);
/// silent or foreign connections (a port scan, an HTTP client) are dropped
/// with a warning instead of stalling or ending the target. While no
/// initiator has come it says so every [`STILL_WAITING_EVERY`]; with a
/// `timeout` it fails naming the address once that passed.
pub(super) fn listen(l: &mut SideListener, addr: &str, timeout: Option<Duration>) -> Result<()> {
    let started = std::time::Instant::now();
    let mut next_note = started + STILL_WAITING_EVERY;
    loop {
        let Some(mut chan) = l.try_accept()? else {
            let waited = started.elapsed();
            if let Some(t) = timeout.filter(|t| waited >= *t) {
                bail!("no initiator came to {addr} within {} s (--listen-timeout)", t.as_secs_f64());
            }
            if std::time::Instant::now() >= next_note {
                eprintln!("kvwire bench: still waiting for an initiator on {addr} ({} s)", waited.as_secs());
                next_note += STILL_WAITING_EVERY;
            }
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        chan.set_read_timeout(Some(SETUP_TIMEOUT))?;
        match chan.recv::<Ctl>() {
            Ok(setup @ Ctl::Setup { .. }) => {
                chan.set_read_timeout(None)?;
                return serve(chan, setup);
            }
            Ok(other) => eprintln!("kvwire bench: dropped a connection that sent {other:?} instead of a Setup"),
            Err(e) => eprintln!("kvwire bench: dropped a connection that is not a kvwire bench initiator ({e})"),
        }
    }
}

/// `--target-memory plain`: the buffer registered by address only, without
/// the memfd behind it, as an engine's own (numpy, torch) memory is: shm
/// peers reach it by cross-memory attach instead of mapping it.
struct Plain(Arc<HostBuffer>);

// SAFETY: the `Arc` keeps the HostBuffer, and so its mapping, alive for as
// long as this registration; the descriptor is the buffer's own.
unsafe impl kvwire::transport::MemoryBacking for Plain {
    fn desc(&self) -> kvwire::transport::MemoryDesc {
        self.0.desc()
    }
}

/// How often a `--listen` target with no initiator yet says it still waits.
const STILL_WAITING_EVERY: Duration = Duration::from_secs(60);

fn serve(mut chan: SideChannel, setup: Ctl) -> Result<()> {
    chan.send(&Ctl::Accepted)?;
    let r = target_loop(&mut chan, setup);
    if let Err(e) = &r {
        // Tell the initiator why, so that it reports the cause (not "closed").
        let _ = chan.send(&Ctl::Failed(format!("{e:#}")));
    }
    r
}

fn target_loop(chan: &mut SideChannel, setup: Ctl) -> Result<()> {
    let Ctl::Setup { transport, op, block_size, blocks, options, copy_threads, plain_memory } = setup else {
        bail!("expected Setup from the initiator");
    };
    let mut engine = TransferEngine::new("bench-target", transport, &config(copy_threads, options))?;
    let buf = Arc::new(HostBuffer::new((block_size * blocks) as usize)?);
    if op == Op::Read {
        fill_blocks(&buf, block_size, blocks);
    }
    if plain_memory {
        engine.register(Arc::new(Plain(buf.clone())))?;
    } else {
        engine.register(buf.clone())?;
    }
    chan.send(&Ctl::Meta(engine.metadata().to_bytes()))?;
    let mut seen = 0usize;
    let mut verified = false;
    loop {
        match chan.recv()? {
            Ctl::Verify { seed, scatter, notifications } => {
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    seen += engine.get_notifs().values().map(Vec::len).sum::<usize>();
                    if seen >= notifications || Instant::now() >= deadline {
                        break;
                    }
                    std::thread::yield_now();
                }
                let bad_blocks = if op == Op::Write {
                    count_bad(&buf, block_size, &destinations(blocks, scatter, seed), Op::Write)
                } else {
                    0
                };
                chan.send(&Ctl::Verified { bad_blocks, notifications: seen })?;
                verified = true;
            }
            Ctl::Exit if verified => return Ok(()),
            Ctl::Exit => bail!(
                "the initiator left before any transfer was measured (its own error says why; a target on another host needs --transport tcp or verbs there)"
            ),
            other => bail!("unexpected {other:?}"),
        }
    }
}
