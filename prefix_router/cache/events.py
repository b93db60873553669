"""vLLM's KV cache events, decoded, and the picture of one replica's prefix cache they build.

vLLM publishes what its prefix cache stores and frees (``--kv-events-config``;
``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``, vLLM 0.32):

- a PUB socket sends multipart messages ``(topic, seq, payload)``: ``seq`` an 8-byte
  big-endian counter from 0 per engine process, ``payload`` a msgpack ``EventBatch``, an array
  ``[ts, events, data_parallel_rank]``;
- each event a tagged struct: a map ``{"type": "BlockStored", "block_hashes": [...], ...}`` in
  vLLM 0.32, an array ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name]`` in earlier releases (``array_like=True``); both are read, typed:
  a payload costs a bounded multiple of its bytes (``tests/test_kv_events_hostile.py``);
- ``BlockStored``: the hashes of newly cached full blocks, their parent's hash (None at the
  start of a prompt), their token ids, the block size, LoRA, medium (``GPU``, ``CPU``) and, per
  block, ``extra_keys`` (the cache salt rides on the first block's);
- ``BlockRemoved``: hashes of blocks evicted (one event per evicted block); ``AllBlocksCleared``;
- a ROUTER socket answers a replay request ``(empty frame, start seq)`` with every buffered
  batch from that sequence number, ``(empty, topic, seq, payload)`` each, then an end marker
  whose seq is -1 (the publisher keeps the last ``buffer_steps`` batches, 10,000 by default).

``EngineView`` keys what it learns by the gateway's own chained block hash of each block's
token ids (``prefix_router/cache/blocks.py``), never vLLM's digest, which depends on the engine's hash
algorithm and seed; a map from the engine's hash to the gateway's serves removals.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated

import msgspec

from prefix_router.cache.blocks import BlockHash, block_hashes

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "EventBatch", "decode_batch", "decode_events",
           "to_event", "read_extra_keys", "EngineView", "END_SEQ"]

END_SEQ = -1  # the replay stream's end marker (``ZmqEventPublisher.END_SEQ``)
EngineHash = bytes | int  # vLLM's ``ExternalBlockHash``


@dataclasses.dataclass(slots=True)
class BlockStored:
    """Full blocks newly cached by the engine; ``token_ids`` covers every one of them."""

    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    cache_salt: str | None = None  # from the first block's extra keys, for a prompt's first blocks
    group_idx: int | None = None
    opaque: bool = False  # extra keys the gateway does not hash (images, prompt embeds): not matchable
    # the extra keys, msgpack, unread: EngineView reads them (read_extra_keys) only if it can store the blocks
    extra_keys: bytes | msgspec.Raw | None = None


@dataclasses.dataclass(slots=True)
class BlockRemoved:
    """Blocks the engine evicted."""

    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclasses.dataclass(slots=True)
class AllBlocksCleared:
    """The engine's prefix cache was reset."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclasses.dataclass(slots=True)
class EventBatch:
    """One published message: a timestamp (engine's wall clock, s), its events, its DP rank."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# The wire types: typed decoding (msgspec, in C) fails a payload of another shape at its first wrong
# byte instead of building millions of Python objects, and skips unbuilt fields no type here names.
# Token ids are hashed as signed 64-bit ints (blocks.extend_block_hashes). Engine hashes, kept one a
# block, are 32 bytes (sha256), 16 (xxh3_128) or an int (vllm/utils/hashing.py): none longer.
_Token = Annotated[int, msgspec.Meta(le=(1 << 63) - 1)]
_Size = Annotated[int, msgspec.Meta(ge=1)]
_Hash = Annotated[bytes, msgspec.Meta(max_length=64)] | int


class _Event(msgspec.Struct, gc=False):
    """A map-encoded event (vLLM 0.32): every type's fields, so that an unknown type decodes."""

    type: str
    block_hashes: list[_Hash] | None = None
    parent_block_hash: _Hash | None = None
    token_ids: list[_Token] | None = None
    block_size: _Size | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = msgspec.Raw()
    group_idx: int | None = None


