"""vLLM's KV events on the wire (``prefix_router/cache/events.py``): every event type and encoding
decoded, what is unknown skipped, garbage refused. The view they build: ``test_engine_view.py``;
the stream that repairs its gaps: ``test_stream_gaps.py``.

The encoder is the simulator's (``prefix_router/tools/sim/kv_events.py``, vLLM's structs and options); the
real vLLM classes encode the same batch in ``tests/vllm_tier/test_kv_events_vllm.py``.
"""

from __future__ import annotations

import msgspec
import pytest

from prefix_router.cache.blocks import seed_hash
from prefix_router.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from prefix_router.tools.sim import kv_events as sim_events

BS = 4  # tokens per block
MODEL = "tiny"


def seed(lora, salt):
    return seed_hash(lora or MODEL, salt)


def stored(hashes, parent, tokens, salt=None, **kw):
    extra = kw.pop("extra_keys", [(salt,)] + [None] * (len(hashes) - 1) if salt else None)
    return sim_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                                  lora_id=None, medium="GPU", lora_name=None, extra_keys=extra, **kw)


def encode(*events, ts=1.0):
    return msgspec.msgpack.encode(sim_events._EventBatch(ts, list(events), 0))


# --- the wire format -----------------------------------------------------------------------

def test_a_map_encoded_batch_decodes_every_event_type():
    tokens = list(range(100, 108))
    batch = decode_batch(encode(stored([11, 12], None, tokens, salt="tenant-a"),
                                sim_events.BlockRemoved(block_hashes=[11], medium="GPU"),
                                sim_events.AllBlocksCleared(), ts=5.5))
    assert batch.ts == 5.5 and batch.data_parallel_rank == 0
    first, removed, cleared = batch.events
    assert first == BlockStored([11, 12], None, tokens, BS, None, "GPU", "tenant-a", None)
    assert removed == BlockRemoved([11], "GPU") and isinstance(cleared, AllBlocksCleared)


def test_the_array_encoding_of_earlier_vllm_releases_decodes_too():
    payload = msgspec.msgpack.encode([2.0, [["BlockStored", [b"\x01" * 32], None, [1, 2, 3, 4], BS, None, "GPU", None],
                                            ["BlockRemoved", [b"\x01" * 32], "GPU"], ["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    assert batch.events[0].block_hashes == [b"\x01" * 32] and batch.events[0].token_ids == [1, 2, 3, 4]
    assert batch.events[1] == BlockRemoved([b"\x01" * 32], "GPU")
    assert isinstance(batch.events[2], AllBlocksCleared) and batch.data_parallel_rank is None


def test_events_of_unknown_types_are_skipped_and_garbage_raises_value_error():
    payload = msgspec.msgpack.encode([1.0, [{"type": "SomethingNew", "x": 1}, {"type": "AllBlocksCleared"}]])
    assert [type(e) for e in decode_batch(payload).events] == [AllBlocksCleared]
    for garbage in (b"", b"\xc1", msgspec.msgpack.encode({"not": "a batch"}),
                    msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]])):
        with pytest.raises(ValueError):
            decode_batch(garbage)


def test_the_salt_is_read_past_a_lora_name_in_the_first_blocks_extra_keys():
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
             "block_size": BS, "lora_id": 3, "medium": "GPU", "lora_name": "sql-adapter",
             "extra_keys": [["sql-adapter", ["mm-image", 0], "tenant-b"]]}
    got = decode_batch(msgspec.msgpack.encode([1.0, [event]])).events[0]
    assert got.lora_name == "sql-adapter" and got.cache_salt == "tenant-b"
