"""An open-addressing hash table of numpy arrays: 64-bit keys -> 32-bit ids, for the fleet's map.

``U64Map`` (``cache/u64map.py``) finds a key by binary search, twenty-odd cache lines a key in a
table of millions; the fleet's map (``cache/engine_map.py``) is read for every block of every
request's prompt, so it is kept here instead, where a key is found in one window of slots.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np

from prefix_router.cache.blocks import packed_hashes
from prefix_router.cache.u64map import SMALL

__all__ = ["IdTable", "WINDOW"]

_TOMB = np.uint32(0xFFFF_FFFF)  # a slot deleted
WINDOW = 8  # slots a probe reads a numpy round: a key's home is the start of a window (8: a row of bools is a word)
_M64 = (1 << 64) - 1
PROBE_IN_PYTHON = 8  # keys left to find below which a probe goes on in Python (a numpy round costs about as much as 8 keys probed in Python)


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

    def _find(self, query: np.ndarray, row: np.ndarray | None = None) -> np.ndarray:
        """Each key's slot, -1 where absent: a probe ends at a match or an empty slot. ``row``:
        the window each probe starts at, when not the key's home (``values_of`` read that)."""
        pos = np.full(len(query), -1, np.intp)
        todo, row = np.arange(len(query)), self._home(query) // WINDOW if row is None else row
        keys, ids = self._keys.reshape(-1, WINDOW), self._ids.reshape(-1, WINDOW)  # a window a row
        rows = len(keys)
        while len(todo):
            if len(todo) <= PROBE_IN_PYTHON:  # the few in long runs of slots: on in Python, not a numpy round a window
                pos[todo] = self._probe_from(query[todo].tolist(), (row * WINDOW).tolist())
                break
            # rows by ``take``: numpy's fancy indexing of a 2-D array's rows is several times slower
            at = np.flatnonzero(keys.take(row, axis=0) == query[todo][:, None])  # equal keys; live ones are a slot a key
            first = at // WINDOW
            slot = row[first] * WINDOW + at % WINDOW
            held = self._ids[slot]
            live = (held != 0) & (held != _TOMB)
            first = first[live]
            pos[todo[first]] = slot[live]
            missed = np.ones(len(todo), bool)
            missed[first] = False
            missed = np.flatnonzero(missed)
            go = missed[ids.take(row[missed], axis=0).min(axis=1) != 0]  # an empty slot ends a probe: the key is not further on
            todo, row = todo[go], (row[go] + 1) % rows
        return pos

    def _find_small(self, keys: Sequence[int]) -> list[int]:
        """``_find`` a key at a time in Python (the same probe: the same home slot, in Python ints)."""
        return self._probe_from(keys, self._start(keys))

    def _probe_from(self, keys: Sequence[int], starts: Sequence[int]) -> list[int]:
        """Each key's slot, -1 where absent, probing in Python from ``starts`` (the first slots of
        windows), a window read at a time (one numpy scalar a slot costs several times more)."""
        out = []
        stored, ids, mask, tomb = self._keys, self._ids, self._mask, int(_TOMB)
        for k, at in zip(keys, starts):
            while True:
                window = ids[at:at + WINDOW].tolist()
                if k in (found := stored[at:at + WINDOW].tolist()):  # live or deleted
                    slot = next((at + i for i, (v, key) in enumerate(zip(window, found))
                                 if key == k and v != 0 and v != tomb), -1)
                    if slot >= 0:
                        break
                if 0 in window:  # an empty slot ends the probe (no key is placed past one)
                    slot = -1
                    break
                at = (at + WINDOW) & mask
            out.append(slot)
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
        query = np.frombuffer(packed_hashes(keys, len(keys)), np.uint64, len(keys))
        # most keys are settled in their home window, read for all at once: a live slot with the
        # key, or an empty slot (the key is absent); ``_find`` probes on for the rest
        row = self._home(query) // WINDOW
        window = self._ids.reshape(-1, WINDOW).take(row, axis=0)
        equal = self._keys.reshape(-1, WINDOW).take(row, axis=0) == query[:, None]
        equal &= window - np.uint32(1) < _TOMB - np.uint32(1)  # live slots (an empty one's key is 0, a deleted one's kept)
        at = np.flatnonzero(equal)  # (reductions along a row of 8 are slow in numpy: none here)
        found = np.zeros(len(query), np.uint32)
        found[at // WINDOW] = window.ravel()[at]
        open_row = (window == 0).view(np.uint64).ravel() != 0  # a row of 8 bools read as one word
        rest = np.flatnonzero((found == 0) & ~open_row)
        if len(rest):
            pos = self._find(query[rest], (row[rest] + 1) % (len(self._keys) // WINDOW))
            found[rest] = np.where(pos >= 0, self._ids[pos], 0)
        return found

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
