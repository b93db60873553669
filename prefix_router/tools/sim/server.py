"""The simulated replica's HTTP API, shaped like vLLM 0.32's OpenAI server.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``,
``stream_options.include_usage``, ``n`` and ``usage.prompt_tokens_details.cached_tokens``),
``POST /v1/responses`` (``store`` and ``previous_response_id`` too), ``GET /v1/models``,
``GET /health``, ``POST /tokenize``, ``GET /metrics``, ``GET /kv_event_sources``,
``POST /reset_prefix_cache``, and with a KV
connector (``--kv-transfer-config``) ``POST /sim/kv_pull``, where a decode replica pulls a prefill
leg's blocks (``kv_transfer.py``). Response bodies, SSE framing (``data: {...}\\n\\n`` events,
then ``data: [DONE]``) and error bodies (``{"error": {"message", "type", "param", "code"}}``)
were copied from a running vLLM CPU replica (``answers.py``). Bad input gets a 400 (unknown model:
404), never a 5xx; a decode whose prefill replica is gone gets vLLM's 500. With
``--data-parallel-size K`` the server runs K engines, each request on the one its
``X-data-parallel-rank`` names or vLLM's balancer picks (``data_parallel.py``).

One difference by design: when a stream falls behind the engine, the tokens generated since
its last write go out as one SSE event (vLLM sends one event per engine step). Clients see the
same text and the same final usage; only the number of events differs.

Two additions: a stream's first event with tokens carries ``sim_ttft_s``, the replica's own time to
those tokens (wall seconds from the request's submission to its engine, so queueing and prefill),
and ``sim_modelled_ttft_s``, that span in modelled seconds (``first_token_s - arrival_s``, as
``vllm:time_to_first_token_seconds`` observes it: the engine's clock, which the process's lag does
not move; ``engine.py``). Clients ignore fields they do not know; the replay client records both
(``Record``) for benchmarks that scale only the replica's part of a TTFT, and for the demo. vLLM
sends neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections import OrderedDict

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prefix_router.cache.blocks import extend_block_hashes, seed_hash
from prefix_router.errors import openai_error
from prefix_router.prompts.tokenizer import ChatFormatError, PromptTokenizer
from prefix_router.tools.sim.answers import CHAT, COMPLETION, RESPONSES, Answer
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.data_parallel import Ranks, check_event_ports, offset_endpoint
from prefix_router.tools.sim.engine import Engine
from prefix_router.tools.sim.kv_transfer import Connector, ConnectorMetrics, expire_leases
from prefix_router.tools.sim.requests import (ApiError, CompletionParams, parse_chat, parse_completion,
                                              parse_responses, parse_tokenize)
from prefix_router.tools.sim.scheduler import SimRequest

__all__ = ["create_app", "ENGINE", "ENGINES", "TOKENIZER"]

ENGINE = web.AppKey("engine", Engine)  # rank 0's (the only one without data parallelism)
ENGINES = web.AppKey("engines", Ranks)
TOKENIZER = web.AppKey("tokenizer", object)
CONFIG = web.AppKey("config", SimConfig)
CONNECTOR = web.AppKey("connector", Connector)
STORED = web.AppKey("stored", OrderedDict)  # Responses stored: id -> the messages a continuation sees

_PREFIX = {COMPLETION: "cmpl-", CHAT: "chatcmpl-", RESPONSES: "resp_"}
_MAX_STORED = 10_000  # stored Responses kept, oldest forgotten first (vLLM keeps all in memory)

_ids = itertools.count()


def _error(exc: ApiError) -> web.Response:
    return openai_error(exc.status, str(exc), exc.param, exc.type)


async def _read_json(request: web.Request) -> dict:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"JSON decode error: {exc}", param="body") from None
    except RecursionError:  # json.loads on deeply nested arrays or objects
        raise ApiError("JSON decode error: nested too deeply", param="body") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object", param="body")
    return body


class _Stream:
    """Wakes a handler when the engine has new tokens for its request."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __call__(self) -> None:
        self.event.set()


