"""The routing benchmark: this gateway against round-robin and the peer routers, side by side, in one run.

For every workload and every system (``bench/systems.py``: this gateway with prefix affinity and
in round-robin mode, vllm-router's ``cache_aware``, ``consistent_hash`` and ``power_of_two``,
sglang-router's ``cache_aware``), on fresh simulated replicas so that no system inherits another's
cache: start the replicas and the system, replay the workload time-compressed, then read every
replica's own counters. Each replica models an 80 GB GPU serving an 8B model (28,000 blocks of
16 tokens, the simulator's default, ``prefix_router/tools/sim/config.py``).

Workloads (the matrix of issue 14): the Mooncake conversation and synthetic traces (``--traces``;
sent as text prompts, ``load_mooncake(text=True)``, because sglang-router refuses token-id
prompts), the built-in agent workload, and the ``--shapes``: SGLang's generated-shared-prefix
benchmark (``gsp``), many sessions sharing one long system prompt (``system``), a dozen
multi-turn agent sessions on 4 replicas (``dozen``), and ``vllm bench serve``'s own client on
its ``prefix_repetition`` and shared-prefix ``random`` datasets through chat and completions
(``vllm-bench``, from the vLLM CPU environment; left out with a note when it is missing). A
missing trace file is left out with a note; with none, the built-in chat workload stands in.
Then the overhead sweep (``bench/hop.py``: one fast replica, ~1k-token chats at fixed rates
through each system; ``python -m bench overhead`` measures the hop in depth).

Fairness (``--pin``, on by default with two or more cores): the router under test runs on the
last core (``taskset``), the replicas and the client on the others, so a router's own CPU
does not slow the simulated GPUs. ``--runs N`` repeats every cell on fresh replicas and reports
medians with the spread (min-max).

Per system and workload: token hit rate from the replicas' counters
(``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``), its ratio to the
pooled-cache bound (``bench/pooled.py``; the unbounded-cache hit rate, the true ceiling, is
printed beside it), the busiest replica's share of requests and of prefill
tokens (1.00 is a perfect spread), TTFT p50/p90/p99 and end-to-end latency p50/p99 at the client
in modelled seconds (wall x time scale), and errors.

Time compression speeds up the simulated GPUs, not the routers: a router's own milliseconds,
multiplied by the time scale with the rest, would weigh 10x (quick) or 5x (full) what they weigh
in front of real GPUs. So for the replayed workloads the table also gives TTFT p50/p99 with each
request's replica time scaled and the rest counted as timed (``hop_ttft``: wall TTFT + (time scale
- 1) x the replica's own time to the first token, which the simulator sends in the stream:
``sim_ttft_s``). ``vllm bench serve`` reports percentiles only; its cells have the scaled figures.

    python -m bench compare            # full: 8 replicas, 2,000 requests per trace (~75 min on 2 cores, estimated)
    python -m bench compare --quick    # 4 replicas, 150 requests per trace (~25 min on 2 cores)

Writes ``README.md``, ``results.json`` and PNG plots (``bench/plots.py``) to ``--out`` (full:
``bench/results/compare``; quick: ``.cache/bench/compare-quick``) and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from prefix_router.tools.launch import find_vllm_python
from prefix_router.tools.replay.client import replay
from prefix_router.tools.replay.summary import percentile, summarize

from .. import CACHE, RESULTS
from ..drivers import run_vllm_bench
from ..hop import ADDED_P99_LIMIT_MS, Entry, rates_sweep, sustained
from ..meters import CACHE_RESULTS, ROUTES, hop_ttfts, metric_sum, scrape
from ..pooled import pooled_hit_rate, spread_hit_rate, unbounded_hit_rate
from ..report import command_line, header
from ..systems import PEER_PACKAGES, SYSTEMS, Gateway, Peer, System, ensure_peers, fleet, tiny_tokenizer, \
    with_gateway_args
from ..workloads import DEFAULT_TRACES, MODEL, SHAPES, Workload, matrix, shape_bound

MODES = {  # replicas, requests per trace, agent sessions, time scale, overhead rates and seconds
    "quick": {"replicas": 4, "limit": 150, "sessions": 12, "time_scale": 10.0, "rates": "25,50,100", "seconds": 3.0},
    # past ~150 requests/s the load generator and the replica alone saturate 2 cores (measured:
    # direct TTFT p99 375 ms at 200/s, 16 s at 400/s), so higher rates would measure the machine
    "full": {"replicas": 8, "limit": 2000, "sessions": 48, "time_scale": 5.0, "rates": "25,50,100,150",
             "seconds": 10.0},
}
# CPU per request is read at one rate for every system: idle costs (health checks, scrapes)
# inflate it at low rates and contention for the 2 cores at high ones
CPU_REFERENCE_RATE = 50.0
OVERHEAD_TOKENS = 1000  # prompt size of the overhead sweep's chats


def run_cell(system: System, work: Workload, args, log_dir: Path, seed: int = 0) -> dict:
    """One system on one workload, on fresh replicas: counters, latencies and per-request records."""
    sim_args = ["--model", MODEL, "--num-blocks", str(args.num_blocks), "--block-size", str(args.block_size),
                "--time-scale", str(args.time_scale)]
    rest, own_cpu = args.cpus
    with fleet(work.replicas or args.replicas, log_dir, sim_args, rest) as urls:
        extra = ("--config", str(args.gateway_config)) if args.gateway_config else ()
        with with_gateway_args(system, extra).start(urls, log_dir, own_cpu) as started:
            began = time.perf_counter()
            if work.shape is None:
                records = asyncio.run(replay(work.requests, started.url, model=MODEL, time_scale=args.time_scale))
                bench = None
            else:
                records = []
                bench = run_vllm_bench(find_vllm_python(), started.url, work.shape, args.tokenizer,
                                       log_dir / "vllm-bench" / system.name.replace(" ", "_"), MODEL, seed, rest)
            wall = time.perf_counter() - began
            own = scrape(started.url) if isinstance(system, Gateway) else None  # its routes and miss causes
        pages = [scrape(u) for u in urls]
    hits = [metric_sum(p, "vllm:prefix_cache_hits_total") for p in pages]
    queries = [metric_sum(p, "vllm:prefix_cache_queries_total") for p in pages]
    done = [metric_sum(p, "vllm:request_success_total") for p in pages]
    prefill = [q - h for q, h in zip(queries, hits)]  # prompt tokens computed, not reused
    fair = lambda xs: max(xs) / (sum(xs) / len(xs)) if sum(xs) else 0.0  # noqa: E731
    modelled = lambda v: None if v is None else v * args.time_scale  # noqa: E731
    if bench is None:
        s = summarize(records, args.time_scale)
        errors = [r.error for r in records if r.error is not None or r.status != 200]
        hops = hop_ttfts(records, args.time_scale)
        times = {**{f"ttft_p{q}_s": modelled(s[f"ttft_p{q}_s"]) for q in (50, 90, 99)},
                 **{f"latency_p{q}_s": modelled(s[f"latency_p{q}_s"]) for q in (50, 99)},
                 **{f"hop_ttft_p{q}_s": percentile(hops, q) for q in (50, 99)}}
        count = len(records)
    else:  # vllm bench serve reports wall milliseconds
        errors = [f"{bench['failed']} failed"] if bench.get("failed") else []
        times = {**{f"ttft_p{q}_s": modelled(bench[f"p{q}_ttft_ms"] / 1000) for q in (50, 90, 99)},
                 **{f"latency_p{q}_s": modelled(bench[f"p{q}_e2el_ms"] / 1000) for q in (50, 99)},
                 "hop_ttft_p50_s": None, "hop_ttft_p99_s": None}
        count = int(bench["completed"]) + int(bench.get("failed") or 0)
    return {
        "system": system.name, "requests": count, "errors": len(errors),
        "first_error": errors[0] if errors else None, "wall_s": round(wall, 1),
        "hit_rate": sum(hits) / sum(queries) if sum(queries) else 0.0,
        "busiest_requests_of_fair": fair(done), "busiest_prefill_of_fair": fair(prefill), **times,
        "reused_per_replica": hits, "requests_per_replica": done,
        "gateway_routes": own and {r: metric_sum(own, "prefix_router_requests_total", route=r) for r in ROUTES},
        "gateway_results": own and {r: metric_sum(own, "prefix_router_cache_requests_total", result=r)
                                    for r in CACHE_RESULTS},
        "records": [{"send_s": r.send_s * args.time_scale, "ttft_s": modelled(r.ttft_s),
                     "replica_ttft_s": modelled(r.replica_ttft_s),
                     "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens} for r in records],
    }


MEDIAN_KEYS = ("hit_rate", "busiest_requests_of_fair", "busiest_prefill_of_fair", "ttft_p50_s", "ttft_p90_s",
               "ttft_p99_s", "latency_p50_s", "latency_p99_s", "hop_ttft_p50_s", "hop_ttft_p99_s")


def combine(runs: list[dict]) -> dict:
    """One row from repeated runs of a cell: the median of each figure, its (min, max) in
    ``spread``, errors summed, the first run's records and counters."""
    row = dict(runs[0])
    row["runs"] = len(runs)
    row["errors"] = sum(r["errors"] for r in runs)
    row["spread"] = {}
    for key in MEDIAN_KEYS:
        values = [r[key] for r in runs if r[key] is not None]
        if values:
            row[key] = statistics.median(values)
            row["spread"][key] = (min(values), max(values))
    return row


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _spread(r: dict, key: str, spec: str) -> str:
    lo_hi = (r.get("spread") or {}).get(key)
    if not lo_hi or r.get("runs", 1) < 2:
        return ""
    return f" ({format(lo_hi[0], spec)}-{format(lo_hi[1], spec)})"


