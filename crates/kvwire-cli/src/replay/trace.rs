//! Mooncake-format request traces: one JSON object per line with
//! `timestamp` (ms), `input_length`, `output_length` (tokens) and `hash_ids`
//! (prefix block hashes, 512 tokens per block).

use std::io::{BufRead, BufReader};
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

/// One request of the trace.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub(crate) struct TraceRequest {
    /// Arrival time (ms from the trace start).
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// Prefix block hashes (512 tokens each).
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

/// Read at most `limit` requests from `path`, sorted by arrival time.
///
/// # Errors
/// Unreadable file; a malformed line (with its line number); an empty trace.
pub(crate) fn load(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRequest>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in BufReader::new(file).lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        // One location, the file's: `FILE:LINE:COLUMN`, and serde's message
        // without its own "at line 1 column C" (the line is one record).
        let r: TraceRequest = serde_json::from_str(&line).map_err(|e| {
            let msg = e.to_string();
            let msg = msg.rfind(" at line ").map_or(msg.as_str(), |i| &msg[..i]).to_string();
            anyhow::anyhow!("{}:{}:{}: not a trace record: {msg}", path.display(), n + 1, e.column())
        })?;
        out.push(r);
    }
    if out.is_empty() {
        bail!("trace {} holds no requests", path.display());
    }
    out.sort_by_key(|r| r.timestamp);
    Ok(out)
}

/// Fraction of block references that repeat an earlier one: the prefix hit
/// rate of a cache of unlimited size on this trace.
pub(crate) fn unlimited_hit_rate(reqs: &[TraceRequest]) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let (mut refs, mut hits) = (0u64, 0u64);
    for r in reqs {
        for h in &r.hash_ids {
            refs += 1;
            if !seen.insert(*h) {
                hits += 1;
            }
        }
    }
    if refs == 0 { 0.0 } else { hits as f64 / refs as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_the_bundled_trace_and_its_repeat_rate() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/mooncake_conversation_trace.jsonl");
        let all = load(&p, None).unwrap();
        assert_eq!(all.len(), 12_031);
        assert_eq!(all[0].input_length, 6758);
        let rate = unlimited_hit_rate(&all);
        assert!((rate - 0.366).abs() < 0.001, "{rate}");
        assert_eq!(load(&p, Some(200)).unwrap().len(), 200);
    }

    #[test]
    fn reports_bad_lines() {
        let dir = std::env::temp_dir().join(format!("kvwire-trace-{}", std::process::id()));
        std::fs::write(&dir, "{\"timestamp\": 1, \"input_length\": 5, \"output_length\": 1}\nnot json\n").unwrap();
        let e = load(&dir, None).unwrap_err();
        assert!(format!("{e:#}").contains(":2:"), "{e:#}");
        std::fs::remove_file(&dir).unwrap();
    }
}
