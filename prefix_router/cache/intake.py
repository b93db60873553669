"""How an ``EngineView`` takes its engine's KV events: one at a time, or a run of them at once.

vLLM publishes a ``BlockRemoved`` for every block it evicts and a ``BlockStored`` for every
request's newly full blocks, so a busy replica's message is mostly events of one or a few blocks.
The view's tables are numpy arrays (``cache/engine_map.py``, ``cache/u64map.py``), whose cost is
mostly per call: a run of consecutive removals, or of consecutive stores, is applied in one call
(``apply_run``), in the order the engine published it, with the answers a one-by-one application
gives (``tests/cache/test_intake.py``). ``cache/stream.py`` feeds the runs; an event loop runs
between them.
"""

from __future__ import annotations

import struct
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from itertools import compress

import xxhash

from prefix_router.cache.blocks import BlockHash, block_hashes
from prefix_router.cache.events import (AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, Event,
                                        read_extra_keys)
from prefix_router.cache.offload import MEDIA, OffloadTier

__all__ = ["EventIntake", "engine_keys", "runs"]

_U64 = (1 << 64) - 1
_UNREADABLE = (struct.error, ValueError, TypeError, OverflowError)  # an event's ids or hashes the view cannot hash
# an offload tier's blocks at most, per block of the view's ``max_blocks`` (twice the GPU's
# capacity): a CPU tier 16 times a GPU's memory (1.3 TB of host memory behind an 80 GB GPU) fits
# twice; past it the events are not a real cache's
OFFLOAD_BLOCKS_PER_BLOCK = 16


def engine_keys(hashes: Sequence[EngineHash]) -> list[int]:
    """vLLM's block hashes as 64-bit keys: an int as it is (in two's complement if negative), bytes
    (sha256 or xxh3-128 digests, where ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is off) by their
    xxh3-64 digest. Two hashes meeting in one key would take a 2**-64 chance, or a publisher that
    wants it, and confuse that publisher's own view only."""
    digest = xxhash.xxh3_64_intdigest
    return [h & _U64 if type(h) is int else digest(h) for h in hashes]


def runs(events: Sequence[Event], slice_blocks: int) -> Iterator[list[Event]]:
    """``events`` as runs of one kind each (removals, or stores), of at most ``slice_blocks``
    blocks unless one event is longer; an ``AllBlocksCleared`` alone.

    Within a stretch of events whose removals name no block that its stores name or chain onto,
    the removals go first as one run, then the stores as one: vLLM evicts cached blocks no request
    uses to make room for the ones it stores (``BlockPool.get_new_blocks``, then
    ``cache_full_blocks``), so a step's events alternate between the two kinds, a request at a
    time, but rarely meet. Where they meet the stretch ends, so the view ends where the events one
    at a time leave it (``tests/cache/test_intake.py``)."""
    removals: list[Event] = []
    stores: list[Event] = []
    removed: set[int] = set()  # engine keys the stretch removes
    touched: set[int] = set()  # engine keys the stretch stores, or chains its stores onto
    size = 0
    for event in events:
        if isinstance(event, AllBlocksCleared):
            yield from (run for run in (removals, stores) if run)
            yield [event]
            removals, stores, removed, touched, size = [], [], set(), set(), 0
            continue
        n = len(event.block_hashes)
        if n > slice_blocks:  # a long event alone: the view slices it (its keys are not even read here)
            yield from (run for run in (removals, stores) if run)
            yield [event]
            removals, stores, removed, touched, size = [], [], set(), set(), 0
            continue
        keys = set(engine_keys(event.block_hashes))
        if isinstance(event, BlockStored) and event.parent_block_hash is not None:
            keys.add(engine_keys([event.parent_block_hash])[0])
        meets = not keys.isdisjoint(touched if isinstance(event, BlockRemoved) else removed)
        if (removals or stores) and (meets or size + n > slice_blocks):
            yield from (run for run in (removals, stores) if run)
            removals, stores, removed, touched, size = [], [], set(), set(), 0
        if isinstance(event, BlockRemoved):
            removals.append(event)
            removed |= keys
        else:
            stores.append(event)
            touched |= keys
        size += n
    yield from (run for run in (removals, stores) if run)


