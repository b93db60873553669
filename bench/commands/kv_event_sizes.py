"""How large a KV event batch one vLLM engine step can publish: the figures behind the gateway's
per-message cap (``prefix_router/cache/stream.py``, ``MAX_MESSAGE_BYTES``).

Run with vLLM's own environment, never the gateway's (the gateway does not import vllm)::

    .venv-vllm/bin/python -m bench kv-event-sizes

It writes ``README.md`` to ``--out`` (``bench/results/kv-event-sizes``).

Each batch is built from vLLM's event classes (``vllm/distributed/kv_events.py``:
``KVEventBatch``, ``BlockStored``, ``BlockRemoved``) exactly as its block pool fills them
(``vllm/v1/core/block_pool.py``: ``cache_full_blocks`` and ``_build_block_stored_event`` give one
``BlockStored`` per request and step, ``_emit_block_removed_events`` one ``BlockRemoved`` per
evicted block, with ``group_idx`` and ``medium``), and encoded with the encoder
``ZmqEventPublisher._publisher_thread`` uses (``msgspec.msgpack.Encoder().encode``). Block hashes
are sha256 digests (32 bytes; ``prefix_caching_hash_algo`` "sha256", the default) or, with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, 64-bit integers (``maybe_convert_block_hash``). Token
ids are 17-bit (vocabularies of 128K-152K): uniform below 2**17, or all at or above 2**16 (five
bytes each in msgpack, the worst an id below 2**32 can be). Every step evicts as many cached
blocks as it stores (a full cache: ``get_new_blocks`` evicts one cached block per block it
allocates).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from pathlib import Path

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from .. import RESULTS
from ..report import command_line, write_results

BLOCK_SIZE = 16  # vLLM's default on CUDA (CacheConfig.block_size, resolved per attention backend)
MAX_NUM_SEQS = 1024  # vLLM's API-server default on H100/H200 and B200 (arg_utils._set_default_max_num_seqs...)
SESSION = "session-0123456789abcdef"  # BlockStored.session_id (Request.session_id), one per request
LORA = "sql-adapter-v2"
SALT = "tenant-0123456789abcdef"
MM_ID = hashlib.sha256(b"an image").hexdigest()  # MultiModalFeatureSpec.identifier: a hex digest
CAP = 4 << 20  # prefix_router/cache/stream.py MAX_MESSAGE_BYTES, chosen from these figures (not imported: another venv)

_rng = random.Random(0)


def _tokens(n: int, worst: bool) -> list[int]:
    low = 1 << 16 if worst else 0
    return [_rng.randrange(low, 1 << 17) for _ in range(n)]


def _hash(i: int, ints: bool) -> bytes | int:
    digest = hashlib.sha256(i.to_bytes(8, "big")).digest()
    return int.from_bytes(digest[:8], "big") if ints else digest


def _stored(first: int, blocks: int, *, worst: bool, ints: bool, lora: bool = False, salt: bool = False,
            mm: bool = False) -> BlockStored:
    """One request's newly cached blocks ``first .. first + blocks - 1``, parent the block before."""
    extra = []
    for i in range(blocks):
        keys: tuple = ((LORA,) if lora else ()) + (((MM_ID, -3),) if mm else ()) + \
            ((SALT,) if salt and first + i == 0 else ())
        extra.append(keys or None)
    return BlockStored(block_hashes=[_hash(first + i, ints) for i in range(blocks)],
                       parent_block_hash=None if first == 0 else _hash(first - 1, ints),
                       token_ids=_tokens(blocks * BLOCK_SIZE, worst), block_size=BLOCK_SIZE,
                       lora_id=1 if lora else None, medium="GPU", lora_name=LORA if lora else None,
                       extra_keys=extra if any(extra) else None, group_idx=0, session_id=SESSION)


def _removed(blocks: int, ints: bool) -> list[BlockRemoved]:
    return [BlockRemoved(block_hashes=[_hash(10**9 + i, ints)], medium="GPU", group_idx=0) for i in range(blocks)]


def _size(events: list) -> int:
    return len(msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)))


def _one_prompt(tokens: int, **kw) -> int:
    """One request storing ``tokens`` tokens of blocks in one step, and as many evicted."""
    blocks = tokens // BLOCK_SIZE
    return _size([_stored(0, blocks, **kw)] + _removed(blocks, kw["ints"]))


