"""Page contents and the destination permutation, as `kvwire bench` makes them.

`permutation(n, seed)` is the same seeded Fisher-Yates over splitmix64 as
kvwire's `pattern::permutation`, so both systems scatter pages to the same
destinations. Page contents are unique per (page, word), so a page landing in
the wrong slot, a torn page or a missing page all fail verification.
"""

from __future__ import annotations

import numpy as np

M64 = (1 << 64) - 1
STEP = 0xD6E8_FEB8_6659_FD93


def mix(x: int) -> int:
    """splitmix64 (kvwire's `pattern::mix`)."""
    x = (x + 0x9E37_79B9_7F4A_7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & M64
    return x ^ (x >> 31)


def permutation(n: int, seed: int) -> np.ndarray:
    v = list(range(n))
    s = seed
    for i in range(n - 1, 0, -1):
        s = mix(s)
        j = s % (i + 1)
        v[i], v[j] = v[j], v[i]
    return np.asarray(v, dtype=np.int64)


def _mix_vec(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E37_79B9_7F4A_7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58_476D_1CE4_E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D0_49BB_1331_11EB)
        return x ^ (x >> np.uint64(31))


def expected_pages(block_size: int, blocks: int, seed: int) -> np.ndarray:
    """(blocks, block_size/8) uint64: word k of source page i."""
    if block_size % 8:
        raise ValueError("block size must be a multiple of 8")
    keys = np.arange(blocks, dtype=np.uint64) ^ np.uint64(seed)
    base = _mix_vec(keys)
    with np.errstate(over="ignore"):
        steps = np.arange(block_size // 8, dtype=np.uint64) * np.uint64(STEP)
        return base[:, None] + steps[None, :]


def fill_pages(buf: np.ndarray, block_size: int, blocks: int, seed: int) -> None:
    """Write the source pages into `buf` (uint8, blocks*block_size bytes), in chunks."""
    words = buf.view(np.uint64).reshape(blocks, block_size // 8)
    chunk = max(1, (32 << 20) // block_size)
    for lo in range(0, blocks, chunk):
        hi = min(blocks, lo + chunk)
        keys = np.arange(lo, hi, dtype=np.uint64) ^ np.uint64(seed)
        base = _mix_vec(keys)
        with np.errstate(over="ignore"):
            steps = np.arange(block_size // 8, dtype=np.uint64) * np.uint64(STEP)
            words[lo:hi] = base[:, None] + steps[None, :]
