"""From an OpenAI request body to what routing needs: token blocks, keys and message hashes.

Token ids are the engine's when a tokenizer is configured (``prefix_router/prompts/tokenizer.py`` renders
chat exactly as vLLM does; token-id completion prompts are used as they are). Without one,
text is cut into blocks of ``char_block_size`` characters: routing still follows shared
prefixes, but predicted token counts are approximate (``/replicas`` says so).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated

import msgspec
import xxhash

from prefix_router.cache.blocks import BlockHash, extend_block_hashes, seed_hash, text_block_hashes
from prefix_router.misses.diagnosis import RequestPrint, digest
from prefix_router.prompts.tokenizer import ChatFormatError, PromptTokenizer, Tokens

__all__ = ["PromptInfo", "analyze", "chat_tokens", "check_body", "check_fields", "check_messages", "conversation_id",
           "kind"]


@dataclass(slots=True)
class PromptInfo:
    """A request's prompt as the router sees it."""

    hashes: list[BlockHash]  # chained hashes of the full blocks
    full_hash: int  # the whole prompt, partial last block included
    num_units: int  # tokens (or characters without a tokenizer)
    exact: bool  # True when units are the engine's tokens
    message_hashes: tuple[int, ...]  # tools, then each message (chat); () for completions
    # Session key, else the first user message (chat). "" for a completion without a session
    # key: token ids alone cannot tell a client rewriting its prompt from two requests that
    # share a document and branch, so such requests are never called miss_changed.
    conversation: str
    # Chat only: a hash of the conversation's opening (model, cache salt, tools and the messages
    # through the first user message), the same on every turn and in every gateway instance;
    # None for completions and for chats without a user message.
    opening: str | None = None
    # The fingerprint ``diagnosis.diagnose`` compares with the conversation's previous request;
    # set by the proxy for requests that belong to a conversation.
    print: RequestPrint | None = None
    # Chat only: True while no assistant or tool message has been sent (the conversation's
    # opening turn), False after; None for completions, whose turns cannot be told apart
    first_turn: bool | None = None


def conversation_id(body: dict, session_key: str | None, by_user: bool = False) -> str:
    """The conversation a request belongs to: its session key, else (chat) a hash of the model,
    cache salt and first user message, else "" (a completion without a session key has none).
    ``by_user``: the key is the OpenAI ``user`` (an end user, not a conversation: one user opens
    many chats), so a chat's conversation is that key and the hash together; a new chat of the
    same user is then not read as a rewrite of the last one."""
    if session_key and not by_user:
        return session_key
    messages = body.get("messages")
    if not isinstance(messages, list):
        return session_key or ""
    salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    first_user = next((m for m in messages if isinstance(m, dict) and m.get("role") == "user"), None)
    opened = f"u:{digest([str(body.get('model') or ''), salt, first_user])}"
    return f"{session_key}|{opened}" if session_key else opened


def check_body(body: dict, chat: bool) -> tuple[str, str] | None:
    """(message, param) for a body whose fields the gateway reads have the wrong shape, else None.

    The same shapes vLLM's request models (``vllm/entrypoints/openai/protocol.py``) require:
    ``messages`` a list of objects with a string ``role`` (chat), ``prompt`` a string, a list of
    strings or a list of token ids, or a list of those lists (completions), ``model``,
    ``cache_salt`` and ``user`` strings, ``stream`` a boolean, ``stream_options`` an object and
    ``tools`` a list. Refusing here gives the client the 400 vLLM would, without a hop.
    """
    problem = check_fields(body, _FIELDS)
    if problem is not None:
        return problem
    if chat:
        return check_messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        ok = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt) or _token_ids(prompt)
            or all(isinstance(p, list) and p and _token_ids(p) for p in prompt)))
        if not ok:
            return ("'prompt' must be a string, a list of strings, a list of token ids or a list of token-id "
                    f"lists, got {kind(prompt)}"), "prompt"
    return None


_FIELDS = (("model", str, "a string"), ("cache_salt", str, "a string"), ("user", str, "a string"),
           ("stream", bool, "a boolean"), ("stream_options", dict, "an object"), ("tools", list, "a list"))


def check_fields(body: dict, fields) -> tuple[str, str] | None:
    """(message, param) for the first of ``fields`` ((key, type, "a string"), ...) that ``body``
    holds with another type (null allowed), else None."""
    for key, type_, expected in fields:
        if body.get(key) is not None and not isinstance(body[key], type_):
            return f"'{key}' must be {expected}, got {kind(body[key])}", key
    return None


def check_messages(messages) -> tuple[str, str] | None:
    """(message, "messages") unless ``messages`` is a non-empty list of objects with a string
    ``role``, else None."""
    if not isinstance(messages, list) or not messages:
        return f"'messages' must be a non-empty list of messages, got {kind(messages)}", "messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"'messages[{i}]' must be an object with a string 'role', got {kind(m)}", "messages"
    return None


def kind(value) -> str:
    """A JSON value's type as an error message names it ("nothing" for null)."""
    return "nothing" if value is None else type(value).__name__


# Token ids as vLLM's request models take them: integers (not booleans) in [0, 2**63), checked
# by msgspec in C: a Python loop over a 32k-token prompt cost about as much as hashing it.
_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]]


