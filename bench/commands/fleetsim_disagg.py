"""A disaggregated fleet in the fleet simulator: the prefill replica chosen by its cache (this
gateway) against the peers' choices, the decode replica by this gateway's rule in every run.

A fleet of P prefill and D decode replicas (``FleetConfig.prefill_replicas``;
``tools/fleetsim/run.py`` models the legs: a one-token job on the prefill replica, its blocks held
until the decode replica pulls what it lacks over a 25 GB/s link, a decode job computing the last
prompt token). The prefill replica is chosen by each policy: this gateway's (prefix-router),
round-robin (vLLM's own P/D proxy and vllm-router's default), SGLang's ``cache_aware`` (its P/D
gateway's ``--prefill-policy``) and Dynamo's KV cost. Only the prefill choice differs between
runs, so the table reads as the prefill choice's worth; two more rows measure llm-d's decider
(``disaggregation.min_prefill_tokens``: a request whose decode replica lacks fewer prompt tokens
goes whole to it) at 256 and 1,024 tokens. Two readings a cell: the capacity at
``fleetsim-capacity``'s objective for the workload (requests served a second, TTFT p99 within
it) with the hit rate and TTFT there, and every policy at one common rate (round-robin's
capacity) with its prefill pool's token hit rate and TTFT p50/p99. Workloads: coding agents
(sessions of growing contexts) and SGLang's generated shared prefix (many questions about shared
documents), sized for the fleet as ``fleetsim-capacity`` sizes them.

    python -m bench fleetsim-disagg [--pools 4+4,8+8] [--workloads NAME,...] [--jobs 2]

Writes ``bench/results/fleetsim-disagg/`` (README, results.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from prefix_router.prompts.tokenizer import load_tokenizer
from prefix_router.tools.fleetsim.capacity import capacity
from prefix_router.tools.fleetsim.run import FleetConfig, simulate
from prefix_router.tools.sim.config import SimConfig

from .. import CACHE, RESULTS
from ..report import command_line, write_results
from .fleetsim_capacity import WORKLOADS, _first_guess, _requests, read_cells, run_all, served_rps

# a row's label -> (the policy choosing the prefill replica, disaggregation.min_prefill_tokens)
RULES = {"prefix-router": ("prefix-router", 0), "round-robin": ("round-robin", 0),
         "sglang-cache-aware": ("sglang-cache-aware", 0), "dynamo-kv": ("dynamo-kv", 0),
         "prefix-router, whole under 256": ("prefix-router", 256),
         "prefix-router, whole under 1024": ("prefix-router", 1024)}
DEFAULT_WORKLOADS = ("coding agents", "sglang generated-shared-prefix")
CELLS = CACHE / "fleetsim-disagg" / "cells.jsonl"


def _fleet(workload: str, prefill: int, decode: int, rule: str) -> tuple[list, FleetConfig]:
    """The workload's requests sized for the whole fleet, and the fleet under ``rule``, its
    search starting where the prefill pool would compute every prompt whole as fast as it comes."""
    requests, engine = _requests(workload, prefill + decode), SimConfig()
    return requests, FleetConfig(replicas=decode, prefill_replicas=prefill, engine=engine,
                                 rate_scale=_first_guess(requests, prefill, engine), decode_policy="prefix-router",
                                 min_prefill_tokens=RULES[rule][1])


def cell(workload: str, prefill: int, decode: int, policy: str, steps: int) -> dict:
    """One rule's capacity on one workload and fleet, kept in ``CELLS`` (``policy``: a label of ``RULES``)."""
    requests, fleet = _fleet(workload, prefill, decode, policy)
    started = time.process_time()
    found = capacity(requests, RULES[policy][0], fleet, load_tokenizer(None), WORKLOADS[workload][1], steps=steps)
    out = {"workload": workload, "prefill": prefill, "decode": decode, "policy": policy, "reading": "capacity",
           "cpu_s": round(time.process_time() - started, 1), **found}
    _keep(out)
    return out


def at_rate(workload: str, prefill: int, decode: int, policy: str, rate_scale: float) -> dict:
    """One rule's figures at one rate scale (the common rate), kept in ``CELLS``."""
    requests, fleet = _fleet(workload, prefill, decode, policy)
    started = time.process_time()
    figures = simulate(requests, RULES[policy][0], dataclasses.replace(fleet, rate_scale=rate_scale),
                       load_tokenizer(None))
    out = {"workload": workload, "prefill": prefill, "decode": decode, "policy": policy, "reading": "common rate",
           "rate_scale": rate_scale, "cpu_s": round(time.process_time() - started, 1), **figures}
    _keep(out)
    return out