def table(results: dict) -> str:
    """The Markdown table: one row per workload and system; with several runs, medians and the
    (min-max) spread of hit rate and TTFT."""
    lines = ["| workload | system | token hit rate | of pooled bound | busiest replica: requests / fair | "
             "prefill tokens / fair | TTFT p50 / p90 / p99 (s) | TTFT p50 / p99, routers' time unscaled (s) | "
             "latency p50 / p99 (s) | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for w in results["workloads"]:
        for r in w["rows"]:
            lines.append(
                f"| {w['name']} | {r['system']} | {r['hit_rate']:.3f}{_spread(r, 'hit_rate', '.3f')} | "
                f"{r['hit_rate'] / w['pooled_bound']:.1%} | "
                f"{r['busiest_requests_of_fair']:.2f} | {r['busiest_prefill_of_fair']:.2f} | "
                f"{fmt(r['ttft_p50_s'], '.2f')}{_spread(r, 'ttft_p50_s', '.2f')} / {fmt(r['ttft_p90_s'], '.2f')} / "
                f"{fmt(r['ttft_p99_s'], '.2f')}{_spread(r, 'ttft_p99_s', '.2f')} | "
                f"{fmt(r.get('hop_ttft_p50_s'), '.2f')}{_spread(r, 'hop_ttft_p50_s', '.2f')} / "
                f"{fmt(r.get('hop_ttft_p99_s'), '.2f')}{_spread(r, 'hop_ttft_p99_s', '.2f')} | "
                f"{fmt(r['latency_p50_s'], '.2f')} / {fmt(r['latency_p99_s'], '.2f')} | {r['errors']} |")
    return "\n".join(lines)


def overhead_sweep(systems: list[System], rates: list[float], seconds: float, log_dir: Path) -> dict:
    """Added TTFT and CPU per system and rate (``hop.rates_sweep``, one repetition, ~1k-token
    chats, this gateway with the tiny tokenizer), and the highest rate each sustains."""
    tokenizer = tiny_tokenizer(traces=True)
    entries = [Entry(s.name, with_gateway_args(s, ("--tokenizer", str(tokenizer)))) for s in systems]
    rows = rates_sweep(entries, rates=rates, reps=1, seconds=seconds, tokens=OVERHEAD_TOKENS, log_dir=log_dir,
                       tokenizer=tokenizer)
    return {"rates": rates, "prompt_tokens": OVERHEAD_TOKENS, "rows": rows, "sustained": sustained(rows, rates)}


def overhead_table(overhead: dict) -> str:
    """Markdown: one row per system, added TTFT p50/p99 at each rate, sustained rate, CPU."""
    rates = overhead["rates"]
    cpu_rate = CPU_REFERENCE_RATE if CPU_REFERENCE_RATE in rates else rates[0]
    head = ("| system | " + " | ".join(f"added TTFT p50 / p99 at {r:g}/s (ms)" for r in rates)
            + f" | highest rate with added p99 <= {ADDED_P99_LIMIT_MS:g} ms | CPU ms a request at {cpu_rate:g}/s |")
    lines = [f"Overhead: ~{overhead['prompt_tokens']}-token streaming chat requests, one replica; "
             "direct TTFT p50 / p99 (ms): " + ", ".join(
                 f"{r['rate']:g}/s {r['direct_ttft_p50_ms']:.1f} / {r['direct_ttft_p99_ms']:.1f}"
                 for r in overhead["rows"] if r["system"] == overhead["rows"][0]["system"]), "",
             head, "|---" * (len(rates) + 3) + "|"]
    for name in dict.fromkeys(r["system"] for r in overhead["rows"]):
        by_rate = {r["rate"]: r for r in overhead["rows"] if r["system"] == name}
        cells = [f"{by_rate[r]['added_ttft_p50_ms']:.1f} / {by_rate[r]['added_ttft_p99_ms']:.1f}"
                 + (f" ({by_rate[r]['errors']} errors)" if by_rate[r]["errors"] else "") for r in rates]
        best = overhead["sustained"].get(name)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'none tested' if best is None else f'{best:g}/s'}"
                     f"{' (every rate tested)' if best == max(rates) else ''} | {by_rate[cpu_rate]['cpu_ms']:.2f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench compare", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer replicas and requests: about 25 minutes, under 5 with --shapes none")
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
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"workloads beyond the traces and the agent workload: {','.join(SHAPES)}, or none")
    parser.add_argument("--gateway-config", type=Path, help="a gateway YAML for this gateway's systems (A/B a setting)")
    parser.add_argument("--runs", type=int, default=1, help="runs of every cell; medians and spread reported")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2,
                        help="the router on the last core, replicas and client on the others (taskset)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="the replicas' and routers' logs (default: /tmp/bench_compare_PID, kept)")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    for key, value in MODES[mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = CACHE / "bench" / "compare-quick" if args.quick else RESULTS / "compare"
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    known = {s.name: s for s in SYSTEMS}
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {list(known)}")
    args.system_list = [known[n] for n in names]
    args.mode = mode
    args.shape_list = [] if args.shapes.strip() in ("", "none") else [x.strip() for x in args.shapes.split(",")]
    bad = [x for x in args.shape_list if x not in SHAPES]
    if bad:
        parser.error(f"unknown shapes {bad}; choose from {list(SHAPES)}")
    cores = os.cpu_count() or 1
    args.cpus = (f"0-{cores - 2}", str(cores - 1)) if args.pin and cores >= 2 else (None, None)
    return args


