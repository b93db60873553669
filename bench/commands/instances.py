"""Several gateway instances behind a round-robin client: with the replicas' KV events, and without.

Each instance sees every Nth request and, without events, learns only from those; with events
(``prefix_router/cache/events.py``) every instance reads every replica's cache as its engine reports it. For
each workload and run, on fresh simulated replicas publishing vLLM's events
(``--kv-events-config``): one gateway and ``--instances`` gateways, events on and off, the same
requests replayed without session ids (a client that names no conversation: the case where the
instances' own pictures matter most). Gateways and replicas share the tiny tokenizer
(``prefix_router/tools/tiny_model.py``), so prompts are cut into exact token blocks, as events need.

Workloads: the built-in mixed workload (multi-turn chats and agents sharing system prompts and
tools), a dozen agent sessions (``compare``'s), and SGLang's generated-shared-prefix shape
(``bench/workloads.py``: many single-turn prompts per shared document).

The replay runs ``--time-scale`` times faster than the workload's clock, and so do the gateways'
scrapes of the replicas (``--scrape-interval`` of workload time): an instance counts the
requests the others have running from the last scrape, and a scrape as old in wall time as in
a real deployment would be ``--time-scale`` times staler next to the requests it counts.

    python -m bench instances                 # 4 instances, 3 runs each (~15 min on 2 cores)
    python -m bench instances --runs 1 --quick

Writes ``README.md`` and ``results.json`` to ``--out`` (``bench/results/instances``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
import urllib.request
from pathlib import Path

from prefix_router.tools.launch import gateway_server, running
from prefix_router.tools.replay.client import replay
from prefix_router.tools.replay.generate import builtin_workload

from .. import CACHE, RESULTS
from ..meters import metric_sum, scrape
from ..report import command_line, write_results
from ..systems import fleet, tiny_tokenizer
from ..workloads import MODEL, generated_shared_prefix

EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                     "replay_endpoint": "tcp://127.0.0.1:*"})


_cells = itertools.count()


def workloads(quick: bool) -> list[tuple[str, list]]:
    """(name, requests) of each workload; ``quick``: fewer sessions and groups."""
    sessions = 24 if quick else 48
    return [(f"built-in mixed, {sessions} sessions", builtin_workload("mixed", sessions=sessions, seed=11)),
            ("a dozen agent sessions", builtin_workload("agent", sessions=12, seed=12)),
            ("sglang generated-shared-prefix", generated_shared_prefix(groups=8 if quick else 16, rate=8.0))]


def _wait_for_streams(urls: list[str], timeout_s: float = 30.0) -> None:
    """Wait until every gateway at ``urls`` routes every replica by its KV events; RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = [json.loads(urllib.request.urlopen(u + "/replicas", timeout=5).read())["replicas"] for u in urls]
        if all(r["kv_events"] is not None and r["kv_events"]["routing_by_events"] for view in views for r in view):
            return
        time.sleep(0.2)
    raise RuntimeError("the gateways found no KV event streams")