def _keep(out: dict) -> None:
    print(f"{out['workload']:32} {out['prefill']}+{out['decode']} {out['policy']:20} {out['reading']}: "
          f"hit {out['token_hit_rate']:.3f} p99 {out['ttft_p99_s']}", file=sys.stderr, flush=True)
    with open(CELLS, "a") as f:
        f.write(json.dumps(out) + "\n")


def _kept() -> dict[tuple, dict]:
    return {(c["workload"], c["prefill"], c["decode"], c["policy"], c["reading"]): c for c in read_cells(CELLS)}


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def _table(cells: dict, runs: list[tuple[str, int, int]]) -> list[str]:
    lines = ["| workload | prefill + decode | prefill choice | capacity (req/s served) | vs round-robin | "
             "hit rate there | TTFT p99 there (ms) | hit rate at the common rate | TTFT p50 / p99 there (ms) | "
             "prompt tokens moved / computed by decode replicas there |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for w, p, d in runs:
        base = cells.get((w, p, d, "round-robin", "capacity"))
        for policy in RULES:
            c, r = cells.get((w, p, d, policy, "capacity")), cells.get((w, p, d, policy, "common rate"))
            if c is None:
                continue
            served = served_rps(c)
            ratio = (f"{served / served_rps(base):.2f}x" if served and base and served_rps(base) else "-")
            common = (f"{r['token_hit_rate']:.3f}", f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])}",
                      f"{r['transfer_tokens']:,} / {r['decode_computed_tokens']:,}") if r else ("-", "-", "-")
            lines.append(f"| {w} | {p} + {d} | {policy} | {'unbounded' if served is None else f'{served:.3g}'} | "
                         f"{ratio} | {c['token_hit_rate']:.3f} | {_ms(c['ttft_p99_s'])} | {' | '.join(common)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fleetsim-disagg", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pools", default="4+4,8+8", help="prefill+decode replicas, comma-separated fleets")
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                    help="comma-separated names of fleetsim-capacity's workloads: " + ", ".join(WORKLOADS))
    ap.add_argument("--steps", type=int, default=4, help="halvings of the bracket's ratio, as fleetsim-capacity's")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "fleetsim-disagg")
    args = ap.parse_args(argv)
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workloads: {', '.join(unknown)}")
    try:
        pools = [tuple(int(n) for n in f.split("+")) for f in args.pools.split(",")]
    except ValueError:
        ap.error("--pools: prefill+decode, e.g. 4+4")
    if any(len(f) != 2 or min(f) < 1 for f in pools):
        ap.error("--pools: prefill+decode, each at least 1")
    runs = [(w, p, d) for w in workloads for p, d in pools]
    CELLS.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    kept = _kept()
    run_all([(cell, w, p, d, policy, args.steps) for w, p, d in runs for policy in RULES
          if (w, p, d, policy, "capacity") not in kept], args.jobs)
    kept = _kept()
    run_all([(at_rate, w, p, d, policy, kept[(w, p, d, "round-robin", "capacity")]["rate_scale"])
          for w, p, d in runs for policy in RULES if (w, p, d, policy, "common rate") not in kept], args.jobs)
    cells = {k: c for k, c in _kept().items() if (k[0], k[1], k[2]) in runs}
    cpu = sum(c["cpu_s"] for c in cells.values())
    lines = ["A disaggregated fleet: the prefill replica chosen by each policy, the decode replica by this "
             "gateway's rule in every run. Capacity: requests served a second with TTFT p99 within the "
             "workload's objective (fleetsim-capacity's: 2 s), within a factor "
             f"{2 ** (1 / 2 ** args.steps):.3f} below the true one. The common rate: round-robin's capacity, "
             "every policy run at it. Hit rates are the prefill pool's (where prompts are computed); tokens moved: "
             "prompt tokens the decode replicas pulled. "
             f"{cpu:,.0f} s of CPU in all ({time.perf_counter() - started:,.0f} s of wall time this call).", "",
             *_table(cells, runs)]
    write_results(args.out, "Prefill/decode disaggregation at fleet scale", command_line(__name__, argv), lines,
                  {"cells": list(cells.values())})
    return 0
