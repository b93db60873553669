"""The fleet simulator's loop (``tools/fleetsim/run.py``): repeatable for a seed, in any process;
sessions wait for their answers; the figures are the engines' and the gateway's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from prefix_router.prompts.tokenizer import load_tokenizer
from prefix_router.tools.fleetsim.run import FleetConfig, simulate
from prefix_router.tools.replay.generate import builtin_workload
from prefix_router.tools.replay.request import COMPLETIONS, ReplayRequest
from prefix_router.tools.sim.config import SimConfig

SMALL = SimConfig(num_gpu_blocks=2000)


@pytest.fixture(scope="module")
def mixed():
    return builtin_workload("mixed", sessions=16)


def test_two_runs_of_one_seed_give_identical_figures_and_records(mixed):
    tok = load_tokenizer(None)
    runs = []
    for _ in range(2):
        records: list[dict] = []
        figures = simulate(mixed, "prefix-router", FleetConfig(replicas=4, engine=SMALL), tok, records=records)
        runs.append((figures, records))
    assert runs[0] == runs[1] and runs[0][0]["requests"] == len(mixed)


def test_a_run_in_another_process_with_another_hash_seed_prints_the_same_figures(mixed):
    code = ("import json; from prefix_router.prompts.tokenizer import load_tokenizer;"
            "from prefix_router.tools.fleetsim.run import FleetConfig, simulate;"
            "from prefix_router.tools.replay.generate import builtin_workload;"
            "from prefix_router.tools.sim.config import SimConfig;"
            "print(json.dumps(simulate(builtin_workload('mixed', sessions=16), 'prefix-router',"
            " FleetConfig(replicas=4, engine=SimConfig(num_gpu_blocks=2000)), load_tokenizer(None))))")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    here = simulate(mixed, "prefix-router", FleetConfig(replicas=4, engine=SMALL), load_tokenizer(None))
    assert json.loads(outs[0]) == json.loads(outs[1]) == json.loads(json.dumps(here))


def test_a_sessions_turn_is_sent_only_after_its_previous_turn_ended(mixed):
    records: list[dict] = []
    simulate(mixed, "round-robin", FleetConfig(replicas=4, engine=SMALL), load_tokenizer(None), records=records)
    by_request = {r["request"]: r for r in records}
    turns = [(i, r) for i, r in enumerate(mixed) if r.session is not None]
    previous: dict[str, int] = {}
    checked = 0
    for i, r in turns:
        if r.session in previous:
            before = by_request[previous[r.session]]
            assert by_request[i]["sent_s"] >= before["end_s"] + r.think_s - 1e-9
            checked += 1
        previous[r.session] = i
    assert checked > len(mixed) // 2


def test_affinity_reuses_more_of_the_prompts_than_round_robin_on_the_built_in_mix(mixed):
    """The loss the gateway exists to stop: round-robin spreads a conversation over the fleet."""
    tok = load_tokenizer(None)
    fleet = FleetConfig(replicas=8, engine=SMALL)
    ours = simulate(mixed, "prefix-router", fleet, tok)
    spread = simulate(mixed, "round-robin", fleet, tok)
    assert ours["token_hit_rate"] > spread["token_hit_rate"] + 0.1
    assert spread["busiest_over_fair"] < 1.2


def test_a_prompt_longer_than_a_replicas_cache_is_refused_not_left_waiting_forever():
    """vLLM will not start with a max_model_len its cache cannot hold; a prompt past it is refused."""
    long = ReplayRequest(COMPLETIONS, {"prompt": list(range(300, 300 + 40 * 16)), "max_tokens": 4})
    short = ReplayRequest(COMPLETIONS, {"prompt": list(range(300, 300 + 4 * 16)), "max_tokens": 4}, at_s=1.0)
    figures = simulate([long, short], "prefix-router", FleetConfig(replicas=2, engine=SimConfig(num_gpu_blocks=32)),
                       load_tokenizer(None))
    assert figures["rejected"] == 1 and figures["requests"] == 1


@pytest.mark.parametrize("policy", ["prefix-router", "least-loaded"])
def test_decode_only_steps_applied_at_once_change_nothing_in_a_run(mixed, policy):
    """Runs of decode-only steps at once (``Scheduler.decode``), cut short where a request
    arrives at the replica mid-run, give the run that steps one at a time gives: the same
    requests on the same replicas at the same times."""
    tok = load_tokenizer(None)
    outs = []
    for runs in (False, True):
        records: list[dict] = []
        figures = simulate(mixed, policy, FleetConfig(replicas=3, engine=SMALL, decode_runs=runs), tok, records=records)
        outs.append((figures, records))
    assert outs[0] == outs[1]


def test_the_engine_takes_the_gateways_hashes_of_a_token_prompt_as_it_would_compute_them():
    """A prompt of token ids is hashed once: the engine's prefix cache is keyed by the hashes the
    gateway's analysis made, which equal the engine's own (one seed, one block size)."""
    from prefix_router.tools.fleetsim import run
    from prefix_router.tools.fleetsim.jobs import prompt_of
    from prefix_router.tools.sim.scheduler import Scheduler, SimRequest

    request = ReplayRequest(COMPLETIONS, {"max_tokens": 4}, meta={"hash_ids": [3, 4, 5], "input_length": 1500})
    info, ids = prompt_of(request, load_tokenizer(None), block_size=16, char_block_size=64)
    job = SimRequest("0", ids, 4, model=run._MODEL)
    Scheduler(SimConfig(block_size=16)).add(job)
    assert info.exact and job.block_hashes == info.hashes and len(job.block_hashes) == 1500 // 16


def test_the_cyclic_collector_is_off_during_a_run_and_back_after(mixed):
    import gc

    enabled = [gc.isenabled()]
    simulate(mixed, "prefix-router", FleetConfig(replicas=2, engine=SMALL), _Watch(load_tokenizer(None), enabled))
    assert enabled[0] and len(enabled) > 1 and not any(enabled[1:]) and gc.isenabled()


class _Watch:
    """A tokenizer that notes whether the collector is on each time the run asks it for ids."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __getattr__(self, name):
        self.log.append(__import__("gc").isenabled())
        return getattr(self.inner, name)


