"""Validation of OpenAI request bodies for the simulated replica, with vLLM's error wording.

Only the fields that change what the engine does are read; sampling parameters are accepted
and ignored (the simulator's tokens are not sampled from a model). Every error is an
``ApiError`` carrying the HTTP status, the OpenAI error ``type`` and the offending ``param``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefix_router.prompts.responses import responses_prompt
from prefix_router.tools.sim.config import SimConfig

__all__ = ["ApiError", "CompletionParams", "parse_chat", "parse_completion", "parse_responses", "parse_tokenize"]


class ApiError(Exception):
    """A client error: ``status`` 400 (``BadRequestError``) unless said otherwise."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.type = type


@dataclass(frozen=True, slots=True)
class CompletionParams:
    """What the engine needs from a completion or chat request."""

    model: str
    max_tokens: int | None
    stream: bool
    include_usage: bool
    cache_salt: str | None
    add_special_tokens: bool
    n: int = 1  # sequences generated from the one prompt
    kv_transfer_params: dict | None = None  # a disaggregated fleet's leg (sim/kv_transfer.py)


def _typed(body: dict, key: str, kind: type | tuple, default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    # bool is an int in Python; vLLM (pydantic) rejects true for an integer field too.
    if isinstance(value, bool) and kind in (int, (int, float)):
        raise ApiError(f"'{key}' must be {getattr(kind, '__name__', 'a number')}, got {value!r}", param=key)
    if not isinstance(value, kind):
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ApiError(f"'{key}' must be of type {name}, got {type(value).__name__}", param=key)
    return value


def _common(body: dict, config: SimConfig, *, chat: bool) -> CompletionParams:
    model = _typed(body, "model", str, config.model)
    if model != config.model:
        raise ApiError(f"The model `{model}` does not exist. Valid aliases: {config.model}.",
                       param="model", status=404, type="NotFoundError")
    max_tokens = _typed(body, "max_tokens", int)
    if chat:
        max_tokens = _typed(body, "max_completion_tokens", int, max_tokens)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    n = _typed(body, "n", int, 1)
    if n < 1:
        raise ApiError(f"n must be at least 1, got {n}.", param="n")
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, {})
    include_usage = _typed(options, "include_usage", bool, False)
    if options and not stream:
        raise ApiError("Stream options can only be defined when `stream=True`.", param="stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    add_special = _typed(body, "add_special_tokens", bool, not chat)
    transfer = _typed(body, "kv_transfer_params", dict, None)
    return CompletionParams(model, max_tokens, stream, include_usage, salt, add_special, n, transfer)


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return prompt
        if all(isinstance(t, (str, list)) for t in prompt):
            raise ApiError("the simulator serves one prompt per request", param="prompt")
        raise ApiError("'prompt' must be a string or a list of non-negative token ids", param="prompt")
    raise ApiError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")


def parse_completion(body: dict, config: SimConfig) -> tuple[CompletionParams, str | list[int]]:
    """``/v1/completions``: parameters and the prompt (text or token ids)."""
    return _common(body, config, chat=False), _prompt(body)


def _chat_args(body: dict) -> dict:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError("'messages' must be a list of messages", param="messages")
    return {
        "messages": messages,
        "tools": body.get("tools"),
        "add_generation_prompt": _typed(body, "add_generation_prompt", bool, True),
        "continue_final_message": _typed(body, "continue_final_message", bool, False),
        "chat_template_kwargs": _typed(body, "chat_template_kwargs", dict, None),
    }


def parse_chat(body: dict, config: SimConfig) -> tuple[CompletionParams, dict]:
    """``/v1/chat/completions``: parameters and keyword arguments for ``render_chat``."""
    return _common(body, config, chat=True), _chat_args(body)


def parse_responses(body: dict, config: SimConfig, history: list[dict] | None
                    ) -> tuple[CompletionParams, bool, dict]:
    """``/v1/responses``: parameters (``max_output_tokens`` as the limit; no ``n``, no stream
    options), whether to store the response (vLLM's default: yes), and the keyword arguments
    for ``render_chat`` of the chat vLLM renders it as after ``history`` (``prompts/responses.py``)."""
    common = {k: v for k, v in body.items() if k in ("model", "stream", "cache_salt", "kv_transfer_params")}
    params = _common({**common, "max_tokens": _typed(body, "max_output_tokens", int)}, config, chat=True)
    if not isinstance(body.get("input"), (str, list)):
        raise ApiError("'input' must be a string or a list of input items", param="input")
    return params, _typed(body, "store", bool, True), _chat_args(responses_prompt(body, history))


def parse_tokenize(body: dict, config: SimConfig) -> tuple[str, dict]:
    """``/tokenize``: ("chat", render_chat kwargs) or ("completion", encode kwargs)."""
    _common({k: v for k, v in body.items() if k in ("model",)}, config, chat=False)
    if "messages" in body:
        return "chat", _chat_args(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError("'prompt' must be a string", param="prompt")
    return "completion", {"text": prompt,
                          "add_special_tokens": _typed(body, "add_special_tokens", bool, True)}
