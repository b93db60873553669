"""The simulated replica's HTTP API, shaped like vLLM 0.32's OpenAI server.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``,
``stream_options.include_usage`` and ``usage.prompt_tokens_details.cached_tokens``),
``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``GET /metrics``,
``POST /reset_prefix_cache``. Response bodies, SSE framing (``data: {...}\\n\\n`` events,
then ``data: [DONE]``) and error bodies (``{"error": {"message", "type", "param", "code"}}``)
were copied from a running vLLM CPU replica. Bad input gets a 400 (unknown model: 404), never a 5xx.

One difference by design: when a stream falls behind the engine, the tokens generated since
its last write go out as one SSE event (vLLM sends one event per engine step). Clients see the
same text and the same final usage; only the number of events differs.

One addition: a stream's first event with tokens carries ``sim_ttft_s``, the replica's own time to
those tokens (wall seconds from the request's submission to its engine, so queueing and prefill;
multiply by the time scale for modelled seconds). OpenAI clients ignore a field they do not know;
the replay client records it (``Record.replica_ttft_s``) so that a benchmark can scale only the
replica's part of a time to first token and count the client's and the router's as timed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prefix_router.errors import openai_error
from prefix_router.prompts.tokenizer import ChatFormatError, PromptTokenizer
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.engine import Engine
from prefix_router.tools.sim.requests import ApiError, CompletionParams, parse_chat, parse_completion, parse_tokenize
from prefix_router.tools.sim.scheduler import SimRequest

__all__ = ["create_app", "ENGINE", "TOKENIZER"]

ENGINE = web.AppKey("engine", Engine)
TOKENIZER = web.AppKey("tokenizer", object)
CONFIG = web.AppKey("config", SimConfig)

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


def _usage(req: SimRequest) -> dict:
    return {
        "prompt_tokens": req.num_prompt_tokens,
        "total_tokens": req.num_tokens,
        "completion_tokens": req.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": req.num_cached_tokens or 0},
    }


class _Stream:
    """Wakes a handler when the engine has new tokens for its request."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __call__(self) -> None:
        self.event.set()


async def _generate(request: web.Request, params: CompletionParams, token_ids: list[int], chat: bool):
    app = request.app
    engine, tokenizer, config = app[ENGINE], app[TOKENIZER], app[CONFIG]
    if len(token_ids) > config.max_model_len:
        raise ApiError(
            f"This model's maximum context length is {config.max_model_len} tokens. However, your "
            f"prompt contains {len(token_ids)} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens")
    if len(token_ids) == config.max_model_len:
        # vLLM rejects this too (InputProcessor._validate_prompt_len); admitted, a chunked
        # prefill would stop one token short (the scheduler's max_model_len - 1 cap) forever.
        raise ApiError(
            f"The decoder prompt (length {len(token_ids)}) plus the number of requested output "
            f"tokens (at least 1) is longer than the maximum model length of {config.max_model_len}. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens "
            "(prompt + requested output tokens).",
            param="input_tokens")
    if params.max_tokens is not None and params.max_tokens > config.max_model_len:
        raise ApiError(f"max_tokens={params.max_tokens} cannot be greater than "
                       f"max_model_len={config.max_model_len}. Please request fewer output tokens.",
                       param="max_tokens")
    max_tokens = params.max_tokens or config.default_max_tokens
    prefix = "chatcmpl-" if chat else "cmpl-"
    rid = f"{prefix}{next(_ids):016x}"
    sim_req = SimRequest(rid, token_ids, max_tokens, model=params.model, cache_salt=params.cache_salt)
    wake = _Stream()
    sim_req.on_update = wake
    created = int(time.time())
    submitted = time.perf_counter()
    engine.submit(sim_req)
    try:
        if not params.stream:
            while sim_req.finish_reason is None:
                await wake.event.wait()
                wake.event.clear()
            text = "".join(tokenizer.decode_token(t) for t in sim_req.output_token_ids)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text},
                          "logprobs": None, "finish_reason": sim_req.finish_reason, "stop_reason": None}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "logprobs": None,
                          "finish_reason": sim_req.finish_reason, "stop_reason": None}
                obj = "text_completion"
            return web.json_response({"id": rid, "object": obj, "created": created, "model": params.model,
                                      "choices": [choice], "usage": _usage(sim_req)})
        return await _stream(request, sim_req, wake, params, chat, created, submitted)
    finally:
        engine.abort(sim_req)  # no-op once finished; frees blocks if the client went away


