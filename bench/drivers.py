"""How the benchmarks send load: at fixed rates from a Python client, ``wrk`` at saturation,
vLLM's own ``vllm bench serve``, and the routing code called in-process.

- ``fixed_rate``: an open loop (requests leave at ``rate``/s whatever the answers), the way users
  arrive; it measures TTFT at the client. Its own CPU shares the machine with the system under
  test, so it is the driver for latency, not for a router's ceiling.
- ``wrk_run``: ``wrk`` (Debian's package, C), one thread keeping ``connections`` busy in a closed
  loop: the most a system serves, with the client's cost out of the picture.
- ``run_vllm_bench``: ``vllm bench serve`` from the vLLM CPU environment (``make vllm-env``),
  traffic this project did not write (``workloads.VllmBenchShape``).
- ``decision_times``: ``prompts.analyze`` and the policy's ``select`` called in-process on
  bodies, no HTTP: the routing decision's own time.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from pathlib import Path

import aiohttp

from prefix_router.tools.replay.summary import percentile

from .workloads import MODEL, VllmBenchShape

__all__ = ["decision_times", "fixed_rate", "parse_wrk", "run_vllm_bench", "wrk_run", "wrk_script"]


async def fixed_rate(url: str, requests: list[list[dict]], rate: float) -> list[tuple[float, float]]:
    """Send ``requests`` (message lists, streaming chats of 8 tokens) at ``rate``/s regardless of
    responses; (TTFT, latency) per request in seconds, TTFT 0.0 for a request that failed (an
    HTTP error or a broken connection)."""
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


# wrk's Lua: each request the next body of the file (one JSON object a line), in turn
_WRK_LUA = """
local bodies = {}
for line in io.lines("%s") do bodies[#bodies + 1] = line end
local i = 0
init = function(args) i = tonumber(args[1]) or 0 end  -- where this run starts in the file
local headers = {["Content-Type"] = "application/json"}
request = function()
  i = i %% #bodies + 1
  return wrk.format("POST", "/v1/chat/completions", headers, bodies[i])
end
"""


def wrk_script(requests: list[list[dict]], folder: Path, name: str) -> Path:
    """A wrk Lua script in ``folder`` that sends ``requests`` (message lists) in order as
    streaming chats of 8 tokens, from the first again when they run out."""
    bodies = folder / f"{name}.jsonl"
    bodies.write_text("".join(json.dumps({"model": MODEL, "messages": m, "max_tokens": 8, "stream": True}) + "\n"
                              for m in requests))
    script = folder / f"{name}.lua"
    script.write_text(_WRK_LUA % bodies)
    return script


def parse_wrk(out: str) -> tuple[int, float, str]:
    """(requests completed, requests/s, latency p50 as wrk prints it) from the output of
    ``wrk --latency``. Raises ValueError when the output has no such figures or reports
    non-2xx answers or socket errors."""
    done = re.search(r"(\d+) requests in", out)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"^\s+50%\s+(\S+)$", out, re.MULTILINE)
    if not done or not rate or not p50 or "Non-2xx" in out or "Socket errors" in out:
        raise ValueError(f"wrk: no clean run:\n{out}")
    return int(done.group(1)), float(rate.group(1)), p50.group(1)


def wrk_run(url: str, script: Path, connections: int, seconds: float, cpus: str | None,
            start: int = 0) -> tuple[int, float, str]:
    """``parse_wrk`` of one closed-loop ``wrk`` run (one thread, pinned to ``cpus``) whose first
    request is body ``start + 1`` of the script's file. Raises ValueError for a run with errors
    (``parse_wrk``), ``subprocess.CalledProcessError`` when wrk fails."""
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", str(script), url, "--", str(start)]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    return parse_wrk(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=seconds + 60).stdout)


def run_vllm_bench(python: Path, url: str, shape: VllmBenchShape, tokenizer: Path, out_dir: Path,
                   model: str, seed: int = 0, cpus: str | None = None) -> dict:
    """Run ``vllm bench serve`` (the vLLM environment's ``python``) against ``url`` and return
    its result JSON (times in wall ms). The vLLM CPU environment needs no GPU for the client;
    the tokenizer is the tiny model's, built locally (nothing is downloaded).

    ``cpus``: a ``taskset`` CPU list to pin the client to. Raises ``subprocess.CalledProcessError``
    when the client fails (its output is in ``out_dir``).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    filename = f"vllm-bench-{seed}.json"
    cmd = [str(python), "-m", "vllm.entrypoints.cli.main", "bench", "serve",
           "--backend", "openai-chat" if shape.chat else "openai",
           "--endpoint", "/v1/chat/completions" if shape.chat else "/v1/completions",
           "--base-url", url, "--model", model, "--tokenizer", str(tokenizer),
           "--num-prompts", str(shape.num_prompts), "--request-rate", str(shape.rate), "--seed", str(seed),
           "--ignore-eos", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", filename, "--disable-tqdm",
           *shape.args()]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    env_cmd = ["env", "HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "VLLM_TARGET_DEVICE=cpu", *cmd]
    with open(out_dir / f"vllm-bench-{seed}.log", "w") as log:
        subprocess.run(env_cmd, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    return json.loads((out_dir / filename).read_text())


def decision_times(requests: list[list[dict]], tokenizer_dir: Path) -> dict:
    """The routing decision timed in-process over ``requests`` (message lists), in order: per
    request ``prompts.analyze`` (chat template, incremental tokenization, block hashes) and
    ``PrefixAffinityPolicy.select`` over 4 replicas whose shadow indexes learn each choice; and,
    for contrast, a full tokenization of the same rendered prompt. Returns the prompts' token
    p50 and milliseconds: routing p50/p99, full tokenization p50."""
    from prefix_router.cache.shadow import ShadowIndex
    from prefix_router.config import RoutingConfig
    from prefix_router.prompts.analysis import analyze
    from prefix_router.prompts.tokenizer import HFTokenizer, normalize_messages
    from prefix_router.routing.bounds import ReplicaView
    from prefix_router.routing.policy import PrefixAffinityPolicy
    from prefix_router.routing.prefix_stats import BranchStats
    from prefix_router.routing.ring import Ring

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
