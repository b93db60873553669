"""Workloads to replay: Mooncake traces, SWE-agent trajectories and a built-in generator.

Every loader returns a list of ``ReplayRequest``. A request with no ``session`` is sent at
``at_s``; the turns of a session are sent in order, the first at ``at_s`` and each later one
``think_s`` after the previous turn's response ended (an agent or a user waits for the answer).
Times are modelled seconds; the replayer divides them by its ``--time-scale``.

- Mooncake (FAST'25 trace release, kvcache-ai/Mooncake): one JSON object a line with
  ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (one id per
  ``block_size``-token block, 512 in the release). Each id maps to a fixed block of token ids
  drawn from a generator seeded by the id, so equal ids give equal tokens; the last block holds
  ``input_length - 512 * (len(hash_ids) - 1)`` tokens. Sent as ``/v1/completions`` with a
  token-id prompt, ``max_tokens = output_length`` and ``ignore_eos``. With ``text=True`` the
  prompt is a string instead, 4 ASCII characters per token id (``token_text``): exactly one
  token each for the simulator's built-in byte tokenizer, so the block structure is unchanged,
  and readable by routers that only take text prompts (SGLang's gateway rejects token ids).
- SWE-agent ``.traj`` files (``history`` of messages with tool calls): turn k is the chat
  request holding ``history[:k]`` up to the k-th assistant message; each file is a session.
- Request logs (``load_request_log``): JSONL of OpenAI request bodies as an application sends
  them, one a line, optionally with a ``session`` (or ``session_id``) field beside the body's
  own; or lines ``{"body": {...}, "path": ..., "session": ...}``, which is what the gateway's
  request log holds with ``request_log_bodies`` on (there ``conversation`` names the session and
  ``t`` the time). Lines without a session are grouped as the gateway groups them: by model,
  cache salt and first user message (``analysis.conversation_id``). Turns go out in file order.
- ``builtin_workload``: seeded synthetic chat and agent sessions (see ``generate.py``).
"""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import numpy as np

from prefix_router.tools.replay.generate import builtin_workload
from prefix_router.tools.replay.request import CHAT, COMPLETIONS, ReplayRequest
from prefix_router.tools.replay.shapes import token_text

__all__ = ["CHAT", "COMPLETIONS", "ReplayRequest", "load_mooncake", "load_trajectories", "load_request_log",
           "mooncake_block_tokens", "load_workload", "token_text"]

log = logging.getLogger(__name__)

def mooncake_block_tokens(hash_id: int, block_size: int, vocab_size: int) -> np.ndarray:
    """The fixed token ids of Mooncake block ``hash_id``: ``block_size`` ids in [100, vocab).

    Seeded by the id alone (numpy PCG64), so every run and every process agrees.
    Ids below 100 are left out to keep clear of a tokenizer's special tokens.
    """
    rng = np.random.default_rng(hash_id)
    return rng.integers(100, vocab_size, size=block_size, dtype=np.int64)


def load_mooncake(path: str | Path, *, block_size: int = 512, vocab_size: int = 32_000,
                  limit: int | None = None, text: bool = False) -> list[ReplayRequest]:
    """Read a Mooncake-format JSONL trace into completion requests with token-id prompts
    (``text=True``: the same prompts as ``token_text`` strings).

    Raises ValueError naming the line of a malformed record.
    """
    requests: list[ReplayRequest] = []
    cache: dict[int, np.ndarray] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                hash_ids = [int(h) for h in rec["hash_ids"]]
                input_length = int(rec["input_length"])
                output_length = int(rec["output_length"])
                timestamp_ms = float(rec["timestamp"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake record ({exc})") from None
            if not hash_ids or input_length <= block_size * (len(hash_ids) - 1) or input_length > block_size * len(hash_ids):
                raise ValueError(f"{path}:{lineno}: input_length {input_length} does not fit "
                                 f"{len(hash_ids)} blocks of {block_size}")
            blocks = []
            for h in hash_ids:
                block = cache.get(h)
                if block is None:
                    block = cache[h] = mooncake_block_tokens(h, block_size, vocab_size)
                blocks.append(block)
            tokens = np.concatenate(blocks)[:input_length].tolist()
            body = {"prompt": token_text(tokens) if text else tokens, "max_tokens": max(output_length, 1), "ignore_eos": True}
            requests.append(ReplayRequest(COMPLETIONS, body, at_s=timestamp_ms / 1000.0,
                                          meta={"hash_ids": hash_ids, "input_length": input_length}))
    return requests


def _literal(value):
    """SWE-agent stores tool_calls / tool_call_ids as Python reprs; accept those or JSON."""
    if isinstance(value, str):
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return json.loads(value)
    return value


def trajectory_messages(history: list[dict]) -> list[dict]:
    """SWE-agent history entries as OpenAI chat messages (tool calls kept)."""
    messages: list[dict] = []
    for entry in history:
        role = entry.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            continue
        content = entry.get("content")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        message: dict = {"role": role, "content": "" if content is None else str(content)}
        if role == "assistant" and entry.get("tool_calls"):
            calls = _literal(entry["tool_calls"])
            message["tool_calls"] = [
                {"id": c.get("id", f"call_{i}"), "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments") or "{}"}}
                for i, c in enumerate(calls)
            ]
        if role == "tool":
            ids = _literal(entry.get("tool_call_ids") or "[]")
            message["tool_call_id"] = ids[0] if ids else "call_0"
        messages.append(message)
    return messages


