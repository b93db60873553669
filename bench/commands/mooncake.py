"""The Mooncake conversation trace through the gateway in front of 8 simulated replicas, against round-robin.

For each policy (prefix affinity, then round-robin for contrast), on fresh replicas: replay the
trace time-compressed through a gateway, then read every replica's own
``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` and request count. The
bound to compare with is one pooled cache of the same total capacity serving the same requests
one after another (``pooled_hit_rate``: the simulator's own KV cache rules, computed offline).
``compare`` runs the same trace beside the peer routers; this is the gateway alone, on the
whole trace.

    python -m bench mooncake [--limit N] [--replicas 8] [--time-scale 20]

Writes ``README.md`` and ``results.json`` to ``--out`` (``bench/results/mooncake``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from prefix_router.tools.replay.client import replay
from prefix_router.tools.replay.summary import summarize
from prefix_router.tools.replay.workloads import load_mooncake

from .. import RESULTS
from ..meters import CACHE_RESULTS, ROUTES, metric_sum, scrape
from ..pooled import pooled_hit_rate
from ..report import command_line, write_results
from ..systems import Gateway, fleet
from ..workloads import DEFAULT_TRACES, MODEL

TRACE = DEFAULT_TRACES[0]  # the conversation trace


def run_policy(policy: str, requests, args, log_dir: Path) -> dict:
    """One replay through a gateway with ``policy`` on fresh replicas: the replicas' counters and
    the gateway's routes and miss kinds."""
    sim_args = ["--model", MODEL, "--num-blocks", str(args.num_blocks), "--time-scale", str(args.time_scale)]
    gateway = Gateway(policy, policy, ("--config", str(args.gateway_config)) if args.gateway_config else ())
    with fleet(args.replicas, log_dir, sim_args) as urls, gateway.start(urls, log_dir) as started:
        began = time.perf_counter()
        records = asyncio.run(replay(requests, started.url, model=MODEL, time_scale=args.time_scale))
        wall = time.perf_counter() - began
        pages = [scrape(u) for u in urls]
        own = scrape(started.url)
    hits = sum(metric_sum(p, "vllm:prefix_cache_hits_total") for p in pages)
    queries = sum(metric_sum(p, "vllm:prefix_cache_queries_total") for p in pages)
    per_replica = [metric_sum(p, "vllm:request_success_total") for p in pages]
    prefill = [metric_sum(p, "vllm:prompt_tokens_total") for p in pages]
    summary = summarize(records, args.time_scale)
    return {
        "policy": policy, "requests": len(records), "errors": summary["errors"], "wall_s": wall,
        "hit_rate": hits / queries if queries else 0.0,
        "busiest_share_of_fair": max(per_replica) / (sum(per_replica) / len(per_replica)) if sum(per_replica) else 0.0,
        "busiest_prefill_share_of_fair": max(prefill) / (sum(prefill) / len(prefill)) if sum(prefill) else 0.0,
        "ttft_p50_modelled_s": (summary["ttft_p50_s"] or 0) * args.time_scale,
        "ttft_p99_modelled_s": (summary["ttft_p99_s"] or 0) * args.time_scale,
        "requests_per_replica": per_replica,
        "gateway_cache_results": {r: metric_sum(own, "prefix_router_cache_requests_total", result=r)
                                  for r in CACHE_RESULTS},
        "routes": {r: metric_sum(own, "prefix_router_requests_total", route=r) for r in ROUTES},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench mooncake", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=28_000, help="per replica (H100 80 GB, 8B model)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--policies", default="prefix-affinity,round-robin")
    parser.add_argument("--gateway-config", type=Path, default=None, help="YAML for the gateway (routing knobs)")
    parser.add_argument("--out", type=Path, default=RESULTS / "mooncake")
    args = parser.parse_args(argv)
    if not args.trace.exists():
        print(f"trace {args.trace} not found", file=sys.stderr)
        return 2
    requests = load_mooncake(args.trace, limit=args.limit)
    bound = pooled_hit_rate(requests, args.replicas * (args.num_blocks - 1) + 1, args.block_size)
    log_dir = Path("/tmp") / f"bench_mooncake_{os.getpid()}"
    rows = [run_policy(p, requests, args, log_dir) for p in args.policies.split(",")]
    lines = [f"Mooncake conversation trace, {len(requests)} requests, {args.replicas} simulated replicas x "
             f"{args.num_blocks} blocks of {args.block_size}, time scale {args.time_scale:g}; pooled-cache bound "
             f"{bound:.3f}", "",
             "| policy | token hit rate | of pooled bound | busiest replica (requests / fair) | busiest (prefill tokens / fair) "
             "| TTFT p50 / p99 (modelled s) | errors |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['hit_rate']:.3f} | {r['hit_rate'] / bound:.1%} | "
                     f"{r['busiest_share_of_fair']:.2f} | {r['busiest_prefill_share_of_fair']:.2f} | "
                     f"{r['ttft_p50_modelled_s']:.2f} / {r['ttft_p99_modelled_s']:.2f} | {r['errors']} |")
    write_results(args.out, "The Mooncake conversation trace through the gateway", command_line(__name__, argv), lines,
                  {"pooled_bound": bound, "rows": rows})
    return 0
