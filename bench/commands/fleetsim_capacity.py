"""Each policy's capacity at a TTFT objective, per workload, at 8 to 256 replicas (the fleet simulator).

For each workload and fleet size, ``prefix-router fleetsim``'s search (``tools/fleetsim/
capacity.py``) finds the highest arrival rate each routing policy serves with TTFT p99 within the
objective, and reports its token hit rate and TTFT there. The workloads:

- the Mooncake traces (at least 4,000 requests, and a minute of arrivals at the rate N replicas
  would prefill every prompt whole: 12,500-14,400 at 128 replicas, 25,000-28,800 at 256; the
  synthetic trace's 3,993 played back to back past that; an objective of 5 s, since 2 s is below
  what an idle replica takes to prefill their longest prompts), at every size. A shorter run measures a burst, not a
  load the fleet sustains: with 32 requests a replica, 256 replicas took them in 4-9 s of arrivals,
  the queues still growing when the run ended (docs/benchmarks.md, "Capacity at 8 to 256 replicas");
- coding agents (``coding_agents``: 48 x N sessions whose turns wait for their answers, contexts to
  ~40k tokens; a closed loop needs that many to load a fleet at all: with 24 a replica, this
  gateway and session hashing served every session at full pace within 2 s, where round-robin
  reached 2 s at 17 req/s on 8 replicas), at 8, 32 and 128 (23-29 minutes of CPU a policy at
  128);
- SGLang's generated shared prefix (32 x N system prompts, 16 questions each) and ``vllm bench
  serve``'s ``prefix_repetition`` (32 prefixes) and ``random`` with a shared prefix
  (``vllm_bench_requests``; 512 x N prompts each), at 8 and 32.

Not in the matrix: chat sessions of one 2,000-token system prompt (``one_system_prompt``, 2 s of
thought between turns). Short questions on one cached prompt never load a fleet past what the
sessions' own pace brings: with 1,000 sessions a replica at 8 replicas, every policy served
510-715 requests/s within 2 s, about as fast as the sessions come however fast they start (TTFT
p99 0.45-1.8 s; docs/benchmarks.md).

A workload grows with the fleet: a fixed one is served whole at once by a big fleet, its capacity
then unbounded and saying nothing. Short prompts with high hit rates need ~500 requests a replica
before a fleet misses a 2 s objective at all, so those workloads stop at 32 replicas here (at 1 ms
of CPU a request, 256 replicas would take ~2 minutes a run). Every run is virtual time: figures
are the same on any machine; the CPU seconds are this one's. Finished cells are kept in ``.cache/fleetsim-capacity/
cells.jsonl`` and not run again unless ``--fresh`` (needed too after a change to a workload's size:
a kept cell is known by workload, fleet size and policy only).

    python -m bench fleetsim-capacity [--sizes 8,32,128,256] [--workloads NAME,...] [--jobs 2]

Writes ``bench/results/fleetsim-capacity/`` (README, results.json, capacity.png).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from prefix_router.prompts.tokenizer import load_tokenizer
from prefix_router.tools.fleetsim.capacity import capacity, trace_rate
from prefix_router.tools.fleetsim.jobs import load_jobs
from prefix_router.tools.fleetsim.router import POLICIES
from prefix_router.tools.fleetsim.run import FleetConfig
from prefix_router.tools.sim.config import SimConfig

from .. import CACHE, RESULTS
from ..report import command_line, write_results
from .fleetsim_speed import back_to_back
from ..workloads import (DEFAULT_TRACES, VllmBenchShape, coding_agents, generated_shared_prefix, vllm_bench_requests)

SIZES = (8, 32, 128, 256)
OBJECTIVE_S, LONG_PROMPT_OBJECTIVE_S = 2.0, 5.0
BASELINES = tuple(p for p in POLICIES if p != "prefix-router")
CELLS = CACHE / "fleetsim-capacity" / "cells.jsonl"


MIN_REQUESTS, SPAN_S = 4000, 60.0  # a Mooncake run's least requests, and its least arrivals' span (the docstring)


def _mooncake(path: Path):
    def make(n: int):
        head = load_jobs(str(path), workload=None, limit=MIN_REQUESTS, seed=0)
        tokens = sum(_prompt_tokens(r) for r in head) / len(head)
        count = max(MIN_REQUESTS, round(SPAN_S * n * SimConfig().prefill_tokens_per_s / tokens))
        requests = load_jobs(str(path), workload=None, limit=count, seed=0) if count > len(head) else head
        return back_to_back(requests, count) if len(requests) < count else requests
    return make


def _shape(dataset: str):
    return lambda n: vllm_bench_requests(VllmBenchShape(dataset, dataset, False, 512 * n, 16.0,
                                                        prefixes=32 if dataset == "prefix_repetition" else 1))


SMALL = (8, 32)  # sizes affordable for the workloads that need many requests a replica (see the docstring)
# name -> (requests for a fleet of n, TTFT p99 objective in s, fleet sizes run by default)
WORKLOADS = {
    **{f"mooncake {p.stem.split('_')[-1]}": (_mooncake(p), LONG_PROMPT_OBJECTIVE_S, SIZES) for p in DEFAULT_TRACES},
    "coding agents": (lambda n: coding_agents(sessions=48 * n), OBJECTIVE_S, SMALL + (128,)),
    "sglang generated-shared-prefix": (lambda n: generated_shared_prefix(groups=32 * n), OBJECTIVE_S, SMALL),
    "vllm-bench prefix-repetition": (_shape("prefix_repetition"), OBJECTIVE_S, SMALL),
    "vllm-bench random shared-prefix": (_shape("random"), OBJECTIVE_S, SMALL),
}


@functools.lru_cache(maxsize=2)
def _requests(workload: str, n: int):
    return WORKLOADS[workload][0](n)


def _prompt_tokens(r) -> float:
    """A request's prompt length in the byte tokenizer's tokens (4 characters each), roughly."""
    if "input_length" in r.meta:
        return r.meta["input_length"]
    if "prompt" in r.body:
        return len(r.body["prompt"]) / 4
    return sum(len(m.get("content") or "") for m in r.body["messages"]) / 4


def _first_guess(requests, n: int, engine: SimConfig) -> float:
    """The rate scale at which n replicas would prefill every prompt whole as fast as it comes: a
    policy with no cache hits saturates near it, one with hits above it."""
    tokens = sum(_prompt_tokens(r) for r in requests) / len(requests)
    return n * engine.prefill_tokens_per_s / tokens / trace_rate(requests)


def chain(workload: str, policy: str, sizes: tuple[int, ...], steps: int, kept: dict) -> list[dict]:
    """One workload under one policy at each fleet size, smallest first, each search starting
    where the last size's capacity, scaled by the fleet, says; cells in ``kept`` not run again."""
    tokenizer, engine, out, last = load_tokenizer(None), SimConfig(), [], None
    objective = WORKLOADS[workload][1]
    for n in (n for n in sizes if n in WORKLOADS[workload][2]):
        if (workload, n, policy) in kept:
            last = kept[(workload, n, policy)]
            continue
        requests = _requests(workload, n)
        guess = _first_guess(requests, n, engine)
        if last is not None and last["capacity_rps"]:
            guess = last["capacity_rps"] * n / last["replicas"] / trace_rate(requests)
        started = time.process_time()
        found = capacity(requests, policy, FleetConfig(replicas=n, engine=engine, rate_scale=guess), tokenizer,
                         objective, steps=steps)
        last = {"workload": workload, "replicas": n, "policy": policy, "objective_s": objective,
                "trace_requests": len(requests), "cpu_s": round(time.process_time() - started, 1), **found}
        out.append(last)
        print(f"{workload:32} {n:4} {policy:28} capacity {found['capacity_rps']} hit {found['token_hit_rate']:.3f} "
              f"({found['runs']} runs, {last['cpu_s']:.0f} s)", file=sys.stderr, flush=True)
        with open(CELLS, "a") as f:
            f.write(json.dumps(last) + "\n")
    return out


