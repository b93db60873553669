"""The engines' views of the fleet in one map: block hash -> the replicas whose view holds it;
and ``match_all``, the one walk of a prompt for every replica, whatever structure holds them.

Matching a prompt against each replica's index on its own costs replicas x matched blocks: a
shared 32k-token prompt in front of 256 replicas is half a million lookups a request. SGLang's
gateway (one radix tree whose nodes carry the workers holding them), NVIDIA Dynamo's KV router
and llm-d's KV-block index keep one index for the fleet instead. The gateway's guesses live in
one ``BlockTree`` (``cache/tree.py``); the engines' views (``EngineView``), whose blocks come and
go by the engine's events in any order, report a block here when it starts or stops matching,
and ``drops`` walks a prompt's blocks once, with one bit a replica, stopping at the first block
no candidate holds. Chained hashes make a held block's prefix held too, so a replica's depth is
where its bit first drops out.

Each view stays the truth of what its engine holds (counts, ghosts and blocks in flight); this
map mirrors only membership, so its answer equals every view's own ``match``
(``tests/cache/test_holders.py`` holds the two equal under random operations).

Memory: one dict entry a distinct block held anywhere, its value an int of one bit a replica.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import groupby
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol

from prefix_router.cache.blocks import BlockHash

if TYPE_CHECKING:
    from prefix_router.cache.tree import BlockTree

__all__ = ["Holders", "Index", "match_all"]

_HOLDERS, _BIT = attrgetter("holders"), attrgetter("bit")


class Index(Protocol):
    """A replica's index as ``match_all`` reads it (a ``ShadowIndex`` in a ``BlockTree``, an
    ``EngineView`` in ``Holders``)."""

    holders: Holders | BlockTree | None
    bit: int

    def match(self, hashes: Sequence[BlockHash]) -> int: ...


def match_all(hashes: Sequence[BlockHash], indexes: Mapping[str, Index], cap: int) -> dict[str, int]:
    """Replica name -> the leading blocks of ``hashes`` its index holds, at most ``cap``: one walk
    of the prompt for all the indexes that report into one ``Holders`` map (at most two: the
    gateway's guesses and the engines' views), an index's own ``match`` for any that does not.
    Apart from the walk, a pass over the indexes is a few ``map`` and ``zip`` calls in C."""
    out = dict.fromkeys(indexes, 0)
    maps = list(map(_HOLDERS, indexes.values()))
    distinct = set(maps)
    for holders in distinct:
        if len(distinct) == 1:
            group = indexes
        else:
            group = {name: index for (name, index), h in zip(indexes.items(), maps) if h is holders}
        if holders is None:
            for name, index in group.items():
                out[name] = min(index.match(hashes), cap)
            continue
        names = dict(zip(map(_BIT, group.values()), group))
        for bits, depth in holders.drops(hashes, sum(names), cap):
            if bits.bit_count() < 8:
                while bits:
                    low = bits & -bits
                    out[names[low]] = depth
                    bits ^= low
            else:  # many replicas at one depth (a prompt every replica holds): one pass, in C
                out.update(dict.fromkeys([name for bit, name in names.items() if bit & bits], depth))
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

    def drops(self, hashes: Sequence[BlockHash], mask: int, cap: int | None = None) -> list[tuple[int, int]]:
        """Where the slots of ``mask`` stop holding the prompt: ``(slots, depth)`` pairs, the
        slots (bits) that hold exactly the first ``depth`` blocks of ``hashes``, ``depth`` > 0
        and increasing. One pass over the prompt, ending at the first block no remaining slot
        holds.

        The blocks' masks are read by ``map`` and a run of equal masks (a prefix held by the same
        replicas, the common case: a shared system prompt, then one conversation's history) is
        stepped over by ``groupby`` in C: within a run no slot drops out, so only where the mask
        changes does Python look at the bits."""
        if cap is not None and cap < len(hashes):
            hashes = hashes[:cap]
        out: list[tuple[int, int]] = []
        alive = mask
        depth = 0
        for value, run in groupby(map(self._bits.get, hashes)):  # a block nobody holds: None
            held = alive & value if value is not None else 0
            if depth and alive != held:
                out.append((alive ^ held, depth))
            alive = held
            if not alive:
                return out
            depth += len(list(run))  # within a run of equal masks nobody drops out
        if depth:
            out.append((alive, depth))
        return out