def _many_requests(tokens: int, **kw) -> int:
    """``MAX_NUM_SEQS`` running requests each filling one block in the step (a decode step that
    crosses every request's block boundary at once: the most events per token), the rest of the
    token budget one prefill, and as many blocks evicted as stored."""
    events = [_stored(1 + 8 * i, 1, **kw) for i in range(MAX_NUM_SEQS)]
    rest = (tokens - MAX_NUM_SEQS) // BLOCK_SIZE
    events.append(_stored(0, rest, **kw))
    return _size(events + _removed(MAX_NUM_SEQS + rest, kw["ints"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench kv-event-sizes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "kv-event-sizes")
    args = parser.parse_args(argv)
    rows = []
    for tokens, label in ((8192, "8,192 (max_num_batched_tokens on H100/H200)"),
                          (16384, "16,384 (max_num_batched_tokens on B200)"),
                          (131072, "131,072 (a 128K prompt in one step: a KV connector's load, or "
                                   "kv_cache_report_mode=full re-announcing a cached prefix)")):
        for shape, fn in (("one request", _one_prompt), (f"{MAX_NUM_SEQS} requests", _many_requests)):
            if tokens == 131072 and fn is _many_requests:
                continue
            for kw_label, kw in (("sha256, uniform ids", dict(worst=False, ints=False)),
                                 ("sha256, ids >= 2**16", dict(worst=True, ints=False)),
                                 ("int hashes, ids >= 2**16", dict(worst=True, ints=True)),
                                 ("sha256, ids >= 2**16, LoRA + salt + an image per block",
                                  dict(worst=True, ints=False, lora=True, salt=True, mm=True))):
                rows.append((label, shape, kw_label, fn(tokens, **kw)))
    write_results(args.out, "KV event batch sizes: the largest one vLLM engine step publishes",
                  command_line(__name__, argv, python=".venv-vllm/bin/python"), report(rows))
    return 0


def report(rows: list[tuple[str, str, str, int]]) -> list[str]:
    """The README's lines: the table of ``rows`` (label, requests, keys, bytes), the largest batch
    against the gateway's cap, and what passes the cap."""
    import vllm

    largest = max(size for *_, size in rows)
    prefix = _size([_stored(0, 131072 // BLOCK_SIZE, worst=False, ints=False)])
    lines = [f"Built with vLLM {vllm.__version__}'s own event classes and encoder: `KVEventBatch`, `BlockStored`, "
             "`BlockRemoved` filled as `BlockPool.cache_full_blocks` and `_emit_block_removed_events` fill them, "
             f"encoded as `ZmqEventPublisher` encodes them. Block size {BLOCK_SIZE}; every stored block also "
             "evicts one (a full cache).", "",
             "| tokens stored in the step | requests | hashes, token ids, extra keys | encoded bytes | bytes / token |",
             "|---|---|---|---:|---:|"]
    for label, shape, kw_label, size in rows:
        tokens = int(label.split(" ")[0].replace(",", ""))
        lines.append(f"| {label} | {shape} | {kw_label} | {size:,} | {size / tokens:.1f} |")
    lines += ["", f"Largest: {largest:,} bytes ({largest / 2**20:.2f} MiB). The gateway's cap, "
              f"`prefix_router/cache/stream.py` `MAX_MESSAGE_BYTES`, is {CAP >> 20} MiB: {CAP / largest:.1f}x that.", "",
              "Past the cap: `kv_cache_report_mode=full` (a request's `vllm_xargs`) makes the scheduler publish a "
              "request's whole cached prefix as stored again when it is scheduled "
              "(`KVCacheManager.get_computed_blocks` -> `BlockPool.emit_cached_block_events`), "
              f"{prefix / 2**20:.2f} MiB for a 128K-token prefix; {CAP // prefix + 1} such requests scheduled in one "
              "step pass the cap. The gateway strips that field from the requests it forwards. A message over the "
              "cap is dropped (ZMQ's MAXMSGSIZE) and lost like any gap: that replica is routed by the gateway's "
              "guess until its view is rebuilt."]
    return lines
