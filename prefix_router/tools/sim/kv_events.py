"""The simulator's KV event publisher: vLLM's wire format, replay socket included.

Mirrors ``vllm/distributed/kv_events.py`` (vLLM 0.32): the event structs below have vLLM's
names, fields and msgspec options (tagged maps for events, an array for the batch), and
``EventPublisher`` is ``ZmqEventPublisher``: a PUB socket sends ``(topic, seq, payload)`` with
``seq`` an 8-byte big-endian counter from 0, and a ROUTER socket answers ``(empty, start seq)``
with every buffered batch from there, ``(empty, topic, seq, payload)`` each, then an end marker
with seq -1. The engine publishes one batch per step that stored or removed blocks
(``EngineCore.step`` -> ``Scheduler.update_from_output`` -> ``take_events``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "EventPublisher", "encode_batch"]

_END_SEQ = (-1).to_bytes(8, "big", signed=True)


class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVCacheEvent):
    """Full blocks newly cached: their hashes, their parent's (None at a prompt's start), their
    token ids, the block size, LoRA, medium, and per block the extra keys (the cache salt)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_KVCacheEvent):
    """Blocks evicted from the prefix cache."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_KVCacheEvent):
    """The prefix cache was reset."""


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(events: list, ts: float, data_parallel_rank: int | None = 0) -> bytes:
    """One step's events as the payload vLLM's ``ZmqEventPublisher`` sends (``KVEventBatch``,
    msgpack, an array of ts, events, rank)."""
    return _ENCODER.encode(_EventBatch(ts, events, data_parallel_rank))


class EventPublisher:
    """PUB on ``endpoint`` and ROUTER on ``replay_endpoint`` (both bound: ``tcp://*:5557``),
    keeping the last ``buffer_steps`` batches for replay. Start ``serve_replay`` as a task."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, data_parallel_rank: int = 0) -> None:
        self._context = zmq.asyncio.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(100_000)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0

    @property
    def endpoints(self) -> tuple[str, str | None]:
        """The bound addresses (a port 0 resolved)."""
        pub = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        return pub, replay

    def publish(self, events: list) -> None:
        """Send one batch of events (never blocks: a PUB socket drops past its high-water mark)."""
        payload = encode_batch(events, time.time(), self._rank)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    async def serve_replay(self) -> None:
        """Answer replay requests forever (``ZmqEventPublisher._service_replay``)."""
        if self._replay is None:
            return
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", _END_SEQ, b""))
            await asyncio.sleep(0)

    def close(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
