//! [`EtcdStore`]: agent metadata in etcd v3, through its JSON gateway
//! (`/v3/kv/put`, `/v3/kv/range`, `/v3/kv/deleterange`, `/v3/lease/grant`,
//! `/v3/lease/keepalive`, `/v3/lease/revoke`, `/v3/watch`; keys and values
//! base64). Entry `PREFIX + agent name` holds the binary metadata
//! ([`AgentMetadata::to_bytes`]) and is attached to this store's lease.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::http::{self, b64decode, b64encode};
use super::{DiscoveryError, MetadataStore};
use kvwire::engine::AgentMetadata;

/// Timeout of one gateway call.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// First and largest pause between two range queries of a waiting lookup.
const POLL_MIN: Duration = Duration::from_millis(20);
const POLL_MAX: Duration = Duration::from_millis(250);

/// Published entries (key → value), re-put under a new lease if etcd
/// forgot ours (it restarted, or we were cut off past the TTL).
type Entries = Arc<Mutex<HashMap<String, String>>>;

struct Keeper {
    stop: Arc<AtomicBool>,
    lease: Arc<Mutex<i64>>,
    thread: Option<JoinHandle<()>>,
}

/// Agent metadata in etcd. See the module docs.
pub struct EtcdStore {
    endpoints: Vec<String>,
    prefix: String,
    ttl: Duration,
    entries: Entries,
    keeper: Option<Keeper>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore").field("endpoints", &self.endpoints).field("prefix", &self.prefix).finish()
    }
}

/// A change under the watched prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// An agent published (or replaced) its metadata.
    Put(AgentMetadata),
    /// An agent's entry went away (unpublished, or its lease expired).
    Delete(String),
}

/// A stream of [`WatchEvent`]s; see [`EtcdStore::watch`].
pub struct Watch {
    resp: http::Response,
    prefix: String,
    queue: std::collections::VecDeque<WatchEvent>,
}

