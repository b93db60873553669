"""The gateway in front of two real vLLM replicas: predictions, routing gain, template, breakers, salts.

Two vLLM CPU replicas serve the tiny model (``prefix_router/tools/tiny_model.py``) with 32-token blocks, a
small KV cache so that eviction happens, and prompt token details on; the gateway uses the
model's own tokenizer folder, as an operator would. The replayed traffic is the SWE-agent
trajectories in ``../shared/agent_traces`` (several agents per trajectory, sharing its system
prompt and demonstration), or the built-in agent workload where that folder is absent.

The replicas start once for the module (about a minute on 2 cores) with
``VLLM_SERVER_DEV_MODE=1``, so that each test empties their prefix caches with
``POST /reset_prefix_cache`` instead of restarting them; every test starts a fresh gateway.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from prefix_router.tools import launch
from prefix_router.prompts.analysis import chat_tokens
from prefix_router.tools.replay.client import replay
from prefix_router.tools.replay.generate import builtin_workload
from prefix_router.tools.replay.workloads import load_trajectories
from prefix_router.fleet.replicas import parse_engine_metrics
from prefix_router.prompts.tokenizer import HFTokenizer

from ..helpers import TEMPLATES, with_template
from .harness import SHARED, get, post_json, tiny_model, unbounded_hits, vllm_spec

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
# KV blocks per replica: room for about three agents' contexts of the replayed workload, so the
# cache evicts under round-robin (every replica sees every agent) and less under affinity. The
# built-in agents' contexts are about twice the trajectories' with the generated-text tokenizer.
# Measured with twice the pressure (1000 blocks for the built-in agents): both policies thrash,
# affinity's gain shrinks to 1.02x and 8 of 46 predictions miss by a few blocks, because the
# shadow index evicts when a request is routed, the engine when it schedules it.
NUM_BLOCKS = 1000 if any((SHARED / "agent_traces").glob("*.traj")) else 2000
MAX_MODEL_LEN = 16_384
TIME_SCALE = 20.0  # the trajectories' think times and start stagger, compressed


def _workload():
    """Agent sessions: the trajectories, each run by two agents; else the first 8 sessions of the
    built-in agent workload, each cut before its first turn longer than the model takes."""
    traces = sorted((SHARED / "agent_traces").glob("*.traj"))
    if traces:
        return load_trajectories(traces, sessions=2 * len(traces), max_tokens=8, stagger_s=1.0, think_s=0.5), "trajectories"
    tokenizer = HFTokenizer(str(tiny_model()))
    workload = builtin_workload("agent", seed=0)
    keep = list(dict.fromkeys(r.session for r in workload))[:8]
    cut: set[str] = set()
    requests = []
    for r in workload:
        if r.session not in keep or r.session in cut:
            continue
        if len(chat_tokens(r.body, tokenizer)) + r.body["max_tokens"] > MAX_MODEL_LEN:
            cut.add(r.session)  # this turn and the session's later ones
            continue
        requests.append(r)
    return requests, "built-in agent workload (8 sessions)"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("vllm")
    # --trust-request-chat-template: /tokenize may render another template (the model families' test)
    specs = [vllm_spec(log_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                       extra=["--trust-request-chat-template"]) for _ in range(2)]
    for spec in specs:
        spec.env["VLLM_SERVER_DEV_MODE"] = "1"  # enables POST /reset_prefix_cache
    with launch.running(specs) as urls:
        yield urls


def _reset(urls: list[str]) -> None:
    for url in urls:
        urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", method="POST"), timeout=60)


def _engine_hits(urls: list[str]) -> float:
    return sum(parse_engine_metrics(get(u + "/metrics").decode()).get("vllm:prefix_cache_hits_total", 0.0) for u in urls)


@contextmanager
def _gateway(urls: list[str], tmp_path: Path, policy: str = "prefix-affinity", extra_config: str = ""):
    """A fresh gateway on emptied replicas; yields (base URL, request log path)."""
    _reset(urls)
    log = tmp_path / f"requests-{policy}.jsonl"
    # Two CPU replicas computing long prompts on two cores can take seconds to answer /health;
    # a GPU replica answers at once. Patient health checks keep this test about routing.
    config = tmp_path / "gateway.yaml"
    config.write_text("health: {timeout_s: 10.0, unhealthy_after: 3}\n" + extra_config)
    spec = launch.gateway_server(tmp_path, urls, ["--config", str(config), "--policy", policy,
                                                  "--tokenizer", str(tiny_model()), "--request-log", str(log)])
    with launch.running([spec]) as (url,):
        yield url, log


def _read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _replay(url: str, requests) -> list:
    records = asyncio.run(replay(requests, url, model="tiny", time_scale=TIME_SCALE))
    failed = [r for r in records if r.status != 200 or r.error]
    assert not failed, f"{len(failed)} requests failed, first: {failed[0]}"
    return records


def _expected_cached(d: dict) -> int:
    """The cached tokens a request-log line's prediction stands for: predicted, less what the
    engine evicted while the request waited (``evicted_in_flight_tokens``)."""
    return d["predicted_cached_tokens"] - d["evicted_in_flight_tokens"]


def _unexplained(differ: list[dict]) -> list[tuple[int, int, int]]:
    """(predicted, evicted in flight, cached) tokens of the request-log lines in ``differ`` that a
    swap does not explain. Two requests of one prefix sent to one replica a moment apart may reach
    its engine in the other order (vLLM's API server renders and tokenizes requests concurrently):
    the gateway counted the first one sent as the prefix's prefill, the engine the second, and
    each one's engine figure is the other's prediction. Such a pair, in flight together, the one
    the gateway under-predicted sent first, is not a wrong picture of the cache."""
    def start(d: dict) -> float:
        return d["t"] - d["elapsed_s"]

    def swapped(a: dict, b: dict) -> bool:
        if _expected_cached(a) > a["cached_tokens"]:
            a, b = b, a  # a: the one the engine gave more than predicted, the prefill's first sender
        return (a["replica"] == b["replica"]
                and start(a) <= start(b) < a["t"]  # sent first, both in flight at once
                and _expected_cached(a) == b["cached_tokens"] and _expected_cached(b) == a["cached_tokens"])

    left = list(differ)
    i = 0
    while i < len(left):
        j = next((j for j in range(i + 1, len(left)) if swapped(left[i], left[j])), None)
        if j is None:
            i += 1
        else:
            del left[j], left[i]
    return [(d["predicted_cached_tokens"], d["evicted_in_flight_tokens"], d["cached_tokens"]) for d in left]


def test_prefix_affinity_predicts_vllm_and_beats_round_robin(engines, tmp_path):
    requests, kind = _workload()
    tokenizer = HFTokenizer(str(tiny_model()))
    prompts = [chat_tokens(r.body, tokenizer) for r in requests]
    hits, logs = {}, {}
    for policy in ("prefix-affinity", "round-robin"):
        with _gateway(engines, tmp_path, policy) as (url, log):
            before = _engine_hits(engines)
            _replay(url, requests)
            hits[policy] = _engine_hits(engines) - before
        logs[policy] = _read_log(log)  # complete once the gateway has stopped
    total = sum(map(len, prompts))
    bound = sum(unbounded_hits(prompts, BLOCK_SIZE))  # the most any router could get
    lines = logs["prefix-affinity"]
    assert len(lines) == len(requests) and all(line["status"] == 200 for line in lines)
    assert sum(line["prompt_tokens"] for line in lines) == total, "the gateway's tokens are not the engine's"

    # 1. Predictions: the gateway's predicted cached tokens equal the engine's for 95%, and
    # every difference is explained.
    differ = [line for line in lines if line["predicted_cached_tokens"] != line["cached_tokens"]]
    print(f"\n{kind}: {len(requests)} requests, {total} prompt tokens; 2 vLLM replicas x {NUM_BLOCKS} blocks "
          f"of {BLOCK_SIZE}; an unbounded pooled cache would reuse {bound}")
    for policy in hits:
        computed = total - hits[policy]
        print(f"  {policy}: vLLM prefix cache hits {hits[policy]:.0f} ({hits[policy] / total:.1%}, "
              f"{hits[policy] / bound:.1%} of the bound), prefill tokens computed {computed:.0f}")
    print(f"  prefix-affinity predictions: {len(lines) - len(differ)}/{len(lines)} exact; differences: "
          f"{[(d['predicted_cached_tokens'], d['cached_tokens'], d['result']) for d in differ]}")
    # a pair swapped at the engine (two requests of one prefix in flight together) is the engine's
    # order, not a wrong picture of the cache: it failed one CI run on a loaded machine (65/70)
    assert len(_unexplained(differ)) <= 0.05 * len(lines), _unexplained(differ)
    for d in differ:
        if d["cached_tokens"] < d["predicted_cached_tokens"]:
            # The replica served less than believed: evicted; or routed, when another replica was
            # believed to hold even more (the larger loss is the routing's; seen once in CI).
            assert d["result"] in ("miss_evicted", "miss_routed"), d
        else:
            assert d["result"] == "hit", d  # it served more than believed: never called a miss

    # 2. Routing gain on the engine's own counters. Not "1.5x round-robin's hits": on this
    # traffic no router can get that. The agents of one trajectory share its system prompt and
    # demonstration, which every replica computes once and then serves to both policies, and
    # with two replicas round-robin still finds half of each session's previous turns; so
    # round-robin already reuses 84-88% of what an unbounded pooled cache would (measured), and
    # the bound itself is 1.14-1.18x round-robin. What affinity must do: win, and recover at
    # least half of what round-robin loses against that bound.
    a, rr = hits["prefix-affinity"], hits["round-robin"]
    print(f"  the bound is {bound / rr:.2f}x round-robin's hits; prefix affinity got {a / rr:.2f}x and "
          f"recovered {(a - rr) / (bound - rr):.0%} of what round-robin lost")
    assert a >= 1.05 * rr, hits
    assert bound - a <= 0.5 * (bound - rr), hits


def test_gateway_token_ids_equal_the_engines_tokenize(engines):
    """The chat template path is exact: messages, tool calls, tool results and tool lists."""
    requests, _ = _workload()
    mixed = builtin_workload("mixed", seed=0)[::5]  # shared tool lists, reordered tools, timestamps
    bodies = [r.body for r in requests] + [r.body for r in mixed]
    assert any(b.get("tools") for b in bodies) and any(m.get("tool_calls") for b in bodies for m in b["messages"])
    tokenizer = HFTokenizer(str(tiny_model()))
    differ = []
    for i, body in enumerate(bodies):
        query = {"model": "tiny", "messages": body["messages"], "add_generation_prompt": True}
        if body.get("tools"):
            query["tools"] = body["tools"]
        if post_json(engines[0] + "/tokenize", query)["tokens"] != chat_tokens(body, tokenizer):
            differ.append(i)
    print(f"\n{len(bodies)} chat requests: the gateway's token ids equal vLLM's /tokenize on {len(bodies) - len(differ)}")
    assert not differ, f"token ids differ for requests {differ}"


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.stem)
def test_the_gateway_renders_real_model_families_templates_as_vllm_does(engines, template, tmp_path):
    """The compiled template (not transformers' apply_chat_template) against vLLM's own
    rendering, on templates in the Llama 3.1 and Qwen 2.5 formats, tools and tool calls included."""
    bodies = [r.body for r in builtin_workload("mixed", seed=1)[::4]]
    assert any(b.get("tools") for b in bodies) and any(m.get("tool_calls") for b in bodies for m in b["messages"])
    tokenizer = with_template(tiny_model(), tmp_path, template.read_text())
    assert tokenizer._template is not None  # the fast path is the one under test
    differ = []
    for i, body in enumerate(bodies):
        query = {"model": "tiny", "messages": body["messages"], "add_generation_prompt": True,
                 "chat_template": template.read_text(), "chat_template_kwargs": {"date_string": "1 Dec 2026"}}
        if body.get("tools"):
            query["tools"] = body["tools"]
        ours = tokenizer.render_chat(body["messages"], tools=body.get("tools"), add_generation_prompt=True,
                                     chat_template_kwargs={"date_string": "1 Dec 2026"})
        if post_json(engines[0] + "/tokenize", query)["tokens"] != ours:
            differ.append(i)
    print(f"\n{template.stem}: {len(bodies)} chat requests, the gateway's token ids equal vLLM's on "
          f"{len(bodies) - len(differ)}")
    assert not differ, f"token ids differ for requests {differ}"


def _turns(system, n: int) -> list[dict]:
    """``n`` turns of one chat session; ``system(turn)`` gives each turn's system prompt."""
    words = "the replica keeps the prefix of this conversation in its cache while the agent works".split()
    history, bodies = [], []
    for turn in range(n):
        history.append({"role": "user", "content": " ".join(words[(turn + k) % len(words)] for k in range(120))})
        bodies.append({"model": "tiny", "max_tokens": 4, "ignore_eos": True,
                       "messages": [{"role": "system", "content": system(turn)}, *history]})
        history.append({"role": "assistant", "content": f"step {turn} done"})
    return bodies


def test_timestamp_in_the_system_prompt_is_miss_changed_at_message_0(engines, tmp_path):
    instructions = " ".join(["You are a careful coding agent working in a repository."] * 20)
    with _gateway(engines, tmp_path) as (url, log):
        for body in _turns(lambda t: f"Current time: 2026-11-30T10:0{t}:00Z. {instructions}", 4):
            post_json(url + "/v1/chat/completions", body, headers={"X-Session-ID": "stamped"})
        for body in _turns(lambda t: instructions, 4):  # the fix: the same client, no timestamp
            post_json(url + "/v1/chat/completions", body, headers={"X-Session-ID": "steady"})
    lines = _read_log(log)
    stamped, steady = lines[:4], lines[4:]
    for line in stamped[1:]:
        assert line["result"] == "miss_changed" and line["diverged_message"] == 0, line
        assert line["cached_tokens"] <= line["diverged_token"] < 64, line  # the engine agrees: reuse stops there
    for line in steady[1:]:
        assert line["result"] == "hit" and line["cached_tokens"] > 0.5 * line["prompt_tokens"], line


def test_tenants_with_different_cache_salts_share_no_blocks(engines, tmp_path):
    document = " ".join(f"clause {i}: the tenant's contract text that is long enough to fill blocks." for i in range(60))
    body = {"model": "tiny", "max_tokens": 4, "ignore_eos": True,
            "messages": [{"role": "system", "content": document}, {"role": "user", "content": "summarise"}]}
    with _gateway(engines, tmp_path) as (url, log):
        a1 = post_json(url + "/v1/chat/completions", {**body, "cache_salt": "tenant-a"})
        a2 = post_json(url + "/v1/chat/completions", {**body, "cache_salt": "tenant-a"})
        b1 = post_json(url + "/v1/chat/completions", {**body, "cache_salt": "tenant-b"})
        b2 = post_json(url + "/v1/chat/completions", {**body, "cache_salt": "tenant-b"})
        # The engine itself, on the replica that holds tenant A's blocks: tenant C still gets nothing.
        lines = _read_log(log)
        holder = next(u for u in engines if u.endswith(lines[0]["replica"]))
        c1 = post_json(holder + "/v1/chat/completions", {**body, "cache_salt": "tenant-c"})
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (a1, a2, b1, b2, c1)]
    prompt = a1["usage"]["prompt_tokens"]
    assert cached[0] == 0 and cached[1] >= prompt - 2 * BLOCK_SIZE, cached  # a tenant reuses its own blocks
    assert cached[2] == 0 and cached[4] == 0, cached  # never another tenant's
    assert cached[3] == cached[1], cached
    assert [line["predicted_cached_tokens"] for line in _read_log(log)[:4]] == cached[:4]  # the gateway knew


def test_gateway_tenants_get_their_own_salt_so_the_engine_shares_nothing_between_them(engines, tmp_path):
    """Tenants configured at the gateway, clients sending no salt, one replica (so any sharing
    would show): the engine reports cached tokens for a tenant's own repeat, none across
    tenants. That the gateway overrides a salt a client forges is checked at the replica's
    door in tests/fleet/test_tenants.py."""
    document = " ".join(f"section {i}: shared policy text that both tenants happen to send." for i in range(60))
    body = {"model": "tiny", "max_tokens": 4, "ignore_eos": True,
            "messages": [{"role": "system", "content": document}, {"role": "user", "content": "summarise"}]}
    auth = ("auth:\n  tenants:\n    - {name: acme, keys: [sk-acme-0001]}\n"
            "    - {name: bolt, keys: [sk-bolt-0001]}\n")
    headers = {"acme": {"Authorization": "Bearer sk-acme-0001"}, "bolt": {"Authorization": "Bearer sk-bolt-0001"}}
    with _gateway(engines[:1], tmp_path, extra_config=auth) as (url, log):
        results = [post_json(url + "/v1/chat/completions", body, headers=headers[tenant])
                   for tenant in ("acme", "acme", "bolt", "bolt")]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results]
    prompt = results[0]["usage"]["prompt_tokens"]
    assert cached[0] == 0 and cached[1] >= prompt - 2 * BLOCK_SIZE, cached  # acme reuses its own blocks
    assert cached[2] == 0, cached  # bolt gets none of acme's
    assert cached[3] == cached[1], cached  # and reuses its own
