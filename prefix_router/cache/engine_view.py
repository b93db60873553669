"""The engine's own picture of one replica's prefix cache, built from its KV events.

``EngineView`` keys what it learns by the gateway's own chained block hash of each block's
token ids (``prefix_router/cache/blocks.py``), never vLLM's digest, which depends on the engine's
hash algorithm and seed; a map from the engine's hash to the gateway's serves removals. The
events themselves are decoded in ``cache/events.py``; ``cache/stream.py`` feeds them in order.
How it takes the events is in ``cache/intake.py``. Which blocks each replica holds is kept for
the whole fleet in one ``EngineMap`` (``cache/engine_map.py``), so that a prompt is matched
against every replica in one walk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import compress

import numpy as np

from prefix_router.cache.blocks import BlockHash
from prefix_router.cache.engine_map import EngineMap
from prefix_router.cache.ghosts import GhostRing
from prefix_router.cache.intake import EventIntake
from prefix_router.cache.offload import OffloadTier
from prefix_router.cache.u64map import U64Map

__all__ = ["EngineView"]


class EngineView(EventIntake):
    """What one replica's prefix cache holds, from its events, in the gateway's block hashes.

    ``seed(lora_name, cache_salt)`` gives the parent hash of a prompt's first block, as the
    gateway seeds the requests it hashes (``blocks.seed_hash``). Only blocks in KV cache group 0
    count; those on the GPU (medium ``GPU`` or unset) are the view's own, the ones a request's
    prefill hits, and those in CPU memory or storage are its ``offload`` tiers'.

    Which gateway blocks the engine stores is a bit of this view's slot (``bit``) in ``holders``,
    the fleet's ``EngineMap`` (a private one when none is given), where the blocks routed here and
    in flight, or lately released, count too, so the fleet is matched in one walk. The view keeps
    the engine's hash of each block (``U64Map``: 17 bytes a block, not the ~200 of dict entries),
    and counts only where one hash is stored twice (vLLM may cache one hash in two blocks, when two
    requests computed it before either was cached, and removes each separately) or two engine
    hashes name one gateway block. Also ``max_ghosts`` removed hashes remembered for
    ``held_lately`` and ``evicted_since``; events that would take it past ``max_blocks`` (set to
    twice the replica's capacity) are not a real cache's, and make the view ``overflowed``.
    ``close`` gives the slot back.
    """

    def __init__(self, block_size: int, seed: Callable[[str | None, str | None], BlockHash],
                 max_ghosts: int = 100_000, pending_s: float = 2.0, max_blocks: int = 1 << 22,
                 holders: EngineMap | None = None) -> None:
        self.holders = holders if holders is not None else EngineMap()
        self.bit = self.holders.slot()
        self.block_size = block_size
        self.max_blocks = max_blocks  # past this many engine hashes, or blocks, the events cannot be a real cache's
        self.overflowed = False
        self.seed = seed
        self.max_ghosts = max_ghosts
        self.pending_s = pending_s
        # blocks of the requests in flight here (a count per block), and of those that ended
        # lately whose BlockStored has not arrived (their end time): vLLM makes a prompt's blocks
        # hittable once it is scheduled, so a burst of one new prefix, or a request queued behind
        # one that computes its prefix, must see them before the events do
        self._inflight: dict[BlockHash, int] = {}
        self._released: OrderedDict[BlockHash, float] = OrderedDict()
        self.removals = 0  # blocks removed, ever
        # a removal's stamp: removals between two routings share one, and a routing that follows
        # a removal moves it on, so that ``note_routed``'s
        # answer (``_since``) is below every later removal's stamp and not below an earlier one's
        self._since, self._stamp, self._stamp_used = 0, 1, False
        self._engine = U64Map()  # engine key (``engine_keys``) -> gateway hash
        self._engine_extra: dict[int, int] = {}  # engine key -> times stored beyond once
        self._block_extra: dict[BlockHash, int] = {}  # gateway hash -> engine blocks beyond one naming it
        self._engine_held = 0  # engine keys held
        self._held = 0  # gateway blocks held
        # the blocks of the last ``max_ghosts`` removals, each with its last removal's stamp
        # (``_stamp``): for ``held_lately``, and for ``evicted_since``: a
        # request routed before a removal of a block it wants recomputes it, though predicted
        # held. Kept when the block is stored again and after the request ends: vLLM publishes a
        # step's events and its answers at once, so a removal may reach the gateway after the
        # answer, and the request itself stores the block again
        self._ghosts = GhostRing(max_ghosts)
        self.stored = 0  # blocks stored, ever
        self.orphans = 0  # stored blocks whose parent the view never saw (events lost, or an opaque parent)
        self.opaque = 0  # stored blocks with inputs the gateway does not hash (images, prompt embeds)
        self.misshapen = 0  # stored events whose token ids are not their blocks' (null or masked blocks)
        self.foreign_block_size = 0  # stored events in another block size than the gateway's
        self.bad_events = 0  # events of a run that could not be read (a token id out of range)
        # its blocks in CPU memory and storage, by medium, from the offloading connector's events
        # (``cache/offload.py``); routing reads them through ``holders.tiers``
        self.offload: dict[str, OffloadTier] = {}

    def __len__(self) -> int:
        return self._held

    def blocks(self) -> set[BlockHash]:
        """The gateway blocks the engine stores."""
        return set(self._engine.items()[1])

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` the engine holds, or that are pending here (chained: stop
        at the first miss)."""
        drops = self.holders.drops(hashes, self.bit)
        return drops[0][1] if drops else 0

    def note_routed(self, hashes: Sequence[BlockHash]) -> int:
        """Count a request's blocks as held from the moment it is sent until it ends. Returns
        the stamp of the removals so far, for ``evicted_since``."""
        inflight = self._inflight
        for h in hashes:
            inflight[h] = inflight.get(h, 0) + 1
        self.holders.pend(self.holders.unstored(hashes, self.bit), self.bit)  # a stored one is pended if removed
        if self._stamp_used:  # the removals so far came before this request; later ones get a new stamp
            self._since, self._stamp, self._stamp_used = self._stamp, self._stamp + 1, False
        return self._since

    def evicted_since(self, hashes: Sequence[BlockHash], n: int, since: int) -> tuple[int, ...]:
        """Which of the leading ``n`` blocks of a request in flight (their indices, ascending) the
        engine evicted after it was sent (``since``: ``note_routed``'s answer). vLLM evicts free
        blocks to make room for other requests' (``kv_cache_utils.FreeKVCacheBlockQueue``, tail
        blocks first): one queued behind them finds less of its prefix than it was routed for. A
        block evicted may be stored again before the request is scheduled (another request
        recomputed it), or be evicted after (vLLM preempts a running request and frees its
        blocks), so the engine's hit stops at one of these, not always the first. Answers after
        the request ended too, for the ``max_ghosts`` blocks removed last."""
        if not self._ghosts or n <= 0:
            return ()
        return tuple(np.flatnonzero(self._ghosts.stamps(hashes[:n]) > since).tolist())

    def release_routed(self, hashes: Sequence[BlockHash], now: float, served: bool) -> None:
        """The request sent with ``note_routed`` ended (``now``: monotonic s). ``served``: the
        engine ran it, so its blocks are stored even if the events have not said so yet; they
        count for ``pending_s`` more. A failed request's blocks are not coming."""
        inflight, released = self._inflight, self._released
        leaving = []
        for h in hashes:
            left = inflight.get(h, 0) - 1
            if left > 0:
                inflight[h] = left
            else:
                inflight.pop(h, None)
                leaving.append(h)
        if served:
            stored = self.holders.stored(leaving, self.bit)
            done = list(compress(leaving, stored))
            kept = [h for h, confirmed in zip(leaving, stored) if not confirmed] if len(done) < len(leaving) else []
        else:
            done, kept = leaving, []
        for h in kept:
            released.pop(h, None)
            released[h] = now
        self.holders.pend(kept, self.bit)  # in flight here before a clear() forgot it, it matches again
        while released:
            h, t = next(iter(released.items()))
            if now - t < self.pending_s and len(released) <= self.max_ghosts:
                break
            del released[h]
            done.append(h)
        self._unpend(done)

    def _unpend(self, hashes: Sequence[BlockHash]) -> None:
        """``hashes`` may have stopped being pending here: clear the pending bit of those that did."""
        inflight, released = self._inflight, self._released
        if inflight or released:
            hashes = [h for h in hashes if h not in inflight and h not in released]
        self.holders.unpend(hashes, self.bit)

    def match_ever(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks held now or removed lately (``ShadowIndex.match_ever``'s meaning)."""
        if not hashes:
            return 0
        held = np.array(self.holders.stored(hashes, self.bit)) | self._ghosts.holds(hashes)
        return int(held.argmin()) if not held.all() else len(hashes)

    def held_lately(self, block: BlockHash) -> bool:
        """Whether ``block`` is held now or was removed lately."""
        return bool(self._ghosts.holds([block])[0]) or self.holders.stored([block], self.bit)[0]

    def _forget_stored(self) -> None:
        self.holders.unstore(list(self.blocks()), self.bit)
        self._engine.clear()
        self._engine_extra.clear()
        self._block_extra.clear()
        self._engine_held = self._held = 0

    def _forget_offload(self) -> None:
        for tier in self.offload.values():
            tier.clear()
        self.offload = {}

    def clear(self) -> None:
        """Forget everything (an engine restart, an unrepaired gap; an ``AllBlocksCleared``
        forgets the GPU's blocks only, as vLLM's ``reset_prefix_cache`` clears only those)."""
        self._forget_stored()
        self._forget_offload()
        self.holders.unpend(list({*self._inflight, *self._released}), self.bit)
        self.overflowed = False
        self._ghosts = GhostRing(self.max_ghosts)
        self._inflight.clear()
        self._released.clear()

    def close(self) -> None:
        """The view is dropped (its replica left, or a new stream replaces it): its blocks leave
        ``holders`` and its slot is free again. What it stored is forgotten; requests still in
        flight end on a private map, and ``evicted_since`` answers on."""
        self._forget_stored()
        self._forget_offload()
        pending = list({*self._inflight, *self._released})
        self.holders.release(self.bit, [], pending)
        self.holders = EngineMap()
        self.bit = self.holders.slot()
        self.holders.pend(pending, self.bit)