fn call(endpoints: &[String], path: &str, body: &Value) -> Result<Value, DiscoveryError> {
    let text = body.to_string();
    let mut last = None;
    for ep in endpoints {
        match http::post(ep, path, &text, CALL_TIMEOUT).and_then(|mut r| r.next_message()) {
            Ok(Some(msg)) => {
                return serde_json::from_slice(&msg).map_err(|e| DiscoveryError::Protocol(format!("{path}: {e}")));
            }
            Ok(None) => last = Some(DiscoveryError::Protocol(format!("{path}: empty answer"))),
            // A socket timeout (EAGAIN on a read, ETIMEDOUT on a connect):
            // say that etcd did not answer, not "Resource temporarily unavailable".
            Err(DiscoveryError::Io { source, .. })
                if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
            {
                last = Some(DiscoveryError::Unanswered { url: format!("http://{ep}"), waited: CALL_TIMEOUT });
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| DiscoveryError::BadUrl("no endpoint".into())))
}

/// An integer etcd's gateway sends as a JSON string (int64 fields).
fn int_field(v: &Value, key: &str) -> Option<i64> {
    match v.get(key)? {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

fn grant(endpoints: &[String], ttl: Duration) -> Result<i64, DiscoveryError> {
    let r = call(endpoints, "/v3/lease/grant", &json!({ "TTL": ttl.as_secs().max(1) }))?;
    int_field(&r, "ID").ok_or_else(|| DiscoveryError::Protocol(format!("lease grant answered {r}")))
}

fn put(endpoints: &[String], key: &str, value: &str, lease: i64) -> Result<(), DiscoveryError> {
    call(endpoints, "/v3/kv/put", &json!({ "key": b64encode(key.as_bytes()), "value": value, "lease": lease }))?;
    Ok(())
}

/// One keepalive; `Ok(false)` when etcd no longer knows the lease.
fn keepalive(endpoints: &[String], lease: i64) -> Result<bool, DiscoveryError> {
    let r = call(endpoints, "/v3/lease/keepalive", &json!({ "ID": lease }))?;
    Ok(r.get("result").and_then(|x| int_field(x, "TTL")).unwrap_or(0) > 0)
}

/// The key just past every key starting with `prefix` (etcd's `range_end`).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn decode_kv(kv: &Value, prefix: &str) -> Result<(String, Option<AgentMetadata>), DiscoveryError> {
    let key = kv.get("key").and_then(Value::as_str).and_then(b64decode).unwrap_or_default();
    let key = String::from_utf8_lossy(&key).into_owned();
    let name = key.strip_prefix(prefix).unwrap_or(&key).to_string();
    let Some(value) = kv.get("value").and_then(Value::as_str) else { return Ok((name, None)) };
    let bytes = b64decode(value).ok_or_else(|| DiscoveryError::Protocol(format!("value of {key} is not base64")))?;
    let meta =
        AgentMetadata::from_bytes(&bytes).map_err(|source| DiscoveryError::Metadata { name: name.clone(), source })?;
    Ok((name, Some(meta)))
}

impl EtcdStore {
    /// A store on etcd at `urls` (`http://host:port`, several comma-separated
    /// for fail-over), with entries under `prefix` and a lease of `ttl`
    /// (whole seconds, at least 1) once something is published. Checks that
    /// etcd answers.
    ///
    /// # Errors
    /// [`DiscoveryError::BadUrl`]; the error of the first call when no
    /// endpoint answers.
    pub fn connect(urls: &str, prefix: &str, ttl: Duration) -> Result<Self, DiscoveryError> {
        let endpoints = urls.split(',').map(http::parse_endpoint).collect::<Result<Vec<_>, _>>()?;
        let store = Self { endpoints, prefix: prefix.to_string(), ttl, entries: Arc::default(), keeper: None };
        store.range(prefix.as_bytes(), None)?;
        Ok(store)
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn range(&self, key: &[u8], range_end: Option<&[u8]>) -> Result<Value, DiscoveryError> {
        let mut body = json!({ "key": b64encode(key) });
        if let Some(end) = range_end {
            body["range_end"] = json!(b64encode(end));
        }
        call(&self.endpoints, "/v3/kv/range", &body)
    }

    /// Every agent currently published under the prefix, by name.
    ///
    /// # Errors
    /// Gateway errors; [`DiscoveryError::Metadata`] for an undecodable entry.
    pub fn list(&self) -> Result<Vec<AgentMetadata>, DiscoveryError> {
        let r = self.range(self.prefix.as_bytes(), Some(&prefix_end(&self.prefix)))?;
        let mut out = Vec::new();
        for kv in r.get("kvs").and_then(Value::as_array).into_iter().flatten() {
            if let (_, Some(m)) = decode_kv(kv, &self.prefix)? {
                out.push(m);
            }
        }
        Ok(out)
    }

    /// Look `name` up once, without waiting.
    ///
    /// # Errors
    /// Gateway errors; [`DiscoveryError::Metadata`].
    pub fn get(&self, name: &str) -> Result<Option<AgentMetadata>, DiscoveryError> {
        let r = self.range(format!("{}{name}", self.prefix).as_bytes(), None)?;
        match r.get("kvs").and_then(Value::as_array).and_then(|a| a.first()) {
            Some(kv) => Ok(decode_kv(kv, &self.prefix)?.1),
            None => Ok(None),
        }
    }

    /// Publish under `prefix + name` with this store's lease. A name another
    /// live engine published is refused ([`DiscoveryError::NameTaken`]):
    /// the first put is a create-only transaction; republishing a name this
    /// store owns (new registrations) overwrites it.
    ///
    /// Any bytes may be published this way (e.g. a KV engine's metadata);
    /// [`MetadataStore::publish`] publishes an agent's.
    ///
    /// # Errors
    /// [`DiscoveryError::NameTaken`]; gateway errors.
    pub fn publish_bytes(&mut self, name: &str, bytes: &[u8]) -> Result<(), DiscoveryError> {
        let lease = self.ensure_keeper()?;
        let key = format!("{}{name}", self.prefix);
        let value = b64encode(bytes);
        let ours = self.entries.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&key);
        if ours {
            put(&self.endpoints, &key, &value, lease)?;
        } else {
            let k = b64encode(key.as_bytes());
            let r = call(
                &self.endpoints,
                "/v3/kv/txn",
                &json!({
                    "compare": [{ "target": "CREATE", "key": k, "createRevision": "0" }],
                    "success": [{ "requestPut": { "key": k, "value": value, "lease": lease } }],
                }),
            )?;
            if !r.get("succeeded").and_then(Value::as_bool).unwrap_or(false) {
                return Err(DiscoveryError::NameTaken(name.to_string()));
            }
        }
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).insert(key, value);
        Ok(())
    }

    /// The bytes published under `name`, once, without waiting.
    ///
    /// # Errors
    /// Gateway errors; a value that is not base64.
    pub fn get_bytes(&self, name: &str) -> Result<Option<Vec<u8>>, DiscoveryError> {
        let r = self.range(format!("{}{name}", self.prefix).as_bytes(), None)?;
        let Some(kv) = r.get("kvs").and_then(Value::as_array).and_then(|a| a.first()) else { return Ok(None) };
        let Some(value) = kv.get("value").and_then(Value::as_str) else { return Ok(None) };
        b64decode(value).map(Some).ok_or_else(|| DiscoveryError::Protocol(format!("value of {name} is not base64")))
    }

    /// The bytes published under `name`, waiting up to `timeout` for them
    /// (polling with backoff; etcd briefly unreachable counts as absent).
    ///
    /// # Errors
    /// [`DiscoveryError::NotFound`] after the wait when etcd answered that
    /// the name is absent; the error of the last call when etcd was
    /// unreachable at the end of the wait ([`DiscoveryError::is_unreachable`]);
    /// other gateway errors at once.
    pub fn lookup_bytes(&mut self, name: &str, timeout: Duration) -> Result<Vec<u8>, DiscoveryError> {
        let deadline = Instant::now() + timeout;
        let mut pause = POLL_MIN;
        loop {
            let unreachable = match self.get_bytes(name) {
                Ok(Some(b)) => return Ok(b),
                Ok(None) => None,
                Err(e) if e.is_unreachable() => Some(e),
                Err(e) => return Err(e),
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(
                    unreachable.unwrap_or_else(|| DiscoveryError::NotFound { name: name.to_string(), waited: timeout })
                );
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(POLL_MAX);
        }
    }

    /// Follow puts and deletes under the prefix from now on.
    ///
    /// # Errors
    /// Gateway errors.
    pub fn watch(&self) -> Result<Watch, DiscoveryError> {
        let body = json!({ "create_request": {
            "key": b64encode(self.prefix.as_bytes()),
            "range_end": b64encode(&prefix_end(&self.prefix)),
        }})
        .to_string();
        let mut last = None;
        for ep in &self.endpoints {
            match http::post(ep, "/v3/watch", &body, CALL_TIMEOUT) {
                Ok(mut resp) => {
                    // The first message confirms the watch ("created": true).
                    resp.next_message()?;
                    return Ok(Watch { resp, prefix: self.prefix.clone(), queue: Default::default() });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| DiscoveryError::BadUrl("no endpoint".into())))
    }

    /// The lease id, once something was published.
    pub fn lease_id(&self) -> Option<i64> {
        self.keeper.as_ref().map(|k| *k.lease.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn ensure_keeper(&mut self) -> Result<i64, DiscoveryError> {
        if let Some(id) = self.lease_id() {
            return Ok(id);
        }
        let id = grant(&self.endpoints, self.ttl)?;
        let stop = Arc::new(AtomicBool::new(false));
        let lease = Arc::new(Mutex::new(id));
        let (eps, entries, ttl) = (self.endpoints.clone(), self.entries.clone(), self.ttl);
        let (stop2, lease2) = (stop.clone(), lease.clone());
        let thread = std::thread::Builder::new()
            .name("kvwire-etcd-lease".into())
            .spawn(move || keep_alive_loop(&eps, &entries, ttl, &stop2, &lease2))
            .map_err(|source| DiscoveryError::Io { call: "spawn", source })?;
        self.keeper = Some(Keeper { stop, lease, thread: Some(thread) });
        Ok(id)
    }
}

/// Renew the lease every third of its TTL; if etcd forgot it, take a new one
/// and re-put every entry.
fn keep_alive_loop(eps: &[String], entries: &Entries, ttl: Duration, stop: &AtomicBool, lease: &Mutex<i64>) {
    let period = (ttl / 3).max(Duration::from_millis(200));
    let mut next = Instant::now() + period;
    while !stop.load(Ordering::Acquire) {
        if Instant::now() < next {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        next = Instant::now() + period;
        let id = *lease.lock().unwrap_or_else(|p| p.into_inner());
        match keepalive(eps, id) {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!("etcd: lease {id:x} expired; publishing again under a new lease");
                let Ok(new) = grant(eps, ttl) else { continue };
                *lease.lock().unwrap_or_else(|p| p.into_inner()) = new;
                let all: Vec<(String, String)> = entries
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                for (k, v) in all {
                    if let Err(e) = put(eps, &k, &v, new) {
                        tracing::warn!("etcd: re-publishing {k} failed: {e}");
                    }
                }
            }
            Err(e) => tracing::warn!("etcd: lease keepalive failed: {e}"),
        }
    }
}

impl MetadataStore for EtcdStore {
    fn publish(&mut self, meta: &AgentMetadata) -> Result<(), DiscoveryError> {
        self.publish_bytes(&meta.name, &meta.to_bytes())
    }

    fn lookup(&mut self, name: &str, timeout: Duration) -> Result<AgentMetadata, DiscoveryError> {
        let bytes = self.lookup_bytes(name, timeout)?;
        AgentMetadata::from_bytes(&bytes).map_err(|source| DiscoveryError::Metadata { name: name.to_string(), source })
    }

    fn unpublish(&mut self, name: &str) -> Result<(), DiscoveryError> {
        let key = format!("{}{name}", self.prefix);
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
        call(&self.endpoints, "/v3/kv/deleterange", &json!({ "key": b64encode(key.as_bytes()) }))?;
        Ok(())
    }
}

impl Drop for EtcdStore {
    /// Stops the keepalive thread and revokes the lease, which removes every
    /// entry at once (a crash instead leaves them until the TTL runs out).
    fn drop(&mut self) {
        if let Some(mut k) = self.keeper.take() {
            k.stop.store(true, Ordering::Release);
            if let Some(t) = k.thread.take() {
                let _ = t.join();
            }
            let id = *k.lease.lock().unwrap_or_else(|p| p.into_inner());
            let _ = call(&self.endpoints, "/v3/lease/revoke", &json!({ "ID": id }));
        }
    }
}

impl Watch {
    /// The next event, waiting up to the gateway call timeout (3 s) for data;
    /// `Ok(None)` when the stream ended.
    ///
    /// # Errors
    /// [`DiscoveryError::Io`] on a timeout with no event (call again to keep
    /// waiting), gateway and decoding errors.
    pub fn next_event(&mut self) -> Result<Option<WatchEvent>, DiscoveryError> {
        loop {
            if let Some(e) = self.queue.pop_front() {
                return Ok(Some(e));
            }
            let Some(msg) = self.resp.next_message()? else { return Ok(None) };
            let v: Value = serde_json::from_slice(&msg).map_err(|e| DiscoveryError::Protocol(format!("watch: {e}")))?;
            let result = v.get("result").unwrap_or(&v);
            for ev in result.get("events").and_then(Value::as_array).into_iter().flatten() {
                let Some(kv) = ev.get("kv") else { continue };
                let deleted = ev.get("type").and_then(Value::as_str) == Some("DELETE");
                let (name, meta) = decode_kv(kv, &self.prefix)?;
                self.queue.push_back(match (deleted, meta) {
                    (false, Some(m)) => WatchEvent::Put(m),
                    _ => WatchEvent::Delete(name),
                });
            }
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.resp.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte() {
        assert_eq!(prefix_end("/kv/"), b"/kv0".to_vec());
        assert_eq!(prefix_end("a"), b"b".to_vec());
    }
}
