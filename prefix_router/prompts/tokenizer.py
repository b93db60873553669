"""Prompt token ids as vLLM computes them, for completions and chat.

Two implementations behind one interface (``PromptTokenizer``):

- ``HFTokenizer``: a Hugging Face tokenizer folder (``tokenizer.json`` plus a chat template),
  loaded with ``transformers``. Chat requests are rendered the way vLLM 0.32 renders them
  (``vllm/renderers/chat_utils.py``, ``renderers/online_renderer.py``): message content as a
  string (text parts joined with newlines, ``None`` as empty), assistant ``tool_calls`` with
  their JSON ``arguments`` parsed to objects (``_postprocess_messages``), tools passed as
  ``{"type": "function", "function": {"name", "description", "parameters"}}``
  (``ChatCompletionToolsParam.model_dump``), ``add_generation_prompt`` true by default, then
  the rendered text tokenized without special tokens. Completion text is tokenized with
  special tokens (vLLM's ``add_special_tokens`` default for completions).
- ``ByteTokenizer``: no model files at all. Every 4 UTF-8 bytes become one token id (about one
  BPE token of English text), and chat renders through a fixed ChatML template. Prefix
  equality of text gives prefix equality of tokens (at 4-byte boundaries), which is what
  prefix caching needs; counts approximate a real tokenizer's.

Errors: ``ChatFormatError`` (a ValueError, from ``chat_template``, where the messages are
normalised) for messages or tools that cannot be rendered.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from prefix_router.prompts.chat_template import (TEMPLATE_ARGS, ChatFormatError, compiled_template, normalize_messages,
                            normalize_tools, template_messages)
from prefix_router.constants import TOKENIZER_CACHE_TOKENS

__all__ = ["PromptTokenizer", "HFTokenizer", "ByteTokenizer", "ChatFormatError", "KnownPrefix", "Tokens",
           "load_tokenizer", "fetch_tokenizer", "normalize_messages", "normalize_tools"]

# What a tokenizer needs of a model's repository on the Hugging Face Hub, and no weights: the
# files ``AutoTokenizer`` reads (tokenizer.json, tokenizer_config.json, the slow tokenizers'
# vocab/merges/sentencepiece model) and config.json, which names the tokenizer class of some.
TOKENIZER_FILES = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*", "merges.txt",
                   "*.tiktoken", "spiece.model", "config.json", "chat_template*"]


class KnownPrefix:
    """A rendered prompt's token ids through its last special token, kept by ``HFTokenizer`` for
    later prompts that start with the same text, and ``memo``: what callers derived from those
    ids and want back with them (the gateway's block hashes, keyed by seed and block size:
    ``analysis.analyze``)."""

    __slots__ = ("ids", "memo")

    def __init__(self, ids: array) -> None:
        self.ids = ids  # typecode "q"
        self.memo: dict = {}


@dataclass(frozen=True, slots=True)
class Tokens:
    """A prompt's token ids (``array("q")``: copied and hashed without a Python int apiece) and
    the tokenizer's cache around them: ``known``, the cached prefix they start with, and
    ``kept``, the prefix of them now cached for a later prompt; either None."""

    ids: array
    known: KnownPrefix | None = None
    kept: KnownPrefix | None = None


class PromptTokenizer(Protocol):
    """What the simulator and gateway need from a tokenizer."""

    vocab_size: int

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt."""

    def render_chat(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a chat request's prompt, as vLLM builds it."""

    def render_chat_tokens(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                           add_generation_prompt: bool = True, continue_final_message: bool = False,
                           chat_template_kwargs: dict | None = None) -> Tokens:
        """``render_chat``'s token ids as ``Tokens``, with the prefix cache's entries when it has one."""

    def decode_token(self, token_id: int) -> str:
        """Text of one generated token."""


class HFTokenizer:
    """A Hugging Face tokenizer folder with its chat template (``transformers.AutoTokenizer``).

    Chat prompts are tokenized incrementally: most of a conversation's prompt is text the
    gateway tokenized on the previous turn. Hugging Face tokenizers cut the text at special
    tokens (``<|im_end|>``, ``<|eot_id|>``...) before anything else, so the token ids of the
    text up to the end of a special token never depend on what follows. The ids of each
    rendered prompt up to its last special token are kept (LRU, at most ``max_cached_tokens``
    token ids, 8 bytes each: 128 MB at the default ``constants.TOKENIZER_CACHE_TOKENS``, plus
    the gateway's block hashes of each entry, about 2.5 bytes a token at block size 16), keyed
    by a hash of that text; a later prompt starting with the same text tokenizes only the rest,
    and the gateway hashes only its new blocks. Tokenizers whose special tokens strip
    neighbouring whitespace (``lstrip``/``rstrip``) or are normalised break that independence:
    for those the cache is off. Encoding dominates a long prompt's analysis, rendering the
    template is a small part (docs/performance-notes.md).

    Raises OSError, with a message naming the path and the fix, when there is no such folder or
    cached model, or the folder holds no tokenizer.
    """

    def __init__(self, path: str, *, max_cached_tokens: int = TOKENIZER_CACHE_TOKENS) -> None:
        import os

        # transformers warns at import that PyTorch is absent; tokenizers need no PyTorch.
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        # One text a call: tokenizers' thread pool can split nothing, yet waking its threads
        # costs CPU every request (docs/performance-notes.md). Read at every encode, so an
        # operator's own setting still wins.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer  # deferred: importing transformers takes ~1 s

        self.path = path
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError):  # huggingface_hub's HFValidationError is a ValueError
            if os.path.isdir(path):
                files = ", ".join(sorted(os.listdir(path))[:6]) or "nothing"
                raise OSError(f"tokenizer: the folder {path} holds no tokenizer transformers can load: it needs "
                              f"the model's tokenizer.json and tokenizer_config.json (it has {files})") from None
            raise OSError(f"tokenizer: no folder {path}, and no model of that id in the local Hugging Face "
                          "cache (give the folder of the model's tokenizer files, or let the gateway fetch them: "
                          "--tokenizer-download, tokenizer_download: true)") from None
        self._backend = self._tok.backend_tokenizer
        # tokenizers >= 0.20's ``encode_batch_fast`` gives the same ids without the offsets that
        # nothing here reads, in about two thirds of ``encode``'s time (docs/performance-notes.md)
        self._encode_fast = getattr(self._backend, "encode_batch_fast", None)
        self.vocab_size = len(self._tok)
        self._token_text: dict[int, str] = {}
        added = [t for t in self._backend.get_added_tokens_decoder().values() if t.special]
        safe = bool(added) and not any(t.lstrip or t.rstrip or t.normalized for t in added)
        self._special_re = re.compile("|".join(re.escape(t.content) for t in added)) if safe else None
        self._special_ids = {self._backend.token_to_id(t.content) for t in added}
        self.max_cached_tokens = max_cached_tokens
        self._prefixes: OrderedDict[int, KnownPrefix] = OrderedDict()
        self._cached_tokens = 0
        self._lock = threading.Lock()  # analyze() runs in worker threads
        self._template, self._template_vars = compiled_template(self._tok)
        template = getattr(self._tok, "chat_template", None)
        self.chat_template: str | None = template if isinstance(template, str) else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if self._encode_fast is not None:
            return self._encode_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages, *, tools=None, add_generation_prompt=True,
                    continue_final_message=False, chat_template_kwargs=None) -> list[int]:
        return self.render_chat_tokens(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       chat_template_kwargs=chat_template_kwargs).ids.tolist()

    def render_chat_tokens(self, messages, *, tools=None, add_generation_prompt=True,
                           continue_final_message=False, chat_template_kwargs=None) -> Tokens:
        conversation = normalize_messages(messages)
        kwargs = dict(chat_template_kwargs or {})
        if self._template is not None and not continue_final_message and not TEMPLATE_ARGS.intersection(kwargs):
            return self.tokens(self._render(conversation, normalize_tools(tools), add_generation_prompt, kwargs))
        try:
            text = self._tok.apply_chat_template(
                conversation,
                tools=normalize_tools(tools),
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except ChatFormatError:
            raise
        except Exception as exc:  # jinja2 errors raised by the template itself
            raise ChatFormatError(f"chat template failed: {exc}", "messages") from None
        return self.tokens(text)

    def _render(self, conversation: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                kwargs: dict) -> str:
        """``apply_chat_template(conversation, tools=tools, tokenize=False, ...)`` without its
        per-call work that JSON input does not need: transformers' compiled template, rendered
        with the same variables (``render_jinja_template``: messages with their null fields
        dropped and reasoning aliased, ``documents`` None, the special tokens map, then the
        caller's kwargs). ``tests/prompts/test_chat_template.py`` holds it equal to ``apply_chat_template``."""
        chat = template_messages(conversation)
        try:
            return self._template.render(messages=chat, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self._template_vars, **kwargs})
        except Exception as exc:  # jinja2 errors raised by the template itself
            raise ChatFormatError(f"chat template failed: {exc}", "messages") from None

    def encode_incremental(self, text: str) -> list[int]:
        """``encode(text, add_special_tokens=False)``, reusing the ids of a known prefix."""
        return self.tokens(text).ids.tolist()

    def tokens(self, text: str) -> Tokens:
        """``encode_incremental`` as ``Tokens``: the ids, the known prefix they reuse, the
        prefix of them kept for later prompts."""
        if self._special_re is None:
            return Tokens(array("q", self.encode(text, add_special_tokens=False)))
        digest = xxhash.xxh3_64()
        start = 0
        boundaries: list[tuple[int, int]] = []  # (end of a special token, hash of text up to it)
        for match in self._special_re.finditer(text):
            digest.update(text[start : match.end()].encode("utf-8", "surrogatepass"))
            start = match.end()
            boundaries.append((start, digest.intdigest()))
        known: KnownPrefix | None = None
        cut = 0
        num_known = 0  # boundaries inside the known prefix
        with self._lock:
            for i in range(len(boundaries) - 1, -1, -1):
                known = self._prefixes.get(boundaries[i][1])
                if known is not None:
                    self._prefixes.move_to_end(boundaries[i][1])
                    cut, num_known = boundaries[i][0], i + 1
                    break
        # arrays, not lists, from end to end: turning a long prompt's ids into a list and back
        # costs about as much as hashing its blocks; an array's copy is one memcpy
        ids = known.ids[:] if known is not None else array("q")
        start = len(ids)
        tail = self.encode(text[cut:], add_special_tokens=False)
        ids.extend(tail)
        kept = None
        if len(boundaries) > num_known:  # the new tail has special tokens: keep through its last
            # one (a special token's id comes only from its own text), found from the end: in a
            # chat prompt it is the generation prompt's, a few tokens from the end, so a long new
            # tail costs no Python step a token
            special = self._special_ids
            index = next((i for i in range(len(tail) - 1, -1, -1) if tail[i] in special), None)
            if index is not None:
                kept = self._remember(boundaries[-1][1], ids[: start + index + 1])
        return Tokens(ids, known, kept)

    def _remember(self, key: int, ids: array) -> KnownPrefix | None:
        """Cache ``ids`` under ``key``; the entry (the one already there, if any), or None
        when they alone are over ``max_cached_tokens``."""
        if len(ids) > self.max_cached_tokens:
            return None
        with self._lock:
            entry = self._prefixes.get(key)
            if entry is not None:
                return entry
            entry = self._prefixes[key] = KnownPrefix(ids)
            self._cached_tokens += len(ids)
            while self._cached_tokens > self.max_cached_tokens:
                _, dropped = self._prefixes.popitem(last=False)
                self._cached_tokens -= len(dropped.ids)
        return entry

    def decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tok.decode([token_id])
        return text


