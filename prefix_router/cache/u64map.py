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

from collections import deque
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from prefix_router.cache.blocks import packed_hashes

__all__ = ["U64Map", "SMALL"]

SMALL = 16  # keys a call takes one at a time in Python: below this, numpy's per-call cost dominates

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