def _check_length(config: SimConfig, params: CompletionParams, num_tokens: int) -> None:
    """Raise vLLM's ApiError for a prompt or ``max_tokens`` the model's length cannot take."""
    if num_tokens > config.max_model_len:
        raise ApiError(
            f"This model's maximum context length is {config.max_model_len} tokens. However, your "
            f"prompt contains {num_tokens} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens")
    if num_tokens == config.max_model_len:
        # vLLM rejects this too (InputProcessor._validate_prompt_len); admitted, a chunked
        # prefill would stop one token short (the scheduler's max_model_len - 1 cap) forever.
        raise ApiError(
            f"The decoder prompt (length {num_tokens}) plus the number of requested output "
            f"tokens (at least 1) is longer than the maximum model length of {config.max_model_len}. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens "
            "(prompt + requested output tokens).",
            param="input_tokens")
    if params.max_tokens is not None and params.max_tokens > config.max_model_len:
        raise ApiError(f"max_tokens={params.max_tokens} cannot be greater than "
                       f"max_model_len={config.max_model_len}. Please request fewer output tokens.",
                       param="max_tokens")


async def _pulled_tokens(app: web.Application, engine: Engine, leg, params: CompletionParams,
                         token_ids: list[int]) -> int:
    """A decode leg's prompt tokens pulled from its prefill replica, after the modelled transfer
    time of those the local cache lacks (0 for any other request). Raises a 500 ApiError when
    the prefill replica cannot be reached, as vLLM does (``kv_load_failure_policy`` "fail")."""
    if leg.consume is None:
        return 0
    config, connector = app[CONFIG], app[CONNECTOR]
    hashes: list = []
    extend_block_hashes(hashes, token_ids, config.block_size, seed_hash(params.model, params.cache_salt))
    pulled = await connector.pull(leg.consume, hashes, config.block_size)
    if pulled is None:
        raise ApiError("KV transfer failed: the prefill replica could not be reached", status=500,
                       type="InternalServerError")
    local = len(engine.scheduler.kv.find_longest_cache_hit(hashes, len(token_ids))) * config.block_size
    await asyncio.sleep(connector.transfer_s(max(min(pulled, len(token_ids) - 1) - local, 0)) / config.time_scale)
    return pulled


async def _generate(request: web.Request, params: CompletionParams, token_ids: list[int], kind: str,
                    store: bool = False, history: list | None = None):
    """Run ``params.n`` sequences of ``token_ids`` and answer as the API ``kind`` does."""
    app = request.app
    tokenizer, config, connector = app[TOKENIZER], app[CONFIG], app[CONNECTOR]
    _check_length(config, params, len(token_ids))
    engine = app[ENGINES].pick(request.headers)
    leg = connector.leg(params.kv_transfer_params, stream=params.stream, max_tokens=params.max_tokens, n=params.n)
    external = await _pulled_tokens(app, engine, leg, params, token_ids)
    max_tokens = params.max_tokens or config.default_max_tokens
    rid = f"{_PREFIX[kind]}{next(_ids):016x}"
    children = [SimRequest(rid if params.n == 1 else f"{i}_{rid}", token_ids, max_tokens, model=params.model,
                           cache_salt=params.cache_salt) for i in range(params.n)]
    wake = _Stream()
    for child in children:
        child.on_update, child.num_external_tokens, child.hold_blocks = wake, external, leg.produce
    reported = leg.consume.get("remote_prefill_cached_tokens") if leg.consume is not None else None
    answer = Answer(kind, rid, params.model, params.include_usage, reported if isinstance(reported, int) else None)
    stored = app[STORED]

    def remember(text: str) -> None:  # a Response's messages, for one that continues it
        if store:
            stored[rid] = [*(history or []), {"role": "assistant", "content": text}]
    submitted = time.perf_counter()
    engine.submit(*children)
    try:
        if not params.stream:
            while any(c.finish_reason is None for c in children):
                await wake.event.wait()
                wake.event.clear()
            texts = ["".join(tokenizer.decode_token(t) for t in c.output_token_ids) for c in children]
            transfer = _held(request, engine, children[0]) if leg.produce else None
            remember(texts[0])
            return web.json_response(answer.body(children, texts, transfer))
        response = await _stream(request, children, wake, answer, submitted)
        remember(answer.text)
        return response
    finally:
        for child in children:
            engine.abort(child)  # no-op once finished; frees blocks if the client went away


def _held(request: web.Request, engine: Engine, child: SimRequest) -> dict | None:
    """A finished prefill leg's ``kv_transfer_params``, its blocks held for the decode on
    ``engine``; None when it did not finish by length (nothing is held)."""
    scheduler = engine.scheduler
    blocks = scheduler.held.get(child.request_id)
    if blocks is None:
        return None
    host, port = request.transport.get_extra_info("sockname")[:2]
    return request.app[CONNECTOR].answer_params(child.request_id, [b.block_id for b in blocks], host, port,
                                                engine.now_s(), child.num_prompt_tokens,
                                                child.num_cached_tokens or 0)


