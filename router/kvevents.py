"""vLLM's KV cache events, decoded, and the picture of one replica's prefix cache they build.

vLLM publishes what its prefix cache stores and frees (``--kv-events-config``;
``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``, vLLM 0.32):

- a PUB socket sends multipart messages ``(topic, seq, payload)``: ``seq`` an 8-byte
  big-endian counter from 0 per engine process, ``payload`` a msgpack ``EventBatch``, an array
  ``[ts, events, data_parallel_rank]``;
- each event a tagged struct: a map ``{"type": "BlockStored", "block_hashes": [...], ...}`` in
  vLLM 0.32, an array ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name]`` in earlier releases (``array_like=True``); both are read;
- ``BlockStored``: the hashes of newly cached full blocks, their parent's hash (None at the
  start of a prompt), their token ids, the block size, LoRA, medium (``GPU``, ``CPU``) and, per
  block, ``extra_keys`` (the cache salt rides on the first block's);
- ``BlockRemoved``: hashes of blocks evicted (one event per evicted block);
- ``AllBlocksCleared``: ``reset_prefix_cache``;
- a ROUTER socket answers a replay request ``(empty frame, start seq)`` with every buffered
  batch from that sequence number, ``(empty, topic, seq, payload)`` each, then an end marker
  whose seq is -1 (the publisher keeps the last ``buffer_steps`` batches, 10,000 by default).

``EngineView`` keys what it learns by the gateway's own chained block hash of each block's
token ids (``router/blocks.py``), never vLLM's digest, which depends on the engine's hash
algorithm and seed; a map from the engine's hash to the gateway's serves removals.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from .blocks import BlockHash, extend_block_hashes

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "EventBatch", "decode_batch", "EngineView",
           "END_SEQ"]

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


_decoder = msgspec.msgpack.Decoder()
# field order of the array encoding (vLLM before the map encoding; the fields it then had)
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium")


def _unhashable_extras(extra_keys: Any) -> bool:
    """Whether any block's extra keys carry what the gateway's hashes leave out: multimodal
    inputs (``(mm_identifier, offset)`` pairs) or prompt-embeds digests (bytes). Two images behind
    the same placeholder tokens would otherwise share one gateway hash."""
    if not isinstance(extra_keys, list):
        return False
    return any(isinstance(k, (list, tuple, bytes)) for keys in extra_keys if isinstance(keys, (list, tuple))
               for k in keys)


def _salt(extra_keys: Any, lora_name: str | None) -> str | None:
    """The cache salt in the first block's extra keys: its string entries are the LoRA name
    (when set) then the salt; ``(mm_identifier, offset)`` pairs are lists
    (``kv_cache_utils.generate_block_hash_extra_keys``, ``to_event_extra_keys``)."""
    if not isinstance(extra_keys, list) or not extra_keys or not isinstance(extra_keys[0], (list, tuple)):
        return None
    strings = [k for k in extra_keys[0] if isinstance(k, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[0] if strings else None


_MAX_TOKEN = 1 << 63  # token ids are hashed as signed 64-bit integers (blocks.extend_block_hashes)


def _hashes(value: Any) -> list[EngineHash]:
    if not isinstance(value, list) or not all(isinstance(h, (bytes, int)) and not isinstance(h, bool) for h in value):
        raise TypeError("block hashes must be a list of bytes or integers")
    return value


def _parent(value: Any) -> EngineHash | None:
    if value is not None and (not isinstance(value, (bytes, int)) or isinstance(value, bool)):
        raise TypeError("a parent block hash must be bytes or an integer")
    return value


def _tokens(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int and -_MAX_TOKEN <= t < _MAX_TOKEN for t in value):
        raise TypeError("token ids must be a list of 64-bit integers")
    return value


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _event(raw: Any) -> Event | None:
    if isinstance(raw, (list, tuple)):  # array encoding: the tag first
        if not raw:
            return None
        tag, values = raw[0], raw[1:]
        fields = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(tag, ())
        raw = {"type": tag, **dict(zip(fields, values))}
    if not isinstance(raw, dict):
        return None
    tag = raw.get("type")
    if tag == "BlockStored":
        lora = _text(raw.get("lora_name"))
        size = raw["block_size"]
        if type(size) is not int or size < 1:
            raise TypeError("block_size must be a positive integer")
        group = raw.get("group_idx")
        extra = raw.get("extra_keys")
        return BlockStored(_hashes(raw["block_hashes"]), _parent(raw.get("parent_block_hash")),
                           _tokens(raw["token_ids"]), size, lora, _text(raw.get("medium")),
                           _salt(extra, lora), group if type(group) is int else None, _unhashable_extras(extra))
    if tag == "BlockRemoved":
        group = raw.get("group_idx")
        return BlockRemoved(_hashes(raw["block_hashes"]), _text(raw.get("medium")),
                            group if type(group) is int else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event type this gateway does not know: skipped


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload. Raises ValueError for bytes that are not an event batch; events of
    unknown types are skipped."""
    try:
        raw = _decoder.decode(payload)
        ts, events = float(raw[0]), raw[1]
        rank = raw[2] if len(raw) > 2 and type(raw[2]) is int else None
        decoded = [e for e in map(_event, events) if e is not None]
    except Exception as exc:  # anything a publisher can send: malformed, nested too deep, wrong types
        raise ValueError(f"not a KV event batch: {type(exc).__name__}: {exc}"[:300]) from None
    return EventBatch(ts, decoded, rank)


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
        self.max_blocks = max_blocks  # past this many engine hashes the events cannot be a real cache's
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
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            if event.medium not in (None, "GPU") or event.group_idx not in (None, 0):
                return
            for engine_hash in event.block_hashes:
                self._removed(engine_hash)
        elif isinstance(event, AllBlocksCleared):
            # vLLM queues the event when the cache is reset and publishes it after its next step
            # (``Scheduler.update_from_output``): the requests in flight then store their blocks
            # after it, so their tallies stay
            inflight, evicted = dict(self._inflight), dict(self._evicted)
            self.clear()
            self._inflight, self._evicted = inflight, evicted

    def _stored(self, event: BlockStored) -> None:
        if event.medium not in (None, "GPU") or event.group_idx not in (None, 0):
            return
        if event.block_size != self.block_size:
            self.foreign_block_size += 1
            return
        if event.opaque:
            self.opaque += len(event.block_hashes)
            return
        if len(event.token_ids) != len(event.block_hashes) * event.block_size:
            self.misshapen += 1  # vLLM leaves null and masked blocks out of the hashes, not the tokens
            return
        if event.parent_block_hash is None:
            ours: list[BlockHash] = []
            seed = self.seed(event.lora_name, event.cache_salt)
        else:
            parent = self._engine.get(event.parent_block_hash)
            if parent is None:
                self.orphans += len(event.block_hashes)
                return
            ours, seed = [], parent[0]
        extend_block_hashes(ours, event.token_ids, self.block_size, seed)
        engine, blocks, ghosts = self._engine, self._blocks, self._ghosts
        if len(engine) + len(ours) > self.max_blocks:
            self.overflowed = True  # EventStream marks the view stale
            return
        for engine_hash, h in zip(event.block_hashes, ours):
            entry = engine.get(engine_hash)
            if entry is None:
                engine[engine_hash] = [h, 1]
            else:
                entry[1] += 1
            blocks[h] = blocks.get(h, 0) + 1
            ghosts.pop(h, None)
            self._released.pop(h, None)
            self.stored += 1

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
