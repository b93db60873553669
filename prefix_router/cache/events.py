"""vLLM's KV cache events, decoded, and the picture of one replica's prefix cache they build.

vLLM publishes what its prefix cache stores and frees (``--kv-events-config``;
``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``, vLLM 0.32):

- a PUB socket sends multipart messages ``(topic, seq, payload)``: ``seq`` an 8-byte
  big-endian counter from 0 per engine process, ``payload`` a msgpack ``EventBatch``, an array
  ``[ts, events, data_parallel_rank]``;
- each event a tagged struct: a map ``{"type": "BlockStored", "block_hashes": [...], ...}`` in
  vLLM 0.32, an array ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name]`` in earlier releases (``array_like=True``); both are read, typed:
  a payload costs a bounded multiple of its bytes (``tests/cache/test_stream_hostile.py``);
- ``BlockStored``: the hashes of newly cached full blocks, their parent's hash (None at the
  start of a prompt), their token ids, the block size, LoRA, medium (``GPU``, ``CPU``) and, per
  block, ``extra_keys`` (the cache salt rides on the first block's);
- ``BlockRemoved``: hashes of blocks evicted (one event per evicted block); ``AllBlocksCleared``;
- a ROUTER socket answers a replay request ``(empty frame, start seq)`` with every buffered
  batch from that sequence number, ``(empty, topic, seq, payload)`` each, then an end marker
  whose seq is -1 (the publisher keeps the last ``buffer_steps`` batches, 10,000 by default).

The picture these events build of one replica's cache is ``cache/engine_view.py``'s
``EngineView``.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import msgspec

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "EventBatch", "decode_batch", "decode_events",
           "to_event", "read_extra_keys", "END_SEQ", "EngineHash", "Event"]

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
# 0 too: vLLM's offloading connector announces a chunk it cannot describe with block size 0 and no
# tokens (``OffloadingEventsTracker._placeholder_stored``), and the batch around it must still decode
_Size = Annotated[int, msgspec.Meta(ge=0)]
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
