"""The built-in workload: seeded chat and agent sessions, some from clients that break their cache.

What it models (the traffic a prefix-affinity gateway is for, see ``../shared/notes/field.md``):

- a few long system prompts and tool lists shared by many sessions;
- chat sessions with append-only multi-turn histories;
- agent loops: the assistant calls a tool, the tool's output is appended, and so on;
- cache-breaking clients: a timestamp in the system prompt that changes every request
  (``timestamp``), the tool list reordered per request (``tools_reordered``), and history
  trimmed in place to the last few messages every turn (``trimmed``).

Workload names: ``mixed`` (all of the above), ``chat``, ``agent``, ``breakers`` (only the
cache-breaking clients), and other projects' traffic shapes by the names of ``shapes.SHAPES``. Same name and seed, same requests: the generator uses only
``random.Random(seed)``. Session starts are Poisson at ``rate`` sessions per modelled second;
think time between turns is exponential with mean ``think_s``.
"""

from __future__ import annotations

import json
import random

from prefix_router.tools.replay.request import CHAT, ReplayRequest
from prefix_router.tools.replay.shapes import SHAPES

__all__ = ["builtin_workload", "WORKLOADS"]

WORKLOADS = ("mixed", "chat", "agent", "breakers", *SHAPES)

_WORDS = (
    "request replica cache prefix token block model server client latency queue batch prompt "
    "system user assistant tool result error value config deploy metric trace session agent "
    "file line test build run check update read write open close search index order time data "
    "the a of to and in is for on with as by at from that this it be are was not or an"
).split()


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def _tools(rng: random.Random, n: int, tag: str) -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"{tag}_tool_{i}",
        "description": _text(rng, 25),
        "parameters": {"type": "object", "properties": {
            f"arg_{j}": {"type": "string", "description": _text(rng, 8)} for j in range(3)},
            "required": ["arg_0"]}}} for i in range(n)]


def _clock(t: float) -> str:
    s = int(t)
    return f"2026-11-30T{(s // 3600) % 24:02d}:{(s // 60) % 60:02d}:{s % 60:02d}Z"


def _session(rng: random.Random, sid: str, kind: str, start_s: float, system: str,
             tools: list[dict] | None, breaker: str | None, think_s: float, max_tokens: int) -> list[ReplayRequest]:
    history: list[dict] = []
    out: list[ReplayRequest] = []
    turns = rng.randint(3, 8) if kind == "chat" else rng.randint(4, 12)
    clock = start_s
    for turn in range(turns):
        if kind == "chat" or turn == 0:
            history.append({"role": "user", "content": _text(rng, rng.randint(20, 150))})
        sys_text = system
        if breaker == "timestamp":
            sys_text = f"Current time: {_clock(clock)}. " + system
        shown = history
        if breaker == "trimmed" and len(history) > 4:
            shown = history[-4:]  # trimmed in place every turn: the prefix after the system prompt moves
        body: dict = {"messages": [{"role": "system", "content": sys_text}, *shown], "max_tokens": max_tokens,
                      "ignore_eos": True}
        if tools is not None:
            request_tools = list(tools)
            if breaker == "tools_reordered":
                rng.shuffle(request_tools)
            body["tools"] = request_tools
            body["tool_choice"] = "none"
        think = rng.expovariate(1.0 / think_s) if turn else 0.0
        clock += think + 2.0
        out.append(ReplayRequest(CHAT, body, at_s=start_s, session=sid, turn=turn, think_s=think,
                                 meta={"kind": kind, "breaker": breaker}))
        if kind == "chat":
            history.append({"role": "assistant", "content": _text(rng, rng.randint(30, 200))})
        else:
            call_id = f"call_{sid}_{turn}"
            args = json.dumps({"arg_0": _text(rng, 3)})
            name = tools[rng.randrange(len(tools))]["function"]["name"] if tools else "run"
            history.append({"role": "assistant", "content": _text(rng, rng.randint(5, 30)),
                            "tool_calls": [{"id": call_id, "type": "function",
                                            "function": {"name": name, "arguments": args}}]})
            history.append({"role": "tool", "tool_call_id": call_id, "content": _text(rng, rng.randint(100, 600))})
    return out


def builtin_workload(name: str = "mixed", *, seed: int = 0, sessions: int = 48, rate: float = 0.5,
                     think_s: float = 3.0, max_tokens: int = 64) -> list[ReplayRequest]:
    """Generate the named workload: ``sessions`` sessions starting at ``rate`` per modelled second
    (a shape of ``shapes.SHAPES`` with its own defaults and ``seed``, the rest unused).

    Raises ValueError for an unknown name (one of ``WORKLOADS``).
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if name in SHAPES:
        return SHAPES[name](seed=seed)
    rng = random.Random(seed)
    systems = [_text(rng, rng.randint(600, 1500)) for _ in range(3)]
    tool_sets = [_tools(rng, 8, f"set{i}") for i in range(2)]
    breakers = ("timestamp", "tools_reordered", "trimmed")
    requests: list[ReplayRequest] = []
    start = 0.0
    num_breakers = 0
    for s in range(sessions):
        start += rng.expovariate(rate)
        if name == "breakers":
            kind, breaker = rng.choice(("chat", "agent")), breakers[s % len(breakers)]
        else:
            kind = name if name in ("chat", "agent") else rng.choice(("chat", "agent"))
            breaker = None
            if name == "mixed" and rng.random() < 0.2:
                breaker = breakers[num_breakers % len(breakers)]  # every kind, in turn
                num_breakers += 1
        system = systems[rng.randrange(len(systems))]
        tools = tool_sets[rng.randrange(len(tool_sets))] if kind == "agent" or breaker == "tools_reordered" else None
        requests.extend(_session(rng, f"{name}-{s}", kind, start, system, tools, breaker, think_s, max_tokens))
    return requests
