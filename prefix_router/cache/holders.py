"""The fleet's cache picture in one map: block hash -> the replicas whose index holds it.

Matching a prompt against each replica's index on its own costs replicas x matched blocks: a
shared 32k-token prompt in front of 256 replicas is half a million lookups a request. SGLang's
gateway (one radix tree whose nodes carry the workers holding them), NVIDIA Dynamo's KV router
and llm-d's KV-block index keep one index for the fleet instead. ``Holders`` is that index for
this gateway's chained block hashes: each replica's index (``ShadowIndex``, ``EngineView``)
reports a block when it starts or stops holding it, and ``depths`` walks a prompt's blocks once,
with one bit a replica, stopping at the first block no candidate holds. Chained hashes make a
held block's prefix held too, so a replica's depth is where its bit first drops out.

Each index stays the truth of what its replica holds (its LRU order, ghosts, counts and blocks in
flight); this map mirrors only membership, so its answer equals every index's own ``match``
(``tests/cache/test_holders.py`` holds the two equal under random operations).

Memory: one dict entry a distinct block held anywhere, its value an int of one bit a replica.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from prefix_router.cache.blocks import BlockHash

__all__ = ["Holders", "Index", "match_all"]


class Index(Protocol):
    """A replica's index as ``match_all`` reads it (``ShadowIndex``, ``EngineView``)."""

    holders: Holders | None
    bit: int

    def match(self, hashes: Sequence[BlockHash]) -> int: ...


def match_all(hashes: Sequence[BlockHash], indexes: Iterable[tuple[str, Index]], cap: int) -> dict[str, int]:
    """Replica name -> the leading blocks of ``hashes`` its index holds, at most ``cap``: one walk
    of the prompt for all the indexes that report into one ``Holders`` map (at most two: the
    gateway's guesses and the engines' views), an index's own ``match`` for any that does not."""
    out: dict[str, int] = {}
    groups: dict[int, tuple[Holders, dict[int, str]]] = {}
    for name, index in indexes:
        holders = index.holders
        if holders is None:
            out[name] = min(index.match(hashes), cap)
            continue
        out[name] = 0
        group = groups.get(id(holders))
        if group is None:
            group = groups[id(holders)] = (holders, {})
        group[1][index.bit] = name
    head = hashes[:cap] if cap < len(hashes) else hashes
    for holders, names in groups.values():
        for bit, depth in holders.depths(head, sum(names)).items():
            out[names[bit]] = depth
    return out


class Holders:
    """Block hash -> bitmask of replica slots; slots are handed out by ``slot`` and freed by ``release``."""

    def __init__(self) -> None:
        self._bits: dict[BlockHash, int] = {}
        self._next_slot = 0
        self._free: list[int] = []  # slots given back, reused lowest first

    def __len__(self) -> int:
        return len(self._bits)

    def slot(self) -> int:
        """A free slot's bit (``1 << slot``) for a new replica's index."""
        if self._free:
            self._free.sort()
            return 1 << self._free.pop(0)
        self._next_slot += 1
        return 1 << (self._next_slot - 1)

    def release(self, bit: int, held: Iterable[BlockHash]) -> None:
        """Give ``bit``'s slot back once its index is gone, clearing it from the blocks ``held``."""
        for h in held:
            self.discard(h, bit)
        self._free.append(bit.bit_length() - 1)

    def add(self, h: BlockHash, bit: int) -> None:
        """The replica of ``bit`` holds ``h``."""
        bits = self._bits
        bits[h] = bits.get(h, 0) | bit

    def discard(self, h: BlockHash, bit: int) -> None:
        """The replica of ``bit`` no longer holds ``h`` (nothing if it did not)."""
        bits = self._bits
        held = bits.get(h)
        if held is None:
            return
        held &= ~bit
        if held:
            bits[h] = held
        else:
            del bits[h]

    def holds(self, h: BlockHash, bit: int) -> bool:
        return bool(self._bits.get(h, 0) & bit)

    def depths(self, hashes: Sequence[BlockHash], mask: int) -> dict[int, int]:
        """For each slot in ``mask`` holding the prompt's first block, the leading blocks of
        ``hashes`` it holds, by bit; slots holding none of it are left out. One pass over the
        prompt, ending at the first block no remaining slot holds."""
        bits = self._bits
        out: dict[int, int] = {}
        alive = mask
        depth = 0
        for h in hashes:
            held = bits.get(h, 0) & alive
            dropped = alive ^ held
            if dropped:
                _record(out, dropped, depth)
            alive = held
            if not alive:
                return out
            depth += 1
        _record(out, alive, depth)
        return out


def _record(out: dict[int, int], bits: int, depth: int) -> None:
    """``out[bit] = depth`` for every set bit of ``bits`` (none when ``depth`` is 0)."""
    if depth == 0:
        return
    while bits:
        low = bits & -bits
        out[low] = depth
        bits ^= low