def _token_ids(values: list) -> bool:
    """Whether ``values`` is a list of token ids (every one an int in [0, 2**63), no bool).

    The last list's answer is kept: ``check_body`` asks and ``analyze`` asks again of the same
    list, and a 32k-token prompt's check is a tenth of its gateway CPU. The list is held with it,
    so its identity cannot pass to another list; a tuple swapped whole, so a worker thread's
    analysis reads an answer and its list together."""
    global _last_checked
    last = _last_checked
    if last[0] is values:
        return last[1]
    try:
        msgspec.convert(values, _TOKEN_IDS)
        ok = True
    except msgspec.ValidationError:
        ok = False
    _last_checked = (values, ok)
    return ok


_last_checked: tuple[list | None, bool] = (None, False)


def _chat_text(body: dict) -> str:
    """A canonical text of a chat request for character blocks (tools first, as templates do)."""
    parts = [json.dumps(body.get("tools"), separators=(",", ":"), default=str)] if body.get("tools") else []
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, dict):
            content = m.get("content")
            parts.append(f"<{m.get('role')}>{content if isinstance(content, str) else json.dumps(content, default=str)}")
            if m.get("tool_calls"):
                parts.append(json.dumps(m["tool_calls"], separators=(",", ":"), default=str))
    return "\n".join(parts)


def chat_tokens(body: dict, tokenizer: PromptTokenizer) -> list[int] | None:
    """The token ids vLLM computes for a chat request body (messages, tools, template options),
    or None when the body cannot be rendered (the request is then routed by its characters)."""
    rendered = _rendered(body, tokenizer)
    return None if rendered is None else rendered.ids.tolist()


def _rendered(body: dict, tokenizer: PromptTokenizer) -> Tokens | None:
    """``chat_tokens`` as the tokenizer's ``Tokens`` (ids and its prefix cache's entries)."""
    try:
        return tokenizer.render_chat_tokens(
            body.get("messages"), tools=body.get("tools"),
            add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            continue_final_message=body.get("continue_final_message") is True,
            chat_template_kwargs=body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"), dict) else None)
    except (ChatFormatError, TypeError, ValueError):
        return None


def analyze(body: dict, chat: bool, tokenizer: PromptTokenizer | None, block_size: int,
            char_block_size: int, session_key: str | None, by_user: bool = False) -> PromptInfo:
    """Token (or character) blocks, hashes and conversation id of one request body.

    Never raises on odd input: what cannot be tokenized is routed by its characters.
    """
    model = str(body.get("model") or "")
    salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    seed = seed_hash(model, salt)
    opening = None
    rendered = _rendered(body, tokenizer) if chat and tokenizer is not None else None
    tokens = rendered.ids if rendered is not None else None
    if chat:
        messages = body.get("messages")
        messages = messages if isinstance(messages, list) else []
        message_hashes = (digest(body.get("tools")), *(digest(m) for m in messages))
        first = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), None)
        conversation = conversation_id(body, session_key, by_user)
        if first is not None:
            opening = f"o:{digest([model, salt, message_hashes[:first + 2]])}"
        first_turn = not any(isinstance(m, dict) and m.get("role") in ("assistant", "tool") for m in messages)
        text = None if tokens is not None else _chat_text(body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        message_hashes = ()
        conversation = session_key or ""
        first_turn = None
        text = None
        if isinstance(prompt, list) and prompt and _token_ids(prompt):
            tokens = prompt
        elif isinstance(prompt, str) and tokenizer is not None:
            tokens = tokenizer.encode(prompt)
        else:
            text = prompt if isinstance(prompt, str) else json.dumps(prompt, default=str)
    if tokens is not None:
        hashes = _block_hashes(tokens, rendered, block_size, seed)
        full = xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[len(hashes) * block_size:]),
                                        hashes[-1] if hashes else seed)
        units, exact = len(tokens), True
    else:
        hashes = text_block_hashes(text, char_block_size, seed)
        full = xxhash.xxh3_64_intdigest(text[len(hashes) * char_block_size:].encode("utf-8", "surrogatepass"),
                                        hashes[-1] if hashes else seed)
        units, exact = len(text), False
    return PromptInfo(hashes, full, units, exact, message_hashes, conversation, opening, first_turn=first_turn)


def _block_hashes(tokens, rendered: Tokens | None, block_size: int, seed: BlockHash) -> list[BlockHash]:
    """``block_hashes(tokens, block_size, seed)``, taking those of the blocks inside the prefix
    the tokenizer's cache knew (``rendered.known``) from it, and leaving those of the prefix it
    keeps now (``rendered.kept``) for the next prompt: a conversation's turn hashes only its new
    blocks. Blocks inside a known prefix are that prefix's, whatever follows (chained hashes);
    the memo is keyed by seed and block size, so models, cache salts and replicas of another
    block size never share an entry. Copying the known blocks' hashes costs a small fraction of
    hashing them (docs/performance-notes.md)."""
    memo_key = (seed, block_size)
    known = rendered.known.memo.get(memo_key) if rendered is not None and rendered.known is not None else None
    hashes = list(known) if known is not None else []
    extend_block_hashes(hashes, tokens, block_size, seed)
    kept = rendered.kept if rendered is not None else None
    if kept is not None and memo_key not in kept.memo:
        kept.memo[memo_key] = hashes[: len(kept.ids) // block_size]
    return hashes
