"""``prefix-router gate``: fail a CI job when a change lowers the prefix-cache hit rate.

Replays a workload (a request log such as an application's test suite writes, a trace, or the
built-in workload) several times, takes the median token hit rate (cached prompt tokens the
engine reported over prompt tokens, from ``usage.prompt_tokens_details``) and compares it with
a baseline: exit 0 at or above ``baseline - tolerance``, 1 below it, 2 when it could not
measure (unreachable target, failed requests, no baseline).

Each run is cold: its requests carry a cache salt of their own (vLLM's ``cache_salt``; a salt
the request had is kept inside it), so no run reuses another's KV blocks, without restarting
or resetting anything. Through a gateway with tenants configured, use ``auth.client_salt: nest``
so the salt reaches the engine. Without ``--target`` the gate starts its own fleet on loopback:
``--replicas`` simulated replicas behind a prefix-affinity gateway (prefix_router/tools/launch.py), stopped
when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path

from prefix_router.tools.replay.generate import WORKLOADS

__all__ = ["add_parser", "salted", "verdict"]


def salted(requests: list, salt: str) -> list:
    """Copies of ``requests`` (``ReplayRequest``) whose bodies carry ``cache_salt`` ``salt``
    (``salt/<theirs>`` when a body had one)."""
    out = []
    for r in requests:
        own = r.body.get("cache_salt")
        out.append(replace(r, body={**r.body, "cache_salt": f"{salt}/{own}" if isinstance(own, str) else salt}))
    return out


def verdict(median: float, baseline: float, tolerance: float) -> bool:
    """True when the median hit rate passes: at least ``baseline - tolerance`` (fractions)."""
    return median >= baseline - tolerance


async def _runs(requests: list, target: str, runs: int, time_scale: float, model: str | None) -> list[dict]:
    from prefix_router.tools.replay.cli import _first_model
    from prefix_router.tools.replay.client import replay
    from prefix_router.tools.replay.summary import summarize

    model = model or await _first_model(target)
    out = []
    for k in range(runs):
        records = await replay(salted(requests, f"gate-{uuid.uuid4().hex[:12]}-{k}"), target, model=model,
                               time_scale=time_scale)
        summary = summarize(records, time_scale)
        out.append({"token_hit_rate": summary["token_hit_rate"], "errors": summary["errors"],
                    "prompt_tokens": summary["prompt_tokens"], "cached_tokens": summary["cached_tokens"],
                    "first_error": next((r.error for r in records if r.error), None)})
        print(f"run {k + 1}/{runs}: token hit rate {summary['token_hit_rate']:.4f} "
              f"({summary['errors']} errors)", file=sys.stderr, flush=True)
    return out


def _measure(requests: list, args: argparse.Namespace) -> list[dict]:
    if args.target:
        return asyncio.run(_runs(requests, args.target.rstrip("/"), args.runs, args.time_scale, args.model))
    from prefix_router.tools import launch

    with tempfile.TemporaryDirectory(prefix="prefix-router-gate-") as tmp:
        log_dir = Path(tmp)
        sims = [launch.sim_server(log_dir, ["--time-scale", str(args.time_scale)]) for _ in range(args.replicas)]
        with launch.running(sims) as urls, launch.running([launch.gateway_server(log_dir, urls)]) as (gateway,):
            return asyncio.run(_runs(requests, gateway, args.runs, args.time_scale, args.model))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gate", help="replay a workload a few times; exit 1 when the hit rate fell below a baseline",
                       description="Replay a workload --runs times (each with a cache of its own), take the "
                                   "median token hit rate and compare it with a baseline. Exit 0: at or above "
                                   "baseline - tolerance; 1: below; 2: could not measure.")
    p.add_argument("--trace", default=None, help="a request log (JSONL of request bodies), a Mooncake .jsonl, "
                                                 "a .traj file or a folder of them (default: the built-in workload)")
    p.add_argument("--workload", default="mixed", choices=WORKLOADS, help="built-in workload when no --trace")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--target", default=None, help="a gateway or replica base URL (default: start 'replicas' "
                                                  "simulated replicas and a gateway on loopback)")
    p.add_argument("--replicas", type=int, default=2, help="simulated replicas when no --target (default: 2)")
    p.add_argument("--model", default=None, help="model name to send (default: the target's first model)")
    p.add_argument("--runs", type=int, default=3, help="replays; the median counts (default: 3)")
    p.add_argument("--time-scale", type=float, default=50.0, help="divide the workload's times by this (default: 50)")
    p.add_argument("--baseline", default=None, help="JSON file with the baseline's token_hit_rate")
    p.add_argument("--min-hit-rate", type=float, default=None, help="a fixed baseline instead of --baseline (0-1)")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="how far below the baseline still passes, as a fraction (default: 0.02, 2 points)")
    p.add_argument("--write-baseline", action="store_true", help="write the median to --baseline and pass")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prefix_router.tools.replay.workloads import load_workload

    if args.runs < 1 or not 0 <= args.tolerance < 1:
        print("prefix-router gate: --runs must be at least 1 and --tolerance from 0 to 1", file=sys.stderr)
        return 2
    if args.write_baseline and not args.baseline:
        print("prefix-router gate: --write-baseline needs --baseline FILE", file=sys.stderr)
        return 2
    baseline = args.min_hit_rate
    if baseline is None and args.baseline and not args.write_baseline:
        try:
            baseline = float(json.loads(Path(args.baseline).read_text())["token_hit_rate"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"prefix-router gate: cannot read the baseline {args.baseline}: {exc!r} "
                  "(make one with --write-baseline)", file=sys.stderr)
            return 2
    if baseline is None and not args.write_baseline:
        print("prefix-router gate: give --baseline FILE (or --min-hit-rate R), or --write-baseline", file=sys.stderr)
        return 2
    try:
        requests = load_workload(args.trace, workload=args.workload, limit=args.limit)
        runs = _measure(requests, args)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"prefix-router gate: {exc}", file=sys.stderr)
        return 2
    failed = [r for r in runs if r["errors"]]
    median = statistics.median(r["token_hit_rate"] for r in runs)
    result = {"token_hit_rate": median, "runs": runs, "requests": len(requests),
              "workload": args.trace or f"built-in {args.workload}", "baseline": baseline, "tolerance": args.tolerance}
    if failed:
        result["passed"] = None
        print(json.dumps(result) if args.json else
              f"gate: {sum(r['errors'] for r in failed)} requests failed ({failed[0]['first_error']}); not measured")
        return 2
    if args.write_baseline:
        Path(args.baseline).write_text(json.dumps({k: result[k] for k in ("token_hit_rate", "requests", "workload")},
                                                  indent=1) + "\n")
        result["passed"] = True
        print(json.dumps(result) if args.json else
              f"gate: baseline written to {args.baseline}: token hit rate {median:.4f} (median of {len(runs)})")
        return 0
    result["passed"] = verdict(median, baseline, args.tolerance)
    line = (f"gate: token hit rate {median:.4f} (median of {len(runs)}) against baseline {baseline:.4f} "
            f"- {args.tolerance:g}: {'pass' if result['passed'] else 'FAIL'}")
    print(json.dumps(result) if args.json else line)
    return 0 if result["passed"] else 1
