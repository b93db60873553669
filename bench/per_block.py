"""The gateway's guess of a replica's cache as it was before ``cache/tree.py``: an LRU set of
block hashes per replica (a dictionary entry a block), optionally reporting into the fleet's
``Holders`` map. Kept as the baseline that ``python -m bench choice`` measures the tree against,
in the same run; the gateway does not use it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import groupby

from prefix_router.cache.blocks import BlockHash

__all__ = ["PerBlockIndex", "Holders"]


class PerBlockIndex:
    """LRU set of one replica's block hashes, at most ``capacity`` (``ShadowIndex`` before the tree)."""

    def __init__(self, capacity: int, holders: Holders | None = None) -> None:
        self.capacity = capacity
        self.holders = holders
        self.bit = holders.slot() if holders is not None else 0
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        """The chain, touched tail first; the least recently used beyond capacity go."""
        blocks = self._blocks
        for h in reversed(hashes[: self.capacity]):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                if self.holders is not None:
                    self.holders.add(h, self.bit)
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            if self.holders is not None:
                self.holders.discard(h, self.bit)


class Holders:
    """Block hash -> bitmask of replica slots, a dict entry a block (the fleet's map before
    ``cache/engine_map.py``); slots are handed out by ``slot`` and freed by ``release``."""

    def __init__(self) -> None:
        self._bits: dict[BlockHash, int] = {}
        self._next_slot = 0
        self._free: list[int] = []  # slots given back, reused lowest first

    def __len__(self) -> int:
        return len(self._bits)

    @property
    def table(self) -> dict[BlockHash, int]:
        """Block hash -> mask, to read (``EngineMap.drops`` reads it with ``map``)."""
        return self._bits

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
