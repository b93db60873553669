"""``python -m bench fleet-cost``: the fake fleet answers what the gateway asks of a replica, in the
shapes it parses, and a short run fills the results folder (two gateways on loopback, ~10 s)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp

from bench.commands.fleet_cost import Prompts, main, report_lines
from bench.fake_fleet import MODEL, serve
from prefix_router.fleet.replicas import parse_engine_metrics


async def test_each_fake_answers_health_metrics_models_and_a_completion(tmp_path):
    stop, urls_file = asyncio.Event(), tmp_path / "urls"
    task = asyncio.create_task(serve(3, urls_file, stop=stop))
    try:
        while not urls_file.exists():
            await asyncio.sleep(0.01)
        urls = urls_file.read_text().split()
        assert len(set(urls)) == 3
        async with aiohttp.ClientSession() as http:
            async with http.get(urls[1] + "/health") as resp:
                assert resp.status == 200
            body = {"model": MODEL, "prompt": list(range(40)), "max_tokens": 1, "stream": False}
            async with http.post(urls[1] + "/v1/completions", json=body) as resp:
                answer = await resp.json()
            assert answer["object"] == "text_completion" and answer["choices"][0]["finish_reason"] == "length"
            assert answer["usage"] == {"prompt_tokens": 40, "total_tokens": 41, "completion_tokens": 1,
                                       "prompt_tokens_details": {"cached_tokens": 0}}
            async with http.post(urls[1] + "/v1/completions", json={**body, "stream": True}) as resp:
                assert resp.status == 400
            async with http.get(urls[1] + "/metrics") as resp:  # compressed, as the simulator answers aiohttp
                assert resp.headers["Content-Encoding"] in ("gzip", "deflate")
                metrics = parse_engine_metrics(await resp.text())
            async with http.get(urls[1] + "/v1/models") as resp:
                assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
            async with http.get(urls[1] + "/kv_event_sources") as resp:
                assert await resp.json() == {}
            async with http.get(urls[0] + "/metrics") as resp:
                other = parse_engine_metrics(await resp.text())
        assert metrics["cache_config"]["block_size"] == "16" and metrics["cache_config"]["num_gpu_blocks"] == "28000"
        assert metrics["vllm:num_requests_waiting"] == metrics["vllm:num_requests_running"] == 0
        assert metrics["vllm:prefix_cache_queries_total"] == 40 and other["vllm:prefix_cache_queries_total"] == 0
    finally:
        stop.set()
        await task


def test_bodies_share_the_prefix_and_differ_after_it():
    import random
    prompts = Prompts(shared=100, own=8, rng=random.Random(0))
    a, b = (json.loads(prompts.body()) for _ in range(2))
    assert len(a["prompt"]) == len(b["prompt"]) == prompts.tokens == 108
    assert a["prompt"][:100] == b["prompt"][:100] and a["prompt"][100:] != b["prompt"][100:]
    assert a["max_tokens"] == 1 and a["stream"] is False and a["model"] == MODEL


def test_the_ratios_come_from_the_medians():
    cells = [{"replicas": n, "tokens": t, "shared": t - 128, "own": 128, "requests": 100, "elapsed_s": 1.0,
              "cpu_ms": ms, "requests_per_s": 100.0, "latency_p50_ms": 5.0, "errors": 0, "first_error": None,
              "holders": 1}
             for n, t, ms in [(4, 1024, 1.0), (4, 32896, 2.0), (256, 1024, 1.5), (256, 32896, 3.0), (256, 32896, 9.0),
                              (256, 32896, 2.0), (4, 32896, 2.0), (4, 32896, 2.0)]]
    idle = [{"replicas": 4, "seconds": 30.0, "gateway_pct": 0.0, "fleet_pct": 1.0},
            {"replicas": 256, "seconds": 30.0, "gateway_pct": 5.0, "fleet_pct": 9.0}]
    args = SimpleNamespace(concurrency=8, warmup=20, requests=100, reps=3, settle_seconds=10.0,
                           shared_tokens=[896, 32768])
    text = "\n".join(report_lines(cells, idle, {"gateway": "g"}, args))
    assert "| 256 / 4 replicas, 32,896-token prompts | 1.50x |" in text  # median 3.0 over 2.0
    assert "| 32,896 / 1,024 tokens, 4 replicas | 2.00x | 2.00x |" in text
    assert "| 32,896 / 1,024 tokens, 256 replicas | 2.00x | 2.50x |" in text  # 0.5 ms of idle off each
    assert "| idle, 256 replicas: % of one core | 5.0% |" in text
    assert "| 256 | 32,896 (32,768 + 128) | 3.00 | 3.00, 9.00, 2.00 | 2.50 | 100 | 5.0 | 0 | 1, 1, 1 |" in text


def test_the_command_writes_its_results_folder(tmp_path):
    assert main(["--replicas", "1,2", "--shared-tokens", "256,32", "--own-tokens", "16", "--requests", "10",
                 "--warmup", "2", "--reps", "2", "--settle-seconds", "0", "--idle-seconds", "0.5",
                 "--background-seconds", "0.3", "--out", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert "python -m bench fleet-cost" in readme and "| 2 | 272 (256 + 16) |" in readme
    assert "health probes every 2 s" in readme and "| 2 / 1 replicas, 272-token prompts |" in readme
    assert "| prompt tokens | floor CPU ms / request |" in readme  # the floor proxy beside it, in the same turns
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert len(results["cells"]) == 12 and all(c["errors"] == 0 for c in results["cells"])
    gateways = [c for c in results["cells"] if not c.get("floor")]
    assert len(gateways) == 8 and all(1 <= c["holders"] <= c["replicas"] for c in gateways)
    assert [t["rate_per_s"] for t in results["background"]] == [0.5, 1.0, 0.1, 0.1]  # each task measured
    assert "| health probes (`/health` every `health.interval_s`, 2 s) |" in readme
