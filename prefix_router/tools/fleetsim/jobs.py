"""The requests the fleet simulator sends: any workload the replayer reads, with their prompts
made into token ids (for the engines) and analysed (for the gateway) only when sent.

A Mooncake trace of 100,000 requests of ~8k tokens is billions of token ids if read at once
(``replay/workloads.load_mooncake`` does, for a replay of a few thousand): here each record keeps
its hash ids, and its prompt's tokens (``mooncake_block_tokens``, the same ids the replayer
sends) are made when it is sent and dropped when it ends.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from prefix_router.prompts.analysis import PromptInfo, analyze, chat_tokens
from prefix_router.prompts.tokenizer import PromptTokenizer
from prefix_router.tools.replay.request import CHAT, COMPLETIONS, ReplayRequest
from prefix_router.tools.replay.workloads import load_workload, mooncake_block_tokens

__all__ = ["MOONCAKE_VOCAB", "load_jobs", "new_blocks", "prompt_of"]

_BLOCK_CACHE = 4096  # Mooncake blocks kept made (512 tokens each): the hot system prompts
MOONCAKE_VOCAB = 32_000  # token ids drawn below this, as ``prefix-router replay``'s default (``--vocab-size``)


def _is_mooncake(path: Path) -> bool:
    first = _first_line(path) if path.suffix == ".jsonl" and path.is_file() else None
    return first is not None and "hash_ids" in first


def _whole(value, low: int = 0, high: int = 1 << 62) -> int:
    """``value`` as an int in [low, high] (no bool, no fraction, no infinity), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or int(value) != value:
        raise ValueError(f"{value!r} is not a whole number")
    if not low <= value <= high:
        raise ValueError(f"{value!r} is out of range [{low}, {high}]")
    return int(value)


def _time(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite time")
    return float(value)


def _mooncake(path: Path, limit: int | None, trace_block_size: int) -> Iterator[ReplayRequest]:
    """Mooncake records as completions whose prompt is made when sent (``meta``: hash ids, length)."""
    start = None  # the first record's time: the run starts there (epoch milliseconds are common)
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec["hash_ids"], list):
                    raise ValueError("hash_ids is not a list")
                hash_ids = [_whole(h, 0, (1 << 63) - 1) for h in rec["hash_ids"]]
                length, output = _whole(rec["input_length"]), _whole(rec["output_length"])
                at_s = _time(rec["timestamp"]) / 1000.0
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake record ({exc})") from None
            start = at_s if start is None else start
            at_s -= start
            if not hash_ids or not trace_block_size * (len(hash_ids) - 1) < length <= trace_block_size * len(hash_ids):
                raise ValueError(f"{path}:{lineno}: input_length {length} does not fit {len(hash_ids)} blocks "
                                 f"of {trace_block_size}")
            yield ReplayRequest(COMPLETIONS, {"max_tokens": max(output, 1), "ignore_eos": True}, at_s=max(at_s, 0.0),
                                meta={"hash_ids": hash_ids, "input_length": length})
            if limit is not None:
                limit -= 1
                if limit <= 0:
                    return


def load_jobs(trace: str | None, *, workload: str = "mixed", limit: int | None = None,
              trace_block_size: int = 512, seed: int = 0) -> list[ReplayRequest]:
    """A Mooncake ``.jsonl`` (prompts made when sent), a gateway request log written with
    ``request_log_blocks``, else what ``load_workload`` reads: a request log with bodies,
    SWE-agent trajectories, or the built-in ``workload`` when ``trace`` is None."""
    if trace is not None and _is_mooncake(Path(trace)):
        return list(_mooncake(Path(trace), limit, trace_block_size))
    lines = _first_lines(Path(trace)) if trace is not None and Path(trace).is_file() else []
    if any("blocks" in line for line in lines):
        return _block_log(Path(trace), limit)
    if lines and any("replica" in line for line in lines) and not any("body" in line for line in lines):
        raise ValueError(f"{trace}: a gateway request log without prompts: write it with request_log_blocks "
                         "(--request-log-blocks; no prompt text) for fleetsim to replay it")
    return load_workload(trace, workload=workload, limit=limit, trace_block_size=trace_block_size, seed=seed)


