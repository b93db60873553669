"""The blocks an engine removed lately, each with the stamp of its last removal: a ring of arrays.

An ``EngineView`` remembers its engine's last removals (``held_lately``, ``match_ever`` for the
miss accounting, ``evicted_since`` for a request's exact hit). A busy replica removes blocks all
the time, so the memory is ``max_ghosts`` per replica: as an ``OrderedDict`` about 150 bytes a
ghost (15 MB a replica at 100,000, 3.8 GB at 256 replicas); here 17 bytes a ghost in the ring
plus 13 in the ``U64Map`` from block to slot. The ring grows as removals come, up to its bound,
so an idle replica costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prefix_router.cache.blocks import BlockHash
from prefix_router.cache.u64map import SMALL, U64Map

__all__ = ["GhostRing"]


class GhostRing:
    """The blocks of the last ``capacity`` removals, newest last, each with its last removal's
    stamp (an int >= 0). A block removed again moves to the newest end; its earlier slot is left
    empty, so after many repeated removals fewer than ``capacity`` distinct blocks remain."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hash = np.zeros(0, np.uint64)
        self._stamp = np.zeros(0, np.int64)
        self._live = np.zeros(0, bool)
        self._next = 0  # the slot written next; slots are reused only once the ring is full
        self._count = 0
        self._slot = U64Map(np.uint32)  # block hash -> its slot + 1

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._hash.nbytes + self._stamp.nbytes + self._live.nbytes + self._slot.nbytes

    def note(self, hashes: Sequence[BlockHash], stamp: int) -> None:
        """``hashes`` were removed now, in this order, all under ``stamp``."""
        if not hashes or self.capacity <= 0:
            return
        if len(set(hashes)) < len(hashes):  # keep each block's last removal only
            hashes = list(dict.fromkeys(reversed(hashes)))[::-1]
        hashes = hashes[-self.capacity:]
        k = len(hashes)
        if k <= SMALL:  # a key at a time: vLLM removes a block an event
            earlier = [v - 1 for f, v in zip(*self._slot.get(hashes)) if f]
        else:
            earlier = self._slot.values_of(hashes)
            earlier = (earlier[earlier > 0].astype(np.int64) - 1).tolist()
        self._live[earlier] = False
        self._count -= len(earlier)
        if self._next + k > len(self._hash) and len(self._hash) < self.capacity:  # grow before wrapping
            size = min(self.capacity, max(2 * len(self._hash), self._next + k, 1024))
            grow = size - len(self._hash)
            self._hash = np.concatenate([self._hash, np.zeros(grow, np.uint64)])
            self._stamp = np.concatenate([self._stamp, np.zeros(grow, np.int64)])
            self._live = np.concatenate([self._live, np.zeros(grow, bool)])
        size = len(self._hash)
        if k <= SMALL:
            slots = [(self._next + i) % size for i in range(k)]
            over = [int(self._hash[at]) for at in slots if self._live[at]]  # the oldest ghosts, written over
            for at, h in zip(slots, hashes):
                self._hash[at], self._stamp[at], self._live[at] = h, stamp, True
        else:
            at = (self._next + np.arange(k)) % size
            over = self._hash[at[self._live[at]]].tolist()
            self._hash[at], self._stamp[at], self._live[at] = np.array(hashes, np.uint64), stamp, True
            slots = at.tolist()
        if over:
            self._slot.delete(over)
            self._count -= len(over)
        self._slot.put(hashes, [at + 1 for at in slots])
        self._count += k
        end = slots[-1] + 1  # the next write wraps to the oldest slot only once the ring is full
        self._next = end % size if size == self.capacity else end

    def stamps(self, hashes: Sequence[BlockHash]) -> np.ndarray:
        """The stamp of each block's last removal remembered, -1 for a block not here."""
        if not self._count or not hashes:
            return np.full(len(hashes), -1, np.int64)
        slot = self._slot.values_of(hashes).astype(np.int64)
        return np.where(slot > 0, self._stamp[slot - 1], -1)

    def holds(self, hashes: Sequence[BlockHash]) -> np.ndarray:
        """Whether each block was removed lately (a bool array)."""
        return self.stamps(hashes) >= 0
