"""Thousands of concurrent streaming connections through the gateway, on loopback.

    python -m bench load [--connections 5000] [--replicas 4] [--out DIR]

Simulated replicas are made slow on purpose (one engine step a second, ``--tokens`` steps a
stream) and large enough to run every stream at once, so each connection stays open for tens
of seconds and all of them are open together: the gateway holds ``connections`` client
connections and as many upstream ones. Connections open at ``--ramp-per-s``, as users arrive.

The same load runs twice in one run, first straight to the replicas (spread over them in
turn), then through the gateway, and the two are compared:

- errors (anything but a 200 stream ending in ``[DONE]``);
- the most streams open at once (client side), which must reach ``connections``;
- time to the first SSE chunk (vLLM and the simulator send the role chunk of a chat stream
  before any engine step, so this is the hop's cost under load, not the engine's) and to the
  first generated token, p50/p99, and the gateway's added share of each;
- the gateway's memory (VmRSS after start, peak VmHWM, and after the streams ended) and CPU.

Needs about 3 x ``connections`` file descriptors: the soft ``RLIMIT_NOFILE`` is raised to the
hard limit (children inherit it); ``RuntimeError`` when the hard limit is too low.

Writes ``README.md`` and ``results.json`` to ``--out`` (``bench/results/load``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import time
from pathlib import Path

import aiohttp

from prefix_router.tools.launch import gateway_server, running
from prefix_router.tools.replay.summary import percentile

from .. import CACHE, RESULTS
from ..meters import cpu_seconds, memory_mib
from ..report import command_line, write_results
from ..systems import fleet

__all__ = ["main", "raise_fd_limit", "report", "run"]

MODEL = "load-sim"


def raise_fd_limit(needed: int) -> int:
    """Raise the soft open-file limit to the hard one; returns it. Raises RuntimeError below ``needed``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, needed)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        raise RuntimeError(f"{needed} file descriptors needed, the hard limit is {hard} (ulimit -Hn)")
    return target


def _sim_args(connections: int, replicas: int) -> list[str]:
    """A slow replica (one engine step a second) with room to run its share of the streams at once."""
    per = connections // replicas + 1
    return ["--model", MODEL, "--max-num-seqs", str(4 * per), "--max-num-batched-tokens", str(1 << 22),
            "--decode-ms-per-token", "1000", "--num-blocks", "200000", "--max-model-len", "4096"]


async def _load(targets: list[str], connections: int, ramp_per_s: float, tokens: int) -> dict:
    """Open ``connections`` chat streams over ``targets`` in turn at ``ramp_per_s``; returns the
    per-request series and the most streams open at once."""
    open_now = most = 0
    results: list[tuple[float | None, float | None, str | None]] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def one(i: int) -> None:
            nonlocal open_now, most
            await asyncio.sleep(i / ramp_per_s)
            body = {"model": MODEL, "stream": True, "max_tokens": tokens, "ignore_eos": True,
                    "messages": [{"role": "system", "content": "You answer briefly."},
                                 {"role": "user", "content": f"user {i}: say something about the number {i}"}]}
            t0 = time.perf_counter()
            first = token = None
            error = None
            counted = False
            try:
                async with http.post(targets[i % len(targets)] + "/v1/chat/completions", json=body) as resp:
                    if resp.status != 200:
                        error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                        return
                    last = b""
                    async for line in resp.content:
                        if not line.startswith(b"data: "):
                            continue
                        if first is None:
                            first = time.perf_counter() - t0
                            open_now += 1
                            counted = True
                            most = max(most, open_now)
                        elif token is None and b'"content":"' in line and b'"content":""' not in line:
                            token = time.perf_counter() - t0
                        last = line
                    if last.strip() != b"data: [DONE]":
                        error = f"stream ended without [DONE]: {last[:200]!r}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}"[:200]
            finally:
                if counted:
                    open_now -= 1
                results.append((first, token, error))

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(connections)))
        elapsed = time.perf_counter() - started
    ok = [r for r in results if r[2] is None]
    errors = [r[2] for r in results if r[2] is not None]

    def pct(values, q):
        return round(1e3 * percentile(values, q), 1) if values else None

    firsts = [r[0] for r in ok]
    tokens_ = [r[1] for r in ok if r[1] is not None]
    return {"requests": len(results), "errors": len(errors), "first_error": errors[0] if errors else None,
            "most_open": most, "elapsed_s": round(elapsed, 1),
            "first_chunk_p50_ms": pct(firsts, 50), "first_chunk_p99_ms": pct(firsts, 99),
            "ttft_p50_ms": pct(tokens_, 50), "ttft_p99_ms": pct(tokens_, 99)}


