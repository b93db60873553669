"""What the gateway adds to each request: latency at the client, and routing decision time.

Two measurements, for chat prompts of about 1k, 8k and 32k tokens (multi-turn conversations:
each request is the next turn of one of 16 conversations, so most of a prompt was seen on the
previous turn, as in agent and chat traffic):

1. Added latency: the same fixed-rate (``--rate`` requests/s) sequence of streaming requests
   sent straight to a simulated replica, then through the gateway (with the tokenizer, exact
   token blocks) to a fresh one. TTFT and end-to-end latency p50/p99 of each; the difference
   is the gateway's cost. The replica runs at a high time scale so its modelled GPU time is
   negligible next to the hop being measured.
2. Routing decision time, in-process: ``prompts.analyze`` (chat template and incremental
   tokenization) plus ``policy.select``, per request of the same sequence; and, for contrast,
   a full tokenization of the same prompts.

    python -m bench.gateway_overhead [--rate 100] [--seconds 10] [--sizes 1000,8000,32000]

The tokenizer is the byte-level BPE of the real-engine tier (``prefix_router/tools/tiny_model.py``,
built into ``.cache/tiny-tokenizer`` if missing). Writes ``bench/results/gateway_overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import aiohttp

from prefix_router.tools.launch import build_tiny_model
from prefix_router.tools.replay.summary import percentile

from .fleet import ROOT, fleet, gateway

MODEL = "sim"
WORDS = ("request replica cache prefix token block model server client latency queue batch prompt system "
         "user assistant tool result error value config deploy metric trace session agent file line").split()


def conversations(size: int, count: int, turns: int, seed: int = 0) -> list[list[dict]]:
    """Request message lists: ``turns`` rounds over ``count`` conversations of ~``size`` tokens."""
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    # About 3 tokens per word with the tiny tokenizer (2,048-token vocabulary, measured): the
    # system prompt takes ~80% of the size, the turns so far the rest.
    histories = [[{"role": "system", "content": f"conversation {c}. " + words(int(size * 0.27))}] for c in range(count)]
    requests = []
    for _turn in range(turns):
        for history in histories:
            history.append({"role": "user", "content": words(max(size // 600, 5))})
            requests.append([dict(m) for m in history])
            history.append({"role": "assistant", "content": words(max(size // 600, 5))})
    return requests


def staggered(count: int, turns: int, window: int = 64) -> list[tuple[int, int]]:
    """(conversation, turn) pairs in the order they are sent: conversation ``c``'s turn ``t``
    at slot ``c + t x window``, so that once ``turns x window`` bodies have gone, one body in
    ``turns`` opens a conversation and the others extend one whose previous turn went
    ``window`` slots before (long enough to be answered with 8 connections, or at any fixed
    rate here). Shape: ``count x turns`` pairs, each conversation's turns in order."""
    return sorted(((c, t) for c in range(count) for t in range(turns)), key=lambda p: (p[0] + p[1] * window, p[1]))


