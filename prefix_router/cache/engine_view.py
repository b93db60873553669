"""The engine's own picture of one replica's prefix cache, built from its KV events.

``EngineView`` keys what it learns by the gateway's own chained block hash of each block's
token ids (``prefix_router/cache/blocks.py``), never vLLM's digest, which depends on the engine's
hash algorithm and seed; a map from the engine's hash to the gateway's serves removals. The
events themselves are decoded in ``cache/events.py``; ``cache/stream.py`` feeds them in order.
Which blocks each replica holds is kept for the whole fleet in one ``EngineMap``
(``cache/engine_map.py``), so that a prompt is matched against every replica in one walk.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from itertools import compress

import numpy as np
import xxhash

from prefix_router.cache.blocks import BlockHash, block_hashes
from prefix_router.cache.engine_map import EngineMap
from prefix_router.cache.events import (AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, Event,
                                        read_extra_keys)
from prefix_router.cache.ghosts import GhostRing
from prefix_router.cache.u64map import U64Map

__all__ = ["EngineView", "engine_keys"]

_U64 = (1 << 64) - 1


def engine_keys(hashes: Sequence[EngineHash]) -> list[int]:
    """vLLM's block hashes as 64-bit keys: an int as it is (in two's complement if negative), bytes
    (sha256 or xxh3-128 digests, where ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is off) by their
    xxh3-64 digest. Two hashes meeting in one key would take a 2**-64 chance, or a publisher that
    wants it, and confuse that publisher's own view only."""
    digest = xxhash.xxh3_64_intdigest
    return [h & _U64 if type(h) is int else digest(h) for h in hashes]


class EngineView:
    """What one replica's prefix cache holds, from its events, in the gateway's block hashes.

    ``seed(lora_name, cache_salt)`` gives the parent hash of a prompt's first block, as the
    gateway seeds the requests it hashes (``blocks.seed_hash``). Only blocks on the GPU (medium
    ``GPU`` or unset) and in KV cache group 0 count: the ones a request's prefill can hit.

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
        self.holders.pend(hashes, self.bit)
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
        self.holders.unpend([h for h in hashes if h not in inflight and h not in released], self.bit)

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

    def clear(self) -> None:
        """Forget everything (``AllBlocksCleared``, an engine restart, an unrepaired gap)."""
        self._forget_stored()
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
        pending = list({*self._inflight, *self._released})
        self.holders.release(self.bit, [], pending)
        self.holders = EngineMap()
        self.bit = self.holders.slot()
        self.holders.pend(pending, self.bit)

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
                self._removed(engine_keys(event.block_hashes[start:start + slice_blocks]))
                yield min(slice_blocks, len(event.block_hashes) - start)
        elif isinstance(event, AllBlocksCleared):
            # vLLM queues the event when the cache is reset and publishes it after its next step
            # (``Scheduler.update_from_output``): the requests in flight then store their blocks
            # after it, so their tallies stay
            inflight, ghosts = dict(self._inflight), self._ghosts
            self._ghosts = GhostRing(0)  # kept as they are: removals before the reset still tell
            self.clear()
            self._inflight, self._ghosts = inflight, ghosts
            self.holders.pend(list(inflight), self.bit)

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
            found, parent = self._engine.get(engine_keys([event.parent_block_hash]))
            if not found[0]:
                self.orphans += len(event.block_hashes)
                return
            seed = parent[0]
        size = self.block_size
        for start in range(0, len(event.block_hashes), slice_blocks):
            keys = engine_keys(event.block_hashes[start:start + slice_blocks])
            ours = block_hashes(event.token_ids[start * size:(start + len(keys)) * size], size, seed)
            if max(self._engine_held, self._held) + len(ours) > self.max_blocks:  # a repeated engine hash too
                self.overflowed = True  # EventStream marks the view stale
                return
            if len(set(keys)) == len(keys):
                self._store(keys, ours)
            else:  # one hash twice in one event: never in vLLM's chains, so one at a time
                for key, h in zip(keys, ours):
                    self._store([key], [h])
            released = self._released
            if released:
                self._unpend([h for h in ours if released.pop(h, None) is not None])
            self.stored += len(ours)
            seed = ours[-1]
            yield len(ours)

    def _store(self, keys: list[int], ours: list[BlockHash]) -> None:
        """The engine stored blocks ``ours`` under engine keys ``keys`` (distinct)."""
        found, known = self._engine.get(keys)
        if any(found):  # a hash the engine holds already: one more block of it
            engine_extra, block_extra = self._engine_extra, self._block_extra
            for key, h, f in zip(keys, known, found):
                if f:
                    engine_extra[key] = engine_extra.get(key, 0) + 1
                    block_extra[h] = block_extra.get(h, 0) + 1
            keys = [k for k, f in zip(keys, found) if not f]
            ours = [h for h, f in zip(ours, found) if not f]
        self._engine.put(keys, ours)
        self._engine_held += len(keys)
        before = self.holders.store(ours, self.bit)
        for h, held in zip(ours, before):
            if held:  # another engine hash names this block too
                self._block_extra[h] = self._block_extra.get(h, 0) + 1
            else:
                self._held += 1

    def _removed(self, keys: list[int]) -> None:
        """The engine removed the blocks of engine keys ``keys``, in order."""
        found, known = self._engine.get(keys)
        engine_extra, block_extra = self._engine_extra, self._block_extra
        if not engine_extra and not block_extra and len(set(keys)) == len(keys):  # no copies: the common case
            self._drop(list(compress(keys, found)), list(compress(known, found)))
            return
        dropped: set[int] = set()
        gone: list[BlockHash] = []
        for key, h, f in zip(keys, known, found):
            if not f or key in dropped:
                continue
            if key in engine_extra:
                engine_extra[key] -= 1
                if not engine_extra[key]:
                    del engine_extra[key]
            else:
                dropped.add(key)
            if h in block_extra:
                block_extra[h] -= 1
                if not block_extra[h]:
                    del block_extra[h]
                continue
            gone.append(h)
        self._drop(list(dropped), gone)

    def _drop(self, keys: list[int], gone: list[BlockHash]) -> None:
        """Engine keys ``keys`` are no longer held, and blocks ``gone`` left the engine."""
        if keys:
            self._engine.delete(keys)
            self._engine_held -= len(keys)
        if gone:
            self._held -= len(gone)
            self.removals += len(gone)
            self.holders.unstore(gone, self.bit)
            self._ghosts.note(gone, self._stamp)  # after every request routed so far
            self._stamp_used = True