def run(connections: int = 5000, replicas: int = 4, ramp_per_s: float = 500.0, tokens: int = 30,
        log_dir: Path | None = None) -> dict:
    """Both phases; returns {"direct", "gateway", "added", "gateway_memory_mib", "gateway_cpu_s", ...}."""
    limit = raise_fd_limit(3 * connections + 1000)
    log_dir = log_dir or CACHE / "bench" / "load"
    with fleet(replicas, log_dir, _sim_args(connections, replicas)) as urls:
        direct = asyncio.run(_load(urls, connections, ramp_per_s, tokens))
        config = log_dir / "gateway.yaml"
        config.write_text("admission: {saturated_depth: 0}\n")  # measure the hop, not the queue
        server = gateway_server(log_dir, urls, ["--config", str(config)])
        with running([server]) as (url,):
            before = memory_mib(server.pid)
            cpu0 = cpu_seconds(server.pid)
            through = asyncio.run(_load([url], connections, ramp_per_s, tokens))
            cpu = cpu_seconds(server.pid) - cpu0
            after = memory_mib(server.pid)
    added = {k: round(through[k] - direct[k], 1) if through[k] is not None and direct[k] is not None else None
             for k in ("first_chunk_p50_ms", "first_chunk_p99_ms", "ttft_p50_ms", "ttft_p99_ms")}
    return {"connections": connections, "replicas": replicas, "ramp_per_s": ramp_per_s, "tokens": tokens,
            "fd_limit": limit, "cores": os.cpu_count(), "direct": direct, "gateway": through, "added": added,
            "gateway_memory_mib": {"start": round(before["VmRSS"], 1), "peak": round(after["VmHWM"], 1),
                                   "end": round(after["VmRSS"], 1)},
            "gateway_cpu_s": round(cpu, 1)}


def report(result: dict) -> str:
    """A few lines of text for a terminal or a closing note."""
    d, g, a, m = result["direct"], result["gateway"], result["added"], result["gateway_memory_mib"]
    return "\n".join([
        f"{result['connections']} streaming connections, {result['replicas']} simulated replicas, "
        f"{result['ramp_per_s']:g} new/s, {result['tokens']} tokens at 1 step/s, {result['cores']} cores",
        f"  direct : errors {d['errors']}, most open at once {d['most_open']}, first chunk p50/p99 "
        f"{d['first_chunk_p50_ms']}/{d['first_chunk_p99_ms']} ms, TTFT p50/p99 {d['ttft_p50_ms']}/{d['ttft_p99_ms']} ms",
        f"  gateway: errors {g['errors']}, most open at once {g['most_open']}, first chunk p50/p99 "
        f"{g['first_chunk_p50_ms']}/{g['first_chunk_p99_ms']} ms, TTFT p50/p99 {g['ttft_p50_ms']}/{g['ttft_p99_ms']} ms",
        f"  added by the gateway: first chunk p50/p99 {a['first_chunk_p50_ms']}/{a['first_chunk_p99_ms']} ms, "
        f"TTFT p50/p99 {a['ttft_p50_ms']}/{a['ttft_p99_ms']} ms",
        f"  gateway memory: {m['start']} MiB at start, peak {m['peak']} MiB, {m['end']} MiB after; "
        f"CPU {result['gateway_cpu_s']} s ({1000 * result['gateway_cpu_s'] / max(result['connections'], 1):.2f} s per 1,000)",
    ] + ([f"  first error: {g['first_error'] or d['first_error']}"] if g["errors"] or d["errors"] else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--ramp-per-s", type=float, default=500.0)
    parser.add_argument("--tokens", type=int, default=30, help="tokens per stream, one a second")
    parser.add_argument("--out", type=Path, default=RESULTS / "load")
    args = parser.parse_args(argv)
    result = run(args.connections, args.replicas, args.ramp_per_s, args.tokens)
    write_results(args.out, "Concurrent streaming connections through the gateway", command_line(__name__, argv),
                  ["```", report(result), "```"], result)
    return 0 if result["gateway"]["errors"] == 0 and result["direct"]["errors"] == 0 else 1