async def _stream(request, children: list[SimRequest], wake: _Stream, answer: Answer, submitted: float):
    tokenizer = request.app[TOKENIZER]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    # vLLM sends a chat's role chunk with the first output the engine yields, after the prefill
    # (``OpenAIServingChat.chat_completion_stream_generator``, ``first_iteration``), not when
    # the stream opens: a client that times the first chunk (``vllm bench serve`` does) measures
    # the prefill, as against vLLM
    start = answer.start()
    if start:
        await response.write(start.encode())
    sent = [0] * len(children)
    timed = False
    decode = tokenizer.decode_token
    while True:
        await wake.event.wait()
        wake.event.clear()
        out = []
        for i, child in enumerate(children):
            if sent[i] < 0:  # ended and sent
                continue
            tokens = child.token_ids[child.num_prompt_tokens + sent[i]:]
            ended = child.finish_reason is not None
            if not tokens and not ended:
                continue
            own = modelled = None
            if tokens and not timed:
                own, modelled, timed = time.perf_counter() - submitted, child.first_token_s - child.arrival_s, True
            sent[i] = -1 if ended else sent[i] + len(tokens)
            out.append(answer.chunk(i, "".join(decode(t) for t in tokens), child.finish_reason if ended else None, own,
                                    modelled))
        if all(s < 0 for s in sent):
            out.append(answer.end(children))
            await response.write("".join(out).encode())
            await response.write_eof()
            return response
        if out:
            await response.write("".join(out).encode())


async def completions(request: web.Request) -> web.StreamResponse:
    try:
        body = await _read_json(request)
        params, prompt = parse_completion(body, request.app[CONFIG])
        tokenizer = request.app[TOKENIZER]
        if isinstance(prompt, str):
            token_ids = tokenizer.encode(prompt, add_special_tokens=params.add_special_tokens)
        else:
            if any(t >= tokenizer.vocab_size for t in prompt):
                bad = next(t for t in prompt if t >= tokenizer.vocab_size)
                raise ApiError(f"Token id {bad} is out of vocabulary")
            token_ids = prompt
        return await _generate(request, params, token_ids, COMPLETION)
    except ApiError as exc:
        return _error(exc)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    try:
        body = await _read_json(request)
        params, chat = parse_chat(body, request.app[CONFIG])
        try:
            token_ids = request.app[TOKENIZER].render_chat(**chat)
        except ChatFormatError as exc:
            raise ApiError(str(exc), param=exc.param) from None
        return await _generate(request, params, token_ids, CHAT)
    except ApiError as exc:
        return _error(exc)


async def responses(request: web.Request) -> web.StreamResponse:
    """``/v1/responses``: the input rendered as vLLM renders it (``prompts/responses.py``), after
    the stored history of ``previous_response_id``."""
    try:
        body = await _read_json(request)
        history, previous = None, body.get("previous_response_id")
        if previous is not None:
            history = request.app[STORED].get(previous)
            if history is None:
                raise ApiError(f"Response with id '{previous}' not found.", param="previous_response_id",
                               status=404, type="NotFoundError")
        params, store, chat = parse_responses(body, request.app[CONFIG], history)
        try:
            token_ids = request.app[TOKENIZER].render_chat(**chat)
        except ChatFormatError as exc:
            raise ApiError(str(exc), param=exc.param) from None
        stored = request.app[STORED]
        while len(stored) >= _MAX_STORED:
            stored.popitem(last=False)
        return await _generate(request, params, token_ids, RESPONSES, store, chat["messages"])
    except ApiError as exc:
        return _error(exc)


async def kv_pull(request: web.Request) -> web.Response:
    """A decode replica pulls a prefill leg's held blocks (vLLM: a NIXL read): ``{"block_hashes":
    [...]}``, the blocks freed here; 404 when none are held under that id."""
    body = await request.json()
    engine = request.app[ENGINES].holding(str(body.get("remote_request_id")))
    release = engine.scheduler.release_held if engine is not None else (lambda _: None)
    hashes = request.app[CONNECTOR].give(body.get("remote_request_id"), body.get("remote_engine_id"), release)
    if hashes is None:
        return openai_error(404, "no KV blocks held under that request id", type_="NotFoundError")
    return web.json_response({"block_hashes": hashes})


async def tokenize(request: web.Request) -> web.Response:
    try:
        body = await _read_json(request)
        tokenizer, config = request.app[TOKENIZER], request.app[CONFIG]
        kind, args = parse_tokenize(body, config)
        try:
            tokens = tokenizer.render_chat(**args) if kind == "chat" else tokenizer.encode(**args)
        except ChatFormatError as exc:
            raise ApiError(str(exc), param=exc.param) from None
        return web.json_response({"count": len(tokens), "max_model_len": config.max_model_len,
                                  "tokens": tokens, "token_strs": None})
    except ApiError as exc:
        return _error(exc)


