"""Capacity at a latency objective: the highest arrival rate a fleet serves with TTFT p99 at most
the objective, found by bisection on the trace's rate; and its converse, the fewest replicas that
serve a given rate within it, found by bisection on the fleet's size.

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

__all__ = ["capacity", "fewest_replicas", "trace_rate"]

_STEPS = 6  # bisection steps once a served and an unserved scale bracket the capacity: a factor of 2**(1/64)
_WIDEST = 2.0 ** 12  # scales searched: from 1/4096 to 4096 times the first one tried
_SCALES = (1e-6, 1e6)  # rate scales a target rate may ask for: past them a trace's times lose their precision
_OFFERED = 0.9  # a fleet serves a target rate only if the trace's requests came at this share of it at least
_CLOSED = 1.1  # twice the rate asked bringing requests at less than this times the last run's pace: a closed loop


def trace_rate(requests: Sequence[ReplayRequest]) -> float:
    """The trace's own arrival rate, requests a second: its requests over the span of the times
    they start at (a session's later turns follow their previous one, so the span is its starts')."""
    times = [r.at_s for r in requests]
    span = max(times) - min(times) if times else 0.0
    return len(requests) / span if span > 0 else float(len(requests))


def capacity(requests: Sequence[ReplayRequest], policy: str, fleet: FleetConfig, tokenizer: PromptTokenizer,
             slo_ttft_p99_s: float, on_run: Callable[[float, dict], None] | None = None,
             steps: int = _STEPS) -> dict:
    """The figures of the fastest served rate found (``simulate``'s, plus ``capacity_rps``,
    ``rate_scale`` and ``runs``); ``capacity_rps`` 0.0 when even the slowest scale searched misses
    the objective, None when it met the objective at the fastest (a closed loop: a trace of
    sessions whose turns wait for their answers loads a fleet no further however fast they start;
    seen when doubling the rate asked brings the requests less than 1.1 times as fast, or at the
    fastest scale searched).

    The search starts at ``fleet.rate_scale`` (a good guess saves runs), doubles or halves it
    until a served and an unserved scale bracket the capacity, then halves the bracket's ratio
    ``steps`` times (its geometric middle): the capacity found is within a factor of
    ``2 ** (1 / 2 ** steps)`` below the true one. ``on_run`` is told each scale tried and its figures."""
    tried = 0

    def run(scale: float) -> dict:
        nonlocal tried
        tried += 1
        figures = simulate(requests, policy, replace(fleet, rate_scale=scale), tokenizer)
        if on_run is not None:
            on_run(scale, figures)
        return figures

    def served(figures: dict) -> bool:  # a prompt past the model's length is refused at any rate: not load
        p99 = figures["ttft_p99_s"]
        return p99 is not None and p99 <= slo_ttft_p99_s

    scale = start = fleet.rate_scale
    figures = run(scale)
    good, bad = (scale, None) if served(figures) else (None, scale)
    best = figures if good is not None else None
    while good is None and bad > start / _WIDEST:
        scale = bad / 2
        figures = run(scale)
        if served(figures):
            good, best = scale, figures
        else:
            bad = scale
    while bad is None and good < start * _WIDEST:
        scale = good * 2
        figures = run(scale)
        if served(figures):
            if _paced(best, figures):  # twice the rate asked, not twice the rate that came:
                good, best = scale, figures  # turns that wait for their answers set the pace
                break
            good, best = scale, figures
        else:
            bad = scale
    if good is None:
        return {**figures, "capacity_rps": 0.0, "rate_scale": bad, "runs": tried}
    for _ in range(steps if bad is not None else 0):
        scale = (good * bad) ** 0.5
        figures = run(scale)
        if served(figures):
            good, best = scale, figures
        else:
            bad = scale
    if bad is None:  # served at every rate tried: sessions that wait for their answers bound the load
        return {**best, "capacity_rps": None, "rate_scale": good, "runs": tried}
    return {**best, "capacity_rps": trace_rate(requests) * good, "rate_scale": good, "runs": tried}


def fewest_replicas(requests: Sequence[ReplayRequest], policy: str, fleet: FleetConfig, tokenizer: PromptTokenizer,
                    slo_ttft_p99_s: float, rate_rps: float,
                    on_run: Callable[[int, dict], None] | None = None) -> dict:
    """The figures of the smallest fleet of at most ``fleet.replicas`` that serves the trace at
    ``rate_rps`` requests a second with TTFT p99 within the objective (``simulate``'s, plus
    ``replicas``, None when even ``fleet.replicas`` misses it, then with that fleet's figures, and
    ``rate_scale``). Sizes 1, 2, 4, ... are tried until one serves, then the gap to the last that
    did not is halved to one replica: more replicas serve at least as well, so ~2 log2(N) runs.
    A fleet serves the rate when TTFT p99 is within the objective and the requests came at 0.9 of
    the rate at least (``offered_rps``): sessions that wait for their answers, or prompts no
    replica takes, can hold a trace below the rate asked. ``on_run`` is told each size tried and
    its figures.

    Raises ValueError when ``rate_rps`` is not above 0, or asks for the trace's times scaled by
    less than 1e-6 or more than 1e6."""
    if not rate_rps > 0:
        raise ValueError(f"rate_rps must be above 0, got {rate_rps}")
    scale = rate_rps / trace_rate(requests)
    if not _SCALES[0] <= scale <= _SCALES[1]:
        raise ValueError(f"the trace comes at {trace_rate(requests):.4g} requests/s: a target rate must be within "
                         f"{_SCALES[0]:g} and {_SCALES[1]:g} times that")
    tried: dict[int, dict] = {}

    def served(n: int) -> bool:
        tried[n] = simulate(requests, policy, replace(fleet, replicas=n, rate_scale=scale), tokenizer)
        if on_run is not None:
            on_run(n, tried[n])
        f = tried[n]
        carried = f["offered_rps"] is None or f["offered_rps"] >= _OFFERED * rate_rps
        return carried and f["ttft_p99_s"] is not None and f["ttft_p99_s"] <= slo_ttft_p99_s

    low, high = 0, 1  # the largest size known not to serve, the size tried next
    while not served(high):
        if high >= fleet.replicas:
            return {**tried[high], "replicas": None, "rate_scale": scale}
        low, high = high, min(2 * high, fleet.replicas)
    while high - low > 1:  # high serves, low does not
        mid = (low + high) // 2
        if served(mid):
            high = mid
        else:
            low = mid
    return {**tried[high], "replicas": high, "rate_scale": scale}


def _paced(before: dict, after: dict) -> bool:
    """Whether a run at twice the rate of ``before`` came no faster (``offered_rps``): the
    trace's own turns, waiting for their answers, set its pace. A trace's length is no sign of
    it: the last answers of an open trace take as long at any rate once its requests come at once."""
    if before["offered_rps"] is None or after["offered_rps"] is None:
        return before["duration_s"] > 0 and after["duration_s"] >= before["duration_s"]
    return after["offered_rps"] < _CLOSED * before["offered_rps"]
