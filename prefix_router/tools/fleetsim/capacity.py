"""Capacity at a latency objective: the highest arrival rate a fleet serves with TTFT p99 at most
the objective, found by bisection on the trace's rate.

Operators ask "how much traffic can these GPUs serve under my objective", not "what hit rate":
llm-d and KubeAI report their prefix-aware routing that way (TTFT under load on a fixed fleet).
A rate is served when the run's TTFT p99 is within the objective (prompts longer than a replica
can hold are refused at any rate, and counted apart: ``rejected``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from prefix_router.prompts.tokenizer import PromptTokenizer
from prefix_router.tools.fleetsim.run import FleetConfig, simulate
from prefix_router.tools.replay.request import ReplayRequest

__all__ = ["capacity", "trace_rate"]

_STEPS = 6  # bisection steps once a served and an unserved scale bracket the capacity: 1/64 of the bracket
_WIDEST = 2.0 ** 12  # scales searched: from 1/4096 to 4096 times the trace's own rate


def trace_rate(requests: Sequence[ReplayRequest]) -> float:
    """The trace's own arrival rate, requests a second: its requests over the span of the times
    they start at (a session's later turns follow their previous one, so the span is its starts')."""
    times = [r.at_s for r in requests]
    span = max(times) - min(times) if times else 0.0
    return len(requests) / span if span > 0 else float(len(requests))


def capacity(requests: Sequence[ReplayRequest], policy: str, fleet: FleetConfig, tokenizer: PromptTokenizer,
             slo_ttft_p99_s: float, on_run: Callable[[float, dict], None] | None = None) -> dict:
    """The figures of the fastest served rate found (``simulate``'s, plus ``capacity_rps`` and
    ``rate_scale``); ``capacity_rps`` 0.0 when even the slowest scale searched misses the
    objective, None when it met the objective at the fastest (a closed loop: a trace of sessions
    whose turns wait for their answers loads a fleet no further however fast they start).
    ``on_run`` is told each scale tried and its figures."""

    def run(scale: float) -> dict:
        figures = simulate(requests, policy, replace(fleet, rate_scale=scale), tokenizer)
        if on_run is not None:
            on_run(scale, figures)
        return figures

    def served(figures: dict) -> bool:  # a prompt past the model's length is refused at any rate: not load
        p99 = figures["ttft_p99_s"]
        return p99 is not None and p99 <= slo_ttft_p99_s

    scale = fleet.rate_scale
    figures = run(scale)
    good, bad = (scale, None) if served(figures) else (None, scale)
    best = figures if good is not None else None
    while good is None and bad > 1 / _WIDEST:
        scale = bad / 2
        figures = run(scale)
        if served(figures):
            good, best = scale, figures
        else:
            bad = scale
    while bad is None and good < _WIDEST:
        scale = good * 2
        figures = run(scale)
        if served(figures):
            good, best = scale, figures
        else:
            bad = scale
    if good is None:
        return {**figures, "capacity_rps": 0.0, "rate_scale": bad}
    for _ in range(_STEPS if bad is not None else 0):
        scale = (good + bad) / 2
        figures = run(scale)
        if served(figures):
            good, best = scale, figures
        else:
            bad = scale
    if bad is None:  # served at every rate tried: sessions that wait for their answers bound the load
        return {**best, "capacity_rps": None, "rate_scale": good}
    return {**best, "capacity_rps": trace_rate(requests) * good, "rate_scale": good}
