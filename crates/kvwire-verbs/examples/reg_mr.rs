//! `ibv_reg_mr` / `ibv_dereg_mr` seconds per GiB of a large host buffer,
//! backed by 4 KiB pages, by transparent huge pages (THP, `madvise
//! MADV_HUGEPAGE`) and by hugetlbfs pages (`MAP_HUGETLB`), on a real RDMA
//! device (issue 29: "`ibv_reg_mr` of large host buffers is timed and
//! reported, and huge-page-backed buffers are recognized").
//!
//! ```text
//! cargo run --release -p kvwire-verbs --example reg_mr -- [--device rxe0] [--mib 1024] [--rounds 5] [--kinds 4k,thp,hugetlb]
//! ```
//!
//! Every buffer is touched first (one write per 4 KiB), so the figure is
//! pinning and mapping, not first-touch page faults; what backs it is read
//! back from `/proc/self/smaps` (`KernelPageSize`, `AnonHugePages`) and
//! printed beside the times. Without a device, or where a kind cannot be
//! mapped (no hugetlbfs pages reserved: `echo N > /proc/sys/vm/nr_hugepages`),
//! the line says `skipped: <reason>` (without a device the backing is
//! still shown) and the run still exits 0.
//! Output: one line per kind, then one JSON object per kind (`--json`-style,
//! prefixed `json:`) for scripts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_verbs::{Context, MemoryRegion, ProtectionDomain};

const HUGE: usize = 2 << 20;

/// An anonymous mapping, unmapped on drop.
struct Mapping {
    base: *mut u8,
    len: usize,
    /// The usable, aligned part.
    addr: *mut u8,
    size: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping; every MR over it was dropped before.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// `size` bytes of anonymous memory of `kind` (4k, thp, hugetlb), touched.
fn map(kind: &str, size: usize) -> Result<Mapping, String> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let (len, extra) = match kind {
        "hugetlb" => (size, libc::MAP_HUGETLB),
        // room to align the start to 2 MiB, so THP can back all of it
        _ => (size + HUGE, 0),
    };
    // SAFETY: a fresh anonymous mapping.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags | extra, -1, 0) };
    if base == libc::MAP_FAILED {
        let e = std::io::Error::last_os_error();
        return Err(match kind {
            "hugetlb" => {
                format!("mmap MAP_HUGETLB of {size} bytes: {e} (reserve pages: echo N > /proc/sys/vm/nr_hugepages)")
            }
            _ => format!("mmap of {len} bytes: {e}"),
        });
    }
    let base = base.cast::<u8>();
    let addr = if kind == "hugetlb" { base } else { base.wrapping_add(base.align_offset(HUGE)) };
    let m = Mapping { base, len, addr, size };
    let advice = match kind {
        "thp" => Some(libc::MADV_HUGEPAGE),
        "4k" => Some(libc::MADV_NOHUGEPAGE),
        _ => None,
    };
    if let Some(a) = advice {
        // SAFETY: inside our mapping.
        if unsafe { libc::madvise(addr.cast(), size, a) } != 0 {
            return Err(format!("madvise({kind}): {}", std::io::Error::last_os_error()));
        }
    }
    for off in (0..size).step_by(4096) {
        // SAFETY: inside our writable mapping.
        unsafe { addr.add(off).write_volatile(1) };
    }
    Ok(m)
}

