"""This gateway against round-robin and the peer routers, side by side, in one run.

For every workload and every system (``bench/peers.py``: this gateway with prefix affinity and
in round-robin mode, vllm-router's ``cache_aware``, ``consistent_hash`` and ``power_of_two``,
sglang-router's ``cache_aware``), on fresh simulated replicas so that no system inherits another's
cache: start the replicas and the system, replay the workload time-compressed, then read every
replica's own counters. Each replica models an 80 GB GPU serving an 8B model (28,000 blocks of
16 tokens, the simulator's default, ``router/sim/config.py``).

Workloads: the Mooncake conversation and synthetic traces (``--traces``; sent as text prompts,
``load_mooncake(text=True)``, because sglang-router refuses token-id prompts) and the built-in
agent workload. A missing trace file is left out with a note; with none, the built-in chat
workload stands in. Then the overhead sweep (``bench/overhead.py``).

Per system and workload: token hit rate from the replicas' counters
(``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``), its ratio to the
pooled-cache bound (``bench/pooled.py``; the unbounded-cache hit rate, the true ceiling, is
printed beside it), the busiest replica's share of requests and of prefill
tokens (1.00 is a perfect spread), TTFT p50/p90/p99 and end-to-end latency p50/p99 at the client
in modelled seconds (wall x time scale), and errors.

    python -m bench.compare            # full: 8 replicas, 2,000 requests per trace (~40 min on 2 cores)
    python -m bench.compare --quick    # 4 replicas, 150 requests per trace (under 5 min on 2 cores)

Writes ``results.md``, ``results.json`` and PNG plots to ``--out`` (full:
``bench/results/compare``; quick: ``.cache/bench/compare-quick``) and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

from router.launch import running, sim_server
from router.replay.client import replay
from router.replay.generate import builtin_workload
from router.replay.summary import summarize
from router.replay.workloads import load_mooncake

from .fleet import ROOT, metric_sum, scrape
from .peers import PEER_PACKAGES, SYSTEMS, System, ensure_peers
from .pooled import pooled_hit_rate, unbounded_hit_rate

MODEL = "sim"
TRACES = ROOT.parent / "shared" / "traces"
DEFAULT_TRACES = (TRACES / "mooncake_conversation.jsonl", TRACES / "mooncake_synthetic.jsonl")
ROUTES = ("affinity", "sticky", "spill", "fallback")  # prefix_router_requests_total{route}
RESULTS = ("hit", "miss_cold", "miss_changed", "miss_routed", "miss_evicted")  # ..._cache_requests_total{result}
MODES = {  # replicas, requests per trace, agent sessions, time scale, overhead rates and seconds
    "quick": {"replicas": 4, "limit": 150, "sessions": 12, "time_scale": 10.0, "rates": "25,50,100", "seconds": 3.0},
    # past ~150 requests/s the load generator and the replica alone saturate 2 cores (measured:
    # direct TTFT p99 375 ms at 200/s, 16 s at 400/s), so higher rates would measure the machine
    "full": {"replicas": 8, "limit": 2000, "sessions": 48, "time_scale": 5.0, "rates": "25,50,100,150",
             "seconds": 10.0},
}


def workloads(traces: list[Path], limit: int, sessions: int) -> list[tuple[str, list]]:
    """(name, requests) for each trace file present, then the built-in agent workload."""
    out = []
    for path in traces:
        if path.exists():
            out.append((path.stem, load_mooncake(path, limit=limit, text=True)))
        else:
            print(f"note: {path} not found; left out", file=sys.stderr)
    if not out:
        out.append(("builtin-chat", builtin_workload("chat", sessions=sessions)))
    out.append(("builtin-agent", builtin_workload("agent", sessions=sessions)))
    return out


def run_cell(system: System, requests: list, args, peers_bin: Path | None, log_dir: Path) -> dict:
    """One system on one workload, on fresh replicas: counters, latencies and per-request records."""
    sim_args = ["--model", MODEL, "--num-blocks", str(args.num_blocks), "--block-size", str(args.block_size),
                "--time-scale", str(args.time_scale)]
    with running([sim_server(log_dir, sim_args) for _ in range(args.replicas)]) as urls:
        with running([system.server(urls, log_dir, peers_bin)]) as (url,):
            started = time.perf_counter()
            records = asyncio.run(replay(requests, url, model=MODEL, time_scale=args.time_scale))
            wall = time.perf_counter() - started
            own = None if system.is_peer else scrape(url)  # this gateway's routes and miss causes
        pages = [scrape(u) for u in urls]
    hits = [metric_sum(p, "vllm:prefix_cache_hits_total") for p in pages]
    queries = [metric_sum(p, "vllm:prefix_cache_queries_total") for p in pages]
    done = [metric_sum(p, "vllm:request_success_total") for p in pages]
    prefill = [q - h for q, h in zip(queries, hits)]  # prompt tokens computed, not reused
    s = summarize(records, args.time_scale)
    errors = [r.error for r in records if r.error is not None or r.status != 200]
    fair = lambda xs: max(xs) / (sum(xs) / len(xs)) if sum(xs) else 0.0  # noqa: E731
    modelled = lambda v: None if v is None else v * args.time_scale  # noqa: E731
    return {
        "system": system.name, "requests": len(records), "errors": len(errors),
        "first_error": errors[0] if errors else None, "wall_s": round(wall, 1),
        "hit_rate": sum(hits) / sum(queries) if sum(queries) else 0.0,
        "busiest_requests_of_fair": fair(done), "busiest_prefill_of_fair": fair(prefill),
        **{f"ttft_p{q}_s": modelled(s[f"ttft_p{q}_s"]) for q in (50, 90, 99)},
        **{f"latency_p{q}_s": modelled(s[f"latency_p{q}_s"]) for q in (50, 99)},
        "reused_per_replica": hits, "requests_per_replica": done,
        "gateway_routes": own and {r: metric_sum(own, "prefix_router_requests_total", route=r) for r in ROUTES},
        "gateway_results": own and {r: metric_sum(own, "prefix_router_cache_requests_total", result=r)
                                    for r in RESULTS},
        "records": [{"send_s": r.send_s * args.time_scale, "ttft_s": modelled(r.ttft_s),
                     "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens} for r in records],
    }


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: dict) -> str:
    """The Markdown table: one row per workload and system."""
    lines = ["| workload | system | token hit rate | of pooled bound | busiest replica: requests / fair | "
             "prefill tokens / fair | TTFT p50 / p90 / p99 (s) | latency p50 / p99 (s) | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for w in results["workloads"]:
        for r in w["rows"]:
            lines.append(
                f"| {w['name']} | {r['system']} | {r['hit_rate']:.3f} | {r['hit_rate'] / w['pooled_bound']:.1%} | "
                f"{r['busiest_requests_of_fair']:.2f} | {r['busiest_prefill_of_fair']:.2f} | "
                f"{fmt(r['ttft_p50_s'], '.2f')} / {fmt(r['ttft_p90_s'], '.2f')} / {fmt(r['ttft_p99_s'], '.2f')} | "
                f"{fmt(r['latency_p50_s'], '.2f')} / {fmt(r['latency_p99_s'], '.2f')} | {r['errors']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer replicas and requests: under 5 minutes")
    parser.add_argument("--traces", type=Path, nargs="*", default=list(DEFAULT_TRACES))
    parser.add_argument("--replicas", type=int, help="simulated replicas per system")
    parser.add_argument("--limit", type=int, help="requests taken from the start of each trace")
    parser.add_argument("--sessions", type=int, help="sessions of the built-in agent workload")
    parser.add_argument("--time-scale", type=float, help="replay this many times faster than the trace")
    parser.add_argument("--num-blocks", type=int, default=28_000, help="KV blocks per replica (80 GB, 8B model)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--systems", default=",".join(s.name for s in SYSTEMS), help="comma-separated names")
    parser.add_argument("--rates", help="overhead sweep: requests per second, comma-separated")
    parser.add_argument("--seconds", type=float, help="overhead sweep: seconds of load per rate")
    parser.add_argument("--no-overhead", action="store_true", help="skip the overhead sweep")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    for key, value in MODES[mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = ROOT / ".cache" / "bench" / "compare-quick" if args.quick else ROOT / "bench" / "results" / "compare"
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    known = {s.name: s for s in SYSTEMS}
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {list(known)}")
    args.system_list = [known[n] for n in names]
    args.mode = mode
    return args


def main(argv: list[str] | None = None) -> int:
    from .overhead import overhead_sweep

    args = parse_args(argv)
    started = time.perf_counter()
    peers_bin = ensure_peers() if any(s.is_peer for s in args.system_list) else None
    log_dir = Path("/tmp") / f"bench_compare_{os.getpid()}"
    results = {
        "command": "python -m bench.compare " + " ".join(sys.argv[1:] if argv is None else argv),
        "mode": args.mode, "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                                       "platform": platform.platform()},
        "peers": dict(PEER_PACKAGES),
        "replicas": args.replicas, "num_blocks": args.num_blocks, "block_size": args.block_size,
        "time_scale": args.time_scale, "workloads": [],
    }
    for name, requests in workloads(args.traces, args.limit, args.sessions):
        bound = pooled_hit_rate(requests, args.replicas * (args.num_blocks - 1) + 1, args.block_size)
        unbounded = unbounded_hit_rate(requests, args.block_size)
        entry = {"name": name, "requests": len(requests), "pooled_bound": bound, "unbounded": unbounded, "rows": []}
        results["workloads"].append(entry)
        for system in args.system_list:
            row = run_cell(system, requests, args, peers_bin, log_dir)
            entry["rows"].append(row)
            print(f"{name:24} {system.name:28} hit rate {row['hit_rate']:.3f} ({row['hit_rate'] / bound:.0%} of "
                  f"bound {bound:.3f}), TTFT p99 {fmt(row['ttft_p99_s'], '.2f')} s, errors {row['errors']}, "
                  f"{row['wall_s']:.0f} s", file=sys.stderr, flush=True)
    if not args.no_overhead:
        results["overhead"] = overhead_sweep(args.system_list, [float(r) for r in args.rates.split(",")],
                                             args.seconds, peers_bin, log_dir)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    write(results, args)
    return 0


def write(results: dict, args) -> None:
    from .overhead import overhead_table

    head = (f"{results['mode']} mode: {results['replicas']} simulated replicas x {results['num_blocks']} blocks of "
            f"{results['block_size']} tokens, time scale {results['time_scale']:g}; "
            f"{results['machine']['cores']} cores, Python {results['machine']['python']}; "
            f"peers {', '.join(f'{k} {v}' for k, v in results['peers'].items())}; {results['wall_s']:.0f} s")
    bounds = "\n".join(f"- {w['name']}: {w['requests']} requests; pooled bound {w['pooled_bound']:.3f}, "
                        f"unbounded cache {w['unbounded']:.3f}" for w in results["workloads"])
    bounds += ("\n\nThe pooled bound is one LRU cache of the fleet's total capacity serving the requests in "
               "order. When the workload overflows it, LRU on one pool can evict blocks that split caches "
               "keep, so a router can pass 100% of it; the unbounded cache is the true ceiling. TTFT and "
               "latency are wall time at the client x the time scale: every millisecond a router adds, or "
               "takes from the replicas' share of the cores, counts that many times over.")
    text = f"{head}\n\n{bounds}\n\n{table(results)}\n"
    if "overhead" in results:
        text += "\n" + overhead_table(results["overhead"]) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text + f"\nCommand: `{results['command']}`\n")
    slim = json.loads(json.dumps(results))
    for w in slim["workloads"]:
        for r in w["rows"]:
            r.pop("records")  # per-request records go to the plots, not the committed JSON
    (args.out / "results.json").write_text(json.dumps(slim, indent=1) + "\n")
    if not args.no_plots:
        from .plots import plot_all

        for path in plot_all(results, args.out):
            print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
