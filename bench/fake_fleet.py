"""A fleet of fake vLLM replicas in one process: ``--replicas`` listening sockets on one event
loop (uvloop where installed), each answering what the gateway asks of a replica, at once.

Hundreds of simulator processes (``prefix-router sim``) do not fit a 2-core machine; these fakes
do, and cost the gateway what real replicas would, since they answer in the shapes the
simulator (``prefix_router/tools/sim/server.py``, the faithful stand-in for vLLM) answers in:

- ``GET /health``: 200, empty;
- ``GET /metrics``: the simulator's own page (``prefix_router/tools/sim/metrics.py``: the
  ``vllm:`` gauges, counters, histograms and ``cache_config_info`` with ``block_size`` 16 and
  ``num_gpu_blocks`` 28,000), gzipped when asked, as vLLM's is; the prompt-token and
  prefix-cache-query counters count what was served, the gauges stay at 0;
- ``GET /v1/models``: one model, ``--model``;
- ``GET /kv_event_sources``: ``{}`` (no KV events);
- ``POST /v1/completions``: a prompt of token ids, non-streaming, answered at once with one
  token and ``usage`` (``prompt_tokens`` the prompt's length, ``cached_tokens`` 0). A string
  prompt or ``stream: true`` gets a 400.

    python -m bench.fake_fleet --replicas 256 --port 40000 --ports-file urls.txt

writes the fleet's base URLs to ``--ports-file``, one a line (the first on ``--port``), before
any of them answers, and serves until SIGTERM. ``started(n, log_dir)`` runs it as a child
process and yields the URLs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prefix_router.tools.launch import Server, free_port, running
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.metrics import EngineMetrics

from . import ROOT

__all__ = ["MODEL", "FakeReplica", "serve", "started"]

MODEL = "fake-model"


class FakeReplica:
    """One fake replica: its ``app()`` and the counters its ``/metrics`` page reads."""

    def __init__(self, model: str = MODEL) -> None:
        self.config = SimConfig(model=model)
        # what the simulator's collector reads of its scheduler, nothing queued or running
        kv = SimpleNamespace(usage=0.0, num_queries=0, num_hits=0)
        self.scheduler = SimpleNamespace(running=(), waiting=(), kv=kv, num_preemptions=0, num_prompt_tokens=0,
                                         num_generation_tokens=0)
        self.metrics = EngineMetrics(self.config, self.scheduler)
        self.ids = itertools.count()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)  # the simulator's
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/kv_event_sources", self.kv_event_sources)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics_page(self, request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self.metrics.registry),
                                headers={"Content-Type": CONTENT_TYPE_LATEST})
        response.enable_compression()
        return response

    async def models(self, request: web.Request) -> web.Response:
        model = self.config.model
        card = {"id": model, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": model,
                "parent": None, "max_model_len": self.config.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def completions(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            return _error(f"the body is not JSON: {exc}")
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return _error("the fake fleet takes a prompt of token ids only", "prompt")
        if body.get("stream"):
            return _error("the fake fleet answers non-streaming requests only", "stream")
        n = len(prompt)
        s = self.scheduler
        s.kv.num_queries += n
        s.num_prompt_tokens += n
        s.num_generation_tokens += 1
        self.metrics.finished["length"] = self.metrics.finished.get("length", 0) + 1
        choice = {"index": 0, "text": " is", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        usage = {"prompt_tokens": n, "total_tokens": n + 1, "completion_tokens": 1,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        return web.json_response({"id": f"cmpl-{next(self.ids):016x}", "object": "text_completion",
                                  "created": int(time.time()), "model": body.get("model", self.config.model),
                                  "choices": [choice], "usage": usage})


def _error(message: str, param: str | None = None) -> web.Response:
    """An OpenAI-shaped 400, as the simulator's."""
    return web.json_response({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}},
                             status=400)


def _listening(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)  # connections queue from now, before the loop serves them
    return sock


async def serve(replicas: int, ports_file: Path, port: int = 0, model: str = MODEL,
                stop: asyncio.Event | None = None) -> None:
    """Serve ``replicas`` fakes until ``stop`` is set (None: until SIGTERM or SIGINT), having
    written their URLs to ``ports_file``; the first on ``port`` (0: any), and served last, so
    that once it answers they all do."""
    socks = [_listening(port if i == 0 else 0) for i in range(replicas)]
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    ports_file.parent.mkdir(parents=True, exist_ok=True)
    partial = ports_file.with_name(ports_file.name + ".partial")
    partial.write_text("".join(u + "\n" for u in urls))
    partial.replace(ports_file)
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    runners = []
    try:
        for sock in reversed(socks):
            runner = web.AppRunner(FakeReplica(model).app(), access_log=None)
            await runner.setup()
            runners.append(runner)
            await web.SockSite(runner, sock).start()
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()


@contextlib.contextmanager
def started(replicas: int, log_dir: Path, model: str = MODEL) -> Iterator[tuple[list[str], int]]:
    """``replicas`` fakes in one child process; yields (their base URLs, its pid)."""
    port = free_port()
    ports_file = log_dir / f"fake-fleet-{port}.urls"
    server = Server([sys.executable, "-m", "bench.fake_fleet", "--replicas", str(replicas), "--port", str(port),
                     "--ports-file", str(ports_file), "--model", model], port, log_dir / f"fake-fleet-{port}.log",
                    cwd=ROOT)
    with running([server]):
        yield ports_file.read_text().split(), server.pid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fake_fleet", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--port", type=int, default=0, help="the first replica's port (0: any)")
    parser.add_argument("--ports-file", type=Path, required=True, help="where the base URLs are written, one a line")
    parser.add_argument("--model", default=MODEL, help="the model id /v1/models lists")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.replicas, args.ports_file, args.port, args.model))
    else:
        uvloop.run(serve(args.replicas, args.ports_file, args.port, args.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
