"""The fleet simulator against the HTTP matrix: the same workloads at the same fleet size, side by side.

``compare``'s committed run (``bench/results/compare/results.json``: real processes, 8 simulated
replicas, wall time x5) is read back, and each of its workloads that is a list of requests (the
Mooncake traces, the built-in agent sessions, SGLang's generated shared prefix, sessions of one
system prompt, a dozen agent sessions; not ``vllm bench serve``'s, which its own client
generates) goes through ``prefix-router fleetsim``'s loop (``tools/fleetsim/run.py``) at that
workload's fleet size, the built-in tokenizer (4 bytes a token) on both sides as there, under
the policy that models each system: this gateway's own code, ``vllm-router-consistent-hash``
for vllm-router's ``consistent_hash``, ``sglang-cache-aware`` for sglang-router's ``cache_aware``.
Compared: token hit rate (goal: within 1 point), busiest replica over fair, TTFT p50 and p99
against the HTTP run's TTFT with the routers' time unscaled (goal for p50: within 10%).

    python -m bench fleetsim [--workloads NAME,...]

Writes ``bench/results/fleetsim/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from prefix_router.prompts.tokenizer import load_tokenizer
from prefix_router.tools.fleetsim.run import FleetConfig, simulate
from prefix_router.tools.sim.config import SimConfig

from .. import RESULTS
from ..report import command_line, write_results
from ..workloads import DEFAULT_TRACES, matrix

COMPARE = RESULTS / "compare" / "results.json"
MODELS = {"prefix-router": "prefix-router", "vllm-router consistent_hash": "vllm-router-consistent-hash",
          "sglang-router cache_aware": "sglang-cache-aware"}  # system in the HTTP matrix -> fleetsim policy
SHAPE_NAMES = {"gsp": "generated-shared-prefix", "system": "one system prompt", "dozen": "a dozen agent sessions"}


def _cell(http: dict, sim: dict) -> dict:
    """One system on one workload: the HTTP run's figures, the simulator's, and the goals' verdicts."""
    p50 = http.get("hop_ttft_p50_s") or http["ttft_p50_s"]
    p99 = http.get("hop_ttft_p99_s") or http["ttft_p99_s"]
    return {"hit_http": http["hit_rate"], "hit_sim": sim["token_hit_rate"],
            "busiest_http": http["busiest_requests_of_fair"], "busiest_sim": sim["busiest_over_fair"],
            "p50_http": p50, "p50_sim": sim["ttft_p50_s"], "p99_http": p99, "p99_sim": sim["ttft_p99_s"],
            "hit_within_1_point": abs(sim["token_hit_rate"] - http["hit_rate"]) <= 0.01,
            "p50_within_10_percent": bool(p50) and abs(sim["ttft_p50_s"] - p50) <= 0.1 * p50}


def _table(cells: list[dict]) -> list[str]:
    lines = ["| workload | system (policy) | hit rate HTTP / fleetsim | busiest / fair HTTP / fleetsim | "
             "TTFT p50 HTTP / fleetsim (s) | TTFT p99 HTTP / fleetsim (s) | hit within 1 pt | p50 within 10% |",
             "|---|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "**no**"}
    for c in cells:
        lines.append(f"| {c['workload']} | {c['system']} ({c['policy']}) | {c['hit_http']:.3f} / {c['hit_sim']:.3f} | "
                     f"{c['busiest_http']:.2f} / {c['busiest_sim']:.2f} | {c['p50_http']:.3f} / {c['p50_sim']:.3f} | "
                     f"{c['p99_http']:.2f} / {c['p99_sim']:.2f} | {yes[c['hit_within_1_point']]} | "
                     f"{yes[c['p50_within_10_percent']]} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fleetsim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", type=Path, default=COMPARE, help="compare's results.json to set beside")
    ap.add_argument("--workloads", help="comma-separated names of its workloads (default: every list of requests)")
    ap.add_argument("--out", type=Path, default=RESULTS / "fleetsim")
    args = ap.parse_args(argv)
    committed = json.loads(args.compare.read_text())
    wanted = set(args.workloads.split(",")) if args.workloads else None
    http = {w["name"]: w for w in committed["workloads"] if wanted is None or w["name"] in wanted}
    limit, sessions = 2000, 48  # compare's full mode (bench/commands/compare.py: MODES)
    traces = [t for t in DEFAULT_TRACES if t.stem in http]  # made only where wanted: 2,000 long prompts each
    shapes = [s for s, name in SHAPE_NAMES.items() if any(n.endswith(name) for n in http)]
    works = [w for w in matrix(traces, limit, sessions, shapes, "full") if w.name in http and w.requests is not None]
    tokenizer = load_tokenizer(None)  # compare's run_cell gives neither side a tokenizer
    engine = SimConfig(num_gpu_blocks=committed["num_blocks"], block_size=committed["block_size"])
    cells, started = [], time.perf_counter()
    for work in works:
        entry = http[work.name]
        for row in entry["rows"]:
            policy = MODELS.get(row["system"])
            if policy is None:
                continue
            sim = simulate(work.requests, policy, FleetConfig(replicas=entry["replicas"], engine=engine), tokenizer)
            cells.append({"workload": work.name, "system": row["system"], "policy": policy, **_cell(row, sim)})
            c = cells[-1]
            print(f"{work.name:34} {policy:20} hit {c['hit_http']:.3f}/{c['hit_sim']:.3f} "
                  f"p50 {c['p50_http']:.3f}/{c['p50_sim']:.3f}", file=sys.stderr, flush=True)
    hits = sum(c["hit_within_1_point"] for c in cells)
    p50s = sum(c["p50_within_10_percent"] for c in cells)
    lines = [f"Each workload of the HTTP matrix in `{args.compare.name}` (`{args.compare.parent.name}/`: its README "
             "names its command and commit) that is a list of requests, through the fleet simulator at its fleet size "
             f"({committed['num_blocks']:,} blocks of {committed['block_size']} a replica), under the policy that "
             "models each system; the HTTP run's TTFT with the routers' time unscaled (`bench/commands/fleetsim.py`). "
             f"{time.perf_counter() - started:.0f} s.", "",
             *_table(cells), "",
             f"Hit rate within 1 point: {hits} of {len(cells)} cells; TTFT p50 within 10%: {p50s} of {len(cells)}."]
    write_results(args.out, "The fleet simulator beside the HTTP matrix", command_line(__name__, argv), lines,
                  {"cells": cells})
    return 0
