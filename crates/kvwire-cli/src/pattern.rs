//! Deterministic page contents, so that every byte a transfer moves can be
//! verified on the other side, and a deterministic permutation.

/// splitmix64: a fast, well-mixed hash of one word.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Fill `page` with the contents identified by `key` (e.g. mix of request,
/// page and shard): 8-byte words `mix(key) + k * odd`, unique per key and offset.
pub(crate) fn fill_page(page: &mut [u8], key: u64) {
    let base = mix(key);
    let full_words = (page.len() / 8) as u64;
    let mut words = page.chunks_exact_mut(8);
    for (k, chunk) in words.by_ref().enumerate() {
        chunk.copy_from_slice(&word(base, k as u64).to_le_bytes());
    }
    let tail = words.into_remainder();
    if !tail.is_empty() {
        let w = word(base, full_words).to_le_bytes();
        let n = tail.len();
        tail.copy_from_slice(&w[..n]);
    }
}

/// Page `key`'s word `k` (see [`fill_page`]).
pub(crate) fn word(key_mix: u64, k: u64) -> u64 {
    key_mix.wrapping_add(k.wrapping_mul(0xD6E8_FEB8_6659_FD93))
}

/// True when `page` holds exactly the contents of `key` (one pass, no copy).
pub(crate) fn check_page(page: &[u8], key: u64) -> bool {
    check_from(page, key, 0)
}

/// Whether `piece` holds the words of `key`'s page from word `first_word`
/// on (a page checked piece by piece: every piece but the last a multiple
/// of 8 bytes).
pub(crate) fn check_from(piece: &[u8], key: u64, first_word: u64) -> bool {
    let base = mix(key);
    let mut words = piece.chunks_exact(8);
    let mut diff = 0u64;
    for (k, c) in words.by_ref().enumerate() {
        let got = u64::from_le_bytes(c.try_into().expect("chunks_exact(8)"));
        diff |= got ^ word(base, first_word + k as u64);
    }
    let tail = words.remainder();
    if !tail.is_empty() {
        let w = word(base, first_word + (piece.len() / 8) as u64).to_le_bytes();
        if tail != &w[..tail.len()] {
            return false;
        }
    }
    diff == 0
}

/// A seeded Fisher–Yates permutation of `0..n`.
pub(crate) fn permutation(n: usize, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    let mut s = seed;
    for i in (1..n).rev() {
        s = mix(s);
        let j = (s % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_differ_by_key_and_check() {
        let (mut a, mut b) = (vec![0u8; 100], vec![0u8; 100]);
        fill_page(&mut a, 1);
        fill_page(&mut b, 2);
        assert_ne!(a, b);
        assert!(check_page(&a, 1));
        assert!(!check_page(&a, 2));
        a[99] ^= 1;
        assert!(!check_page(&a, 1));
        a[99] ^= 1;
        assert!(check_from(&a[..48], 1, 0) && check_from(&a[48..], 1, 6));
        assert!(!check_from(&a[48..], 1, 5));
        // the page is intact again: the next corruption is the only one
        assert!(check_page(&a, 1));
        a[3] ^= 0x80;
        assert!(!check_from(&a[..48], 1, 0) && check_from(&a[48..], 1, 6));
        assert!(!check_page(&a, 1));
    }

    #[test]
    fn odd_lengths_fill_and_check() {
        for len in [1usize, 7, 9, 4097] {
            let mut p = vec![0u8; len];
            fill_page(&mut p, 5);
            assert!(check_page(&p, 5), "{len}");
            p[len - 1] ^= 1;
            assert!(!check_page(&p, 5), "{len}");
        }
    }

    /// Fill and check must be far faster than the copy they verify.
    #[test]
    #[ignore = "prints fill/check speed; run with --release --ignored --nocapture"]
    fn fill_and_check_speed() {
        let mut p = vec![1u8; 256 << 20]; // touched: no page faults below
        let t = std::time::Instant::now();
        for (i, c) in p.chunks_mut(512 << 10).enumerate() {
            fill_page(c, i as u64);
        }
        let fill = t.elapsed();
        let t = std::time::Instant::now();
        let ok = p.chunks(512 << 10).enumerate().all(|(i, c)| check_page(c, i as u64));
        let check = t.elapsed();
        assert!(ok);
        eprintln!("fill {:.1} GB/s, check {:.1} GB/s", 0.268 / fill.as_secs_f64(), 0.268 / check.as_secs_f64());
    }

    #[test]
    fn permutation_is_a_permutation() {
        let mut p = permutation(1000, 7);
        assert_ne!(p, (0..1000).collect::<Vec<u32>>());
        p.sort();
        assert_eq!(p, (0..1000).collect::<Vec<u32>>());
    }
}