class EventIntake:
    """``EngineView``'s event methods; the state they change is the view's (``cache/engine_view.py``)."""

    def apply(self, event: Event) -> None:
        """Update the view with one event."""
        deque(self.apply_steps(event), maxlen=0)

    def apply_run(self, run: list[Event], slice_blocks: int = 1 << 62) -> Iterator[int]:
        """Update the view with a run of ``runs``, yielding the blocks done after each step. An
        event of the run that cannot be read (a token id out of range) counts in ``bad_events``
        and the others apply."""
        if len(run) == 1 or isinstance(run[0], AllBlocksCleared):
            for event in run:
                try:
                    yield from self.apply_steps(event, slice_blocks)
                except _UNREADABLE:
                    self.bad_events += 1
        else:
            offload = [e for e in run if e.medium not in (None, "GPU")]
            if offload:
                run = [e for e in run if e.medium in (None, "GPU")]
            done = 0
            if run and isinstance(run[0], BlockRemoved):
                keys = engine_keys([h for e in run if self._on_gpu(e) for h in e.block_hashes])
                self._removed(keys)
                done = len(keys)
            elif run:
                done = self._stored_run(run)  # the GPU's first: an offloaded chunk's parent may be among them
            self._offload_run(offload)
            yield done + len(offload)

    def _offload_run(self, events: list[BlockStored | BlockRemoved]) -> None:
        """A run's offload events: each stored chunk once its parent is known (vLLM announces a
        tier's chunks in any order, each naming its parent: ``OffloadingEventsTracker``), in one
        pass, the chunks waiting on a parent indexed by it; those whose parent never comes are
        orphans."""
        waiting: dict[int, list[BlockStored]] = {}
        ready = []
        for event in events:
            try:
                if isinstance(event, BlockStored) and event.parent_block_hash is not None and event.medium in MEDIA:
                    parent = engine_keys([event.parent_block_hash])[0]
                    if self._parent_name(parent) is None:
                        waiting.setdefault(parent, []).append(event)
                        continue
                ready.append(event)
            except _UNREADABLE:
                self.bad_events += 1
        while ready:
            event = ready.pop()
            try:
                self._offload(event)
            except _UNREADABLE:
                self.bad_events += 1
                continue
            if waiting and isinstance(event, BlockStored):
                for key in engine_keys(event.block_hashes):
                    ready += waiting.pop(key, ())
        for orphans in waiting.values():
            for event in orphans:
                self._offload(event)  # counted as orphans

    def apply_steps(self, event: Event, slice_blocks: int = 1 << 62) -> Iterator[int]:
        """Update the view with one event, yielding the blocks done after every ``slice_blocks``:
        an event loop runs between them (a message at the cap holds ~250,000 blocks)."""
        if isinstance(event, (BlockStored, BlockRemoved)) and event.medium not in (None, "GPU"):
            self._offload(event)
            yield len(event.block_hashes)
        elif isinstance(event, BlockStored):
            yield from self._stored(event, slice_blocks)
        elif isinstance(event, BlockRemoved):
            if not self._on_gpu(event):
                return
            for start in range(0, len(event.block_hashes), slice_blocks):
                self._removed(engine_keys(event.block_hashes[start:start + slice_blocks]))
                yield min(slice_blocks, len(event.block_hashes) - start)
        elif isinstance(event, AllBlocksCleared):
            # vLLM queues the event when the cache is reset and publishes it after its next step
            # (``Scheduler.update_from_output``): the requests in flight then store their blocks
            # after it, so their tallies stay, and their blocks match as pending; removals before
            # the reset still tell (the ghosts stay)
            inflight = self._inflight
            still = [h for h in self.blocks() if h in inflight] if inflight else []
            self._forget_stored()
            self.holders.unpend([h for h in self._released if h not in inflight], self.bit)
            self._released.clear()
            self.holders.pend(still, self.bit)
            self.overflowed = False

    def _offload(self, event: BlockStored | BlockRemoved) -> None:
        """An event of an offload tier (``cache/offload.py``): medium ``CPU`` or ``STORAGE``, KV
        cache group 0; others are left out. A stored event is hashed from its tokens under its
        parent, found in this tier, on the GPU or in another tier (vLLM names a chunk's parent by
        the engine hash of the block before it, wherever that block is now); one past
        ``OFFLOAD_BLOCKS_PER_BLOCK`` x ``max_blocks`` blocks, or engine keys, makes the view
        ``overflowed``; one whose parent is not known is an orphan."""
        if event.medium not in MEDIA or event.group_idx not in (None, 0):
            return
        tier = self.offload.get(event.medium)
        if tier is None:
            tier = self.offload[event.medium] = OffloadTier(self.holders.tier(event.medium), self.bit)
        if isinstance(event, BlockRemoved):
            tier.remove(engine_keys(event.block_hashes))
            return
        if event.block_size != self.block_size or len(event.token_ids) != len(event.block_hashes) * event.block_size:
            tier.opaque += len(event.block_hashes)  # a placeholder (no self-describing events), or not our blocks
            return
        if event.extra_keys is not None:
            read_extra_keys(event)
        if event.opaque:
            tier.opaque += len(event.block_hashes)
            return
        if event.parent_block_hash is None:
            seed = self.seed(event.lora_name, event.cache_salt)
        else:
            seed = self._parent_name(engine_keys([event.parent_block_hash])[0])
            if seed is None:
                self.orphans += len(event.block_hashes)
                return
        if max(tier.held, tier.keys) + len(event.block_hashes) > OFFLOAD_BLOCKS_PER_BLOCK * self.max_blocks:
            self.overflowed = True
            return
        tier.store(engine_keys(event.block_hashes), block_hashes(event.token_ids, self.block_size, seed))

    def _parent_name(self, key: int) -> BlockHash | None:
        """The gateway hash of engine key ``key`` on the GPU or any offload tier, or None."""
        for names in (self._engine, *self.offload.values()):
            found, named = names.get([key]) if names is self._engine else names.name_of([key])
            if found[0]:
                return named[0]
        return None

    @staticmethod
    def _on_gpu(event: BlockStored | BlockRemoved) -> bool:
        """Only blocks on the GPU (medium ``GPU`` or unset) and in KV cache group 0 count: the ones
        a request's prefill can hit."""
        return event.medium in (None, "GPU") and event.group_idx in (None, 0)

    def _admit(self, event: BlockStored) -> bool:
        """Whether the view can store ``event``'s blocks by their tokens; counts why not."""
        if not self._on_gpu(event):
            return False
        if event.block_size != self.block_size:
            self.foreign_block_size += 1
            return False
        if len(event.token_ids) != len(event.block_hashes) * event.block_size:
            self.misshapen += 1  # vLLM leaves null and masked blocks out of the hashes, not the tokens
            return False
        if event.extra_keys is not None:  # read only now: the events skipped above never need them
            read_extra_keys(event)
        if event.opaque:
            self.opaque += len(event.block_hashes)
            return False
        return True

    def _stored(self, event: BlockStored, slice_blocks: int) -> Iterator[int]:
        if not self._admit(event):
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
            if not self._store_checked(keys, ours):
                return
            seed = ours[-1]
            yield len(ours)

    def _stored_run(self, run: list[BlockStored]) -> int:
        """A run of stores at once: each event's parent is the block an earlier event of the run
        stored, or one the view held before it (looked up for all of them in one call)."""
        run = [e for e in run if self._admit(e)]
        parents = engine_keys([e.parent_block_hash for e in run if e.parent_block_hash is not None])
        found, named = self._engine.get(parents)
        before = {k: h for k, h, f in zip(parents, named, found) if f}  # a key held keeps its first name
        earlier: dict[int, BlockHash] = {}
        keys: list[int] = []
        ours: list[BlockHash] = []
        for event in run:
            try:
                if event.parent_block_hash is None:
                    seed = self.seed(event.lora_name, event.cache_salt)
                else:
                    parent = engine_keys([event.parent_block_hash])[0]
                    seed = before.get(parent, earlier.get(parent))
                    if seed is None:
                        self.orphans += len(event.block_hashes)
                        continue
                event_keys = engine_keys(event.block_hashes)
                event_ours = block_hashes(event.token_ids, self.block_size, seed)
            except _UNREADABLE:  # a token id out of range: this event only
                self.bad_events += 1
                continue
            for key, h in zip(event_keys, event_ours):
                earlier.setdefault(key, h)
            keys += event_keys
            ours += event_ours
        self._store_checked(keys, ours)
        return len(ours)

    def _store_checked(self, keys: list[int], ours: list[BlockHash]) -> bool:
        """Store unless it takes the view past ``max_blocks`` (then ``overflowed``, False)."""
        if max(self._engine_held, self._held) + len(ours) > self.max_blocks:  # a repeated engine hash too
            self.overflowed = True  # EventStream marks the view stale
            return False
        self._store(keys, ours)
        released = self._released
        if released:
            self._unpend([h for h in ours if released.pop(h, None) is not None])
        self.stored += len(ours)
        return True

    def _store(self, keys: list[int], ours: list[BlockHash]) -> None:
        """The engine stored blocks ``ours`` under engine keys ``keys``, in order. A key given
        again (a hash cached in two blocks, across a run's events or by a publisher that repeats
        one) keeps the block it named first; the later ones count as copies of it."""
        repeats = None
        if len(set(keys)) < len(keys):
            first: dict[int, BlockHash] = {}
            for key, h in zip(keys, ours):
                first.setdefault(key, h)
            repeats = Counter(keys)
            keys, ours = list(first), list(first.values())
        found, known = self._engine.get(keys)
        engine_extra, block_extra = self._engine_extra, self._block_extra
        if repeats is not None:
            for (key, h), held, f in zip(zip(keys, ours), known, found):
                again = repeats[key] - 1
                if again:
                    name = held if f else h
                    engine_extra[key] = engine_extra.get(key, 0) + again
                    block_extra[name] = block_extra.get(name, 0) + again
        if any(found):  # a hash the engine holds already: one more block of it
            for key, h, f in zip(keys, known, found):
                if f:
                    engine_extra[key] = engine_extra.get(key, 0) + 1
                    block_extra[h] = block_extra.get(h, 0) + 1
            keys = [k for k, f in zip(keys, found) if not f]
            ours = [h for h, f in zip(ours, found) if not f]
        self._engine.put(keys, ours)
        self._engine_held += len(keys)
        before = self.holders.store(ours, self.bit)
        new: set[BlockHash] = set()
        for h, held in zip(ours, before):
            if held or h in new:  # another engine hash names this block too
                block_extra[h] = block_extra.get(h, 0) + 1
            else:
                new.add(h)
        self._held += len(new)

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
            inflight, released = self._inflight, self._released
            if inflight or released:  # still wanted here: they match until the request ends
                self.holders.pend([h for h in gone if h in inflight or h in released], self.bit)
            self._ghosts.note(gone, self._stamp)  # after every request routed so far
            self._stamp_used = True