async def _stream(request, sim_req: SimRequest, wake: _Stream, params: CompletionParams, chat: bool, created: int,
                  submitted: float):
    tokenizer = request.app[TOKENIZER]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = f'{{"id":"{sim_req.request_id}","object":"{obj}","created":{created},"model":{json.dumps(params.model)},"choices":['
    # vLLM sends a chat's role chunk with the first output the engine yields, after the prefill
    # (``OpenAIServingChat.chat_completion_stream_generator``, ``first_iteration``), not when
    # the stream opens: a client that times the first chunk (``vllm bench serve`` does) measures
    # the prefill, as against vLLM
    opening = (f'data: {head}{{"index":0,"delta":{{"role":"assistant","content":""}},'
               f'"logprobs":null,"finish_reason":null}}]}}\n\n') if chat else ""
    sent = 0
    decode = tokenizer.decode_token
    while True:
        await wake.event.wait()
        wake.event.clear()
        tokens = sim_req.token_ids[sim_req.num_prompt_tokens + sent :]
        finished = sim_req.finish_reason is not None
        if not tokens and not finished:
            continue
        sent += len(tokens)
        text = json.dumps("".join(decode(t) for t in tokens))
        reason = f'"{sim_req.finish_reason}"' if finished else "null"
        if chat:
            choice = f'{{"index":0,"delta":{{"content":{text}}},"logprobs":null,"finish_reason":{reason}}}'
        else:
            choice = f'{{"index":0,"text":{text},"logprobs":null,"finish_reason":{reason},"stop_reason":null}}'
        own = f',"sim_ttft_s":{time.perf_counter() - submitted:.6f}' if sent == len(tokens) and tokens else ""
        chunk = f"{opening}data: {head}{choice}]{own}}}\n\n"
        opening = ""
        if finished:
            if params.include_usage:
                usage = json.dumps(_usage(sim_req), separators=(",", ":"))
                chunk += f'data: {head}],"usage":{usage}}}\n\n'
            chunk += "data: [DONE]\n\n"
            await response.write(chunk.encode())
            await response.write_eof()
            return response
        await response.write(chunk.encode())


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
        return await _generate(request, params, token_ids, chat=False)
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
        return await _generate(request, params, token_ids, chat=True)
    except ApiError as exc:
        return _error(exc)


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
    return web.json_response({"success": request.app[ENGINE].reset_prefix_cache()})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[ENGINE].metrics.registry)
    response = web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
    response.enable_compression()  # gzip when asked, as vLLM's prometheus-client endpoint does
    return response


async def kv_event_sources(request: web.Request) -> web.Response:
    """vLLM's ``GET /kv_event_sources``: the publisher's configuration per data-parallel rank
    (``{}`` when events are off); endpoints as configured (``tcp://*:5557``), port 0 resolved."""
    engine = request.app[ENGINE]
    if engine.publisher is None:
        return web.json_response({})
    endpoint, replay = engine.publisher.endpoints
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "buffer_steps": 10_000, "hwm": 100_000,
              "max_queue_size": 100_000, "topic": "", **(request.app[CONFIG].kv_events or {}),
              "endpoint": endpoint, "replay_endpoint": replay}
    return web.json_response({"0": config})


def create_app(config: SimConfig, tokenizer: PromptTokenizer) -> web.Application:
    """The aiohttp application of one simulated replica; the engine starts with the app.

    Raises ValueError when ``max_model_len`` tokens do not fit in the KV cache (vLLM refuses
    to start in that case too).
    """
    config.validate()
    capacity = (config.num_gpu_blocks - 1) * config.block_size
    if config.max_model_len > capacity:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the KV cache "
                         f"({config.num_gpu_blocks - 1} usable blocks of {config.block_size} = "
                         f"{capacity} tokens); lower max_model_len or raise num_gpu_blocks")
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[CONFIG] = config
    app[TOKENIZER] = tokenizer

    async def engine_ctx(app: web.Application):
        engine = Engine(config, vocab_size=min(tokenizer.vocab_size, 1 << 31))
        app[ENGINE] = engine
        tasks = [asyncio.create_task(engine.run())]
        events = config.kv_events or {}
        if events.get("enable_kv_cache_events") and events.get("publisher", "zmq") == "zmq":
            from prefix_router.tools.sim.kv_events import EventPublisher  # pyzmq only where events are on
            engine.publisher = EventPublisher(events.get("endpoint", "tcp://*:5557"), events.get("replay_endpoint"),
                                              events.get("topic", ""), events.get("buffer_steps", 10_000))
            engine.scheduler.kv.record_events = True
            tasks.append(asyncio.create_task(engine.publisher.serve_replay()))
        yield
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        if engine.publisher is not None:
            engine.publisher.close()

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app
