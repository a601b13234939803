//! The helper processes `bench` and `replay` start (`bench-target`,
//! `replay-decode`): their failure is reported once, by the parent, with the
//! child's own cause instead of the parent's symptom ("the other process closed the side channel").
//!
//! The child prints `error: <cause>` as any kvwire command does; the parent
//! reads the child's stderr, passes every other line through, keeps the
//! cause, and [`Child::finish`] chooses what to report.

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use kvwire::sidechannel::SideChannelError;

/// A running helper process.
pub struct Child {
    role: &'static str,
    proc: std::process::Child,
    cause: Arc<Mutex<Option<String>>>,
    reader: Option<JoinHandle<()>>,
}

impl Child {
    /// Start this executable as `args` (a hidden subcommand); `role` names it
    /// in messages ("target", "decode").
    ///
    /// # Errors
    /// The process cannot be started.
    pub fn spawn(role: &'static str, args: &[&str]) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the kvwire executable")?;
        let mut cmd = Command::new(exe);
        if crate::failure::verbose() {
            cmd.arg("-v");
        }
        let mut proc = cmd
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting the {role} process"))?;
        let stderr = proc.stderr.take().expect("piped");
        let cause = Arc::new(Mutex::new(None));
        let keep = cause.clone();
        let reader = std::thread::Builder::new().name(format!("{role}-stderr")).spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(c) = line.strip_prefix("error: ") {
                    *keep.lock().expect("not poisoned") = Some(c.to_string());
                } else if !line.starts_with("hint: ") {
                    eprintln!("{line}");
                }
            }
        })?;
        Ok(Self { role, proc, cause, reader: Some(reader) })
    }

    /// Wait for the child and combine its outcome with the parent's
    /// `result`: the child's cause when it failed and the parent's error is
    /// only the side channel breaking (or the parent succeeded), else the
    /// parent's own error. A child that does not exit within 10 s of a
    /// failed parent is killed.
    ///
    /// # Errors
    /// As described.
    pub fn finish<T>(mut self, result: Result<T>) -> Result<T> {
        let status = if result.is_ok() { self.proc.wait().ok() } else { self.wait_or_kill(Duration::from_secs(10)) };
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let cause = self.cause.lock().expect("not poisoned").take();
        let failed = status.is_some_and(|s| !s.success());
        match result {
            Ok(v) if !failed => Ok(v),
            Ok(_) => Err(self.child_error(cause, status)),
            Err(e) if is_channel_symptom(&e) && (failed || cause.is_some()) => Err(self.child_error(cause, status)),
            Err(e) => Err(e),
        }
    }

    fn child_error(&self, cause: Option<String>, status: Option<ExitStatus>) -> anyhow::Error {
        match (cause, status) {
            (Some(c), _) => anyhow!("the {} process failed: {c}", self.role),
            (None, Some(s)) => anyhow!("the {} process exited with {s} without saying why", self.role),
            (None, None) => anyhow!("the {} process could not be waited for", self.role),
        }
    }

    fn wait_or_kill(&mut self, grace: Duration) -> Option<ExitStatus> {
        let until = Instant::now() + grace;
        loop {
            match self.proc.try_wait() {
                Ok(Some(s)) => return Some(s),
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = self.proc.kill();
                    return self.proc.wait().ok();
                }
            }
        }
    }
}

/// The parent's error is the side channel breaking: a symptom of the child
/// going away, not a cause.
fn is_channel_symptom(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(c.downcast_ref::<SideChannelError>(), Some(SideChannelError::Closed | SideChannelError::Io { .. }))
    }) || format!("{e:#}").contains("closed the side channel")
}
