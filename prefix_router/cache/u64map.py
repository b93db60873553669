"""A map of 64-bit keys to fixed-size values in numpy arrays: 8 bytes a key, the value's size, and
one byte, not the ~100 bytes of a Python dict entry with int objects.

It holds what the engines' KV events say each replica stores (``cache/engine_map.py``): at 256
replicas x 30,000 blocks that is 7.7 million entries, 1.7 GB as dicts. Keys live in one sorted
array, matched by ``np.searchsorted``; changes go first to a small dict and are merged into the
arrays once they are a thirty-second of them (at least 256, at most 65,536 keys), so a change
costs a dict or set write and, amortized, a few bytes moved. A deleted key is marked dead in place and
swept at a merge once the dead are more than a quarter of the arrays.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from prefix_router.cache.blocks import packed_hashes

__all__ = ["U64Map", "IdTable", "SMALL"]

_TOMB = np.uint32(0xFFFF_FFFF)  # an ``IdTable`` slot deleted
SMALL = 16  # keys a call takes one at a time in Python: below this, numpy's per-call cost dominates
WINDOW = 8  # an IdTable probe reads this many slots a numpy round: a key's home is the start of a window
_M64 = (1 << 64) - 1

class U64Map:
    """Keys in ``[0, 2**64)`` -> values of ``dtype``; batch calls take and give Python lists."""

    def __init__(self, dtype: type = np.uint64) -> None:
        self.dtype = np.dtype(dtype)
        self._keys = np.empty(0, np.uint64)  # sorted
        self._vals = np.empty(0, self.dtype)
        self._alive = np.empty(0, bool)
        self._dead = 0  # dead entries in the arrays
        self._delta: dict[int, int] = {}  # keys set since the last merge
        self._gone: set[int] = set()  # keys deleted since the last merge (never also in ``_delta``)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (the recent changes are not counted)."""
        return self._keys.nbytes + self._vals.nbytes + self._alive.nbytes

    def may_hold_any(self) -> bool:
        """False only when the map is surely empty (without merging)."""
        return bool(len(self._keys) or self._delta)

    def get(self, keys: Sequence[int]) -> tuple[list[bool], list[int]]:
        """``(found, values)`` for ``keys``, a value 0 where not found."""
        if len(keys) <= SMALL:
            return self._get_small(keys)
        pos, hit = self._find(keys)
        vals = np.where(hit, self._vals[pos], 0).astype(self.dtype, copy=False) if len(self._keys) else \
            np.zeros(len(keys), self.dtype)
        return self._recent(keys, hit, vals)

    def _get_small(self, keys: Sequence[int]) -> tuple[list[bool], list[int]]:
        """``get`` a key at a time in Python: a few keys cost less so than a dozen numpy calls."""
        found, vals = [], []
        arr, alive, n, delta, gone = self._keys, self._alive, len(self._keys), self._delta, self._gone
        for k in keys:
            if k in gone:
                found.append(False), vals.append(0)
            elif k in delta:
                found.append(True), vals.append(delta[k])
            else:
                i = int(arr.searchsorted(np.uint64(k))) if n else 0
                hit = i < n and int(arr[i]) == k and bool(alive[i])
                found.append(hit), vals.append(int(self._vals[i]) if hit else 0)
        return found, vals

    def values_of(self, keys: Sequence[int]) -> np.ndarray:
        """The values of ``keys`` as an array, 0 where not found (for maps whose 0 means absent:
        a dead entry's value is 0 already, so ``alive`` is not read)."""
        n = len(self._keys)
        if not n:
            vals = np.zeros(len(keys), self.dtype)
        else:
            query = np.frombuffer(packed_hashes(keys, len(keys)), np.uint64, len(keys))
            pos = np.searchsorted(self._keys, query)
            np.minimum(pos, n - 1, out=pos)
            vals = self._vals[pos]
            vals[self._keys[pos] != query] = 0
        return self._recent(keys, None, vals)[1] if self._delta or self._gone else vals

    def _find(self, keys: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Each key's place in the arrays and whether it is there, alive."""
        n = len(self._keys)
        if not n:
            return np.zeros(len(keys), np.intp), np.zeros(len(keys), bool)
        query = np.frombuffer(packed_hashes(keys, len(keys)), np.uint64, len(keys))  # kept for the next call with these keys
        pos = np.searchsorted(self._keys, query)
        np.minimum(pos, n - 1, out=pos)
        return pos, (self._keys[pos] == query) & self._alive[pos]

    def _recent(self, keys: Sequence[int], found: np.ndarray | None, vals: np.ndarray):
        """``found`` and ``vals`` with the changes since the last merge laid over them."""
        delta, gone = self._delta, self._gone
        if delta and not delta.keys().isdisjoint(keys):
            at = np.flatnonzero(np.fromiter(map(delta.__contains__, keys), bool, len(keys)))
            vals[at] = [delta[keys[i]] for i in at.tolist()]
            if found is not None:
                found[at] = True
        if gone and not gone.isdisjoint(keys):
            at = np.fromiter(map(gone.__contains__, keys), bool, len(keys))
            vals[at] = 0
            if found is not None:
                found[at] = False
        return (found.tolist() if found is not None else None), (vals.tolist() if found is not None else vals)

    def put(self, keys: Sequence[int], values: Sequence[int]) -> None:
        """Set ``keys`` to ``values`` (a key given twice: the last value)."""
        self._delta.update(zip(keys, values))
        if self._gone:
            self._gone.difference_update(keys)
        self._maybe_merge()

    def delete(self, keys: Sequence[int]) -> None:
        """Remove ``keys`` (a key not here: nothing)."""
        if self._delta:
            deque(map(self._delta.pop, keys, repeat(None)), maxlen=0)
        self._gone.update(keys)
        self._maybe_merge()

    def items(self) -> tuple[list[int], list[int]]:
        """Every live ``(keys, values)``, as two lists."""
        self._merge()
        alive = self._alive
        return self._keys[alive].tolist(), self._vals[alive].tolist()

    def values(self) -> np.ndarray:
        """Every live value, as an array."""
        self._merge()
        return self._vals[self._alive]

    def map_values(self, table: np.ndarray) -> None:
        """Replace every value ``v`` by ``table[v]`` (for integer values below ``len(table)``)."""
        self._merge()
        self._vals = table[self._vals].astype(self.dtype, copy=False)

    def __len__(self) -> int:
        self._merge()
        return len(self._keys) - self._dead

    def clear(self) -> None:
        self.__init__(self.dtype)

    def _maybe_merge(self) -> None:
        if len(self._delta) + len(self._gone) >= min(max(len(self._keys) >> 5, 256), 65_536):
            self._merge()

    def _merge(self) -> None:
        """Fold the recent changes into the arrays: mark deleted keys dead, update live ones in
        place, insert new ones at their sorted places, and sweep the dead past a quarter."""
        delta, gone = self._delta, self._gone
        if not delta and not gone:
            return
        self._delta, self._gone = {}, set()
        n = len(self._keys)
        if gone and n:
            keys = np.fromiter(gone, np.uint64, len(gone))
            pos = np.minimum(np.searchsorted(self._keys, keys), n - 1)
            at = pos[(self._keys[pos] == keys) & self._alive[pos]]
            self._alive[at], self._vals[at] = False, 0
            self._dead += len(at)
        if delta:
            keys = np.fromiter(delta.keys(), np.uint64, len(delta))
            vals = np.fromiter(delta.values(), self.dtype, len(delta))
            pos = np.searchsorted(self._keys, keys)
            known = pos < n
            known[known] = self._keys[pos[known]] == keys[known]
            at = pos[known]
            self._dead -= int(np.count_nonzero(~self._alive[at]))
            self._vals[at], self._alive[at] = vals[known], True
            new = ~known
            if new.any():
                order = np.argsort(keys[new], kind="stable")
                where = pos[new][order]
                self._keys = np.insert(self._keys, where, keys[new][order])
                self._vals = np.insert(self._vals, where, vals[new][order])
                self._alive = np.insert(self._alive, where, True)
        if self._dead * 4 > len(self._keys):
            live = self._alive
            self._keys, self._vals, self._alive = self._keys[live], self._vals[live], np.ones(int(live.sum()), bool)
            self._dead = 0


class IdTable:
    """Keys in ``[0, 2**64)`` -> ids in ``[1, 2**32 - 1)``, in an open-addressing table of numpy
    arrays (linear probing): 12 bytes a slot, at most 70% of them used (live or deleted), so a
    lookup reads one or two slots where ``U64Map``'s binary search reads twenty-odd, each a
    cache miss in a table of millions (``docs/performance-notes.md``). For the fleet's map, read
    at every request; ``U64Map`` stays where memory counts more.

    A key's home slot is a multiplicative hash with a random odd multiplier per table, so no
    client can choose prompts whose blocks pile up in one run of slots. Deleted slots are kept
    as tombstones until an insert reuses one or the table is rebuilt, at most half full (at
    twice the size, at its size when tombstones fill it, smaller when it has emptied): O(n).
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._smallest = max(16, 1 << (capacity - 1).bit_length())
        self._reset(self._smallest)

    def _reset(self, capacity: int) -> None:
        self._keys = np.zeros(capacity, np.uint64)
        self._ids = np.zeros(capacity, np.uint32)  # 0: empty; _TOMB: deleted
        self._mask = capacity - 1
        self._shift = np.uint64(64 - (capacity.bit_length() - 1))
        self._mult = np.uint64(secrets.randbits(64) | 1)
        self._live = self._used = 0  # live slots; live and deleted ones

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._ids.nbytes

    def __len__(self) -> int:
        return self._live

    def may_hold_any(self) -> bool:
        return self._live > 0

    def _home(self, query: np.ndarray) -> np.ndarray:
        """Each key's first slot: the start of a window of ``WINDOW`` slots (see ``_find``)."""
        return ((query * self._mult) >> self._shift).astype(np.intp) & ~(WINDOW - 1)

    def _start(self, keys: Sequence[int]) -> list[int]:
        """``_home`` in Python ints."""
        mult, shift = int(self._mult), int(self._shift)
        return [(((k * mult) & _M64) >> shift) & ~(WINDOW - 1) for k in keys]

    def _find(self, query: np.ndarray) -> np.ndarray:
        """Each key's slot, -1 where absent: a probe ends at a match or an empty slot."""
        pos = np.full(len(query), -1, np.intp)
        todo, row = np.arange(len(query)), self._home(query) // WINDOW
        keys, ids = self._keys.reshape(-1, WINDOW), self._ids.reshape(-1, WINDOW)  # a window a row
        rows = len(keys)
        while len(todo):
            if len(todo) <= SMALL:  # the few in long runs of slots: on in Python, not a numpy round a window
                pos[todo] = self._probe_from(query[todo].tolist(), (row * WINDOW).tolist())
                break
            at = np.flatnonzero(keys[row] == query[todo][:, None])  # equal keys; live ones are a slot a key
            first = at // WINDOW
            slot = row[first] * WINDOW + at % WINDOW
            held = self._ids[slot]
            live = (held != 0) & (held != _TOMB)
            first = first[live]
            pos[todo[first]] = slot[live]
            missed = np.ones(len(todo), bool)
            missed[first] = False
            missed = np.flatnonzero(missed)
            go = missed[ids[row[missed]].min(axis=1) != 0]  # an empty slot ends a probe: the key is not further on
            todo, row = todo[go], (row[go] + 1) % rows
        return pos

    def _find_small(self, keys: Sequence[int]) -> list[int]:
        """``_find`` a key at a time in Python (the same probe: the same home slot, in Python ints)."""
        return self._probe_from(keys, self._start(keys))

    def _probe_from(self, keys: Sequence[int], starts: Sequence[int]) -> list[int]:
        """Each key's slot, -1 where absent, probing from ``starts`` in Python."""
        out = []
        stored, ids, mask = self._keys, self._ids, self._mask
        for k, at in zip(keys, starts):
            while True:
                v = int(ids[at])
                if v == 0:
                    out.append(-1)
                    break
                if v != _TOMB and int(stored[at]) == k:
                    out.append(at)
                    break
                at = (at + 1) & mask
        return out

    def change_small(self, keys: Sequence[int], change) -> list[int]:
        """For a few distinct ``keys``: each one's id (0 where absent) given to ``change``, which
        returns its new id (0: delete); the old ids, as a list. One probe a key, in Python."""
        positions = self._find_small(keys) if self._live else [-1] * len(keys)
        ids, old, new = self._ids, [], []
        for k, p in zip(keys, positions):
            was = int(ids[p]) if p >= 0 else 0
            now = change(was)
            old.append(was)
            if now == was:
                continue
            if p < 0:
                new.append((k, now))
            elif now:
                ids[p] = now
            else:
                ids[p] = _TOMB
                self._live -= 1
        if new:
            if 10 * (self._used + len(new)) > 7 * len(self._keys):
                self._rebuild(len(new))
            self._place([k for k, _ in new], [v for _, v in new], self._start([k for k, _ in new]))
        elif not self._live and self._used:
            self.delete([])  # emptied: as ``delete`` leaves an empty table
        return old

    def ids_small(self, keys: Sequence[int]) -> list[int]:
        """The ids of a few ``keys`` (``SMALL``), 0 where absent, as a list."""
        if not self._live:
            return [0] * len(keys)
        ids = self._ids
        return [int(ids[p]) if p >= 0 else 0 for p in self._find_small(keys)]

    def values_of(self, keys: Sequence[int]) -> np.ndarray:
        """The ids of ``keys``, 0 where absent."""
        if len(keys) <= SMALL:
            return np.array(self.ids_small(keys), np.uint32)
        if not self._live or not len(keys):
            return np.zeros(len(keys), np.uint32)
        pos = self._find(np.frombuffer(packed_hashes(keys, len(keys)), np.uint64, len(keys)))
        return np.where(pos >= 0, self._ids[pos], 0).astype(np.uint32)

    def put(self, keys: Sequence[int], values: Sequence[int]) -> None:
        """Set ``keys`` to ``values`` (ids; a key given twice: the last value)."""
        if not len(keys):
            return
        if len(set(keys)) < len(keys):
            latest = dict(zip(keys, values))
            keys, values = list(latest), list(latest.values())
        if len(keys) <= SMALL:
            self._put_small(keys, values)
            return
        query = np.array(keys, np.uint64)
        ids = np.array(values, np.uint32)
        pos = self._find(query) if self._live else np.full(len(query), -1, np.intp)
        known = pos >= 0
        self._ids[pos[known]] = ids[known]
        if not known.all():
            self._insert(query[~known], ids[~known])

    def _put_small(self, keys: Sequence[int], values: Sequence[int]) -> None:
        """``put`` of a few distinct keys a key at a time in Python."""
        positions = self._find_small(keys) if self._live else [-1] * len(keys)
        new = [(k, v) for k, v, p in zip(keys, values, positions) if p < 0]
        for p, v in zip(positions, values):
            if p >= 0:
                self._ids[p] = v
        if not new:
            return
        if 10 * (self._used + len(new)) > 7 * len(self._keys):
            self._rebuild(len(new))
        self._place([k for k, _ in new], [v for _, v in new], self._start([k for k, _ in new]))

    def _place(self, keys: Sequence[int], values: Sequence[int], starts: Sequence[int]) -> None:
        """Put keys known absent in the first free slot from ``starts``, in Python."""
        stored, ids, mask = self._keys, self._ids, self._mask
        for k, v, at in zip(keys, values, starts):
            while int(ids[at]) not in (0, _TOMB):
                at = (at + 1) & mask
            self._used += int(ids[at]) == 0
            stored[at], ids[at] = k, v
            self._live += 1

    def delete(self, keys: Sequence[int]) -> None:
        """Remove ``keys`` (a key not here: nothing)."""
        if not self._live:
            self._emptied()
            return
        if not len(keys):
            return
        if len(keys) <= SMALL:
            pos = np.array(sorted({p for p in self._find_small(keys) if p >= 0}), np.intp)
        else:
            pos = self._find(np.array(keys, np.uint64))
            pos = np.unique(pos[pos >= 0])
        self._ids[pos] = _TOMB
        self._live -= len(pos)
        if not self._live:
            self._emptied()
        elif self._live * 16 < len(self._keys) and len(self._keys) > 1 << 16:
            self._rebuild(0)

    def _emptied(self) -> None:
        """No key left: every slot free again, a table grown past 65,536 slots let go."""
        if not self._used:
            return
        if len(self._keys) > max(self._smallest, 1 << 16):
            self._reset(self._smallest)
        else:
            self._ids[:] = 0
            self._used = 0

    def values(self) -> np.ndarray:
        ids = self._ids
        return ids[(ids != 0) & (ids != _TOMB)]

    def map_values(self, table: np.ndarray) -> None:
        """Replace every id ``v`` by ``table[v]`` (ids below ``len(table)``; none may become 0)."""
        live = (self._ids != 0) & (self._ids != _TOMB)
        self._ids[live] = table[self._ids[live]]

    def _rebuild(self, more: int) -> None:
        """A new table for the live keys and ``more``, at most half full."""
        live = (self._ids != 0) & (self._ids != _TOMB)
        keys, ids = self._keys[live], self._ids[live]
        self._reset(max(self._smallest, 1 << (2 * (len(keys) + more) - 1).bit_length()))
        self._insert(keys, ids)

    def _insert(self, query: np.ndarray, ids: np.ndarray) -> None:
        """Place keys known absent (distinct) in the first free slot of each one's probe."""
        if 10 * (self._used + len(query)) > 7 * len(self._keys):
            self._rebuild(len(query))
        todo, at = np.arange(len(query)), self._home(query)
        claim = np.empty(len(self._keys), np.int32) if len(query) > 4096 else None
        while len(todo):
            if len(todo) <= SMALL:  # the last few: on in Python
                self._place(query[todo].tolist(), ids[todo].tolist(), at.tolist())
                break
            free = np.flatnonzero((self._ids[at] == 0) | (self._ids[at] == _TOMB))
            if claim is not None:  # one key a slot among those landing on it: whichever wrote last
                claim[at[free]] = free
                won = free[claim[at[free]] == free]
            else:
                won = free[np.unique(at[free], return_index=True)[1]]
            slots = at[won]
            self._used += int(np.count_nonzero(self._ids[slots] == 0))
            self._keys[slots], self._ids[slots] = query[todo[won]], ids[todo[won]]
            self._live += len(won)
            rest = np.ones(len(todo), bool)
            rest[won] = False
            todo, at = todo[rest], (at[rest] + 1) & self._mask
