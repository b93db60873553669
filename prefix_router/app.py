"""``create_app``: the gateway as an aiohttp application, with its pollers in ``cleanup_ctx``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` and
``POST /v1/messages`` (routed by prefix and proxied: ``proxy.py``),
``GET /v1/models`` (the union of the healthy replicas'), ``GET /health`` (liveness), ``GET /ready``
(200 once a replica is on the ring: it passed a health check and a scrape since start; else 503), ``GET /metrics``, ``GET /replicas``
and ``GET /debug/changes?top=N`` (why clients changed their prefixes: ``misses/change_sites.py``); those two
need an admin key once any key is configured (``tenants.py``), and so does ``GET /``, the status
page for a browser (``serve/status_page.py``; a client asking for JSON there gets the replicas'
answer, as before the page). Every other path goes to the
replicas (``passthrough.py``: to one, or an operator's to all). Errors are OpenAI-style JSON,
aiohttp's own 405 and 413 included, and so are the answers aiohttp's HTTP parser gives before any
handler runs (a malformed request line, header or chunked framing: ``_JsonErrorServer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from http import HTTPStatus

import aiohttp
from aiohttp import web, web_protocol, web_server
from prometheus_client import CONTENT_TYPE_LATEST

from prefix_router.serve.bodies import loads
from prefix_router.fleet.kv_follower import follow_events
from prefix_router.config import GatewayConfig
from prefix_router.prompts.responses import MESSAGES, RESPONSES
from prefix_router.fleet.discovery import discover_once, poll_dns
from prefix_router.endpoints import Kind
from prefix_router.errors import error_body, openai_error
from prefix_router.gateway import Gateway
from prefix_router.serve.passthrough import REPLICAS_HEADER, handle_passthrough
from prefix_router.serve.learning import flush_waiting_lines
from prefix_router.serve.proxy import handle_generate
from prefix_router.serve.status_page import HEADERS as PAGE_HEADERS, render, snapshot, wants_html
from prefix_router.serve.summary import log_summaries
from prefix_router.fleet.replicas import check_all, poll_health, poll_metrics, scrape_once, servers
from prefix_router.fleet.tenants import bearer
from prefix_router.prompts.tokenizer import PromptTokenizer

__all__ = ["create_app", "GATEWAY"]

GATEWAY = web.AppKey("gateway", Gateway)

log = logging.getLogger(__name__)


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


class _JsonErrorHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, answering its own errors (400 for bad framing, 500, 504)
    as OpenAI-style JSON instead of text or HTML; the exception's text for a 500 stays in the log."""

    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises if the answer had begun
        text = message if message and status < 500 else HTTPStatus(status).phrase
        response = web.json_response(error_body(status, text[:200]), status=status)
        response.force_close()
        return response


class _JsonErrorServer(web_server.Server):
    """aiohttp's server making ``_JsonErrorHandler`` connections (the class of the server an
    application makes is swapped for this one: aiohttp has no setting for it)."""

    def __call__(self) -> web_protocol.RequestHandler:
        handler = super().__call__()
        handler.__class__ = _JsonErrorHandler
        return handler


def _json_framing_errors(app: web.Application) -> None:
    """Make the servers ``app`` is run by (``web.run_app``, test clients) ``_JsonErrorServer``s."""
    make = app._make_handler

    def make_handler(**kwargs) -> web_server.Server:
        server = make(**kwargs)
        server.__class__ = _JsonErrorServer
        return server

    app._make_handler = make_handler


def _forbidden(request: web.Request) -> web.Response:
    """401 without a key, 403 with a key that is not an admin's."""
    if bearer(request) is None:
        return openai_error(401, "this view needs an admin key (Authorization: Bearer KEY)", type_="AuthenticationError")
    return openai_error(403, "this view needs an admin key; the key given is not one", type_="PermissionDeniedError")


