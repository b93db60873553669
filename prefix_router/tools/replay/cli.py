"""``prefix-router replay``: send a trace or the built-in workload to an endpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from urllib.parse import urlsplit

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


class TargetError(ValueError):
    """The target answered, but not as an OpenAI-compatible server does."""


def _target_problem(target: str) -> str | None:
    """Why ``--target`` is not a base URL replay can use, or None."""
    parts = urlsplit(target)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"--target {target!r}: give the base URL, e.g. http://127.0.0.1:8080"
    if parts.path.rstrip("/").endswith("/v1"):
        return (f"--target: give the base URL, {target.rstrip('/')[:-3]}, without /v1 "
                "(replay calls /v1/... itself)")
    return None


async def _first_model(target: str) -> str | None:
    """The target's first served model. Raises TargetError when ``/v1/models`` does not answer
    with a model list."""
    import aiohttp

    url = target.rstrip("/") + "/v1/models"
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as resp:
            try:
                data = await resp.json(content_type=None) if resp.status == 200 else None
            except ValueError:
                data = None
            if not isinstance(data, dict):
                raise TargetError(f"{url} answered HTTP {resp.status} without a model list; is --target the "
                                 "gateway's or a replica's base URL?")
    models = data.get("data") or []
    return models[0]["id"] if models and isinstance(models[0], dict) and "id" in models[0] else None


def run(args: argparse.Namespace) -> int:
    problem = _target_problem(args.target)
    if problem:
        print(f"prefix-router replay: {problem}", file=sys.stderr)
        return 2
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
    except TargetError as exc:
        print(f"prefix-router replay: {exc}", file=sys.stderr)
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
