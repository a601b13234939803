//! The helper processes `bench` and `replay` start (`bench-target`,
//! `replay-decode`): their failure is reported once, by the parent, with the
//! child's own cause instead of the parent's symptom ("the other process closed the side channel").
//!
//! The child prints `error: <cause>` as any kvwire command does; the parent
//! reads the child's stderr, passes every other line through, keeps the
//! cause, and [`Child::finish`] chooses what to report.

use crate::failure::ChildFailed;
use std::io::{BufRead, BufReader};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use kvwire::sidechannel::SideChannelError;

/// A running helper process.
pub(crate) struct Child {
    role: &'static str,
    proc: std::process::Child,
    report: Arc<Mutex<Option<Report>>>,
    reader: Option<JoinHandle<()>>,
}

/// What a child printed after `error: `: its cause on one line and, under
/// `-v`, its backtrace.
#[derive(Debug, Default)]
struct Report {
    /// The `error:` line and its `Caused by:` entries, joined by `: `.
    cause: String,
    /// The lines of the previous cause (to leave out quoted ones).
    last: String,
    /// Which part of a `-v` report the next line belongs to.
    section: Section,
    backtrace: Vec<String>,
}

#[derive(Debug, Default, PartialEq)]
enum Section {
    #[default]
    Message,
    Causes,
    Backtrace,
}

impl Report {
    fn new(first: &str) -> Self {
        Self { cause: first.to_string(), last: first.to_string(), ..Self::default() }
    }

    /// Fold one more line of a `-v` report (anyhow's `{:?}`) in.
    fn line(&mut self, line: &str) {
        match line.trim_end() {
            "Caused by:" => self.section = Section::Causes,
            "Stack backtrace:" => self.section = Section::Backtrace,
            "" => {}
            l if self.section == Section::Causes => {
                // `    0: cause`, or `    cause` when there is only one.
                let t = l.trim_start();
                let t = t.split_once(": ").filter(|(n, _)| n.parse::<u32>().is_ok()).map_or(t, |(_, c)| c);
                if !self.last.contains(t) {
                    self.cause.push_str(": ");
                    self.cause.push_str(t);
                }
                self.last = t.to_string();
            }
            l if self.section == Section::Backtrace => self.backtrace.push(l.to_string()),
            l => {
                self.cause.push(' ');
                self.cause.push_str(l.trim());
            }
        }
    }
}

impl Child {
    /// Start this executable as `args` (a hidden subcommand); `role` names it
    /// in messages ("target", "decode").
    ///
    /// # Errors
    /// The process cannot be started.
    pub(crate) fn spawn(role: &'static str, args: &[&str]) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the kvwire executable")?;
        let mut cmd = Command::new(exe);
        if crate::failure::verbose() {
            cmd.arg("-v");
        }
        // A process group of its own: Ctrl-C in the terminal reaches only
        // the parent, which stops, prints its partial summary, and closes
        // the side channel (the child then exits).
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut proc = cmd
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting the {role} process"))?;
        let stderr = proc.stderr.take().expect("piped");
        let report = Arc::new(Mutex::new(None));
        let keep = report.clone();
        let reader = std::thread::Builder::new().name(format!("{role}-stderr")).spawn(move || {
            // Lines after `error: ` up to `hint: ` are the rest of the
            // child's report (its causes and backtrace under `-v`): kept, not
            // passed through, so that the parent reports them once.
            let mut in_report = false;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut r = keep.lock().expect("not poisoned");
                if let Some(c) = line.strip_prefix("error: ") {
                    *r = Some(Report::new(c));
                    in_report = true;
                } else if line.starts_with("hint: ") {
                    in_report = false;
                } else if let (true, Some(r)) = (in_report, r.as_mut()) {
                    r.line(&line);
                } else {
                    eprintln!("{line}");
                }
            }
        })?;
        Ok(Self { role, proc, report, reader: Some(reader) })
    }

    /// Wait for the child and combine its outcome with the parent's
    /// `result`: the child's cause when it failed and the parent's error is
    /// only the side channel breaking (or the parent succeeded), else the
    /// parent's own error. A child that does not exit within 10 s of a
    /// failed parent is killed.
    ///
    /// # Errors
    /// As described.
    pub(crate) fn finish<T>(mut self, result: Result<T>) -> Result<T> {
        // After Ctrl-C the helper is stopped at once (the parent reports
        // the partial summary); after another failure it gets 10 s.
        let grace = if crate::failure::interrupted() { Duration::ZERO } else { Duration::from_secs(10) };
        let status = if result.is_ok() { self.proc.wait().ok() } else { self.wait_or_kill(grace) };
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let cause = self.report.lock().expect("not poisoned").take();
        let failed = status.is_some_and(|s| !s.success());
        match result {
            Ok(v) if !failed => Ok(v),
            Ok(_) => Err(self.child_error(cause, status)),
            Err(e) if crate::failure::interrupted() => Err(e),
            Err(e) if is_channel_symptom(&e) && (failed || cause.is_some()) => Err(self.child_error(cause, status)),
            Err(e) => Err(e),
        }
    }

    fn child_error(&self, cause: Option<Report>, status: Option<ExitStatus>) -> anyhow::Error {
        match (cause, status) {
            (Some(r), _) => ChildFailed { role: self.role, cause: r.cause, backtrace: r.backtrace }.into(),
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
