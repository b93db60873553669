"""How many streaming requests per second one simulated replica serves on one CPU core.

The simulator must never be the bottleneck of a fleet benchmark (8-16 replicas on a 2-core
machine), so this measures its ceiling: one ``prefix-router sim`` process pinned to core 0
(``taskset``), a closed-loop load generator pinned to core 1 keeping ``--concurrency``
streaming completions in flight for ``--seconds``. Prompts are token ids sharing a few
prefixes (so the prefix cache works as in a real replay); ``--time-scale`` is high so the
modelled GPU is never what limits the rate: the figure is the simulator's own CPU cost.

    python -m bench sim-throughput [--seconds 20] [--concurrency 64] [--max-tokens 32]

Prints requests/s and the simulator's CPU seconds per 1,000 requests, and writes them to
``--out`` (``bench/results/sim-throughput``: README.md and results.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import time
from pathlib import Path

import aiohttp

from prefix_router.tools.launch import running, sim_server

from .. import CACHE, RESULTS
from ..meters import cpu_seconds
from ..report import command_line, write_results
from ..systems import pinned

async def _load(base: str, seconds: float, concurrency: int, prompt_len: int, max_tokens: int) -> dict:
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 30_000) for _ in range(prompt_len // 2)] for _ in range(8)]
    done = errors = tokens = 0
    deadline = time.perf_counter() + seconds

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal done, errors, tokens
        while time.perf_counter() < deadline:
            prompt = rng.choice(prefixes) + [rng.randrange(100, 30_000) for _ in range(prompt_len // 2)]
            body = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
            try:
                async with http.post(base + "/v1/completions", json=body) as resp:
                    async for line in resp.content:
                        if line.startswith(b'data: {"id"') and b'"usage"' in line:
                            tokens += json.loads(line[6:])["usage"]["completion_tokens"]
                    ok = resp.status == 200
            except aiohttp.ClientError:
                ok = False
            done += ok
            errors += not ok

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {"requests": done, "errors": errors, "elapsed_s": elapsed, "completion_tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench sim-throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=32, help="streamed output tokens per request")
    parser.add_argument("--time-scale", type=float, default=1000.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "sim-throughput")
    args = parser.parse_args(argv)
    pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) > 1
    sim = pinned(sim_server(CACHE / "bench-sim-throughput", ["--model", "sim", "--time-scale", str(args.time_scale)]),
                 "0" if pin else None)
    with running([sim]) as (base,):
        if pin:
            os.sched_setaffinity(0, {1})  # the load generator on the other core
        cpu0 = cpu_seconds(sim.pid)
        load = asyncio.run(_load(base, args.seconds, args.concurrency, args.prompt_len, args.max_tokens))
        sim_cpu = cpu_seconds(sim.pid) - cpu0
    result = {
        "requests_per_s": load["requests"] / load["elapsed_s"],
        "sim_cpu_s_per_1000_requests": 1000 * sim_cpu / max(load["requests"], 1),
        "sim_cpu_utilisation": sim_cpu / load["elapsed_s"],
        "output_tokens_per_s": load["completion_tokens"] / load["elapsed_s"],
        **load,
        "concurrency": args.concurrency, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "sim_pinned_to_one_core": pin,
    }
    line = (f"{result['requests_per_s']:.0f} requests/s streaming ({args.max_tokens} tokens each, "
            f"{args.prompt_len}-token prompts), {result['output_tokens_per_s']:.0f} tokens/s; simulator CPU "
            f"{result['sim_cpu_utilisation']:.0%} of one core, {result['sim_cpu_s_per_1000_requests']:.2f} s per "
            f"1,000 requests; errors {load['errors']}")
    write_results(args.out, "One simulated replica's ceiling on one core", command_line(__name__, argv), [line], result)
    return 0 if load["errors"] == 0 else 1
