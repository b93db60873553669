"""The replay client (``prefix_router/tools/replay/client.py``) against an in-process simulated
replica: every request recorded with its usage and timings, Mooncake prompts as token ids or
as text hitting on their shared hash ids."""

from __future__ import annotations

import pytest

from prefix_router.prompts.tokenizer import ByteTokenizer
from prefix_router.tools.replay.client import replay
from prefix_router.tools.replay.generate import builtin_workload
from prefix_router.tools.replay.workloads import load_mooncake
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.server import create_app

from .test_workloads import BLOCK, MOONCAKE_LINES, write_jsonl


SIM = SimConfig(model="sim-model", block_size=16, num_gpu_blocks=4096, max_model_len=16_384, time_scale=1000)


@pytest.fixture
async def sim_url(aiohttp_server):
    server = await aiohttp_server(create_app(SIM, ByteTokenizer()))
    return str(server.make_url(""))


@pytest.mark.parametrize("stream", [True, False])
async def test_replay_records_every_request_with_usage_and_timings(sim_url, stream):
    requests = builtin_workload("chat", seed=2, sessions=3, rate=50.0, think_s=0.5, max_tokens=6)
    records = await replay(requests, sim_url, model=SIM.model, time_scale=1000, stream=stream)
    assert len(records) == len(requests)
    assert [r.index for r in records] == list(range(len(requests)))
    for record, req in zip(records, requests):
        assert record.status == 200 and record.error is None, record.error
        assert (record.session, record.turn) == (req.session, req.turn)
        assert record.ttft_s is not None and record.latency_s is not None
        assert record.ttft_s <= record.latency_s
        if not stream:
            assert record.ttft_s == record.latency_s
        # a stream says the replica's own part of the TTFT; a body in one piece does not
        assert (0 < record.replica_ttft_s <= record.ttft_s) if stream else record.replica_ttft_s is None
        # ... in modelled seconds too: at least the step that computed its last prompt token
        modelled = record.replica_modelled_ttft_s
        assert (modelled >= SIM.step_seconds(1, 0)) if stream else modelled is None
        assert record.prompt_tokens == len(ByteTokenizer().render_chat(req.body["messages"]))
        assert record.completion_tokens == 6
        assert 0 <= record.cached_tokens < record.prompt_tokens
    later_turns = [r for r in records if r.turn > 0]
    assert any(r.cached_tokens > 0 for r in later_turns)  # append-only histories hit


async def test_replay_sends_mooncake_prompts_that_hit_on_shared_hash_ids(sim_url, tmp_path):
    requests = load_mooncake(write_jsonl(tmp_path / "t.jsonl", MOONCAKE_LINES), block_size=BLOCK)
    records = await replay(requests, sim_url, time_scale=1000)
    assert [r.error for r in records] == [None] * 3
    assert [r.prompt_tokens for r in records] == [20, 17, 8]
    assert [r.completion_tokens for r in records] == [5, 9, 1]
    assert records[1].cached_tokens == 2 * BLOCK  # ids 1, 2 (block_size 16 = one sim block)


async def test_replay_of_mooncake_text_prompts_hits_like_the_token_ids(sim_url, tmp_path):
    requests = load_mooncake(write_jsonl(tmp_path / "t.jsonl", MOONCAKE_LINES), block_size=BLOCK, text=True)
    records = await replay(requests, sim_url, time_scale=1000)
    assert [r.error for r in records] == [None] * 3
    assert [r.prompt_tokens for r in records] == [rec["input_length"] for rec in MOONCAKE_LINES]
    assert records[1].cached_tokens == 2 * BLOCK