def run_cell(requests, instances: int, events: bool, args, tokenizer: Path, log_dir: Path) -> float:
    """Token hit rate, from the replicas' own counters, of one replay through ``instances``."""
    sim_args = ["--model", MODEL, "--time-scale", str(args.time_scale), "--tokenizer", str(tokenizer),
                "--kv-events-config", EVENTS]
    with fleet(args.replicas, log_dir, sim_args) as urls:
        config = log_dir / f"gateway-{instances}-{'events' if events else 'guess'}.yaml"
        # the replay runs time_scale x faster than the workload's clock: so do the scrapes, or
        # each instance's count of the others' requests (a scrape old) would be time_scale x staler
        interval = args.scrape_interval / args.time_scale
        config.write_text(f"kv_events: {{enabled: {str(events).lower()}}}\nscrape: {{interval_s: {interval:g}}}\n"
                          f"routing: {{sole_router: {str(instances == 1).lower()}}}\n")
        logs = args.request_logs
        if logs is not None:  # one file per instance: instances/events/run, the rest a counter
            logs = logs / f"{instances}-{'events' if events else 'guess'}-{next(_cells)}"
            logs.mkdir(parents=True, exist_ok=True)
        gateways = [gateway_server(log_dir, urls, ["--config", str(config), "--tokenizer", str(tokenizer),
                                                   *(["--request-log", str(logs / f"gateway-{i}.jsonl")] if logs else [])])
                    for i in range(instances)]
        with running(gateways) as targets:
            if events:
                _wait_for_streams(targets)
            records = asyncio.run(replay(requests, targets, model=MODEL, time_scale=args.time_scale,
                                         session_header=None))
        errors = [r.error for r in records if r.error is not None or r.status != 200]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
        pages = [scrape(u) for u in urls]
    hits = sum(metric_sum(p, "vllm:prefix_cache_hits_total") for p in pages)
    queries = sum(metric_sum(p, "vllm:prefix_cache_queries_total") for p in pages)
    return hits / queries if queries else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench instances", description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--scrape-interval", type=float, default=1.0,
                        help="the gateways' scrape interval in the workload's seconds (the gateway's default, 1 s)")
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--only", help="the workloads whose name contains this")
    parser.add_argument("--out", type=Path, default=RESULTS / "instances")
    parser.add_argument("--request-logs", type=Path,
                        help="a folder for every gateway's request log (routes, predictions, miss kinds)")
    args = parser.parse_args(argv)
    tokenizer = tiny_tokenizer(traces=False)
    log_dir = CACHE / "bench-instances"
    log_dir.mkdir(parents=True, exist_ok=True)
    cells = [(1, True), (args.instances, True), (args.instances, False), (1, False)]
    started = time.perf_counter()
    results = []
    for name, requests in workloads(args.quick):
        if args.only and args.only not in name:
            continue
        runs: dict[str, list[float]] = {f"{n}:{e}": [] for n, e in cells}
        for _ in range(args.runs):
            for n, events in cells:
                runs[f"{n}:{events}"].append(run_cell(requests, n, events, args, tokenizer, log_dir))
        row = {"workload": name, "requests": len(requests), "runs": runs,
               "median": {k: statistics.median(v) for k, v in runs.items()}}
        results.append(row)
        m = row["median"]
        print(f"{name}: one {m['1:True']:.3f}, {args.instances} with events {m[f'{args.instances}:True']:.3f}, "
              f"{args.instances} without {m[f'{args.instances}:False']:.3f}, one without {m['1:False']:.3f}",
              flush=True)
    n = args.instances
    lines = [f"{args.replicas} simulated replicas publishing KV events, tiny tokenizer on both sides, no session "
             f"ids, time scale {args.time_scale:g}, scrapes every {args.scrape_interval:g} s of workload time; "
             f"{args.runs} run(s) of every cell on fresh replicas, medians (min-max); "
             f"{time.perf_counter() - started:.0f} s", "",
             f"| workload | requests | 1 gateway, events | {n} gateways, events | gap (points) | "
             f"{n} gateways, no events | gap (points) | 1 gateway, no events |", "|---|---|---|---|---|---|---|---|"]
    for row in results:
        m, r = row["median"], row["runs"]
        cell = lambda k: f"{m[k]:.3f} ({min(r[k]):.3f}-{max(r[k]):.3f})"  # noqa: E731
        lines.append(f"| {row['workload']} | {row['requests']} | {cell('1:True')} | {cell(f'{n}:True')} | "
                     f"{100 * (m['1:True'] - m[f'{n}:True']):.1f} | {cell(f'{n}:False')} | "
                     f"{100 * (m['1:False'] - m[f'{n}:False']):.1f} | {cell('1:False')} |")
    lines += ["", "Token hit rate from the replicas' own counters."]
    write_results(args.out, "Several gateway instances, with KV events and without", command_line(__name__, argv),
                  lines, results)
    return 0