class _Tagged(msgspec.Struct, array_like=True, tag=True, gc=False):
    """An array-encoded event (earlier releases): the tag, then the fields they had."""

    extra_keys, group_idx = msgspec.Raw(), None  # class attributes: fields the releases did not have


class _StoredArray(_Tagged, tag="BlockStored"):
    type = "BlockStored"
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[_Token]
    block_size: _Size
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _RemovedArray(_Tagged, tag="BlockRemoved"):
    type = "BlockRemoved"
    block_hashes: list[_Hash]
    medium: str | None = None


class _ClearedArray(_Tagged, tag="AllBlocksCleared"):
    type = "AllBlocksCleared"


# ``[ts, events, data_parallel_rank]``: map events (vLLM 0.32), or array events (earlier releases)
_DECODERS = tuple(msgspec.msgpack.Decoder(msgspec.defstruct(
    "Batch", [("ts", float), ("events", list[e]), ("data_parallel_rank", int | None, None)], array_like=True, gc=False))
    for e in (_Event, _StoredArray | _RemovedArray | _ClearedArray))
# the first block's extra keys (the others skipped unbuilt): LoRA name, (mm_identifier, offset)s, salt
_FIRST_KEYS = msgspec.msgpack.Decoder(msgspec.defstruct(
    "FirstKeys", [("keys", tuple[str | tuple[str | int, ...], ...] | None, None)], array_like=True, gc=False))
# every block's keys, if strings (LoRA name, salt), as structs the GC skips: a pair or digest is in the first 3
_HASHABLE_KEYS = msgspec.msgpack.Decoder(list[msgspec.defstruct(
    "Keys", [("lora", str, ""), ("salt", str, ""), ("other", str, "")], array_like=True, gc=False) | None])


def read_extra_keys(event: BlockStored) -> None:
    """Read ``event``'s ``extra_keys`` (msgpack: nil, or per block the LoRA name, ``(mm_identifier,
    offset)`` pairs, the salt, prompt-embeds digests: ``kv_cache_utils.generate_block_hash_extra_keys``)
    into ``cache_salt`` and ``opaque``: keys the gateway's hashes leave out (an image, embeds: images
    behind the same placeholders would share a hash), or a shape vLLM never sends, such as more
    entries than blocks (not read past the array's header)."""
    raw, event.extra_keys = event.extra_keys, None
    head = bytes(memoryview(raw)[:5]) if raw else b"\xc0"
    if head[0] == 0xC0:
        return
    count = {0xDC: head[1:3], 0xDD: head[1:5]}.get(head[0])  # the count of an array 16, array 32
    entries = head[0] & 0x0F if 0x90 <= head[0] <= 0x9F else None if count is None else int.from_bytes(count, "big")
    if entries is None or entries > len(event.block_hashes):
        event.opaque = True
        return
    first: list[str] = []
    try:
        first = [k for k in _FIRST_KEYS.decode(raw).keys or () if isinstance(k, str)]
        _HASHABLE_KEYS.decode(raw)
    except msgspec.ValidationError:
        event.opaque = True
    if event.lora_name is not None and first and first[0] == event.lora_name:
        first = first[1:]
    event.cache_salt = first[0] if first else None


def decode_events(payload: bytes) -> tuple[float, list, int | None]:
    """(timestamp, wire events for ``to_event``, DP rank) of a payload. Raises ValueError for
    bytes that are not an event batch in either encoding."""
    for decoder in _DECODERS:  # a batch is one release's: all maps (vLLM 0.32), or all arrays
        try:
            batch = decoder.decode(payload)
            return batch.ts, batch.events, batch.data_parallel_rank
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            error = exc
    raise ValueError(f"not a KV event batch: {type(error).__name__}: {error}"[:300])


