"""Tier-aware against GPU-only routing where the working set overflows GPU memory and replicas
keep a CPU offload tier (the fleet simulator, with each engine's KV events).

The engines hold 3,000 GPU blocks (48k tokens, ~6 GB of Llama-3.1-8B's KV: a GPU whose memory
goes mostly elsewhere, so these workloads overflow it) and a CPU tier of 24,000 (384k tokens,
~48 GB of host memory), loaded back at 300k tokens/s (``tools/sim/config.py``), as vLLM's
OffloadingConnector keeps one (``tools/sim/offload.py``); every gateway follows each engine's
events 50 ms late, the tier's too. Rows: this gateway's rule with the tier weighed at
``routing.cpu_hit_weight`` 0.5, 0.75 (Dynamo's) and 0.9; the same with the tier ignored
(weight 0, the default: GPU-only routing); engines without a CPU tier; round-robin with it. Each row's
capacity at the workload's objective (``fleetsim-capacity``'s), its token hit rate there (vLLM's
``cached_tokens``: GPU hits and tier loads) and TTFT p99 at the GPU-only row's capacity.

    python -m bench fleetsim-tiers [--workloads NAME,...] [--replicas N] [--jobs 2]

Writes ``bench/results/fleetsim-tiers/`` (README, results.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from prefix_router.config import RoutingConfig
from prefix_router.prompts.tokenizer import load_tokenizer
from prefix_router.tools.fleetsim.capacity import capacity
from prefix_router.tools.fleetsim.run import FleetConfig, simulate
from prefix_router.tools.sim.config import SimConfig

from .. import CACHE, RESULTS
from ..report import command_line, write_results
from .fleetsim_capacity import WORKLOADS, _first_guess, _requests, read_cells, run_all, served_rps

GPU_BLOCKS, CPU_BLOCKS, EVENTS_DELAY_S = 3_000, 24_000, 0.05
# row -> (policy, CPU tier blocks, routing.cpu_hit_weight)
VARIANTS = {
    "tier-aware (weight 0.75, Dynamo's)": ("prefix-router", CPU_BLOCKS, 0.75),
    "tier-aware (weight 0.5)": ("prefix-router", CPU_BLOCKS, 0.5),
    "tier-aware (weight 0.9)": ("prefix-router", CPU_BLOCKS, 0.9),
    "GPU-only routing (weight 0, the default)": ("prefix-router", CPU_BLOCKS, 0.0),
    "no CPU tier": ("prefix-router", 0, 0.75),
    "round-robin": ("round-robin", CPU_BLOCKS, 0.75),
}
BASE = "GPU-only routing (weight 0, the default)"
CELLS = CACHE / "fleetsim-tiers" / "cells.jsonl"


def _fleet(variant: str, replicas: int, requests) -> tuple[str, FleetConfig]:
    policy, cpu, weight = VARIANTS[variant]
    engine = SimConfig(num_gpu_blocks=GPU_BLOCKS, cpu_offload_blocks=cpu)
    routing = dataclasses.replace(RoutingConfig(), cpu_hit_weight=weight)
    return policy, FleetConfig(replicas=replicas, engine=engine, rate_scale=_first_guess(requests, replicas, engine),
                               kv_events_delay_s=EVENTS_DELAY_S, routing=routing)


def cell(workload: str, variant: str, replicas: int, steps: int) -> dict:
    """One row's capacity on one workload."""
    requests = _requests(workload, replicas)
    policy, fleet = _fleet(variant, replicas, requests)
    started = time.process_time()
    found = capacity(requests, policy, fleet, load_tokenizer(None), WORKLOADS[workload][1], steps=steps)
    out = {"workload": workload, "replicas": replicas, "variant": variant, "cpu_s": round(time.process_time() - started, 1),
           **found}
    print(f"{workload:32} {variant:40} capacity {found['capacity_rps']} hit {found['token_hit_rate']:.3f}",
          file=sys.stderr, flush=True)
    with open(CELLS, "a") as f:
        f.write(json.dumps(out) + "\n")
    return out


def at_rate(workload: str, variant: str, replicas: int, rate_scale: float) -> dict:
    """One row's run at ``rate_scale`` (the GPU-only row's capacity)."""
    requests = _requests(workload, replicas)
    policy, fleet = _fleet(variant, replicas, requests)
    figures = simulate(requests, policy, dataclasses.replace(fleet, rate_scale=rate_scale), load_tokenizer(None))
    out = {"workload": workload, "replicas": replicas, "variant": variant, "at_base_rate": True,
           "rate_scale": rate_scale, **figures}
    with open(CELLS, "a") as f:
        f.write(json.dumps(out) + "\n")
    return out


def _table(cells: dict, runs: list[tuple[str, int]]) -> list[str]:
    lines = ["| workload | replicas | row | capacity (req/s) | vs GPU-only | token hit rate | TTFT p99 at GPU-only's capacity |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for w, n in runs:
        base = cells.get((w, n, BASE, False))
        for variant in VARIANTS:
            c, at = cells.get((w, n, variant, False)), cells.get((w, n, variant, True))
            if c is None:
                continue
            rps = served_rps(c)
            ratio = f"{rps / served_rps(base):.2f}x" if rps and base and served_rps(base) else "-"
            p99 = f"{at['ttft_p99_s']:.2f} s" if at and at.get("ttft_p99_s") is not None else "-"
            lines.append(f"| {w} | {n} | {variant} | {rps:.3g} | {ratio} | {c['token_hit_rate']:.3f} | {p99} |"
                         if rps else f"| {w} | {n} | {variant} | {c['capacity_rps']} | - | - | {p99} |")
    return lines


def _kept() -> dict[tuple, dict]:
    return {(c["workload"], c["replicas"], c["variant"], bool(c.get("at_base_rate"))): c for c in read_cells(CELLS)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fleetsim-tiers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="sglang generated-shared-prefix,coding agents",
                    help="comma-separated names of fleetsim-capacity's workloads: " + ", ".join(WORKLOADS))
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="halvings of the bracket's ratio, as fleetsim-capacity's")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "fleetsim-tiers")
    args = ap.parse_args(argv)
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workloads: {', '.join(unknown)}")
    runs = [(w, args.replicas) for w in workloads]
    CELLS.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    kept = _kept()
    run_all([(cell, w, v, n, args.steps) for w, n in runs for v in VARIANTS if (w, n, v, False) not in kept], args.jobs)
    kept = _kept()
    todo = []
    for w, n in runs:
        base = kept.get((w, n, BASE, False))
        if base and base["capacity_rps"]:
            todo += [(at_rate, w, v, n, base["rate_scale"]) for v in VARIANTS if (w, n, v, True) not in kept]
    run_all(todo, args.jobs)
    cells = {k: c for k, c in _kept().items() if (k[0], k[1]) in runs}
    cpu = sum(c.get("cpu_s", 0) for c in cells.values())
    lines = [f"Replicas of {GPU_BLOCKS:,} GPU blocks and a CPU tier of {CPU_BLOCKS:,} (16-token blocks), KV events "
             f"{EVENTS_DELAY_S * 1000:.0f} ms late. Capacity at the workload's TTFT p99 objective (requests served/s), "
             f"within a factor {2 ** (1 / 2 ** args.steps):.3f} below the true one; {cpu:,.0f} s of CPU for the "
             f"capacity searches ({time.perf_counter() - started:,.0f} s of wall time this call).", "",
             *_table(cells, runs)]
    write_results(args.out, "Tier-aware routing with CPU offload tiers", command_line(__name__, argv), lines,
                  {"cells": list(cells.values())})
    return 0