def create_app(config: GatewayConfig, tokenizer: PromptTokenizer | None = None, proxy: bool = True) -> web.Application:
    """Build the gateway application; nothing runs until the app starts. ``proxy`` False: the
    operator's endpoints only (``/health``, ``/ready``, ``/metrics``, ``/replicas``,
    ``/debug/changes``, the status page ``/``), for the Endpoint Picker, whose HTTP port must be
    no way around the gateway in front of it."""
    # bodies as they came: bodies.read_body inflates gzip and deflate itself, within the limit
    app = web.Application(client_max_size=config.limits.max_body_bytes, middlewares=[_openai_errors],
                          handler_args={"auto_decompress": False})
    _json_framing_errors(app)
    app[GATEWAY] = Gateway(config, tokenizer)
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_draining)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/replicas", _replicas)
    app.router.add_get("/debug/changes", _changes)
    app.router.add_get("/", _root if proxy else _status)  # GET and HEAD; other methods: passthrough below
    if not proxy:
        return app
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post(RESPONSES, _responses)
    app.router.add_post(MESSAGES, _messages)
    app.router.add_get("/v1/models", _models)
    app.router.add_route("*", "/{tail:.*}", _passthrough)  # every other path vLLM serves: passthrough.py
    return app


async def _draining(app: web.Application) -> None:
    """SIGTERM (or Ctrl-C): the listening socket is closed; say what is left to finish."""
    gw = app[GATEWAY]
    inflight = sum(r.inflight for r in gw.replicas.values())
    log.info("shutting down: no new connections; %d requests in flight get up to %g s to finish",
             inflight, gw.config.drain_s)


async def _lifecycle(app: web.Application):
    """The HTTP session to the replicas, the first scrape, then the pollers until shutdown."""
    gw = app[GATEWAY]
    config = gw.config
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
    # the first lookup before serving, so a discovery-only gateway is ready at once
    if config.discovery.dns or config.discovery.prefill_dns:
        await discover_once(gw, config.discovery)
    pods = await _pod_watcher(gw)
    # A health check, then a scrape, of every replica before serving: those that pass both are
    # on the ring from the first request; /ready is 503 until one is.
    replicas = list(gw.replicas.values())
    await check_all(gw.http, replicas, config.health)
    await asyncio.gather(*(scrape_once(gw.http, server, 2.0) for server in servers(replicas)))
    gw.sync_ring()
    models_s = config.scrape.models_interval_s
    tasks = [asyncio.create_task(poll_health(gw.http, gw.replicas, config.health, models_s)),
             asyncio.create_task(poll_metrics(gw.http, gw.replicas, config.scrape.interval_s, models_s,
                                              # a worker of several is not the only router
                                              config.scrape.idle_interval_s if gw.routing.sole_router else 0.0)),
             asyncio.create_task(_sync_loop(gw, min(config.scrape.interval_s, config.health.interval_s) / 2))]
    if config.discovery.dns or config.discovery.prefill_dns:
        tasks.append(asyncio.create_task(poll_dns(gw, config.discovery)))
    if config.kv_events.enabled:
        tasks.append(asyncio.create_task(follow_events(gw)))
    if pods is not None:
        tasks.append(asyncio.create_task(pods[0].run(pods[1])))
    if config.summary_interval_s > 0:
        tasks.append(asyncio.create_task(log_summaries(gw, config.summary_interval_s)))
    yield
    if pods is not None:
        tasks += pods[0].probes  # new pods' first checks: they use the session closed next
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await gw.http.close()
    if pods is not None:
        await pods[0].v1.api_client.close()
    log.info("stopped; %d requests were still in flight", sum(r.inflight for r in gw.replicas.values()))
    gw.executor.shutdown(wait=False)
    if gw.request_log is not None:
        await flush_waiting_lines(gw)
        gw.request_log.close()


async def _pod_watcher(gw: Gateway):
    """With ``discovery.kubernetes``: the pod watcher and its first LIST's resourceVersion (None
    when it failed: the watcher lists again), the pods found already replicas; else None. Raises
    ``ConfigError`` without the client library or credentials (``fleet/kubernetes.py``)."""
    settings = gw.config.discovery.kubernetes
    if not settings.label_selector:
        return None
    from prefix_router.fleet.kubernetes import PodWatcher, connect, namespace_of

    api, context = await connect(settings)
    watcher = PodWatcher(gw, settings, namespace_of(settings, context), api)
    try:
        return watcher, await watcher.list()
    except Exception as exc:  # noqa: BLE001 (the client's errors are many; the loop retries them)
        log.warning("kubernetes: listing pods failed (%s); retrying in the background", exc)
        return watcher, None


