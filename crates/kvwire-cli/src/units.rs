//! Parsing and printing of byte sizes and percentiles for the CLI.

/// Parse `4096`, `4K`, `4KiB`, `64kib`, `1M`, `1MiB`, `2G` into bytes.
pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("bad size {s:?}: expected e.g. 4096, 64KiB, 1MiB"))?;
    let mul: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("bad size unit in {s:?}: use B, KiB, MiB or GiB")),
    };
    n.checked_mul(mul).filter(|&v| v > 0).ok_or_else(|| format!("size {s:?} is zero or too large"))
}

/// Parse a number of seconds (`2`, `1.5`, `0.25`) into a `Duration`:
/// finite, greater than zero and at most one day (86400 s), so that
/// `-1`, `nan`, `inf` or `1e300` are refused instead of panicking in
/// `Duration::from_secs_f64`.
pub(crate) fn parse_seconds(s: &str) -> Result<std::time::Duration, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("bad duration {s:?}: expected seconds, e.g. 2 or 0.5"))?;
    if !v.is_finite() || v <= 0.0 || v > 86_400.0 {
        return Err(format!("duration {s:?} must be more than 0 and at most 86400 seconds"));
    }
    Ok(std::time::Duration::from_secs_f64(v))
}

/// `65536` → `64 KiB`.
pub(crate) fn human(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (name, v) in UNITS {
        if bytes >= v && bytes.is_multiple_of(v) {
            return format!("{} {name}", bytes / v);
        }
    }
    format!("{bytes} B")
}

/// The `q`-quantile (0..=1) of `v` (sorted in place), nearest rank.
pub(crate) fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Parse `key=value`.
pub(crate) fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

/// Check backend options given with `flag` (`--option`, `--target-option`,
/// ...) against `kind`'s keys before anything starts, so that a misspelt
/// key is reported first (not after a missing device or a started child).
pub(crate) fn check_option_keys(
    kind: kvwire::transport::TransportKind,
    flag: &str,
    options: &[(String, String)],
) -> anyhow::Result<()> {
    let config = kvwire::transport::TransportConfig { options: options.to_vec(), ..Default::default() };
    kvwire::transport::options::OptionSet::parse(kind, &config).map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("1m").unwrap(), 1 << 20);
        assert!(parse_size("0").is_err());
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
        assert_eq!(human(65536), "64 KiB");
        assert_eq!(human(1000), "1000 B");
    }

    #[test]
    fn seconds() {
        assert_eq!(parse_seconds("1.5").unwrap(), std::time::Duration::from_millis(1500));
        for bad in ["-1", "nan", "inf", "1e300", "0", "", "2s"] {
            assert!(parse_seconds(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn percentiles() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.5), 50.0);
        assert_eq!(percentile(&mut v, 0.99), 99.0);
        assert_eq!(percentile(&mut [], 0.5), 0.0);
    }
}
