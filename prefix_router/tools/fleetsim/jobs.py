"""The requests the fleet simulator sends: any workload the replayer reads, with their prompts
made into token ids (for the engines) and analysed (for the gateway) only when sent.

A Mooncake trace of 100,000 requests of ~8k tokens is billions of token ids if read at once
(``replay/workloads.load_mooncake`` does, for a replay of a few thousand): here each record keeps
its hash ids, and its prompt's tokens (``mooncake_block_tokens``, the same ids the replayer
sends) are made when it is sent and dropped when it ends.
"""

from __future__ import annotations

import json
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
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    return "hash_ids" in json.loads(line)
                except ValueError:
                    return False
    return False


def _mooncake(path: Path, limit: int | None, trace_block_size: int) -> Iterator[ReplayRequest]:
    """Mooncake records as completions whose prompt is made when sent (``meta``: hash ids, length)."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                hash_ids = [int(h) for h in rec["hash_ids"]]
                length, output = int(rec["input_length"]), int(rec["output_length"])
                at_s = float(rec["timestamp"]) / 1000.0
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake record ({exc})") from None
            if not hash_ids or not trace_block_size * (len(hash_ids) - 1) < length <= trace_block_size * len(hash_ids):
                raise ValueError(f"{path}:{lineno}: input_length {length} does not fit {len(hash_ids)} blocks "
                                 f"of {trace_block_size}")
            yield ReplayRequest(COMPLETIONS, {"max_tokens": max(output, 1), "ignore_eos": True}, at_s=at_s,
                                meta={"hash_ids": hash_ids, "input_length": length})
            if limit is not None:
                limit -= 1
                if limit <= 0:
                    return


def load_jobs(trace: str | None, *, workload: str = "mixed", limit: int | None = None,
              trace_block_size: int = 512, seed: int = 0) -> list[ReplayRequest]:
    """A Mooncake ``.jsonl`` (prompts made when sent), else what ``load_workload`` reads: a request
    log, SWE-agent trajectories, or the built-in ``workload`` when ``trace`` is None."""
    if trace is not None and _is_mooncake(Path(trace)):
        return list(_mooncake(Path(trace), limit, trace_block_size))
    return load_workload(trace, workload=workload, limit=limit, trace_block_size=trace_block_size, seed=seed)


class _Blocks:
    """Mooncake blocks' token ids by hash id, the last ``_BLOCK_CACHE`` made kept."""

    def __init__(self, block_size: int, vocab_size: int) -> None:
        self.block_size, self.vocab_size = block_size, vocab_size
        self._made: OrderedDict[int, np.ndarray] = OrderedDict()

    def __call__(self, hash_id: int) -> np.ndarray:
        block = self._made.get(hash_id)
        if block is None:
            block = self._made[hash_id] = mooncake_block_tokens(hash_id, self.block_size, self.vocab_size)
            if len(self._made) > _BLOCK_CACHE:
                self._made.popitem(last=False)
        else:
            self._made.move_to_end(hash_id)
        return block


def prompt_of(request: ReplayRequest, tokenizer: PromptTokenizer, *, block_size: int, char_block_size: int,
              trace_block_size: int = 512, blocks: _Blocks | None = None) -> tuple[PromptInfo, list[int]]:
    """The gateway's analysis of ``request`` (``analyze``, as the proxy runs it) and the token
    ids the engine computes for it. Raises ValueError for a prompt no engine could take."""
    body = request.body
    if "hash_ids" in request.meta and "prompt" not in body:
        make = blocks or _Blocks(trace_block_size, MOONCAKE_VOCAB)
        ids = np.concatenate([make(h) for h in request.meta["hash_ids"]])[:request.meta["input_length"]].tolist()
        body = {**body, "prompt": ids}
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


def new_blocks(trace_block_size: int) -> _Blocks:
    """A cache of Mooncake blocks' token ids for one run's ``prompt_of`` calls."""
    return _Blocks(trace_block_size, MOONCAKE_VOCAB)