async def _chat(request: web.Request) -> web.StreamResponse:
    return await handle_generate(request, request.app[GATEWAY], "/v1/chat/completions", chat=True)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await handle_generate(request, request.app[GATEWAY], "/v1/completions", chat=False)


async def _responses(request: web.Request) -> web.StreamResponse:
    return await handle_generate(request, request.app[GATEWAY], RESPONSES, chat=True)


async def _messages(request: web.Request) -> web.StreamResponse:
    return await handle_generate(request, request.app[GATEWAY], MESSAGES, chat=True)


async def _passthrough(request: web.Request) -> web.StreamResponse:
    if "." in request.path and any(segment in (".", "..") for segment in request.path.split("/")):
        # the HTTP client forwarding it resolves them (RFC 3986): /v1/./completions would reach
        # /v1/completions past every check that path gets (aiohttp's path is percent-decoded)
        return openai_error(400, "a path with . or .. segments is not served", "path")
    return await handle_passthrough(request, request.app[GATEWAY])


async def _models(request: web.Request) -> web.Response:
    """Every model and LoRA adapter the healthy replicas serve: the union of their
    ``/v1/models`` (each id once, as the first replica to list it describes it), with each
    replica's status in ``x-prefix-router-replicas``."""
    gw = request.app[GATEWAY]
    refused = gw.tenants.refusal(request, Kind.SERVES, "GET", "/v1/models")
    if refused is not None:
        return refused

    async def one(replica) -> tuple[int, list]:
        try:
            async with gw.http.get(replica.url + "/v1/models", allow_redirects=False) as resp:
                data = (await resp.json(loads=loads)).get("data") if resp.status == 200 else None
                return resp.status, data if isinstance(data, list) else []
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return 0, []

    healthy = [r for r in gw.replicas.values() if r.healthy]
    answers = await asyncio.gather(*(one(r) for r in healthy))
    if not any(status == 200 for status, _ in answers):
        return openai_error(503, "no healthy replica answered /v1/models", type_="ServiceUnavailableError")
    models: dict[str, dict] = {}
    for _, data in answers:
        for model in data:
            if isinstance(model, dict) and isinstance(model.get("id"), str):
                models.setdefault(model["id"], model)
    statuses = ",".join(f"{r.name}={status}" for r, (status, _) in zip(healthy, answers))
    return web.json_response({"object": "list", "data": list(models.values())}, headers={REPLICAS_HEADER: statuses})


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    routable = sum(r.routable for r in request.app[GATEWAY].replicas.values())
    return web.json_response({"healthy_replicas": routable}, status=200 if routable else 503)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[GATEWAY].metrics.page(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _replicas(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if not gw.tenants.is_admin(request):
        return _forbidden(request)
    return web.json_response(gw.describe())


async def _status(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if not gw.tenants.is_admin(request):
        return _forbidden(request)
    return web.Response(text=render(snapshot(gw)), content_type="text/html", headers=PAGE_HEADERS)


async def _root(request: web.Request) -> web.StreamResponse:
    """``GET /`` in front of the replicas: the status page for a browser, curl and any client that
    takes HTML; a client naming JSON (an SDK probing the base URL) gets what it got before the
    page existed, the replicas' answer (vLLM serves no ``/``: its 404), as every other path does."""
    if wants_html(request.headers.get("Accept")):
        return await _status(request)
    return await _passthrough(request)


async def _changes(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if not gw.tenants.is_admin(request):
        return _forbidden(request)
    top = request.query.get("top", "20")
    if not (top.isascii() and top.isdigit()) or not 1 <= int(top) <= gw.changes.max_sites:
        return openai_error(400, f"'top' must be an integer from 1 to {gw.changes.max_sites}", "top")
    return web.json_response(gw.changes.view(int(top)))
