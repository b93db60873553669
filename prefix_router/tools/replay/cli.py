"""``prefix-router replay``: send a trace or the built-in workload to an endpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from prefix_router.tools.replay.generate import WORKLOADS

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay a trace or the built-in workload against an endpoint",
                       description="Replay Mooncake traces (.jsonl), SWE-agent trajectories (.traj or a "
                                   "folder of them) or a built-in workload; print hit rate and TTFT.")
    p.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", default=None, help="Mooncake .jsonl, a .traj file or a folder of .traj")
    p.add_argument("--workload", default="mixed", choices=WORKLOADS, help="built-in workload when no --trace")
    p.add_argument("--model", default=None, help="model name to send (default: the target's first model)")
    p.add_argument("--trace-block-size", type=int, default=512, help="tokens per Mooncake hash id")
    p.add_argument("--vocab-size", type=int, default=32_000, help="token ids drawn below this for Mooncake")
    p.add_argument("--time-scale", type=float, default=1.0, help="divide trace times by this")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--concurrency", type=int, default=0, help="requests in flight at most (0: no cap)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per chat turn (trajectories)")
    p.add_argument("--no-stream", action="store_true", help="send stream=false (TTFT = latency)")
    p.add_argument("--session-header", default="X-Session-ID",
                   help="send each session's id in this header ('' sends none; default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write one JSON record per request here")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


async def _first_model(target: str) -> str | None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(target.rstrip("/") + "/v1/models") as resp:
            data = await resp.json()
    models = data.get("data") or []
    return models[0]["id"] if models else None


def run(args: argparse.Namespace) -> int:
    from prefix_router.tools.replay.client import replay
    from prefix_router.tools.replay.summary import format_summary, summarize
    from prefix_router.tools.replay.workloads import load_workload

    try:
        requests = load_workload(args.trace, workload=args.workload, limit=args.limit,
                                 trace_block_size=args.trace_block_size, vocab_size=args.vocab_size,
                                 seed=args.seed, max_tokens=args.max_tokens)
    except (OSError, ValueError) as exc:
        print(f"prefix-router replay: {exc}", file=sys.stderr)
        return 2

    done = [0]

    def progress(_record) -> None:
        done[0] += 1
        if sys.stderr.isatty() and (done[0] % 50 == 0 or done[0] == len(requests)):
            print(f"\r{done[0]}/{len(requests)} requests", end="", file=sys.stderr, flush=True)

    async def go():
        model = args.model or await _first_model(args.target)
        return await replay(requests, args.target, model=model, time_scale=args.time_scale,
                            concurrency=args.concurrency, stream=not args.no_stream,
                            session_header=args.session_header or None, on_record=progress)

    try:
        records = asyncio.run(go())
    except OSError as exc:
        print(f"prefix-router replay: cannot reach {args.target}: {exc}", file=sys.stderr)
        return 2
    if sys.stderr.isatty():
        print(file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            for record in records:
                f.write(record.to_json() + "\n")
    summary = summarize(records, args.time_scale)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0 if summary["errors"] == 0 else 1