class ByteTokenizer:
    """Built-in stand-in: 4 UTF-8 bytes per token, ChatML chat rendering. No files needed."""

    vocab_size = 1 << 32
    BYTES_PER_TOKEN = 4
    chat_template = None  # a fixed ChatML rendering, which takes system messages anywhere
    _WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "on",
              "this", "be", "at", "by", "from", "or", "an", "are")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._ids(text).tolist()

    def _ids(self, text: str) -> np.ndarray:
        """``text``'s UTF-8 bytes read 4 at a time as little-endian numbers (the last, short one
        as if padded with zero bytes), shape (ceil(bytes / 4),), uint32: numpy, since a prompt of
        32k tokens read one token at a time in Python costs milliseconds."""
        data = text.encode("utf-8", "surrogatepass")
        tail = -len(data) % self.BYTES_PER_TOKEN
        return np.frombuffer(data + b"\0" * tail if tail else data, dtype="<u4")

    def render_chat(self, messages, *, tools=None, add_generation_prompt=True,
                    continue_final_message=False, chat_template_kwargs=None) -> list[int]:
        return self.encode(self._chat_text(messages, tools, add_generation_prompt, continue_final_message))

    @staticmethod
    def _chat_text(messages, tools, add_generation_prompt: bool, continue_final_message: bool) -> str:
        """The ChatML text of ``messages`` (and ``tools``) that the chat's tokens are read from."""
        conversation = normalize_messages(messages)
        parts = []
        tool_list = normalize_tools(tools)
        if tool_list:
            parts.append("<|im_start|>tools\n" + json.dumps(tool_list) + "<|im_end|>\n")
        for m in conversation:
            text = m["content"]
            if m.get("tool_calls"):
                text += "".join("\n" + json.dumps(c["function"]) for c in m["tool_calls"])
            parts.append(f"<|im_start|>{m['role']}\n{text}<|im_end|>\n")
        if continue_final_message and parts:
            parts[-1] = parts[-1][: -len("<|im_end|>\n")]
        elif add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def render_chat_tokens(self, messages, *, tools=None, add_generation_prompt=True,
                           continue_final_message=False, chat_template_kwargs=None) -> Tokens:
        return Tokens(array("q", self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message)))

    def decode_token(self, token_id: int) -> str:
        return " " + self._WORDS[token_id % len(self._WORDS)]


