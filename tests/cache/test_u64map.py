"""``U64Map`` (``cache/u64map.py``): sorted numpy arrays and a dict of recent changes answer as
one dict, through merges, deletes and sweeps of the dead."""

from __future__ import annotations

import random

import numpy as np
import pytest

from prefix_router.cache.u64map import IdTable, U64Map


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


def test_an_id_table_answers_as_a_dict_through_growth_tombstones_and_rebuilds():
    rng = random.Random(5)
    table, ref = IdTable(16), {}
    keys = [rng.getrandbits(64) for _ in range(5000)] + [0, 2**64 - 1]
    for step in range(2500):
        some = [rng.choice(keys) for _ in range(rng.choice([1, 7, 40, 5000]) if step % 97 == 0 else rng.randrange(1, 30))]
        if rng.random() < 0.55:
            values = [rng.randrange(1, 2**32 - 1) for _ in some]
            table.put(some, values)
            ref.update(zip(some, values))
        else:
            table.delete(some)
            for k in some:
                ref.pop(k, None)
        if step % 25 == 0:
            asked = rng.sample(keys, 200)
            assert table.values_of(asked).tolist() == [ref.get(k, 0) for k in asked], step
            assert len(table) == len(ref) and sorted(table.values().tolist()) == sorted(ref.values())
            assert table._used * 10 <= len(table._keys) * 7  # at most 70% of the slots used, live or deleted