async def models(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    card = {"id": config.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": config.model, "parent": None, "max_model_len": config.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's dev-mode ``POST /reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1`` there, always on
    here): ``{"success": bool}``, false while running requests hold blocks."""
    return web.json_response({"success": all([e.reset_prefix_cache() for e in request.app[ENGINES].engines])})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[ENGINE].metrics.registry)
    response = web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
    response.enable_compression()  # gzip when asked, as vLLM's prometheus-client endpoint does
    return response


async def kv_event_sources(request: web.Request) -> web.Response:
    """vLLM's ``GET /kv_event_sources``: the publisher's configuration per data-parallel rank
    (``{}`` when events are off); endpoints as configured (``tcp://*:5557``) with each rank's port
    offset by its rank, port 0 resolved."""
    out = {}
    for engine in request.app[ENGINES].engines:
        if engine.publisher is None:
            continue
        endpoint, replay = engine.publisher.endpoints
        out[str(engine.rank)] = {"enable_kv_cache_events": True, "publisher": "zmq", "buffer_steps": 10_000,
                                 "hwm": 100_000, "max_queue_size": 100_000, "topic": "",
                                 **(request.app[CONFIG].kv_events or {}), "endpoint": endpoint,
                                 "replay_endpoint": replay}
    return web.json_response(out)


async def _engines(app: web.Application):
    """The app's engines (one per data-parallel rank), their KV event publishers and the
    connector's lease expiry, from start to shutdown (``cleanup_ctx``)."""
    config, tokenizer = app[CONFIG], app[TOKENIZER]
    vocab = min(tokenizer.vocab_size, 1 << 31)
    engines = [Engine(config, vocab_size=vocab)]
    engines += [Engine(config, vocab_size=vocab, first=engines[0]) for _ in range(config.data_parallel_size - 1)]
    app[ENGINE], app[ENGINES] = engines[0], Ranks(engines)
    tasks = [asyncio.create_task(engine.run()) for engine in engines]
    events = config.kv_events or {}
    if events.get("enable_kv_cache_events") and events.get("publisher", "zmq") == "zmq":
        from prefix_router.tools.sim.kv_events import EventPublisher  # pyzmq only where events are on
        for engine in engines:
            engine.publisher = EventPublisher(offset_endpoint(events.get("endpoint", "tcp://*:5557"), engine.rank),
                                              offset_endpoint(events.get("replay_endpoint"), engine.rank),
                                              events.get("topic", ""), events.get("buffer_steps", 10_000),
                                              data_parallel_rank=engine.rank)
            engine.scheduler.kv.record_events = True
            tasks.append(asyncio.create_task(engine.publisher.serve_replay()))
    connector = app[CONNECTOR]
    if connector.role is not None:
        engines[0].metrics.registry.register(ConnectorMetrics(connector))
        connector.http = aiohttp.ClientSession()
        tasks.append(asyncio.create_task(expire_leases(app[ENGINES], connector)))
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for engine in engines:
        if engine.publisher is not None:
            engine.publisher.close()
    if connector.http is not None:
        await connector.http.close()


def create_app(config: SimConfig, tokenizer: PromptTokenizer) -> web.Application:
    """The aiohttp application of one simulated replica; the engine starts with the app.

    Raises ValueError when ``max_model_len`` tokens do not fit in the KV cache (vLLM refuses
    to start in that case too).
    """
    config.validate()
    check_event_ports(config)
    capacity = (config.num_gpu_blocks - 1) * config.block_size
    if config.max_model_len > capacity:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the KV cache "
                         f"({config.num_gpu_blocks - 1} usable blocks of {config.block_size} = "
                         f"{capacity} tokens); lower max_model_len or raise num_gpu_blocks")
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[CONFIG] = config
    app[TOKENIZER] = tokenizer
    app[CONNECTOR] = Connector(config.kv_transfer)
    app[STORED] = OrderedDict()
    app.cleanup_ctx.append(_engines)
    app.router.add_routes([
        web.post("/v1/completions", completions), web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/responses", responses), web.post("/sim/kv_pull", kv_pull), web.post("/tokenize", tokenize),
        web.get("/v1/models", models), web.get("/health", health), web.get("/metrics", metrics),
        web.get("/kv_event_sources", kv_event_sources), web.post("/reset_prefix_cache", reset_prefix_cache)])
    return app