def test_instances_that_follow_kv_events_route_as_one_and_instances_on_their_own_guesses_do_not():
    """Four gateway instances, each request to the next: each instance's own guess knows a quarter
    of what was sent, the engines' events tell each of them everything."""
    from prefix_router.tools.replay.shapes import coding_agents

    agents, tok = coding_agents(sessions=24, system_len=1000, tool_len=(300, 800)), load_tokenizer(None)

    def hit(**kw) -> float:
        return simulate(agents, "prefix-router", FleetConfig(replicas=4, rate_scale=4, **kw), tok)["token_hit_rate"]

    one = hit()
    assert hit(gateways=4, kv_events_delay_s=0.05) >= one - 0.02
    assert hit(gateways=4) < one - 0.05


def test_events_late_by_a_delay_still_give_one_run_for_one_seed(mixed):
    tok = load_tokenizer(None)
    fleet = FleetConfig(replicas=4, engine=SMALL, gateways=2, kv_events_delay_s=0.5)
    first, second = (simulate(mixed, "prefix-router", fleet, tok) for _ in range(2))
    assert first == second and first["requests"] == len(mixed)


def test_late_events_do_not_lengthen_the_run_they_come_after(mixed):
    tok = load_tokenizer(None)
    plain = simulate(mixed, "least-loaded", FleetConfig(replicas=4, engine=SMALL), tok)
    late = simulate(mixed, "least-loaded", FleetConfig(replicas=4, engine=SMALL, kv_events_delay_s=1000.0), tok)
    assert late["duration_s"] == plain["duration_s"] < 1000 and late["ttft_p99_s"] == plain["ttft_p99_s"]


# -- a disaggregated fleet -------------------------------------------------------------------------

def test_a_disaggregated_fleet_serves_every_request_with_decodes_computing_one_token_each(mixed):
    tok = load_tokenizer(None)
    fleet = FleetConfig(replicas=3, prefill_replicas=2, engine=SMALL)
    records: list[dict] = []
    figures = simulate(mixed, "prefix-router", fleet, tok, records=records)
    assert figures["requests"] == len(mixed) and figures["held_at_end"] == 0  # every held block pulled
    assert figures["decode_computed_tokens"] == len(mixed)  # the last prompt token each, the rest pulled
    assert figures["transfer_tokens"] > 0
    assert {r["replica"] for r in records} == {"replica-0", "replica-1", "replica-2"}  # ended on decode replicas
    assert simulate(mixed, "prefix-router", fleet, tok) == figures  # one run for one seed


def test_choosing_the_prefill_replica_by_its_cache_reuses_more_than_round_robin(mixed):
    tok = load_tokenizer(None)
    fleet = FleetConfig(replicas=2, prefill_replicas=4, engine=SMALL, decode_policy="prefix-router")
    ours, turns = (simulate(mixed, p, fleet, tok)["token_hit_rate"] for p in ("prefix-router", "round-robin"))
    assert ours > turns + 0.1


def test_a_decode_replica_lacking_only_a_short_suffix_computes_it_whole_as_serve_decides(mixed):
    tok = load_tokenizer(None)
    fleet = FleetConfig(replicas=3, prefill_replicas=2, engine=SMALL)
    split = simulate(mixed, "prefix-router", fleet, tok)
    never = simulate(mixed, "prefix-router", replace(fleet, min_prefill_tokens=1 << 30), tok)
    assert never["requests"] == len(mixed) and never["transfer_tokens"] == 0 and never["decode_computed_tokens"] > 0
    some = simulate(mixed, "prefix-router", replace(fleet, min_prefill_tokens=256), tok)
    assert 0 < some["transfer_tokens"] < split["transfer_tokens"]
    assert split["decode_computed_tokens"] < some["decode_computed_tokens"] < never["decode_computed_tokens"]
