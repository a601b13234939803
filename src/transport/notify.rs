//! The target's queue of received notifications, bounded in count and
//! bytes (issue 27 item 3). A target that stops draining it
//! (`take_notifications`) no longer grows without limit: once either bound
//! is reached, a new notification is refused and its sender's transfer
//! fails with [`FailureKind::Overloaded`](super::FailureKind::Overloaded)
//! (the same kind on every backend). Nothing is dropped silently, and the
//! refusal costs the sender one round trip on its own connection, so other
//! peers are not held up. Each refusal is counted in
//! `kvwire_notifications_refused_total{transport=...}`.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::options::OptionSet;
use super::{Notification, TransportError, TransportKind};

/// Default for option `notif_queue_count`: notifications held for the target.
pub const DEFAULT_NOTIF_QUEUE_COUNT: usize = 65_536;
/// Default for option `notif_queue_bytes`: payload bytes held for the target (64 MiB).
pub const DEFAULT_NOTIF_QUEUE_BYTES: usize = 64 << 20;

/// Bounds of the notification queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotifBounds {
    /// Most notifications held.
    pub count: usize,
    /// Most payload bytes held.
    pub bytes: usize,
}

impl Default for NotifBounds {
    fn default() -> Self {
        Self { count: DEFAULT_NOTIF_QUEUE_COUNT, bytes: DEFAULT_NOTIF_QUEUE_BYTES }
    }
}

impl NotifBounds {
    /// The bounds from options `notif_queue_count` and `notif_queue_bytes`.
    ///
    /// # Errors
    /// [`TransportError::InvalidOption`] for a value that is not a positive number.
    pub(crate) fn from_options(opts: &OptionSet<'_>) -> Result<Self, TransportError> {
        Self::from_options_or(opts, Self::default())
    }

    /// [`from_options`](Self::from_options) with the backend's own defaults
    /// (verbs bounds each connected peer: `transport::verbs`).
    ///
    /// # Errors
    /// As [`from_options`](Self::from_options).
    pub(crate) fn from_options_or(opts: &OptionSet<'_>, defaults: Self) -> Result<Self, TransportError> {
        let count = opts.get_checked("notif_queue_count", defaults.count, |n| *n > 0)?;
        let bytes = opts.get_checked("notif_queue_bytes", defaults.bytes, |n| *n > 0)?;
        Ok(Self { count, bytes })
    }
}

/// The queue: notifications in arrival order, their payload bytes, bounds.
#[derive(Debug)]
pub(crate) struct NotifQueue {
    kind: TransportKind,
    bounds: NotifBounds,
    inner: Mutex<(VecDeque<Notification>, usize)>,
    refused: AtomicU64,
}

impl NotifQueue {
    pub(crate) fn new(kind: TransportKind, bounds: NotifBounds) -> Self {
        Self { kind, bounds, inner: Mutex::new((VecDeque::new(), 0)), refused: AtomicU64::new(0) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (VecDeque<Notification>, usize)> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue `n`, or refuse it (counted) with a reason for the sender when
    /// either bound would be passed.
    pub(crate) fn push(&self, n: Notification) -> Result<(), String> {
        let mut q = self.lock();
        let len = n.payload.len();
        if q.0.len() >= self.bounds.count || q.1.saturating_add(len) > self.bounds.bytes {
            let why = format!(
                "target's notification queue is full ({} notifications, {} bytes held; bounds {} and {} bytes): \
                 it is not draining notifications",
                q.0.len(),
                q.1,
                self.bounds.count,
                self.bounds.bytes
            );
            drop(q);
            self.refused.fetch_add(1, Ordering::Relaxed);
            crate::metrics::global().record_notification_refused(&self.kind.to_string());
            return Err(why);
        }
        q.1 += len;
        q.0.push_back(n);
        Ok(())
    }

    /// Move every queued notification to `out`.
    pub(crate) fn drain_into(&self, out: &mut Vec<Notification>) {
        let mut q = self.lock();
        q.1 = 0;
        out.extend(q.0.drain(..));
    }

    /// Notifications refused so far.
    #[cfg(test)]
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_in_count_and_bytes_refuse_and_drain_frees() {
        let q = NotifQueue::new(TransportKind::Tcp, NotifBounds { count: 3, bytes: 10 });
        let n = |len| Notification { from_agent: "a".into(), payload: vec![0; len] };
        q.push(n(4)).unwrap();
        q.push(n(4)).unwrap();
        assert!(q.push(n(4)).unwrap_err().contains("full")); // 12 bytes > 10
        q.push(n(2)).unwrap();
        assert!(q.push(n(0)).is_err()); // count 3
        assert_eq!(q.refused(), 2);
        let mut out = Vec::new();
        q.drain_into(&mut out);
        assert_eq!(out.len(), 3);
        q.push(n(10)).unwrap();
    }
}