def run_all(todo: list[tuple], jobs: int) -> None:
    """Each ``(function, *args)`` of ``todo``: in this process, or in ``jobs`` processes."""
    if jobs <= 1:
        for fn, *args in todo:
            fn(*args)
    elif todo:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for f in as_completed([pool.submit(fn, *args) for fn, *args in todo]):
                f.result()


def read_cells(path: Path) -> list[dict]:
    """The cells kept in ``path`` (one JSON object a line), none when it is not there."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _kept() -> dict[tuple, dict]:
    return {(c["workload"], c["replicas"], c["policy"]): c for c in read_cells(CELLS)}


def served_rps(c: dict) -> float | None:
    """A cell's capacity as requests/s that came at the fastest rate served (``offered_rps``):
    where sessions wait for their answers (coding agents) the trace's rate asked runs ahead of the
    requests' (agents at 8 replicas: 68 asked, 32 came), and what came is what the fleet served.
    Cells kept from before the figure was recorded are open traces, where the two are one; None
    where unbounded."""
    if c["capacity_rps"] is None:
        return None
    return c.get("offered_rps") or c["capacity_rps"]


def _capacity(c: dict) -> str:
    rate = served_rps(c)
    if rate is None:
        return "unbounded"
    return f"{rate:,.0f} ({c['token_hit_rate']:.2f})" if rate >= 100 else f"{rate:.3g} ({c['token_hit_rate']:.2f})"


def _table(cells: dict, workloads: list[str], sizes: tuple[int, ...], policies: tuple[str, ...]) -> list[str]:
    """A row a workload and size: each policy's capacity (requests/s) and hit rate there, and
    this gateway's over the best baseline's, and how long this gateway's run at its capacity took
    its requests in (``_span``)."""
    lines = ["| workload (objective) | replicas | " + " | ".join(policies)
             + " | prefix-router / best baseline | arrivals (s) |",
             "|---|---:|" + "---:|" * len(policies) + "---:|---:|"]
    for w in workloads:
        for n in sizes:
            row = [cells.get((w, n, p)) for p in policies]
            if not any(row):
                continue
            ratio = _ratio({p: c for p, c in zip(policies, row) if c})
            objective = next(c["objective_s"] for c in row if c)
            lines.append(f"| {w} ({objective:g} s) | {n} | " + " | ".join(_capacity(c) if c else "-" for c in row)
                         + f" | {ratio} | {_span(cells.get((w, n, 'prefix-router')))} |")
    return lines


def _span(c: dict | None) -> str:
    """Seconds over which the run at a cell's capacity brought its requests in (requests over the
    rate that came): a span of a few times the objective measures how a fleet drains a burst, not
    a load it sustains, since a queue that grows without bound needs time to pass the objective."""
    rate = served_rps(c) if c else None
    return f"{c['requests'] / rate:,.0f}" if rate else "-"


def _ratio(row: dict) -> str:
    ours = row.get("prefix-router")
    base = [served_rps(c) for p, c in row.items() if p != "prefix-router"]  # None: unbounded
    if ours is None or not base:
        return "-"
    if any(b is None for b in base):
        return "a baseline unbounded" if ours["capacity_rps"] is not None else "all unbounded"
    if ours["capacity_rps"] is None:
        return "unbounded"
    return f"{served_rps(ours) / max(base):.2f}x" if max(base) else "-"


def _plot(cells: dict, workloads: list[str], sizes: tuple[int, ...], policies: tuple[str, ...], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(workloads), 4)
    rows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    fig.suptitle("Capacity at the TTFT p99 objective against fleet size (fleet simulator)")
    for ax, w in zip(axes.flat, workloads):
        for p in policies:
            points = [(n, served_rps(cells[(w, n, p)])) for n in sizes
                      if (w, n, p) in cells and served_rps(cells[(w, n, p)])]
            if points:
                ax.plot(*zip(*points), marker="o", label=p, linewidth=2.5 if p == "prefix-router" else 1)
        ax.set(title=w, xlabel="replicas", ylabel="requests/s", xscale="log", yscale="log")
        ax.set_xticks(list(sizes), [str(n) for n in sizes])
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.savefig(out / "capacity.png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return out / "capacity.png"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fleetsim-capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="fleet sizes, comma-separated")
    ap.add_argument("--workloads", help="comma-separated names (default: all): " + ", ".join(WORKLOADS))
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    ap.add_argument("--steps", type=int, default=4, help="halvings of the bracket's ratio: 2**(1/2**steps) precision")
    ap.add_argument("--jobs", type=int, default=2, help="processes (a chain of sizes each)")
    ap.add_argument("--fresh", action="store_true", help="run every cell again, forgetting the kept ones")
    ap.add_argument("--report-only", action="store_true", help="write the results from the kept cells, run none")
    ap.add_argument("--out", type=Path, default=RESULTS / "fleetsim-capacity")
    args = ap.parse_args(argv)
    sizes = tuple(sorted(int(n) for n in args.sizes.split(",")))
    workloads = args.workloads.split(",") if args.workloads else list(WORKLOADS)
    policies = tuple(args.policies.split(","))
    unknown = [w for w in workloads if w not in WORKLOADS] + [p for p in policies if p not in POLICIES]
    if unknown:
        ap.error(f"unknown: {', '.join(unknown)}")
    CELLS.parent.mkdir(parents=True, exist_ok=True)
    if args.fresh:
        CELLS.unlink(missing_ok=True)
    kept = _kept()
    todo = [(w, p) for w in workloads for p in policies
            if any((w, n, p) not in kept for n in sizes if n in WORKLOADS[w][2])]
    started = time.perf_counter()
    if not args.report_only:
        run_all([(chain, w, p, sizes, args.steps, kept) for w, p in todo], args.jobs)
    cells = {k: c for k, c in _kept().items() if k[0] in workloads and k[1] in sizes and k[2] in policies}
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    _plot(cells, workloads, sizes, policies, out)
    cpu = sum(c["cpu_s"] for c in cells.values())
    lines = ["Each cell: the policy's capacity in requests/s at TTFT p99 within the objective (the requests that "
             "came at the fastest rate served: where sessions wait for their answers, below the rate asked, which "
             "`results.json` keeps as `capacity_rps`), and its token hit rate there; `unbounded` where the fleet "
             "served the workload whole at the fastest rate (a closed "
             f"loop of sessions). {len(cells)} cells, {cpu:,.0f} s of CPU in all "
             f"({time.perf_counter() - started:,.0f} s of wall time this call). Precision: capacities within "
             f"a factor {2 ** (1 / 2 ** args.steps):.3f} below the true one.", "",
             *_table(cells, workloads, sizes, policies), "", "![capacity](capacity.png)"]
    write_results(out, "Capacity at a TTFT objective, 8 to 256 replicas", command_line(__name__, argv), lines,
                  {"cells": list(cells.values())})
    return 0
