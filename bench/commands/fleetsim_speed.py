"""How long the fleet simulator takes on a big fleet: a Mooncake trace at 256 replicas.

The trace is played back to back until ``--requests`` requests (each copy starting where the
last one's arrivals ended, with blocks of its own: the same traffic, a longer day), through
``--replicas`` modelled replicas under ``--policy``, ``--runs`` times in this process: CPU
seconds a run (``time.process_time``), and whether the runs printed identical figures (one seed:
they must).

    python -m bench fleetsim-speed [--trace PATH] [--requests 100000] [--replicas 256] [--runs 2]

Writes ``bench/results/fleetsim-speed/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from tqdm import tqdm

from prefix_router.prompts.tokenizer import load_tokenizer
from prefix_router.tools.fleetsim.jobs import load_jobs
from prefix_router.tools.fleetsim.run import FleetConfig, simulate
from prefix_router.tools.replay.request import ReplayRequest

from .. import RESULTS, ROOT
from ..report import command_line, write_results

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"


def back_to_back(requests: list[ReplayRequest], count: int) -> list[ReplayRequest]:
    """``requests`` (Mooncake, with ``meta["hash_ids"]``) played again after themselves until
    ``count``: copy k arrives k times the trace's span later, its hash ids moved past every id
    of the copies before, so that no copy's prompts meet another's."""
    if not requests:
        raise ValueError("no requests to repeat")
    span = max(r.at_s for r in requests) + 1.0
    ids = max(h for r in requests for h in r.meta["hash_ids"]) + 1
    out = []
    for k in range(-(-count // len(requests))):
        for r in requests[: count - len(out)]:
            meta = {**r.meta, "hash_ids": [h + k * ids for h in r.meta["hash_ids"]]}
            out.append(dataclasses.replace(r, at_s=r.at_s + k * span, meta=meta))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fleetsim-speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake .jsonl trace")
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--replicas", type=int, default=256)
    ap.add_argument("--policy", default="prefix-router")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "fleetsim-speed")
    args = ap.parse_args(argv)
    if not args.trace.is_file():
        print(f"python -m bench fleetsim-speed: no trace at {args.trace} (give --trace)", file=sys.stderr)
        return 2
    requests = back_to_back(load_jobs(str(args.trace)), args.requests)
    runs = []
    for run in range(args.runs):
        with tqdm(total=len(requests), desc=f"run {run + 1}", unit="req", file=sys.stderr, leave=False) as bar:
            started = time.process_time()
            figures = simulate(requests, args.policy, FleetConfig(replicas=args.replicas), load_tokenizer(None),
                               progress=bar.update)
            runs.append({"cpu_s": time.process_time() - started, "figures": figures})
    same = all(r["figures"] == runs[0]["figures"] for r in runs)
    f = runs[0]["figures"]
    lines = [f"{len(requests):,} requests of `{args.trace.name}` played back to back, {args.replicas} replicas, "
             f"policy {args.policy}, {args.runs} runs in one process (`bench/commands/fleetsim_speed.py`).", "",
             "| run | CPU s | CPU ms a request |", "|---|---|---|"]
    lines += [f"| {i + 1} | {r['cpu_s']:.0f} | {1000 * r['cpu_s'] / len(requests):.2f} |" for i, r in enumerate(runs)]
    lines += ["", f"Identical figures in every run: {'yes' if same else 'NO'}. Token hit rate {f['token_hit_rate']:.4f}, "
              f"busiest over fair {f['busiest_over_fair']:.2f}, TTFT p50 {f['ttft_p50_s']:.3f} s, "
              f"p99 {f['ttft_p99_s']:.3f} s, {f['requests']:,} served, {f['duration_s'] / 3600:.1f} virtual hours."]
    write_results(args.out, "Fleet simulator speed", command_line(__name__, argv), lines,
                  {"requests": len(requests), "replicas": args.replicas, "runs": runs, "identical": same})
    return 0 if same else 1
