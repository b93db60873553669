"""``U64Map`` (``cache/u64map.py``): sorted numpy arrays and a dict of recent changes answer as
one dict, through merges, deletes and sweeps of the dead."""

from __future__ import annotations

import random

import numpy as np
import pytest

from prefix_router.cache.u64map import DictMap, U64Map


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


def test_a_dict_map_answers_with_the_same_batch_calls():
    m = DictMap(np.uint32)
    m.put([5, 2**64 - 1], [3, 4])
    m.delete([5, 6])
    assert m.values_of([5, 2**64 - 1, 7]).tolist() == [0, 4, 0] and len(m) == 1
    m.map_values(np.array([0, 0, 0, 0, 9], np.uint32))
    assert m.values().tolist() == [9]
