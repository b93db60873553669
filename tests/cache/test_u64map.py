"""``U64Map`` (``cache/u64map.py``): sorted numpy arrays and a dict of recent changes answer as
one dict, through merges, deletes and sweeps of the dead."""

from __future__ import annotations

import random

import numpy as np
import pytest

from prefix_router.cache.u64map import U64Map


@pytest.mark.parametrize("dtype", [np.uint64, np.uint32])
def test_the_u64_map_answers_as_a_dict_through_merges_deletes_and_sweeps(dtype):
    rng = random.Random(int(np.dtype(dtype).itemsize))
    m, ref = U64Map(dtype), {}
    keys = [rng.getrandbits(64) for _ in range(3000)] + [0, 2**64 - 1]
    for step in range(3000):
        some = rng.sample(keys, rng.randrange(1, 40))
        if rng.random() < 0.55:
            values = [rng.getrandbits(8 * np.dtype(dtype).itemsize) for _ in some]
            m.put(some, values)
            ref.update(zip(some, values))
        else:
            m.delete(some)
            for k in some:
                ref.pop(k, None)
        if step % 50 == 0:
            asked = rng.sample(keys, 100)
            assert m.get(asked) == ([k in ref for k in asked], [ref.get(k, 0) for k in asked])
    assert len(m) == len(ref) and dict(zip(*m.items())) == ref
