"""``IdTable`` (``cache/id_table.py``): the open-addressing table answers as a dict through growth,
tombstones, rebuilds, and batches taken a key at a time or in numpy."""

from __future__ import annotations

import random

from prefix_router.cache.id_table import IdTable


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