/// What backs `[addr, addr + size)`, from /proc/self/smaps: the kernel page
/// size (kB) of the mapping holding `addr`, and the kB of it that THP backs.
fn backing(addr: *const u8, size: usize) -> (u64, u64) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let a = addr as u64;
    let (mut inside, mut page_kb, mut thp_kb) = (false, 0, 0);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-')
            && let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16))
        {
            // a header line of the next mapping
            if inside {
                break;
            }
            inside = lo <= a && a < hi && a + size as u64 <= hi;
            continue;
        }
        if !inside {
            continue;
        }
        let kb = |k: &str| line.strip_prefix(k).and_then(|r| r.split_whitespace().next()?.parse::<u64>().ok());
        if let Some(v) = kb("KernelPageSize:") {
            page_kb = v;
        }
        if let Some(v) = kb("AnonHugePages:") {
            thp_kb = v;
        }
    }
    (page_kb, thp_kb)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |k: &str| args.iter().position(|a| a == k).and_then(|i| args.get(i + 1)).cloned();
    let device = opt("--device");
    let mib: usize = opt("--mib").map_or(1024, |v| v.parse().expect("--mib: MiB, a whole number"));
    let rounds: usize = opt("--rounds").map_or(5, |v| v.parse().expect("--rounds: a whole number")).max(1);
    let kinds = opt("--kinds").unwrap_or_else(|| "4k,thp,hugetlb".into());
    let size = mib << 20;
    // Without a device the buffers are still mapped and their backing
    // printed; only the registration is skipped.
    let pd = match Context::open(device.as_deref()) {
        Ok(c) => Some(ProtectionDomain::new(&Arc::new(c)).expect("ibv_alloc_pd")),
        Err(e) => {
            println!("skipped: {e} (ibv_reg_mr not timed; the page backing is still shown)");
            None
        }
    };
    let gib = size as f64 / (1u64 << 30) as f64;
    println!(
        "ibv_reg_mr of {mib} MiB on {} ({rounds} rounds; s/GiB = seconds per 2^30 bytes)",
        device.as_deref().unwrap_or("the first device")
    );
    println!(
        "{:<8} {:>14} {:>14} {:>13} {:>13} {:>15} {:>9}",
        "pages", "KernelPageSize", "AnonHugePages", "reg s/GiB min", "reg s/GiB med", "dereg s/GiB med", "touch s"
    );
    for kind in kinds.split(',') {
        if !["4k", "thp", "hugetlb"].contains(&kind) {
            eprintln!("--kinds: 4k, thp or hugetlb, got {kind:?}");
            std::process::exit(2);
        }
        let t = Instant::now();
        let m = match map(kind, size) {
            Ok(m) => m,
            Err(e) => {
                println!("{kind:<8} skipped: {e}");
                continue;
            }
        };
        let touch = t.elapsed();
        let (page_kb, thp_kb) = backing(m.addr, m.size);
        let Some(pd) = &pd else {
            println!("{kind:<8} {page_kb:>11} kB {thp_kb:>11} kB skipped: no RDMA device");
            continue;
        };
        let (mut reg, mut dereg) = (Vec::new(), Vec::new());
        let mut failed = None;
        for _ in 0..rounds {
            let t = Instant::now();
            // SAFETY: `m` outlives the MR, which is dropped in this iteration.
            let mr = match unsafe { MemoryRegion::register(pd, m.addr as u64, m.size) } {
                Ok(mr) => mr,
                Err(e) => {
                    failed = Some(e.to_string());
                    break;
                }
            };
            reg.push(t.elapsed().as_secs_f64() / gib);
            let t = Instant::now();
            drop(mr);
            dereg.push(t.elapsed().as_secs_f64() / gib);
        }
        if let Some(e) = failed {
            println!("{kind:<8} failed: {e} (ulimit -l?)");
            continue;
        }
        let min = reg.iter().cloned().fold(f64::INFINITY, f64::min);
        let (rm, dm) = (median(&mut reg), median(&mut dereg));
        println!(
            "{kind:<8} {:>11} kB {:>11} kB {min:>13.4} {rm:>13.4} {dm:>15.4} {:>9.3}",
            page_kb,
            thp_kb,
            touch.as_secs_f64()
        );
        println!(
            "json: {{\"pages\":\"{kind}\",\"mib\":{mib},\"kernel_page_kb\":{page_kb},\"anon_huge_kb\":{thp_kb},\"reg_s_per_gib_min\":{min},\"reg_s_per_gib_median\":{rm},\"dereg_s_per_gib_median\":{dm},\"rounds\":{rounds}}}"
        );
        drop(m);
        std::thread::sleep(Duration::from_millis(10));
    }
}