def load_trajectories(paths: list[Path], *, sessions: int | None = None, stagger_s: float = 5.0,
                      think_s: float = 2.0, max_tokens: int = 64) -> list[ReplayRequest]:
    """One chat session per trajectory (cycled to ``sessions`` copies, each made distinct).

    Turn k holds the history up to the k-th assistant message. Copies after the first of a
    file get a session marker appended to their first user message, so they share the system
    prompt (and demonstration) but not the task, like several agents on one harness.
    """
    histories = []
    for path in sorted(paths):
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("history"), list):
            raise ValueError(f"{path}: not a SWE-agent trajectory (no 'history' list)")
        histories.append(trajectory_messages(data["history"]))
    histories = [h for h in histories if any(m["role"] == "assistant" for m in h)]
    if not histories:
        raise ValueError("no trajectory with an assistant turn")
    count = sessions or len(histories)
    requests: list[ReplayRequest] = []
    for s in range(count):
        messages = [dict(m) for m in histories[s % len(histories)]]
        copy = s // len(histories)
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if copy and first_user is not None:
            messages[first_user]["content"] += f"\n(session {copy})"
        turn = 0
        for k, message in enumerate(messages):
            if message["role"] != "assistant" or k == 0:
                continue
            requests.append(ReplayRequest(CHAT, {"messages": messages[:k], "max_tokens": max_tokens,
                                                 "ignore_eos": True},
                                          at_s=s * stagger_s, session=f"traj-{s}", turn=turn,
                                          think_s=think_s if turn else 0.0))
            turn += 1
    return requests


_SESSION_FIELDS = ("session", "session_id", "conversation")  # not OpenAI fields: taken out of the body


def _logged_request(line: dict) -> tuple[str, dict, str | None, float | None] | None:
    """(path, body, session, t) of one request-log line, or None when it holds no body."""
    body = line.get("body") if isinstance(line.get("body"), dict) else None
    if body is None:
        if "messages" not in line and "prompt" not in line:
            return None
        body = line
    session = next((str(line[k]) for k in _SESSION_FIELDS if line.get(k)), None)
    body = {k: v for k, v in body.items() if k not in _SESSION_FIELDS}
    path = line.get("path") if line.get("path") in (CHAT, COMPLETIONS) else (CHAT if "messages" in body else COMPLETIONS)
    t = line.get("t") if isinstance(line.get("t"), (int, float)) else None
    return path, body, session, t


def load_request_log(path: str | Path) -> list[ReplayRequest]:
    """The requests of a request log (see the module docstring) in the order they were answered:
    by ``t`` where lines carry it (the gateway stamps a line with its answer's time, and a line
    that waits for its replica's KV events may be written after later answers' lines), else, and
    among equal times, in file order; each request's ``meta`` holds its ``line`` (1-based).
    Raises ``ValueError`` for a line that is not JSON, or a file with no request body (a gateway
    log written without ``request_log_bodies``)."""
    from prefix_router.prompts.analysis import conversation_id

    requests: list[ReplayRequest] = []
    turns: dict[str, int] = {}
    t0 = None
    content = Path(path).read_text(encoding="utf-8")
    lines = content.splitlines()
    entries = []  # (answer time, line number, parsed line)
    last_t = float("-inf")
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except ValueError as exc:
            if number == len(lines) and not content.endswith("\n"):
                # a log still being written ends in a line cut short: read what is complete
                log.warning("%s:%d: the last line is incomplete (a log still being written?); skipped", path, number)
                break
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        parsed = _logged_request(line) if isinstance(line, dict) else None
        if parsed is None:
            continue
        last_t = parsed[3] if parsed[3] is not None else last_t  # a line without ``t`` stays after the one before
        entries.append((last_t, number, parsed))
    entries.sort(key=lambda entry: entry[:2])
    for _, number, (route, body, session, t) in entries:
        session = session or conversation_id(body, None) or f"#{number}"
        t0 = t if t0 is None and t is not None else t0
        turn = turns[session] = turns.get(session, -1) + 1
        at_s = (t - t0) if t is not None and t0 is not None else 0.0
        requests.append(ReplayRequest(route, body, at_s=at_s if turn == 0 else 0.0, session=session, turn=turn,
                                      meta={"line": number}))
    if not requests:
        raise ValueError(f"{path}: no request bodies (a gateway request log needs request_log_bodies: true)")
    return requests


def _is_request_log(path: Path) -> bool:
    with path.open(encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        line = json.loads(first)
    except ValueError:
        return False
    return isinstance(line, dict) and "hash_ids" not in line and any(k in line for k in ("messages", "prompt", "body", "replica"))


def load_workload(trace: str | None, *, workload: str = "mixed", limit: int | None = None,
                  trace_block_size: int = 512, vocab_size: int = 32_000, seed: int = 0,
                  max_tokens: int = 64) -> list[ReplayRequest]:
    """Pick a loader by file: ``.traj`` or a folder of them, a request log (JSONL of request
    bodies), a Mooncake ``.jsonl``, else the built-in workload."""
    if trace is None:
        requests = builtin_workload(workload, seed=seed)
    else:
        path = Path(trace)
        if path.is_dir():
            requests = load_trajectories(sorted(path.glob("*.traj")), max_tokens=max_tokens)
        elif path.suffix == ".traj":
            requests = load_trajectories([path], max_tokens=max_tokens)
        elif _is_request_log(path):
            requests = load_request_log(path)
        else:
            requests = load_mooncake(path, block_size=trace_block_size, vocab_size=vocab_size, limit=limit)
    return requests[:limit] if limit is not None else requests
