"""``prefix-router fleetsim``: a trace through N modelled replicas in virtual time, one run a
policy, side by side; with ``--slo-ttft-p99``, each policy's capacity at that objective, or with
``--target-rate`` too, the fewest replicas that serve that rate within it."""

from __future__ import annotations

import argparse
import json
import sys

from prefix_router.tools.fleetsim.router import POLICIES
from prefix_router.tools.replay.generate import WORKLOADS

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fleetsim", help="simulate a fleet of N replicas in virtual time under each routing policy",
                       description="Run a trace (Mooncake .jsonl, SWE-agent .traj or a folder, a request log) or a "
                                   "built-in workload through N modelled vLLM replicas (the simulator's engine "
                                   "model, H100 timing) routed by this gateway's policy and the peers' rules, "
                                   "in virtual time: any fleet size, repeatable for a seed.")
    p.add_argument("--trace", default=None, help="Mooncake .jsonl, a .traj file or folder, or a request log")
    p.add_argument("--workload", default="mixed", choices=WORKLOADS, help="built-in workload when no --trace")
    p.add_argument("--replicas", type=int, required=True,
                   help="replicas in the fleet (with --prefill-replicas: its decode replicas)")
    p.add_argument("--prefill-replicas", type=int, default=0, metavar="N",
                   help="a disaggregated fleet: N prefill replicas beside --replicas decode ones, the policy "
                        "choosing the prefill replica, --decode-policy the decode one (default 0: not disaggregated)")
    p.add_argument("--decode-policy", choices=POLICIES, default=None,
                   help="with --prefill-replicas: the decode pool's policy (default: each run's own)")
    p.add_argument("--policy", action="append", choices=POLICIES,
                   help="a policy to run (repeat; default: all of them); prefix-router is serve's prefix-affinity")
    p.add_argument("--rate-scale", type=float, default=1.0, help="divide trace times and think times by this")
    p.add_argument("--slo-ttft-p99", type=float, default=None, metavar="S",
                   help="find each policy's capacity: the highest rate with TTFT p99 at most S seconds")
    p.add_argument("--target-rate", type=float, default=None, metavar="RPS",
                   help="with --slo-ttft-p99: find the fewest replicas (at most --replicas) that serve RPS "
                        "requests a second within it, instead of the capacity of --replicas")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks a replica (default: an H100's 28,000)")
    p.add_argument("--cpu-offload-blocks", type=int, default=0, metavar="N",
                   help="a CPU offload tier of N blocks a replica, as vLLM's OffloadingConnector keeps (needs --kv-events-delay "
                        "for this gateway to see it; default: none)")
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between scrapes of a replica's queue")
    p.add_argument("--gateways", type=int, default=1,
                   help="gateway instances in front, each request to the next (default 1)")
    p.add_argument("--kv-events-delay", type=float, default=None, metavar="S",
                   help="route on the engines' KV events, each step's reaching the gateways S seconds late "
                        "(default: on the gateways' own guesses, as without kv_events)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for chats and text (default: built-in bytes)")
    p.add_argument("--seed", type=int, default=0, help="seeds the built-in workload and the generated tokens")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures here, an object keyed by policy")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tqdm import tqdm

    from prefix_router.prompts.tokenizer import load_tokenizer
    from prefix_router.tools.fleetsim.capacity import capacity, fewest_replicas
    from prefix_router.tools.fleetsim.jobs import load_jobs
    from prefix_router.tools.fleetsim.run import FleetConfig, simulate
    from prefix_router.tools.sim.config import SimConfig

    problem = _problem(args)
    if problem:
        print(f"prefix-router fleetsim: {problem}", file=sys.stderr)
        return 2
    try:
        if args.json:  # before the runs, not after them
            open(args.json, "a").close()
        requests = load_jobs(args.trace, workload=args.workload, limit=args.limit, seed=args.seed)
        if not requests:
            raise ValueError(f"{args.trace}: no requests in it")
        tokenizer = load_tokenizer(args.tokenizer)
        engine = SimConfig(seed=args.seed)
        if args.num_gpu_blocks is not None:
            engine = replace(engine, num_gpu_blocks=args.num_gpu_blocks).validate()
        if args.cpu_offload_blocks:
            engine = replace(engine, cpu_offload_blocks=args.cpu_offload_blocks).validate()
    except (OSError, ValueError) as exc:
        print(f"prefix-router fleetsim: {exc}", file=sys.stderr)
        return 2
    fleet = FleetConfig(replicas=args.replicas, engine=engine, rate_scale=args.rate_scale,
                        scrape_interval_s=args.scrape_interval, gateways=args.gateways,
                        kv_events_delay_s=args.kv_events_delay, prefill_replicas=args.prefill_replicas,
                        decode_policy=args.decode_policy)
    out: dict[str, dict] = {}
    for policy in args.policy or POLICIES:
        if args.slo_ttft_p99 is None:
            with tqdm(total=len(requests), desc=policy, unit="req", leave=False, disable=None) as bar:
                out[policy] = simulate(requests, policy, fleet, tokenizer, progress=bar.update)
        elif args.target_rate is not None:
            with tqdm(desc=f"{policy}: fleet sizes tried", unit="run", leave=False, disable=None) as bar:
                try:
                    out[policy] = fewest_replicas(requests, policy, fleet, tokenizer, args.slo_ttft_p99,
                                                  args.target_rate, on_run=lambda n, figures: bar.update(1))
                except ValueError as exc:  # a rate the trace's times cannot be scaled to
                    print(f"prefix-router fleetsim: --target-rate: {exc}", file=sys.stderr)
                    return 2
        else:
            with tqdm(desc=f"{policy}: rates tried", unit="run", leave=False, disable=None) as bar:
                out[policy] = capacity(requests, policy, fleet, tokenizer, args.slo_ttft_p99,
                                       on_run=lambda scale, figures: bar.update(1))
    print(_table(out, args))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
                f.write("\n")
        except OSError as exc:
            print(f"prefix-router fleetsim: could not write {args.json}: {exc}", file=sys.stderr)
            return 1
    return 0


def _problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the numbers given, if anything."""
    import math

    if not 1 <= args.replicas <= 100_000:
        return "--replicas must be between 1 and 100,000"
    if not args.rate_scale <= 1e6:
        return "--rate-scale must be at most 1e6"
    for flag, value, low in (("--rate-scale", args.rate_scale, 1e-6), ("--scrape-interval", args.scrape_interval, 0.001),
                             ("--slo-ttft-p99", args.slo_ttft_p99, 0.0), ("--target-rate", args.target_rate, 0.0)):
        if value is not None and not (math.isfinite(value) and value >= low and value > 0):
            return f"{flag} must be a finite number of at least {low:g}" if low else f"{flag} must be a finite number above 0"
    if args.limit is not None and args.limit < 1:
        return "--limit must be at least 1"
    if not 1 <= args.gateways <= 32:
        return "--gateways must be between 1 and 32 (each instance keeps its own picture of every replica)"
    if args.target_rate is not None and args.rate_scale != 1.0:
        return "--target-rate sets the rate; leave --rate-scale out"
    if args.kv_events_delay is not None and not (math.isfinite(args.kv_events_delay) and args.kv_events_delay >= 0):
        return "--kv-events-delay must be a finite number of seconds, 0 or more"
    if args.target_rate is not None and args.slo_ttft_p99 is None:
        return "--target-rate needs --slo-ttft-p99: the objective the fleet must meet at that rate"
    if not 0 <= args.prefill_replicas <= 100_000:
        return "--prefill-replicas must be between 0 and 100,000"
    if args.target_rate is not None and args.prefill_replicas:
        return "--target-rate sizes a fleet of one pool; leave --prefill-replicas out"
    if args.decode_policy is not None and not args.prefill_replicas:
        return "--decode-policy needs --prefill-replicas: a fleet with a decode pool"
    return None


def _table(out: dict[str, dict], args: argparse.Namespace) -> str:
    """A row a policy; with an objective, its figures are those at the fastest rate it served."""
    capacity = args.slo_ttft_p99 is not None and args.target_rate is None
    sizing = args.target_rate is not None
    refused = any(f["rejected"] for f in out.values())
    head = ["policy", "token hit rate", "busiest / fair", "TTFT p50 (s)", "TTFT p99 (s)", "requests"]
    head += ["refused (too long)"] if refused else []
    head += [f"capacity at TTFT p99 <= {args.slo_ttft_p99:g} s (req/s)"] if capacity else []
    head += [f"fewest replicas for {args.target_rate:g} req/s at TTFT p99 <= {args.slo_ttft_p99:g} s"] if sizing else []
    rows = [head]
    for policy, f in out.items():
        row = [policy, f"{f['token_hit_rate']:.3f}", f"{f['busiest_over_fair']:.2f}",
               _s(f["ttft_p50_s"]), _s(f["ttft_p99_s"]), str(f["requests"])]
        row += [str(f["rejected"])] if refused else []
        if capacity:
            row.append("above every rate tried" if f["capacity_rps"] is None else
                       "below every rate tried" if not f["capacity_rps"] else f"{f['capacity_rps']:.2f}")
        if sizing:
            row.append(_sizing(f, args))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if capacity:
        lines.append("(each row's figures at the fastest rate it served, x rate_scale in the JSON)")
    if sizing:
        lines.append("(each row's figures on the fewest replicas found, or on all of them when none served)")
    if args.prefill_replicas:
        lines.append(f"(a disaggregated fleet, {args.prefill_replicas} prefill and {args.replicas} decode replicas: "
                     "each policy chooses the prefill replica; hit rate and busiest / fair are the prefill pool's)")
    return "\n".join(lines)


def _sizing(f: dict, args: argparse.Namespace) -> str:
    """The fewest replicas found, or why there is no such number."""
    if f["replicas"] is not None:
        return str(f["replicas"])
    if not f["requests"] and f["rejected"]:
        return "none: every prompt is longer than a replica holds"
    if f["offered_rps"] is not None and f["offered_rps"] < 0.9 * args.target_rate:
        return f"none: the trace comes at {f['offered_rps']:.3g} req/s at most (its sessions wait for answers)"
    return f"more than {args.replicas}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