def load_tokenizer(path: str | None) -> PromptTokenizer:
    """``HFTokenizer`` for a folder, ``ByteTokenizer`` for None."""
    return HFTokenizer(path) if path else ByteTokenizer()


# The whole download's deadline, seconds: huggingface_hub sends its API calls without a timeout
# (its client's is None), so a Hub or proxy that accepts and never answers, or drips a byte a
# second, would hold the gateway's start (and a Kubernetes init container) for ever. Tokenizer
# files are a few MB: minutes over the slowest link a gateway would fetch them on.
FETCH_TIMEOUT_S = 180.0


def _within(timeout_s: float, call) -> None:
    """Run ``call()`` in a daemon thread and re-raise what it raised; TimeoutError when it has not
    returned after ``timeout_s`` seconds (the thread is left behind: the caller is about to exit
    with its error, and a daemon thread does not hold the process)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            raised.append(exc)

    thread = threading.Thread(target=run, name="tokenizer-download", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no complete answer within {timeout_s:g} s")
    if raised:
        raise raised[0]


def fetch_tokenizer(model_id: str | None, timeout_s: float = FETCH_TIMEOUT_S) -> None:
    """Fetch a model's tokenizer files (``TOKENIZER_FILES``, no weights) from the Hugging Face Hub
    into the local Hugging Face cache, where ``HFTokenizer(model_id)`` then finds them; nothing
    when ``model_id`` is None, a folder or already cached. The Hub is ``$HF_ENDPOINT`` (default
    huggingface.co), with ``$HF_TOKEN`` for gated models, as huggingface_hub reads them.

    Raises OSError with one line naming the model and the reason: HF_HUB_OFFLINE=1 (an operator's
    explicit offline mode: nothing is downloaded), an unknown or gated repository, no network, no
    complete answer within ``timeout_s`` seconds (``FETCH_TIMEOUT_S``).
    """
    import os

    if not model_id or os.path.isdir(model_id):
        return
    if model_id.startswith(("/", ".", "~")) or model_id.count("/") > 1:  # a path: repository ids are org/name
        raise OSError(f"tokenizer: no folder {model_id} (a Hugging Face model id is org/name)")
    import logging

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # huggingface_hub's client logs each request at INFO
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from huggingface_hub import constants, snapshot_download

    try:
        snapshot_download(model_id, allow_patterns=TOKENIZER_FILES, local_files_only=True)
        return
    except Exception:  # not cached (LocalEntryNotFoundError), or not a repository id (ValueError)
        pass
    if constants.HF_HUB_OFFLINE:
        raise OSError(f"tokenizer: {model_id} is not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 "
                      "forbids downloading it: fetch it where the Hub is reachable, or give its folder")
    try:
        _within(timeout_s, lambda: snapshot_download(model_id, allow_patterns=TOKENIZER_FILES))
    except Exception as exc:  # huggingface_hub's HTTP errors, httpx's network errors, HFValidationError
        reason = str(exc).strip().splitlines()[0].removeprefix("Got: ") if str(exc).strip() else type(exc).__name__
        raise OSError(f"tokenizer: could not download {model_id} from {constants.ENDPOINT}: {reason}") from None
