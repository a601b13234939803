"""Self-checks of the harness's pattern code (pytest bench/compare, or run it).

The golden values come from kvwire's `pattern::permutation` (src/bin/kvwire/
pattern.rs), so both systems scatter pages to the same destinations.
"""

import numpy as np

from pattern import expected_pages, fill_pages, permutation

GOLDEN = {
    7: ([1, 4, 6, 3, 0], 86),
    256: ([37, 114, 132, 64, 205], 4147164),
    4096: ([1236, 241, 3507, 1825, 366], 17108176539),
    65536: ([6641, 9040, 29142, 64724, 26079], 70332497875822),
}


def test_permutation_matches_kvwire():
    for n, (head, weighted) in GOLDEN.items():
        p = permutation(n, 42)
        assert list(map(int, p[:5])) == head
        assert sum((i + 1) * int(v) for i, v in enumerate(p)) == weighted
        assert sorted(p.tolist()) == list(range(n))


def test_pages_unique_and_fill_matches_expected():
    bs, n = 4096, 64
    buf = np.zeros(bs * n, dtype=np.uint8)
    fill_pages(buf, bs, n, 42)
    want = expected_pages(bs, n, 42)
    got = buf.view(np.uint64).reshape(n, -1)
    assert (got == want).all()
    # every (page, word) distinct: a misplaced or torn page cannot verify
    assert len(np.unique(want)) == want.size


if __name__ == "__main__":
    test_permutation_matches_kvwire()
    test_pages_unique_and_fill_matches_expected()
    print("2 passed, 0 failed")
