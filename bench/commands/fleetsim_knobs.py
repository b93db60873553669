"""This gateway's routing knobs re-validated at fleet scale: capacity at the TTFT objective with
each knob moved off its default, one at a time, against the defaults (the fleet simulator).

Every knob of ``routing`` that the rule reads (``config/schema.py: RoutingConfig``) was tuned on
the HTTP matrix at 4 and 8 replicas; here each takes a lower and a higher value on workloads of
``fleetsim-capacity`` (its requests, its objectives) at a fleet size each (``--replicas``, one
for all or one a workload), and the table gives each value's capacity over the defaults' (1.00:
the same; precision as there). A knob whose default is beaten by more than the precision on a
workload is one to move, or to explain. By default the Mooncake conversation trace at 32
replicas (4,000 requests, 76 s of arrivals at capacity; at 256 a cell is ~13 minutes of CPU, 18
cells ~4 hours, since a run there must be a minute of arrivals: ``fleetsim-capacity``'s
docstring) and coding agents at 8.

    python -m bench fleetsim-knobs [--workloads NAME,...] [--replicas N[,N...]] [--jobs 2]

Writes ``bench/results/fleetsim-knobs/`` (README, results.json).
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
from prefix_router.tools.fleetsim.run import FleetConfig
from prefix_router.tools.sim.config import SimConfig

from .. import CACHE, RESULTS
from ..report import command_line, write_results
from .fleetsim_capacity import WORKLOADS, _first_guess, _requests, read_cells, run_all, served_rps

# knob -> the values tried beside its default
KNOBS = {
    "load_factor": (1.1, 1.5, 2.0),
    "load_slack": (0, 4),
    "share_half_life_s": (10.0, 300.0),
    "holder_load_factor": (3.0,),
    "holder_share_factor": (2.5,),
    "holder_slack": (1, 8),
    "match_threshold": (0.0, 0.8),
    "sole_router": (False,),
    "prefill_queue_weight": (0.0, 0.25),
}
CELLS = CACHE / "fleetsim-knobs" / "cells.jsonl"


def variants() -> list[tuple[str, object]]:
    """("default", None), then each (knob, value) of ``KNOBS``."""
    return [("default", None)] + [(k, v) for k, values in KNOBS.items() for v in values]


def cell(workload: str, knob: str, value, replicas: int, steps: int) -> dict:
    """Capacity of the prefix-router policy with ``knob`` at ``value`` (the defaults for "default")."""
    routing = RoutingConfig() if knob == "default" else dataclasses.replace(RoutingConfig(), **{knob: value})
    requests, engine = _requests(workload, replicas), SimConfig()
    fleet = FleetConfig(replicas=replicas, engine=engine, rate_scale=_first_guess(requests, replicas, engine),
                        routing=routing)
    started = time.process_time()
    found = capacity(requests, "prefix-router", fleet, load_tokenizer(None), WORKLOADS[workload][1], steps=steps)
    out = {"workload": workload, "replicas": replicas, "knob": knob, "value": value,
           "cpu_s": round(time.process_time() - started, 1), **found}
    print(f"{workload:32} {knob:20} {value!s:6} capacity {found['capacity_rps']} ({found['runs']} runs)",
          file=sys.stderr, flush=True)
    with open(CELLS, "a") as f:
        f.write(json.dumps(out) + "\n")
    return out


def _kept() -> dict[tuple, dict]:
    return {(c["workload"], c["replicas"], c["knob"], json.dumps(c["value"])): c for c in read_cells(CELLS)}


def _table(cells: dict, runs: list[tuple[str, int]]) -> list[str]:
    """A row a knob value: its capacity over the defaults' on each (workload, fleet size)."""
    lines = ["| knob | value | " + " | ".join(f"{w} at {n}" for w, n in runs) + " |",
             "|---|---|" + "---:|" * len(runs)]
    for knob, value in variants():
        row = []
        for w, n in runs:
            c, base = cells.get((w, n, knob, json.dumps(value))), cells.get((w, n, "default", "null"))
            if c is None or base is None:
                row.append("-")
            elif knob == "default":  # the requests that came, as fleetsim-capacity's table reads them
                row.append(f"{served_rps(c):.3g} req/s ({c['token_hit_rate']:.2f})" if c["capacity_rps"] else "-")
            elif c["capacity_rps"] and base["capacity_rps"]:
                row.append(f"{served_rps(c) / served_rps(base):.2f} ({c['token_hit_rate']:.2f})")
            else:
                row.append(str(c["capacity_rps"]))
        shown = getattr(RoutingConfig(), knob) if knob != "default" else ""
        lines.append(f"| {knob}{f' (default {shown})' if knob != 'default' else ''} | "
                     f"{'' if value is None else value} | " + " | ".join(row) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fleetsim-knobs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="32,8", help="fleet size, or one a workload, comma-separated")
    ap.add_argument("--workloads", default="mooncake conversation,coding agents",
                    help="comma-separated names of fleetsim-capacity's workloads: " + ", ".join(WORKLOADS))
    ap.add_argument("--steps", type=int, default=4, help="halvings of the bracket's ratio, as fleetsim-capacity's")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "fleetsim-knobs")
    args = ap.parse_args(argv)
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workloads: {', '.join(unknown)}")
    sizes = [int(n) for n in args.replicas.split(",")]
    if len(sizes) not in (1, len(workloads)):
        ap.error("--replicas: one fleet size, or one a workload")
    runs = list(zip(workloads, sizes * len(workloads) if len(sizes) == 1 else sizes))
    CELLS.parent.mkdir(parents=True, exist_ok=True)
    kept = _kept()
    started = time.perf_counter()
    run_all([(cell, w, k, v, n, args.steps) for w, n in runs for k, v in variants()
             if (w, n, k, json.dumps(v)) not in kept], args.jobs)
    cells = {key: c for key, c in _kept().items() if (key[0], key[1]) in runs}
    cpu = sum(c["cpu_s"] for c in cells.values())
    lines = ["The prefix-router policy, each knob moved alone: its capacity over "
             "the defaults' at the workload's objective (`fleetsim-capacity`'s), and the token hit rate there. "
             f"{cpu:,.0f} s of CPU in all ({time.perf_counter() - started:,.0f} s of wall time this call); "
             f"capacities within a factor {2 ** (1 / 2 ** args.steps):.3f} below the true ones.", "",
             *_table(cells, runs)]
    write_results(args.out, "Routing knobs at fleet scale", command_line(__name__, argv), lines,
                  {"cells": list(cells.values())})
    return 0
