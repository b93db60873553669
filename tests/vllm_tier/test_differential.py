"""The simulator against the real vLLM engine: same requests, same ``cached_tokens``.

Both get the same block size (32) and the block count the real engine reports, and the same
sequence of requests, sent one at a time: every agent turn of the SWE-agent trajectories in
``../shared/agent_traces`` (in a clone without that folder, of the built-in agent workload's
first sessions; sessions interleaved turn by turn), with unrelated prompts between
them so that the small KV cache must evict. Every request's ``cached_tokens`` must be equal.
One at a time is deliberate: with concurrent requests, the order in which two requests that
arrive together enter the engine is a race in either server, and a hit can legitimately differ.

The test also checks that it tested something: evictions happened (some request hit less
than an unbounded cache would give it) and the chat template path produced identical token ids
(the engine's ``/tokenize`` equals the simulator's for every chat request).
"""

from __future__ import annotations

import random

import pytest

from prefix_router.prompts.analysis import chat_tokens
from prefix_router.prompts.tokenizer import HFTokenizer
from prefix_router.tools.replay.generate import builtin_workload
from prefix_router.tools.replay.workloads import load_trajectories

from .harness import SHARED, post_json, sim_server, tiny_model, unbounded_hits, vllm_server

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
NUM_BLOCKS = 700  # 22,400 tokens: holds one max-length prompt, not the whole working set
MAX_MODEL_LEN = 16_384


def _requests() -> list[tuple[str, dict]]:
    traces = sorted((SHARED / "agent_traces").glob("*.traj"))
    turns = load_trajectories(traces, max_tokens=8) if traces else _builtin_turns()
    turns.sort(key=lambda r: (r.turn, r.session))  # interleave sessions turn by turn
    rng = random.Random(7)
    top = min(2000, HFTokenizer(str(tiny_model())).vocab_size)  # the tiny vocabulary is smaller without ../shared
    out: list[tuple[str, dict]] = []
    for i, turn in enumerate(turns):
        out.append(("/v1/chat/completions", turn.body))
        if i % 2 == 1:  # an unrelated prompt that pushes other prefixes out of the cache
            tokens = [rng.randrange(100, top) for _ in range(rng.randrange(1500, 3500))]
            out.append(("/v1/completions", {"prompt": tokens, "max_tokens": 8, "ignore_eos": True}))
    return out


def _builtin_turns(sessions: int = 8):
    """The built-in agent workload's first ``sessions`` sessions, each cut before its first turn
    longer than the model takes, 8 output tokens a turn."""
    tokenizer = HFTokenizer(str(tiny_model()))
    workload = builtin_workload("agent", seed=0)
    keep = list(dict.fromkeys(r.session for r in workload))[:sessions]
    cut: set[str] = set()
    turns = []
    for r in workload:
        if r.session not in keep or r.session in cut:
            continue
        r.body = {**r.body, "max_tokens": 8, "ignore_eos": True}
        if len(chat_tokens(r.body, tokenizer)) + 8 > MAX_MODEL_LEN:
            cut.add(r.session)
            continue
        turns.append(r)
    return turns


def _token_ids(base: str, path: str, body: dict) -> list[int]:
    if path.endswith("/completions") and "prompt" in body:
        return body["prompt"]
    query = {"model": "tiny", "messages": body["messages"]}
    if body.get("tools"):
        query["tools"] = body["tools"]
    return post_json(base + "/tokenize", query)["tokens"]


def test_sim_matches_vllm_cached_tokens(tmp_path):
    requests = _requests()
    assert len(requests) >= 50
    with vllm_server(tmp_path, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN) as real:
        from .harness import cache_config

        num_gpu_blocks = int(cache_config(real)["num_gpu_blocks"])
        real_ids = [_token_ids(real, p, b) for p, b in requests]
        real_cached = []
        for path, body in requests:
            usage = post_json(real + path, {"model": "tiny", **body})["usage"]
            real_cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    with sim_server(tmp_path, block_size=BLOCK_SIZE, num_blocks=num_gpu_blocks, max_model_len=MAX_MODEL_LEN,
                    tokenizer=tiny_model()) as sim:
        sim_ids = [_token_ids(sim, p, b) for p, b in requests]
        sim_cached = [post_json(sim + path, {"model": "tiny", **body})["usage"]["prompt_tokens_details"]["cached_tokens"]
                      for path, body in requests]

    assert sim_ids == real_ids, "chat template rendering differs from the engine's"
    mismatches = [(i, r, s) for i, (r, s) in enumerate(zip(real_cached, sim_cached)) if r != s]
    assert not mismatches, f"(request, vLLM, simulator) cached_tokens differ: {mismatches}"
    unbounded = unbounded_hits(real_ids, BLOCK_SIZE)
    assert sum(real_cached) > 0, "no request hit the cache: the test exercised nothing"
    evicted = [i for i, (got, best) in enumerate(zip(real_cached, unbounded)) if got < best]
    assert evicted, "no request lost a hit to eviction: raise the pressure"
    print(f"\n{len(requests)} requests, {num_gpu_blocks} blocks of {BLOCK_SIZE}: cached tokens equal on all; "
          f"vLLM cached {sum(real_cached)} of {sum(map(len, real_ids))} prompt tokens; "
          f"{len(evicted)} requests lost {sum(unbounded) - sum(real_cached)} tokens to eviction")