def bounds(work: Workload, replicas: int, args) -> tuple[float, float, float | None, int]:
    """(pooled bound, unbounded-cache hit rate, sessions spread evenly, requests) of ``work``."""
    if work.shape is not None:
        bound = shape_bound(work.shape)
        return bound, bound, None, work.shape.num_prompts
    return (pooled_hit_rate(work.requests, replicas * (args.num_blocks - 1) + 1, args.block_size),
            unbounded_hit_rate(work.requests, args.block_size),
            spread_hit_rate(work.requests, replicas, args.block_size), len(work.requests))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if any(isinstance(s, Peer) for s in args.system_list):
        ensure_peers()
    log_dir = args.log_dir or Path("/tmp") / f"bench_compare_{os.getpid()}"
    results = {
        "command": command_line(__name__, argv), "mode": args.mode, "peers": dict(PEER_PACKAGES),
        "replicas": args.replicas, "num_blocks": args.num_blocks, "block_size": args.block_size,
        "time_scale": args.time_scale, "runs": args.runs,
        "pinned": {"router": args.cpus[1], "replicas_and_client": args.cpus[0]} if args.cpus[0] else None,
        "workloads": [],
    }
    works = matrix(args.traces, args.limit, args.sessions, args.shape_list, args.mode)
    if any(w.shape is not None for w in works):
        args.tokenizer = tiny_tokenizer(traces=False)
    for work in works:
        replicas = work.replicas or args.replicas
        bound, unbounded, spread, count = bounds(work, replicas, args)
        entry = {"name": work.name, "requests": count, "replicas": replicas, "pooled_bound": bound,
                 "unbounded": unbounded, "spread": spread, "rows": []}
        results["workloads"].append(entry)
        for system in args.system_list:
            row = combine([run_cell(system, work, args, log_dir, seed) for seed in range(args.runs)])
            entry["rows"].append(row)
            print(f"{work.name:34} {system.name:28} hit rate {row['hit_rate']:.3f} ({row['hit_rate'] / bound:.0%} of "
                  f"bound {bound:.3f}), busiest {row['busiest_requests_of_fair']:.2f}, TTFT p50/p99 "
                  f"{fmt(row['ttft_p50_s'], '.2f')}/{fmt(row['ttft_p99_s'], '.2f')} s (routers' time unscaled "
                  f"{fmt(row['hop_ttft_p50_s'], '.2f')}/{fmt(row['hop_ttft_p99_s'], '.2f')}), errors {row['errors']}, "
                  f"{row['wall_s']:.0f} s", file=sys.stderr, flush=True)
        if len(results["workloads"]) < len(works) or not args.no_overhead:  # a run stopped later keeps these
            results["wall_s"] = round(time.perf_counter() - started, 1)
            write(results, args, plots=False, of=len(works))
    if not args.no_overhead:
        results["overhead"] = overhead_sweep(args.system_list, [float(r) for r in args.rates.split(",")],
                                             args.seconds, log_dir)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    write(results, args)
    return 0


