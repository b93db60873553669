"""Capacity at a TTFT objective (``tools/fleetsim/capacity.py``): the rate found is served and a
little more is not; a closed loop of sessions has no such rate."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from prefix_router.prompts.tokenizer import load_tokenizer
from prefix_router.tools.fleetsim.capacity import capacity, trace_rate
from prefix_router.tools.fleetsim.run import FleetConfig, simulate
from prefix_router.tools.replay.generate import builtin_workload
from prefix_router.tools.replay.request import COMPLETIONS, ReplayRequest
from prefix_router.tools.sim.config import SimConfig


def _open_loop(n: int = 120) -> list[ReplayRequest]:
    """Requests at one a second, each 2,048 tokens of its own: nothing to reuse, so load alone
    sets the TTFT."""
    rng = random.Random(0)
    return [ReplayRequest(COMPLETIONS, {"prompt": [rng.randrange(300, 30_000) for _ in range(2048)], "max_tokens": 16},
                          at_s=float(i)) for i in range(n)]


def test_the_rate_found_meets_the_objective_and_twice_it_does_not():
    requests, tok = _open_loop(), load_tokenizer(None)
    fleet = FleetConfig(replicas=2, engine=SimConfig(num_gpu_blocks=4000))
    found = capacity(requests, "round-robin", fleet, tok, slo_ttft_p99_s=0.5)
    assert found["capacity_rps"] is not None and found["ttft_p99_s"] <= 0.5
    assert abs(found["capacity_rps"] - trace_rate(requests) * found["rate_scale"]) < 1e-9
    faster = simulate(requests, "round-robin", FleetConfig(replicas=2, engine=SimConfig(num_gpu_blocks=4000),
                                                           rate_scale=2 * found["rate_scale"]), tok)
    assert faster["ttft_p99_s"] > 0.5
    more = capacity(requests, "round-robin", FleetConfig(replicas=4, engine=SimConfig(num_gpu_blocks=4000)), tok,
                    slo_ttft_p99_s=0.5)
    assert more["capacity_rps"] > found["capacity_rps"]  # twice the replicas serve more


def test_sessions_that_wait_for_their_answers_meet_the_objective_at_any_rate():
    found = capacity(builtin_workload("chat", sessions=4), "round-robin",
                     FleetConfig(replicas=2, engine=SimConfig(num_gpu_blocks=4000)), load_tokenizer(None), 30.0)
    assert found["capacity_rps"] is None


def test_a_prompt_too_long_for_any_replica_is_refused_apart_and_leaves_the_capacity_found():
    requests, tok = _open_loop(60), load_tokenizer(None)
    requests.append(ReplayRequest(COMPLETIONS, {"prompt": list(range(300, 300 + 4000 * 16)), "max_tokens": 4},
                                  at_s=30.5))
    found = capacity(requests, "round-robin", FleetConfig(replicas=2, engine=SimConfig(num_gpu_blocks=4000)), tok,
                     slo_ttft_p99_s=0.5)
    assert found["rejected"] == 1 and found["capacity_rps"]


def test_fewer_steps_find_a_capacity_within_their_stated_factor_of_the_finer_search():
    requests, tok = _open_loop(), load_tokenizer(None)
    fleet = FleetConfig(replicas=2, engine=SimConfig(num_gpu_blocks=4000))
    fine = capacity(requests, "round-robin", fleet, tok, slo_ttft_p99_s=0.5, steps=8)
    coarse = capacity(requests, "round-robin", fleet, tok, slo_ttft_p99_s=0.5, steps=2)
    assert coarse["runs"] < fine["runs"]
    assert fine["capacity_rps"] / 2 ** (1 / 4) <= coarse["capacity_rps"] <= fine["capacity_rps"] * 2 ** (1 / 256)


def test_a_good_first_guess_takes_fewer_runs_for_the_same_capacity():
    requests, tok = _open_loop(), load_tokenizer(None)
    far = capacity(requests, "round-robin", FleetConfig(replicas=2, engine=SimConfig(num_gpu_blocks=4000)), tok,
                   slo_ttft_p99_s=0.5, steps=3)
    near = capacity(requests, "round-robin", FleetConfig(replicas=2, engine=SimConfig(num_gpu_blocks=4000),
                                                         rate_scale=far["rate_scale"]), tok, slo_ttft_p99_s=0.5, steps=3)
    assert near["runs"] < far["runs"] and near["capacity_rps"] >= far["capacity_rps"]


def test_the_fewest_replicas_found_serve_the_rate_and_one_fewer_does_not():
    from prefix_router.tools.fleetsim.capacity import fewest_replicas

    requests, tok = _open_loop(), load_tokenizer(None)
    fleet = FleetConfig(replicas=16, engine=SimConfig(num_gpu_blocks=4000))
    one = capacity(requests, "round-robin", replace(fleet, replicas=1), tok, slo_ttft_p99_s=0.5, steps=3)
    rate = 3.2 * one["capacity_rps"]  # about what three to four replicas serve
    sizes = []
    found = fewest_replicas(requests, "round-robin", fleet, tok, 0.5, rate, on_run=lambda n, f: sizes.append(n))
    n = found["replicas"]
    assert 2 <= n <= 8 and found["ttft_p99_s"] <= 0.5
    fewer = simulate(requests, "round-robin", replace(fleet, replicas=n - 1, rate_scale=found["rate_scale"]), tok)
    assert fewer["ttft_p99_s"] > 0.5
    assert len(sizes) <= 2 * 4 + 1  # doubling, then halving the gap: about 2 log2(16) runs
    too_few = fewest_replicas(requests, "round-robin", replace(fleet, replicas=2), tok, 0.5, rate)
    assert too_few["replicas"] is None and too_few["ttft_p99_s"] > 0.5
    with pytest.raises(ValueError):
        fewest_replicas(requests, "round-robin", fleet, tok, 0.5, 0.0)


def test_an_open_trace_whose_answers_outlast_its_arrivals_still_has_a_capacity():
    """Long answers make the run as long at any rate once the requests come at once; only the
    pace they came at tells a closed loop from an open trace."""
    rng = random.Random(3)
    requests = [ReplayRequest(COMPLETIONS, {"prompt": [rng.randrange(300, 30_000) for _ in range(2048)],
                                            "max_tokens": 3000}, at_s=float(i)) for i in range(60)]
    tok, fleet = load_tokenizer(None), FleetConfig(replicas=2, engine=SimConfig(num_gpu_blocks=12000))
    found = capacity(requests, "round-robin", fleet, tok, slo_ttft_p99_s=0.5, steps=3)
    assert found["capacity_rps"] and found["ttft_p99_s"] <= 0.5
    faster = simulate(requests, "round-robin", replace(fleet, rate_scale=2 * found["rate_scale"]), tok)
    assert faster["ttft_p99_s"] > 0.5
