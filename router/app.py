"""``create_app``: the gateway as an aiohttp application, with its pollers in ``cleanup_ctx``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (routed and proxied),
``GET /v1/models`` (from the first healthy replica), ``GET /health`` (liveness), ``GET /ready``
(200 when at least one replica is on the ring, else 503), ``GET /metrics``, ``GET /replicas``
and ``GET /debug/changes?top=N`` (why clients changed their prefixes: ``changes.py``); those two
need an admin key once any key is configured (``tenants.py``). Errors are OpenAI-style JSON,
aiohttp's own 404 and 405 included.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from .cacheview import follow_events
from .config import GatewayConfig
from .discovery import discover_once, poll_dns
from .gateway import Gateway
from .errors import openai_error
from .proxy import REPLICA_HEADER, handle_generate
from .replicas import poll_health, poll_metrics, scrape_once
from .tenants import bearer
from .tokenizer import PromptTokenizer

__all__ = ["create_app", "GATEWAY"]

GATEWAY = web.AppKey("gateway", Gateway)


async def _sync_loop(gw: Gateway, interval_s: float) -> None:
    while True:
        gw.forget_drained(time.monotonic())
        gw.sync_ring()
        gw.admission.notify()  # a scrape may have shown a queue drained
        await asyncio.sleep(interval_s)


@web.middleware
async def _openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own 4xx (unknown path, wrong method, body too large) as OpenAI-style JSON."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: f"no such endpoint: {request.method} {request.path[:200]}",
                   405: f"method {request.method} is not allowed on {request.path[:200]}"}.get(exc.status, exc.reason)
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return openai_error(exc.status, message, headers=headers)


def _forbidden(request: web.Request) -> web.Response:
    """401 without a key, 403 with a key that is not an admin's."""
    if bearer(request) is None:
        return openai_error(401, "this view needs an admin key (Authorization: Bearer KEY)", type_="AuthenticationError")
    return openai_error(403, "this view needs an admin key; the key given is not one", type_="PermissionDeniedError")


def create_app(config: GatewayConfig, tokenizer: PromptTokenizer | None = None) -> web.Application:
    """Build the gateway application; nothing runs until the app starts."""
    gw = Gateway(config, tokenizer)
    app = web.Application(client_max_size=config.limits.max_body_bytes, middlewares=[_openai_errors])
    app[GATEWAY] = gw

    async def lifecycle(app: web.Application):
        up = config.upstream
        timeout = aiohttp.ClientTimeout(total=None, connect=up.connect_timeout_s, sock_read=up.read_timeout_s)
        # Bodies are relayed as they are (auto_decompress off, no Content-Encoding passed on), so
        # ask for identity: aiohttp would otherwise send "Accept-Encoding: gzip, deflate", and
        # vLLM's /metrics (prometheus-client) or a gzip proxy would answer compressed bytes.
        headers = {"Accept-Encoding": "identity"}
        if config.auth.upstream_api_key:  # vllm serve --api-key: every call to a replica carries it
            headers["Authorization"] = f"Bearer {config.auth.upstream_api_key}"
        gw.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=up.max_connections),
                                        timeout=timeout, auto_decompress=False, headers=headers)
        if config.discovery.dns:  # the first lookup before serving, so a discovery-only gateway is ready at once
            await discover_once(gw, config.discovery)
        replicas = list(gw.replicas.values())
        await asyncio.gather(*(scrape_once(gw.http, r, 2.0) for r in replicas))
        gw.sync_ring()
        tasks = [asyncio.create_task(poll_health(gw.http, gw.replicas, config.health)),
                 asyncio.create_task(poll_metrics(gw.http, gw.replicas, config.scrape.interval_s)),
                 asyncio.create_task(_sync_loop(gw, min(config.scrape.interval_s, config.health.interval_s) / 2))]
        if config.discovery.dns:
            tasks.append(asyncio.create_task(poll_dns(gw, config.discovery)))
        if config.kv_events.enabled:
            tasks.append(asyncio.create_task(follow_events(gw)))
        yield
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await gw.http.close()
        gw.executor.shutdown(wait=False)
        if gw.request_log is not None:
            gw.request_log.close()

    app.cleanup_ctx.append(lifecycle)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await handle_generate(request, gw, "/v1/chat/completions", chat=True)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await handle_generate(request, gw, "/v1/completions", chat=False)

    async def models(request: web.Request) -> web.Response:
        if gw.tenants.enabled and gw.tenants.tenant_of(request) is None and not gw.tenants.is_admin(request):
            return openai_error(401, "missing or unknown API key (Authorization: Bearer KEY)", type_="AuthenticationError")
        for replica in gw.replicas.values():
            if not replica.healthy:
                continue
            try:
                async with gw.http.get(replica.url + "/v1/models") as resp:
                    if resp.status == 200:
                        return web.Response(body=await resp.read(), content_type="application/json",
                                            headers={REPLICA_HEADER: replica.name})
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        return openai_error(503, "no healthy replica answered /v1/models")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(request: web.Request) -> web.Response:
        routable = sum(r.routable for r in gw.replicas.values())
        return web.json_response({"healthy_replicas": routable}, status=200 if routable else 503)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=gw.metrics.page(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def replicas(request: web.Request) -> web.Response:
        if not gw.tenants.is_admin(request):
            return _forbidden(request)
        return web.json_response(gw.describe())

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    async def changes(request: web.Request) -> web.Response:
        if not gw.tenants.is_admin(request):
            return _forbidden(request)
        top = request.query.get("top", "20")
        if not top.isdigit() or not 1 <= int(top) <= gw.changes.max_sites:
            return openai_error(400, f"'top' must be an integer from 1 to {gw.changes.max_sites}", "top")
        return web.json_response(gw.changes.view(int(top)))

    app.router.add_get("/replicas", replicas)
    app.router.add_get("/debug/changes", changes)
    return app
