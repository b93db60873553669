"""Replaying the Mooncake conversation trace through one simulated replica gives the exact hit rate.

With an unbounded KV cache, the token hit rate the replayer reports must equal what a direct
prefix count over the same requests gives (within 0.5 percentage points). The count here is
computed from the trace's ``hash_ids`` alone, independently of the simulator and of the token
ids the replayer sends: a request reuses the longest prefix any earlier request shares with it,
in whole simulator blocks, and never its last token.
"""

from __future__ import annotations

import pytest

from prefix_router.tools.replay.client import replay
from prefix_router.tools.replay.summary import summarize
from prefix_router.tools.replay.workloads import load_mooncake
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.server import create_app
from prefix_router.prompts.tokenizer import ByteTokenizer

from ...helpers import mooncake_trace

TRACE_BLOCK = 512
SIM_BLOCK = 16
LIMIT = 2000


def exact_prefix_hit_rate(trace: list[tuple[list[int], int]]) -> float:
    """Reused over input tokens for (hash_ids, input_length) requests with an unbounded cache.

    ``best[prefix]`` is the most tokens any earlier request holds within the blocks ``prefix``
    names: a full block is 512 tokens; a request's last block is cut at its input length.
    """
    best: dict[tuple[int, ...], int] = {}
    reused = total = 0
    for ids, length in trace:
        shared = 0
        for k in range(len(ids), 0, -1):
            seen = best.get(tuple(ids[:k]))
            if seen is not None:
                shared = min(seen, length) if k == len(ids) else min(seen, TRACE_BLOCK * k)
                break
        reused += min(shared // SIM_BLOCK, (length - 1) // SIM_BLOCK) * SIM_BLOCK
        total += length
        for j in range(1, len(ids) + 1):
            key = tuple(ids[:j])
            best[key] = max(best.get(key, 0), min(length, TRACE_BLOCK * j))
    return reused / total


@pytest.fixture
def trace_requests(tmp_path):
    # the shared trace, or one in its format in a clone without it
    return load_mooncake(mooncake_trace(tmp_path), block_size=TRACE_BLOCK, limit=LIMIT)


async def test_replayed_hit_rate_equals_an_exact_prefix_count(aiohttp_server, trace_requests):
    config = SimConfig(model="sim", block_size=SIM_BLOCK, num_gpu_blocks=1_000_000, max_model_len=200_000,
                       time_scale=1e6)
    server = await aiohttp_server(create_app(config, ByteTokenizer()))
    # One at a time, in trace order: with an unbounded cache the order alone decides each hit.
    records = await replay(trace_requests, str(server.make_url("")), model="sim", time_scale=1e6, concurrency=1)
    summary = summarize(records)
    assert summary["errors"] == 0
    expected = exact_prefix_hit_rate([(r.meta["hash_ids"], r.meta["input_length"]) for r in trace_requests])
    print(f"\nreplayed {len(records)} requests: hit rate {summary['token_hit_rate']:.4f}, exact count {expected:.4f}")
    assert summary["prompt_tokens"] == sum(r.meta["input_length"] for r in trace_requests)
    assert abs(summary["token_hit_rate"] - expected) <= 0.005
