"""The engine's picture of a replica's cache as it was before ``cache/engine_map.py``: a dict entry
per block per replica (``EngineView`` at d1096be, unchanged but for its name). Kept as the
baseline that ``python -m bench choice`` measures memory against, in the same run, and as the
model that ``tests/cache/test_engine_map.py`` holds the compact view equal to; the gateway does
not use it. What follows is that module's description.


``EngineView`` keys what it learns by the gateway's own chained block hash of each block's
token ids (``prefix_router/cache/blocks.py``), never vLLM's digest, which depends on the engine's
hash algorithm and seed; a map from the engine's hash to the gateway's serves removals. The
events themselves are decoded in ``cache/events.py``; ``cache/stream.py`` feeds them in order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence

from prefix_router.cache.blocks import BlockHash, block_hashes
from prefix_router.cache.events import (AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, Event,
                                        read_extra_keys)

from .per_block import Holders

__all__ = ["PerBlockEngineView"]

class PerBlockEngineView:
    """What one replica's prefix cache holds, from its events, in the gateway's block hashes.

    ``seed(lora_name, cache_salt)`` gives the parent hash of a prompt's first block, as the
    gateway seeds the requests it hashes (``blocks.seed_hash``). Only blocks on the GPU (medium
    ``GPU`` or unset) and in KV cache group 0 count: the ones a request's prefill can hit.

    Counts are kept per engine hash: vLLM may cache one hash in two blocks (two requests
    computed it before either was cached) and removes each separately. Memory: one entry per
    block the engine holds, so at most its ``num_gpu_blocks`` entries (about 200 bytes each in
    CPython), plus ``max_ghosts`` removed hashes remembered for ``held_lately`` and as many blocks
    routed but not yet confirmed; events that would take it past ``max_blocks`` (set to twice the
    replica's capacity) are not a real cache's, and make the view ``overflowed``.

    With ``holders``, every block that starts or stops matching (stored, routed here and in flight,
    or lately released) is reported there under a slot of its own (``bit``), so the fleet is
    matched in one walk (``cache/holders.py``); ``close`` gives the slot back.
    """

    def __init__(self, block_size: int, seed: Callable[[str | None, str | None], BlockHash],
                 max_ghosts: int = 100_000, pending_s: float = 2.0, max_blocks: int = 1 << 22,
                 holders: Holders | None = None) -> None:
        self.holders = holders
        self.bit = holders.slot() if holders is not None else 0
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
        # a removal's stamp: removals between two routings share one (one int object, not one a
        # ghost), and a routing that follows a removal moves it on, so that ``note_routed``'s
        # answer (``_since``) is below every later removal's stamp and not below an earlier one's
        self._since, self._stamp, self._stamp_used = 0, 1, False
        self._engine: dict[EngineHash, list] = {}  # engine hash -> [gateway hash, count]
        self._blocks: dict[BlockHash, int] = {}  # gateway hash -> engine hashes holding it
        # the blocks removed lately, newest last, at most ``max_ghosts``, each with its last
        # removal's stamp (``_stamp``): for ``held_lately``, and for ``evicted_since``: a
        # request routed before a removal of a block it wants recomputes it, though predicted
        # held. Kept when the block is stored again and after the request ends: vLLM publishes a
        # step's events and its answers at once, so a removal may reach the gateway after the
        # answer, and the request itself stores the block again
        self._ghosts: OrderedDict[BlockHash, int] = OrderedDict()
        self.stored = 0  # blocks stored, ever
        self.orphans = 0  # stored blocks whose parent the view never saw (events lost, or an opaque parent)
        self.opaque = 0  # stored blocks with inputs the gateway does not hash (images, prompt embeds)
        self.misshapen = 0  # stored events whose token ids are not their blocks' (null or masked blocks)
        self.foreign_block_size = 0  # stored events in another block size than the gateway's

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` the engine holds (chained: stop at the first miss)."""
        blocks, inflight, released = self._blocks, self._inflight, self._released
        n = 0
        for h in hashes:
            if h not in blocks and h not in inflight and h not in released:
                break
            n += 1
        return n

    def note_routed(self, hashes: Sequence[BlockHash]) -> int:
        """Count a request's blocks as held from the moment it is sent until it ends. Returns
        the stamp of the removals so far, for ``evicted_since``."""
        inflight = self._inflight
        for h in hashes:
            inflight[h] = inflight.get(h, 0) + 1
        if self.holders is not None:
            for h in hashes:
                self.holders.add(h, self.bit)
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
        removed = self._ghosts
        if not removed:
            return ()
        return tuple(i for i, h in enumerate(hashes[:n]) if removed.get(h, -1) > since)

    def release_routed(self, hashes: Sequence[BlockHash], now: float, served: bool) -> None:
        """The request sent with ``note_routed`` ended (``now``: monotonic s). ``served``: the
        engine ran it, so its blocks are stored even if the events have not said so yet; they
        count for ``pending_s`` more. A failed request's blocks are not coming."""
        inflight, blocks, released = self._inflight, self._blocks, self._released
        for h in hashes:
            left = inflight.get(h, 0) - 1
            if left > 0:
                inflight[h] = left
                continue
            inflight.pop(h, None)
            if served and h not in blocks:
                released.pop(h, None)
                released[h] = now
                if self.holders is not None:  # in flight here before a clear() forgot it, it matches again
                    self.holders.add(h, self.bit)
            else:
                self._left(h)
        while released:
            h, t = next(iter(released.items()))
            if now - t < self.pending_s and len(released) <= self.max_ghosts:
                break
            del released[h]
            self._left(h)

    def _left(self, h: BlockHash) -> None:
        """``h`` may have stopped matching here: tell ``holders`` if it did."""
        if self.holders is not None and h not in self._blocks and h not in self._inflight and h not in self._released:
            self.holders.discard(h, self.bit)

    def _members(self) -> set[BlockHash]:
        """The blocks ``match`` counts: stored, in flight here, or lately released."""
        return set(self._blocks) | set(self._inflight) | set(self._released)

    def match_ever(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks held now or removed lately (``ShadowIndex.match_ever``'s meaning)."""
        n = 0
        for h in hashes:
            if h not in self._blocks and h not in self._ghosts:
                break
            n += 1
        return n

    def held_lately(self, block: BlockHash) -> bool:
        """Whether ``block`` is held now or was removed lately."""
        return block in self._blocks or block in self._ghosts

    def clear(self) -> None:
        """Forget everything (``AllBlocksCleared``, an engine restart, an unrepaired gap)."""
        if self.holders is not None:
            for h in self._members():
                self.holders.discard(h, self.bit)
        self.overflowed = False
        self._engine.clear()
        self._blocks.clear()
        self._ghosts.clear()
        self._inflight.clear()
        self._released.clear()


    def close(self) -> None:
        """The view is dropped (its replica left, or a new stream replaces it): its blocks leave
        ``holders`` and its slot is free again."""
        if self.holders is not None:
            self.holders.release(self.bit, self._members())
            self.holders = None

    def apply(self, event: Event) -> None:
        """Update the view with one event."""
        deque(self.apply_steps(event), maxlen=0)

    def apply_steps(self, event: Event, slice_blocks: int = 1 << 62) -> Iterator[int]:
        """Update the view with one event, yielding the blocks done after every ``slice_blocks``:
        an event loop runs between them (a message at the cap holds ~250,000 blocks)."""
        if isinstance(event, BlockStored):
            yield from self._stored(event, slice_blocks)
        elif isinstance(event, BlockRemoved):
            if event.medium not in (None, "GPU") or event.group_idx not in (None, 0):
                return
            for start in range(0, len(event.block_hashes), slice_blocks):
                for engine_hash in event.block_hashes[start:start + slice_blocks]:
                    self._removed(engine_hash)
                yield min(slice_blocks, len(event.block_hashes) - start)
        elif isinstance(event, AllBlocksCleared):
            # vLLM queues the event when the cache is reset and publishes it after its next step
            # (``Scheduler.update_from_output``): the requests in flight then store their blocks
            # after it, so their tallies stay
            inflight, ghosts = dict(self._inflight), self._ghosts
            self._ghosts = OrderedDict()  # kept as they are: removals before the reset still tell
            self.clear()
            self._inflight, self._ghosts = inflight, ghosts
            if self.holders is not None:
                for h in inflight:
                    self.holders.add(h, self.bit)

    def _stored(self, event: BlockStored, slice_blocks: int) -> Iterator[int]:
        if event.medium not in (None, "GPU") or event.group_idx not in (None, 0):
            return
        if event.block_size != self.block_size:
            self.foreign_block_size += 1
            return
        if len(event.token_ids) != len(event.block_hashes) * event.block_size:
            self.misshapen += 1  # vLLM leaves null and masked blocks out of the hashes, not the tokens
            return
        if event.extra_keys is not None:  # read only now: the events skipped above never need them
            read_extra_keys(event)
            yield 0
        if event.opaque:
            self.opaque += len(event.block_hashes)
            return
        if event.parent_block_hash is None:
            seed = self.seed(event.lora_name, event.cache_salt)
        else:
            parent = self._engine.get(event.parent_block_hash)
            if parent is None:
                self.orphans += len(event.block_hashes)
                return
            seed = parent[0]
        engine, blocks, size = self._engine, self._blocks, self.block_size
        for start in range(0, len(event.block_hashes), slice_blocks):
            engine_hashes = event.block_hashes[start:start + slice_blocks]
            ours = block_hashes(event.token_ids[start * size:(start + len(engine_hashes)) * size], size, seed)
            if max(len(engine), len(blocks)) + len(ours) > self.max_blocks:  # a repeated engine hash too
                self.overflowed = True  # EventStream marks the view stale
                return
            for engine_hash, h in zip(engine_hashes, ours):
                entry = engine.get(engine_hash)
                if entry is None:
                    engine[engine_hash] = [h, 1]
                else:
                    entry[1] += 1
                blocks[h] = blocks.get(h, 0) + 1
                if self.holders is not None:
                    self.holders.add(h, self.bit)
                self._released.pop(h, None)
                self.stored += 1
            seed = ours[-1]
            yield len(ours)

    def _removed(self, engine_hash: EngineHash) -> None:
        entry = self._engine.get(engine_hash)
        if entry is None:
            return
        h = entry[0]
        entry[1] -= 1
        if entry[1] <= 0:
            del self._engine[engine_hash]
        left = self._blocks.get(h, 0) - 1
        if left > 0:
            self._blocks[h] = left
            return
        self._blocks.pop(h, None)
        self._left(h)
        self.removals += 1
        ghosts = self._ghosts
        ghosts.pop(h, None)
        ghosts[h] = self._stamp  # after every request routed so far
        self._stamp_used = True
        if len(ghosts) > self.max_ghosts:
            ghosts.popitem(last=False)
