"""What the gateway learns about prefixes shared by many requests, for the routing key and the
holder's leave.

``BranchStats``: for each block, up to ``threshold`` distinct next blocks seen after it. A
block followed by many different continuations ends a prefix shared by many conversations
(a common system prompt or tool list); the routing key must reach past it, to the first block
specific to the conversation, or every conversation sharing that prefix lands on one replica
(the failure the field notes report for peer routers). Bounded by an LRU of ``max_blocks``.

``PrefixDemand``: for each block, the share of recent requests whose prompt passed through it.
A prefix whose share is more than its holders can serve at their fair share is hot and must be
replicated; any other prefix is cold and is best left where it is (``policy.py``, step 2).
"""

from __future__ import annotations

import heapq
import operator
from collections import OrderedDict
from collections.abc import Sequence

from prefix_router.cache.blocks import BlockHash

__all__ = ["BranchStats", "PrefixDemand"]


class BranchStats:
    """Distinct next blocks seen after each block, up to ``threshold``; LRU-bounded.

    Memory: a block seen with one successor stores that successor (an int); with a few, a set;
    once ``threshold`` are seen it is marked shared and the set is dropped. About 170 bytes an
    entry in CPython (measured), so the default 500,000 entries stay under 100 MB.
    """

    _SHARED = True  # marker: at least ``threshold`` successors seen

    def __init__(self, threshold: int = 4, max_blocks: int = 500_000) -> None:
        if threshold < 2:
            raise ValueError(f"threshold must be at least 2, got {threshold}")
        self.threshold = threshold
        self.max_blocks = max_blocks
        self._next: OrderedDict[BlockHash, BlockHash | set[BlockHash] | bool] = OrderedDict()
        self._shared: set[BlockHash] = set()  # the blocks marked shared, for ``key_depth``

    def __len__(self) -> int:
        return len(self._next)

    def record(self, hashes: Sequence[BlockHash], depth: int) -> None:
        """Note the successors of the first ``depth`` blocks of one request."""
        table = self._next
        shared = self._SHARED
        for i in range(min(depth, len(hashes) - 1)):
            block, successor = hashes[i], hashes[i + 1]
            seen = table.get(block)
            if seen is None:
                table[block] = successor
                continue
            table.move_to_end(block)
            if seen is shared or seen == successor:
                continue
            if not isinstance(seen, set):
                seen = {seen}
            seen.add(successor)
            if len(seen) >= self.threshold:
                table[block] = shared
                self._shared.add(block)
            else:
                table[block] = seen
        while len(table) > self.max_blocks:
            old, seen = table.popitem(last=False)
            if seen is shared:
                self._shared.discard(old)

    def is_shared(self, block: BlockHash) -> bool:
        """Whether ``block`` was seen followed by at least ``threshold`` different blocks."""
        return self._next.get(block) is self._SHARED

    def key_depth(self, hashes: Sequence[BlockHash], max_depth: int) -> int:
        """Blocks the routing key should cover: through the first block after the deepest
        shared (branching) block within ``max_depth``; 1 when no branching block is known.
        May exceed ``len(hashes)`` when the prompt ends inside the shared prefix.
        """
        n = min(max_depth, len(hashes))
        found = self._shared.intersection(hashes[:n])  # in C: few blocks branch
        if not found:
            return 1
        backwards = hashes[n - 1::-1] if isinstance(hashes, list) else list(hashes[:n])[::-1]
        return n + 1 - min(map(backwards.index, found))  # the last of them: a block may recur


class PrefixDemand:
    """The share of recent requests whose prompt passed through each block, decayed.

    ``record`` adds one request, weighted ``2 ** (t / half_life_s)`` so that older requests
    count half as much every ``half_life_s`` without touching every entry (weights are rescaled
    when they grow past ``2 ** 50``); ``share`` divides by the total weight, which the same
    decay applies to. Chained hashes make a deeper block's share at most its parent's: the
    share of the deepest block a replica holds is the share of traffic that wants that prefix.

    Memory: one float per block seen within the first ``depth`` blocks of a prompt, at most
    ``max_blocks``; past it the half with the least weight is dropped, so hot prefixes stay.
    """

    def __init__(self, half_life_s: float = 60.0, max_blocks: int = 500_000) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        if max_blocks < 2:
            raise ValueError(f"max_blocks must be at least 2, got {max_blocks}")
        self.half_life_s = half_life_s
        self.max_blocks = max_blocks
        self._weight: dict[BlockHash, float] = {}
        self._total = 0.0
        self._origin: float | None = None  # monotonic seconds at which a request weighs 1

    def __len__(self) -> int:
        return len(self._weight)

    def record(self, hashes: Sequence[BlockHash], depth: int, now: float) -> None:
        """Count one request through the first ``depth`` of ``hashes`` (``now``: monotonic s)."""
        if self._origin is None:
            self._origin = now
        exponent = (now - self._origin) / self.half_life_s
        if exponent > 50:  # rebase before the weights overflow: every ratio is unchanged
            scale = 0.5 ** exponent
            self._weight = {b: w * scale for b, w in self._weight.items() if w * scale > 1e-9}
            self._total *= scale
            self._origin, exponent = now, 0.0
        w = 2.0 ** exponent
        weight = self._weight
        self._total += w
        for h in hashes[:depth]:
            weight[h] = weight.get(h, 0.0) + w
        if len(weight) > self.max_blocks:
            keep = heapq.nlargest(self.max_blocks // 2, weight.items(), key=operator.itemgetter(1))
            self._weight = dict(keep)

    def share(self, block: BlockHash) -> float:
        """Of the recent requests, the fraction whose prompt passed through ``block`` (0 to 1)."""
        return self._weight.get(block, 0.0) / self._total if self._total else 0.0
