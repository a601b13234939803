//! The seeded mutation engine shared by the fuzz suites (`fuzz_decoders`,
//! `fuzz_shm`): a small PRNG, the mutations, the committed corpus.
#![allow(dead_code)]

use std::path::Path;

/// xorshift64*: small, seeded, reproducible.
pub(crate) struct Rng(pub u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

pub(crate) const INTERESTING: [u64; 10] = [0, 1, 0x7f, 0x80, 0xff, 0xffff, 0x7fff_ffff, 0xffff_ffff, 1 << 40, u64::MAX];

/// One to four random edits of `input`: bit flips, interesting bytes and
/// integers, inserted/deleted/duplicated ranges, truncation, splicing.
pub(crate) fn mutate(rng: &mut Rng, input: &[u8], corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let len = v.len();
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                v[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                v[i] = INTERESTING[rng.below(INTERESTING.len())] as u8;
            }
            2 if len >= 8 => {
                let i = rng.below(len - 7);
                let x = INTERESTING[rng.below(INTERESTING.len())];
                let w = [1usize, 2, 4, 8][rng.below(4)];
                v[i..i + w].copy_from_slice(&x.to_le_bytes()[..w]);
            }
            3 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let b = rng.next() as u8;
                v.splice(i..i, std::iter::repeat_n(b, n));
            }
            4 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(32));
                v.drain(i..i + n);
            }
            5 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                let piece = v[i..i + n].to_vec();
                let at = rng.below(len + 1);
                v.splice(at..at, piece);
            }
            6 if len > 0 => v.truncate(rng.below(len)),
            _ if !corpus.is_empty() => {
                let other = &corpus[rng.below(corpus.len())];
                if !other.is_empty() {
                    let i = rng.below(other.len());
                    let at = rng.below(len + 1);
                    v.truncate(at);
                    v.extend_from_slice(&other[i..]);
                }
            }
            _ => {}
        }
    }
    v
}

pub(crate) fn iters(default: usize) -> usize {
    std::env::var("KVWIRE_FUZZ_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

pub(crate) fn corpus(dir: &str) -> Vec<Vec<u8>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus").join(dir);
    let mut files: Vec<_> = std::fs::read_dir(&path)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", path.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let v: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    assert!(!v.is_empty(), "empty corpus {}", path.display());
    v
}

/// With `KVWIRE_WRITE_CORPUS` set, (re)write `tests/corpus/<dir>/<name>`
/// (how the committed corpus files were made).
pub(crate) fn write_corpus(dir: &str, name: &str, bytes: &[u8]) {
    if std::env::var_os("KVWIRE_WRITE_CORPUS").is_some() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus").join(dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}