class _Blocks:
    """Blocks' token ids by id and size (``mooncake_block_tokens``: seeded by the id), the last
    ``_BLOCK_CACHE`` made kept."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._made: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def __call__(self, block_id: int, size: int) -> np.ndarray:
        block = self._made.get((block_id, size))
        if block is None:
            block = self._made[block_id, size] = mooncake_block_tokens(block_id, size, self.vocab_size)
            if len(self._made) > _BLOCK_CACHE:
                self._made.popitem(last=False)
        else:
            self._made.move_to_end((block_id, size))
        return block


def prompt_of(request: ReplayRequest, tokenizer: PromptTokenizer, *, block_size: int, char_block_size: int,
              trace_block_size: int = 512, blocks: _Blocks | None = None) -> tuple[PromptInfo, list[int]]:
    """The gateway's analysis of ``request`` (``analyze``, as the proxy runs it) and the token
    ids the engine computes for it. Raises ValueError for a prompt no engine could take."""
    body, meta = request.body, request.meta
    make = blocks or _Blocks(MOONCAKE_VOCAB)
    if "hash_ids" in meta and "prompt" not in body:
        ids = np.concatenate([make(h, trace_block_size) for h in meta["hash_ids"]])[:meta["input_length"]].tolist()
        body = {**body, "prompt": ids}
    elif "blocks" in meta and "prompt" not in body:  # a request log's keyed chain: a block of ids a key
        size, keys = meta["block_size"], [int(k, 16) for k in meta["blocks"]]
        tail = make(keys[-1] ^ meta["units"] if keys else meta["units"], size)[:meta["units"] - len(keys) * size]
        body = {**body, "prompt": np.concatenate([*(make(k, size) for k in keys), tail]).tolist()}
    chat = request.path == CHAT
    info = analyze(body, chat, tokenizer, block_size, char_block_size, request.session)
    if chat:
        ids = chat_tokens(body, tokenizer)
    elif isinstance(body.get("prompt"), list):
        ids = body["prompt"]
    else:
        ids = tokenizer.encode(str(body.get("prompt", "")))
    if not ids:
        raise ValueError("a prompt of no tokens")
    return info, list(ids)


def new_blocks() -> _Blocks:
    """A cache of blocks' token ids for one run's ``prompt_of`` calls."""
    return _Blocks(MOONCAKE_VOCAB)


def _first_lines(path: Path, count: int = 100) -> list[dict]:
    """The JSON objects among the first ``count`` lines of ``path`` (a request log may open with
    failed requests, which carry no blocks)."""
    found = []
    with open(path, errors="replace") as f:
        for line in itertools.islice(f, count):
            try:
                value = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            if isinstance(value, dict):
                found.append(value)
    return found


def _first_line(path: Path) -> dict | None:
    lines = _first_lines(path, 1)
    return lines[0] if lines else None


def _block_log(path: Path, limit: int | None) -> list[ReplayRequest]:
    """A gateway request log written with ``request_log_blocks`` (``misses/request_log.py``): its
    served requests in the order sent, each prompt its keyed chain of blocks and its length, each
    output its length; a conversation's turns one after another, each its logged gap after the
    previous one's end. Raises ValueError naming a line that is not such a record."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict) or "blocks" not in rec:
                    continue  # a failed request, or a line from before the blocks were on
                end = _time(rec["t"])
                if not isinstance(rec["blocks"], list) or not all(isinstance(b, str) for b in rec["blocks"]):
                    raise ValueError("blocks is not a list of hex digits")
                keys = [f"{_whole(int(b, 16), 0, (1 << 64) - 1):016x}" for b in rec["blocks"]]
                size, units = _whole(rec["block_size"], 1, 1 << 16), _whole(rec["units"])
                if not len(keys) * size <= units < (len(keys) + 1) * size:
                    raise ValueError(f"units {units} do not fit {len(keys)} full blocks of {size}")
                conversation = rec.get("conversation")
                if conversation is not None and not isinstance(conversation, str):
                    raise ValueError("conversation is not a string")
                row = (end - _time(rec.get("elapsed_s") or 0.0), end, conversation,
                       {"blocks": keys, "block_size": size, "units": units},
                       max(_whole(rec.get("completion_tokens") or 1), 1))
            except (KeyError, TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"{path}:{lineno}: not a request-log line with blocks ({exc})") from None
            rows.append(row)
    rows.sort(key=lambda r: r[0])
    rows = rows[:limit] if limit is not None else rows
    t0 = rows[0][0] if rows else 0.0
    last_end: dict[str, float] = {}
    out = []
    for sent, end, conversation, meta, completion in rows:
        think = max(sent - last_end[conversation], 0.0) if conversation in last_end else 0.0
        if conversation is not None:
            last_end[conversation] = end
        out.append(ReplayRequest(COMPLETIONS, {"max_tokens": completion, "ignore_eos": True}, at_s=sent - t0,
                                 session=conversation, think_s=think, meta=meta))
    return out
