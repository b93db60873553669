"""The engines' views of the whole fleet in one map: block hash -> the replicas whose engine holds it.

Each ``EngineView`` (``cache/engine_view.py``) reports here the blocks its engine stores and
removes, by KV events, and the blocks routed to its replica and not yet confirmed (in flight, or
lately released); ``drops`` then matches a prompt against every replica in one walk
(``cache/holders.py``, ``match_all``). Stored blocks live in an ``IdTable`` (``cache/id_table.py``,
a hash table of numpy arrays): a block hash, 8 bytes, and a 4-byte id of its holders' mask, the
masks themselves interned (a fleet has few distinct sets of holders: one replica's own blocks, a
prompt every replica holds). So memory grows with the distinct blocks of the fleet, 12 bytes a
slot at most half the slots used, plus one bit a holder, not with replicas x blocks. The blocks
not yet confirmed (the requests in flight) are a second table of the same kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress

import numpy as np

from prefix_router.cache.blocks import BlockHash
from prefix_router.cache.id_table import IdTable
from prefix_router.cache.u64map import SMALL

__all__ = ["EngineMap"]


class EngineMap:
    """Block hash -> the slots (bits) of the replicas whose engine stores it, and of those it is
    pending on (routed there and not yet confirmed by the events)."""

    def __init__(self) -> None:
        # block hash -> id of a mask of slots, 0 never kept: what the engines store, what is pending
        self._stored, self._pending = IdTable(), IdTable(64)
        self._masks: list[int] = [0]  # id -> mask
        self._ids: dict[int, int] = {0: 0}  # mask -> id
        self._collect_at = 4096  # interned masks past which the unused ones are swept
        self._next_slot = 0
        self._free: list[int] = []  # slots given back, reused lowest first
        # the fleet's offload tiers, by medium (``tier``): the same slots, the blocks each
        # replica's engine holds in CPU memory or storage (``cache/offload.py``)
        self.tiers: dict[str, EngineMap] = {}

    def __len__(self) -> int:
        """Distinct blocks stored by any replica."""
        return len(self._stored)

    @property
    def nbytes(self) -> int:
        return self._stored.nbytes + self._pending.nbytes

    def slot(self) -> int:
        """A free slot's bit (``1 << slot``) for a new replica's view."""
        if self._free:
            self._free.sort()
            return 1 << self._free.pop(0)
        self._next_slot += 1
        return 1 << (self._next_slot - 1)

    def tier(self, medium: str) -> EngineMap:
        """The map of offload medium ``medium`` (``CPU``, ``STORAGE``), made on first use; its
        bits are this map's slots."""
        found = self.tiers.get(medium)
        if found is None:
            found = self.tiers[medium] = EngineMap()
        return found

    def release(self, bit: int, stored: Sequence[BlockHash], pending: Sequence[BlockHash]) -> None:
        """Give ``bit``'s slot back once its view is gone, clearing it from the blocks it holds."""
        self.unstore(stored, bit)
        self.unpend(pending, bit)
        self._free.append(bit.bit_length() - 1)

    def _intern(self, mask: int) -> int:
        found = self._ids.get(mask)
        if found is None:
            found = self._ids[mask] = len(self._masks)
            self._masks.append(mask)
        return found

    def _change(self, table: IdTable, hashes: Sequence[BlockHash], bit: int, add: bool) -> list[bool]:
        """Set or clear ``bit`` on ``hashes`` in ``table``; whether each had it before."""
        if not hashes:
            return []
        if len(hashes) <= SMALL:  # a key at a time: an event of a block or two costs microseconds
            return self._change_small(table, hashes, bit, add)
        ids = table.values_of(hashes)
        unique, inverse = np.unique(ids, return_inverse=True)
        masks = [self._masks[i] for i in unique.tolist()]
        before = np.array([bool(m & bit) for m in masks])[inverse]
        new = np.array([self._intern(m | bit if add else m & ~bit) for m in masks], np.uint32)[inverse]
        changed = new != ids
        if changed.any():
            gone = changed & (new == 0)
            if gone.any():
                table.delete(list(compress(hashes, gone.tolist())))
            kept = changed & ~gone
            table.put(list(compress(hashes, kept.tolist())), new[kept].tolist())
        if len(self._masks) > self._collect_at:
            self._collect()
        return before.tolist()

    def _change_small(self, table: IdTable, hashes: Sequence[BlockHash], bit: int, add: bool) -> list[bool]:
        """``_change`` of a few hashes, in Python: one probe a block (a block given twice is
        changed once, and told as it was before the call, as the batch path tells it)."""
        masks, intern = self._masks, self._intern
        unique = list(dict.fromkeys(hashes)) if len(set(hashes)) < len(hashes) else hashes
        old = table.change_small(unique, (lambda i: intern(masks[i] | bit)) if add else (lambda i: intern(masks[i] & ~bit)))
        before = [bool(masks[i] & bit) for i in old]
        if unique is not hashes:
            was = dict(zip(unique, before))
            before = [was[h] for h in hashes]
        if len(self._masks) > self._collect_at:
            self._collect()
        return before

    def store(self, hashes: Sequence[BlockHash], bit: int) -> list[bool]:
        """The replica of ``bit`` stores ``hashes``; whether it stored each already."""
        return self._change(self._stored, hashes, bit, True)

    def unstore(self, hashes: Sequence[BlockHash], bit: int) -> None:
        """The replica of ``bit`` no longer stores ``hashes`` (nothing for one it did not)."""
        self._change(self._stored, hashes, bit, False)

    def stored(self, hashes: Sequence[BlockHash], bit: int) -> list[bool]:
        """Whether the replica of ``bit`` stores each of ``hashes``."""
        if not hashes:
            return []
        if len(hashes) <= SMALL:
            return [bool(self._masks[i] & bit) for i in self._stored.ids_small(hashes)]
        ids = self._stored.values_of(hashes)
        unique, inverse = np.unique(ids, return_inverse=True)
        return np.array([bool(self._masks[i] & bit) for i in unique.tolist()])[inverse].tolist()

    def unstored(self, hashes: Sequence[BlockHash], bit: int) -> list[BlockHash]:
        """Those of ``hashes`` the replica of ``bit`` does not store."""
        return [h for h, held in zip(hashes, self.stored(hashes, bit)) if not held] if hashes else []

    def pend(self, hashes: Sequence[BlockHash], bit: int) -> None:
        """``hashes`` match on the replica of ``bit`` until ``unpend``: routed there, and not
        stored (the view pends only those; ``drops`` reads stored or pending)."""
        self._change(self._pending, hashes, bit, True)

    def unpend(self, hashes: Sequence[BlockHash], bit: int) -> None:
        if self._pending.may_hold_any():
            self._change(self._pending, hashes, bit, False)

    def _collect(self) -> None:
        """Sweep the masks no block uses any more, renumbering the rest."""
        used = np.union1d(np.union1d(self._stored.values(), self._pending.values()), [0]).astype(np.uint32)
        self._masks = [self._masks[i] for i in used.tolist()]
        self._ids = {m: i for i, m in enumerate(self._masks)}
        table = np.zeros(int(used[-1]) + 1, np.uint32)
        table[used] = np.arange(len(used), dtype=np.uint32)
        self._stored.map_values(table)
        self._pending.map_values(table)
        self._collect_at = max(4096, 2 * len(self._masks))

    def drops(self, hashes: Sequence[BlockHash], mask: int, cap: int | None = None) -> list[tuple[int, int]]:
        """Where the slots of ``mask`` stop holding the prompt: ``(slots, depth)`` pairs, the slots
        that hold exactly the first ``depth`` blocks of ``hashes``, ``depth`` > 0 and increasing
        (``match_all`` reads it). The prompt's blocks are looked up in each table at once; a run of
        equal masks (a prefix held by the same replicas) is found in numpy and
        stepped over at once."""
        if cap is not None and cap < len(hashes):
            hashes = hashes[:cap]
        if not hashes:
            return []
        stored = self._stored.values_of(hashes)
        if self._pending.may_hold_any():
            key = stored.astype(np.uint64) << np.uint64(32) | self._pending.values_of(hashes)
        else:
            key = stored
        starts = [0, *(np.flatnonzero(key[1:] != key[:-1]) + 1).tolist(), len(key)]
        first = key[starts[:-1]].tolist()
        masks, low = self._masks, (1 << 32) - 1
        out: list[tuple[int, int]] = []
        alive, depth = mask, 0
        for k, start, end in zip(first, starts, starts[1:]):
            held = alive & (masks[k >> 32] | masks[k & low])
            if depth and alive != held:
                out.append((alive ^ held, depth))
            alive = held
            if not alive:
                return out
            depth += end - start
        out.append((alive, depth))
        return out