NOTES = ("The pooled bound is one LRU cache of the fleet's total capacity serving the requests in "
         "order. When the workload overflows it, LRU on one pool can evict blocks that split caches "
         "keep, so a router can pass 100% of it; the unbounded cache is the true ceiling. "
         "Sessions spread evenly is the hit rate of a router that keeps each session on one replica "
         "and hands the sessions to the replicas in turn (bench.pooled.spread_hit_rate): each replica "
         "computes once what its sessions share with others; a router passes it by grouping sessions "
         "that share a prefix or by loading some replicas more than others. TTFT and "
         "latency are wall time at the client x the time scale: every millisecond a router adds, or "
         "takes from the replicas' share of the cores, counts that many times over. The column with the "
         "routers' time unscaled scales only each request's time in its replica (queue and prefill, "
         "which the simulator reports) and counts the rest as timed, as in front of real GPUs. The "
         "vllm-bench rows' bound comes from the dataset's shape (each prefix computed once); their latencies are "
         "vllm bench serve's own percentiles.")


def write(results: dict, args, plots: bool = True, of: int | None = None) -> None:
    """``README.md`` (``report.header``, then the run's settings, the bounds and the table) and
    ``results.json`` under ``args.out``, and the plots when ``plots`` and not ``--no-plots``.
    ``of``: the workloads the run will have when it ends, for a partial write after each
    workload (the settings line says how many are in)."""
    head_lines, facts = header("This gateway against the peer routers", results["command"])
    results.update(facts)
    settings = (f"{results['mode']} mode: {results['replicas']} simulated replicas x {results['num_blocks']} blocks of "
                f"{results['block_size']} tokens, time scale {results['time_scale']:g}; "
                f"peers {', '.join(f'{k} {v}' for k, v in results['peers'].items())}; {results['wall_s']:.0f} s; "
                f"{results['runs']} run(s) of each cell" + (", medians and (min-max)" if results["runs"] > 1 else "")
                + "; " + (f"router pinned to CPU {results['pinned']['router']}, replicas and client to CPUs "
                          f"{results['pinned']['replicas_and_client']} (taskset)" if results.get("pinned") else "not pinned")
                + (f"; partial: {len(results['workloads'])} of {of} workloads so far" if of else ""))
    workloads = "\n".join(f"- {w['name']}: {w['requests']} requests on {w['replicas']} replicas; pooled bound "
                          f"{w['pooled_bound']:.3f}, unbounded cache {w['unbounded']:.3f}"
                          + (f", sessions spread evenly {w['spread']:.3f}" if w.get("spread") is not None else "")
                          for w in results["workloads"])
    text = "\n".join(head_lines) + f"\n{settings}\n\n{workloads}\n\n{NOTES}\n\n{table(results)}\n"
    if "overhead" in results:
        text += "\n" + overhead_table(results["overhead"]) + "\n"
    if of is None:
        print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "README.md").write_text(text)
    slim = json.loads(json.dumps(results))
    for w in slim["workloads"]:
        for r in w["rows"]:
            r.pop("records")  # per-request records go to the plots, not the committed JSON
    (args.out / "results.json").write_text(json.dumps(slim, indent=1) + "\n")
    if plots and not args.no_plots:
        from ..plots import plot_all

        for path in plot_all(results, args.out):
            print(f"wrote {path}", file=sys.stderr)