def to_event(raw: _Event | _Tagged) -> Event | None:
    """One wire event as the gateway's, extra keys unread; None for a type it does not know.
    Raises ValueError for a known type without its fields."""
    if raw.type == "BlockStored":
        if None in (raw.block_hashes, raw.token_ids, raw.block_size):
            raise ValueError("a BlockStored without its block hashes, token ids or block size")
        return BlockStored(raw.block_hashes, raw.parent_block_hash, raw.token_ids, raw.block_size, raw.lora_name,
                           raw.medium, group_idx=raw.group_idx, extra_keys=raw.extra_keys or None)
    if raw.type == "BlockRemoved":
        if raw.block_hashes is None:
            raise ValueError("a BlockRemoved without its block hashes")
        return BlockRemoved(raw.block_hashes, raw.medium, raw.group_idx)
    return AllBlocksCleared() if raw.type == "AllBlocksCleared" else None


def decode_batch(payload: bytes) -> EventBatch:
    """A payload decoded, extra keys read. Raises ValueError for bytes that are not an event
    batch, or a known event without its fields; events of unknown types are skipped."""
    ts, raw_events, rank = decode_events(payload)
    events = [e for e in map(to_event, raw_events) if e is not None]
    for e in (e for e in events if isinstance(e, BlockStored)):
        read_extra_keys(e)
    return EventBatch(ts, events, rank)


class EngineView:
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
    """

    def __init__(self, block_size: int, seed: Callable[[str | None, str | None], BlockHash],
                 max_ghosts: int = 100_000, pending_s: float = 2.0, max_blocks: int = 1 << 22) -> None:
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
        # routed blocks the engine evicted while a request that wants them was in flight (the
        # removal's number in ``removals``): its prefill recomputes them, though predicted held
        self._evicted: dict[BlockHash, int] = {}
        self.removals = 0  # blocks removed, ever
        self._engine: dict[EngineHash, list] = {}  # engine hash -> [gateway hash, count]
        self._blocks: dict[BlockHash, int] = {}  # gateway hash -> engine hashes holding it
        self._ghosts: OrderedDict[BlockHash, None] = OrderedDict()
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
        the number of removals so far, for ``evicted_since``."""
        inflight = self._inflight
        for h in hashes:
            inflight[h] = inflight.get(h, 0) + 1
        return self.removals

    def evicted_since(self, hashes: Sequence[BlockHash], n: int, since: int) -> tuple[int, ...]:
        """Which of the leading ``n`` blocks of a request in flight (their indices, ascending) the
        engine evicted after removal number ``since`` (``note_routed``'s answer). vLLM evicts free
        blocks to make room for other requests' (``kv_cache_utils.FreeKVCacheBlockQueue``, tail
        blocks first): one queued behind them finds less of its prefix than it was routed for. A
        block evicted may be stored again before the request is scheduled (another request
        recomputed it), or be evicted after (vLLM preempts a running request and frees its
        blocks), so the engine's hit stops at one of these, not always the first."""
        evicted = self._evicted
        if not evicted:
            return ()
        return tuple(i for i, h in enumerate(hashes[:n]) if evicted.get(h, -1) > since)

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
            self._evicted.pop(h, None)
            if served and h not in blocks:
                released.pop(h, None)
                released[h] = now
        while released:
            h, t = next(iter(released.items()))
            if now - t < self.pending_s and len(released) <= self.max_ghosts:
                break
            del released[h]

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
        self.overflowed = False
        self._engine.clear()
        self._blocks.clear()
        self._ghosts.clear()
        self._inflight.clear()
        self._released.clear()
        self._evicted.clear()

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
            inflight, evicted = dict(self._inflight), dict(self._evicted)
            self.clear()
            self._inflight, self._evicted = inflight, evicted

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
        engine, blocks, ghosts, size = self._engine, self._blocks, self._ghosts, self.block_size
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
                ghosts.pop(h, None)
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
        self.removals += 1
        if h in self._inflight:
            self._evicted[h] = self.removals
        self._ghosts[h] = None
        if len(self._ghosts) > self.max_ghosts:
            self._ghosts.popitem(last=False)