def chat_mix(size: int, count: int, turns: int = 4, seed: int = 0, window: int = 8) -> list[list[dict]]:
    """``count`` request message lists of ~``size`` tokens each: conversations of ``turns``
    turns, ``staggered`` with ``window`` (one request in ``turns`` opens a conversation with a
    system prompt of its own, the others extend one sent ``window`` requests before: at 25/s
    0.3 s, long after its answer), so that the prompts stay near ``size`` however many are
    sent; ``conversations`` of a fixed number grow a turn per round. The mix of
    ``bench/overhead_wrk.py``, for ``bench.overhead`` and ``bench.overhead_ab``."""
    num = max(-(-count // turns), 1)
    rounds = conversations(size, num, turns, seed)  # turn t of conversation c at t x num + c
    return [rounds[t * num + c] for c, t in staggered(num, turns, window)][:count]


async def fixed_rate(url: str, requests: list[list[dict]], rate: float) -> list[tuple[float, float]]:
    """Send at ``rate``/s regardless of responses; (TTFT, latency) per request in seconds, TTFT 0.0
    for a request that failed (an HTTP error or a broken connection)."""
    out: list[tuple[float, float] | None] = [None] * len(requests)

    async def one(i: int, http: aiohttp.ClientSession) -> None:
        body = {"model": MODEL, "messages": requests[i], "max_tokens": 8, "stream": True}
        start = time.perf_counter()
        ttft = None
        try:
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                async for line in resp.content:
                    if ttft is None and resp.status == 200 and line.startswith(b"data: {"):
                        ttft = time.perf_counter() - start
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        out[i] = (ttft or 0.0, time.perf_counter() - start)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.perf_counter()
        tasks = []
        for i in range(len(requests)):
            await asyncio.sleep(max(t0 + i / rate - time.perf_counter(), 0))
            tasks.append(asyncio.create_task(one(i, http)))
        await asyncio.gather(*tasks)
    return out


def decision_times(requests, tokenizer_dir: Path) -> dict:
    """Per-request analyze+select time (incremental tokenizer) and a full tokenization's time."""
    from prefix_router.config import RoutingConfig
    from prefix_router.cache.shadow import ShadowIndex
    from prefix_router.routing.prefix_stats import BranchStats
    from prefix_router.routing.bounds import ReplicaView
    from prefix_router.routing.policy import PrefixAffinityPolicy
    from prefix_router.prompts.analysis import analyze
    from prefix_router.routing.ring import Ring
    from prefix_router.prompts.tokenizer import HFTokenizer, normalize_messages

    tok = HFTokenizer(str(tokenizer_dir))
    ring = Ring(160)
    for name in ("a", "b", "c", "d"):
        ring.add(name)
    branches = BranchStats()
    policy = PrefixAffinityPolicy(RoutingConfig(), ring, branches)
    views = {n: ReplicaView(n, 0, ShadowIndex(28_000)) for n in ring.nodes}
    routed, full, sizes = [], [], []
    for messages in requests:
        t0 = time.perf_counter()
        info = analyze({"model": MODEL, "messages": messages}, True, tok, 16, 64, None)
        decision = policy.select(info.hashes, info.full_hash, views, None, info.num_units // 16)
        routed.append(time.perf_counter() - t0)
        views[decision.replica].shadow.insert(info.hashes)
        branches.record(info.hashes, 512)
        sizes.append(info.num_units)
        text = tok._tok.apply_chat_template(normalize_messages(messages), tokenize=False, add_generation_prompt=True)
        t1 = time.perf_counter()
        tok.encode(text, add_special_tokens=False)
        full.append(time.perf_counter() - t1)
    return {"prompt_tokens_p50": percentile(sizes, 50),
            "routing_p50_ms": 1e3 * percentile(routed, 50), "routing_p99_ms": 1e3 * percentile(routed, 99),
            "full_tokenization_p50_ms": 1e3 * percentile(full, 50)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--sizes", default="1000,8000,32000")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gateway_overhead.json")
    args = parser.parse_args()
    tokenizer_dir = ROOT / ".cache" / "tiny-tokenizer"
    build_tiny_model(tokenizer_dir, corpus=ROOT.parent / "shared" / "agent_traces", tokenizer_only=True)
    log_dir = Path("/tmp") / f"gateway_overhead_{os.getpid()}"
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        count = int(args.rate * args.seconds)
        requests = conversations(size, 16, max(count // 16, 1))
        sim_args = ["--model", MODEL, "--time-scale", "10000", "--tokenizer", str(tokenizer_dir)]
        with fleet(1, log_dir, sim_args) as urls:
            direct = asyncio.run(fixed_rate(urls[0], requests, args.rate))
        with fleet(1, log_dir, sim_args) as urls, gateway(urls, log_dir, ["--tokenizer", str(tokenizer_dir)]) as gw:
            routed = asyncio.run(fixed_rate(gw, requests, args.rate))
        row = {"size": size, "requests": len(requests), **decision_times(requests, tokenizer_dir)}
        for label, series in (("direct", direct), ("gateway", routed)):
            for q in (50, 99):
                row[f"{label}_ttft_p{q}_ms"] = 1e3 * percentile([t for t, _ in series], q)
                row[f"{label}_latency_p{q}_ms"] = 1e3 * percentile([l for _, l in series], q)
        for q in (50, 99):
            row[f"added_ttft_p{q}_ms"] = row[f"gateway_ttft_p{q}_ms"] - row[f"direct_ttft_p{q}_ms"]
        rows.append(row)
        print(f"~{size} tokens (p50 {row['prompt_tokens_p50']:.0f}) at {args.rate:g} req/s: added TTFT p50 "
              f"{row['added_ttft_p50_ms']:.2f} ms, p99 {row['added_ttft_p99_ms']:.2f} ms; routing decision p50 "
              f"{row['routing_p50_ms']:.2f} ms, p99 {row['routing_p99_ms']:.2f} ms (full tokenization p50 "
              f"{row['full_tokenization_p50_ms']:.2f} ms)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python -m bench.gateway_overhead " + " ".join(sys.argv[1:]),
                                    "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
                                    "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
