//! Refuse a run whose buffers cannot fit in this machine's memory, before
//! allocating them, with the numbers (instead of filling RAM and swapping).

use anyhow::Result;

use crate::failure::user_error;

/// Bytes of memory available (`MemAvailable`, lowered to the cgroup's
/// limit), or `None` where unknown: [`kvwire::transport::shm::available_host_bytes`].
pub(crate) fn available_bytes() -> Option<u64> {
    kvwire::transport::shm::available_host_bytes()
}

fn gib(b: u128) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Fail when `need` bytes (described by `what`, e.g. "3 x 64.0 GiB
/// buffers") exceed 90 % of the available memory; `hint` says how to ask for less.
///
/// # Errors
/// [`crate::failure::UserError`] naming both numbers.
pub(crate) fn check(cmd: &str, need: u128, what: &str, hint: &str) -> Result<()> {
    check_against(cmd, need, what, hint, available_bytes())
}

fn check_against(cmd: &str, need: u128, what: &str, hint: &str, avail: Option<u64>) -> Result<()> {
    let Some(avail) = avail else { return Ok(()) };
    if need > avail as u128 / 10 * 9 {
        return Err(user_error(
            format!(
                "{cmd} needs {} of memory ({what}) but this machine has {} available",
                gib(need),
                gib(avail as u128)
            ),
            hint,
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_with_both_numbers() {
        let e = check_against("bench", 192 << 30, "3 x 64 GiB", "use fewer --blocks", Some(23 << 30)).unwrap_err();
        let m = format!("{e:#}");
        assert!(m.contains("192.0 GiB") && m.contains("23.0 GiB"), "{m}");
        assert!(check_against("bench", 1 << 30, "", "", Some(23 << 30)).is_ok());
        assert!(check_against("bench", u128::MAX, "", "", None).is_ok());
        assert!(available_bytes().is_some_and(|b| b > 0));
    }
}
