"""Capacity at a TTFT objective (``tools/fleetsim/capacity.py``): the rate found is served and a
little more is not; a closed loop of sessions has no such rate."""

from __future__ import annotations

import random

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
