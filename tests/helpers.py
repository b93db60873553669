"""Small helpers shared by the gateway tests."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time
from pathlib import Path

from prefix_router.metrics import sample_sum
from prefix_router.prompts.tokenizer import HFTokenizer

MODEL = "sim"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def text(rng: random.Random, n: int) -> str:
    """``n`` words drawn from a small vocabulary (prompt text with no meaning)."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


metric = sample_sum  # (page, name, **labels) -> sum of matching samples


# chat templates in two real model families' prompt formats (Llama 3.1, Qwen 2.5), with tools:
# written for these tests in those formats, not copied from a model
TEMPLATES = sorted((Path(__file__).parent / "data" / "templates").glob("*.jinja"))


def with_template(tokenizer_dir: Path, out: Path, template: str) -> HFTokenizer:
    """The tokenizer in ``tokenizer_dir`` with another chat template, copied to folder ``out``."""
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    (out / "chat_template.jinja").write_text(template)
    return HFTokenizer(str(out))


# --- the shared data folder, and what a clone without it uses instead ------------------------

# ../shared beside the checkout (CI has it; a user's clone has not), or $PREFIX_ROUTER_SHARED
# (an empty folder makes a run take the fallbacks a clone takes)
SHARED = Path(os.environ.get("PREFIX_ROUTER_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def agent_traces(tmp_dir: Path) -> list[Path]:
    """SWE-agent trajectory files: the shared folder's, else the built-in agent workload's
    sessions written in SWE-agent's format (``history``: system, user, assistant with tool
    calls, tool) into ``tmp_dir``."""
    shared = sorted((SHARED / "agent_traces").glob("*.traj"))
    if shared:
        return shared
    from prefix_router.tools.replay.generate import builtin_workload

    last: dict[str, dict] = {}
    for request in builtin_workload("agent", seed=0):
        last[request.session] = request.body  # turns come in order: the last is the longest
    paths = []
    for i, body in enumerate(list(last.values())[:8]):
        history = [dict(m, tool_calls=repr(m["tool_calls"])) if m.get("tool_calls") else dict(m)
                   for m in body["messages"]]
        for m in history:
            if m["role"] == "tool":
                m["tool_call_ids"] = repr([m.pop("tool_call_id", "call_0")])
        history.append({"role": "assistant", "content": "submit"})
        path = tmp_dir / f"builtin-agent-{i}.traj"
        path.write_text(json.dumps({"history": history}))
        paths.append(path)
    return paths


def mooncake_trace(tmp_dir: Path, name: str = "mooncake_conversation.jsonl") -> Path:
    """A Mooncake trace: the shared folder's ``name``, else one written into ``tmp_dir`` in its
    format (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of 512-token
    blocks) with the shape of the conversation trace: a shared first block, conversations
    whose later turns extend their earlier ones, and one-off prompts."""
    shared = SHARED / "traces" / name
    if shared.exists():
        return shared
    rng = random.Random(11)
    lines, next_id = [], 1
    conversations: list[list[int]] = []
    for i in range(300):
        if conversations and rng.random() < 0.6:  # a later turn of an open conversation
            ids = rng.choice(conversations)
            ids += list(range(next_id, next_id + rng.randint(1, 3)))
        else:
            ids = [0] + list(range(next_id, next_id + rng.randint(1, 8)))
            if rng.random() < 0.7:
                conversations.append(ids)
        next_id = max(ids) + 1
        length = 512 * (len(ids) - 1) + rng.randint(1, 512)
        lines.append(json.dumps({"timestamp": i * 200, "input_length": length,
                                 "output_length": rng.randint(1, 400), "hash_ids": list(ids)}))
    path = tmp_dir / name
    path.write_text("\n".join(lines) + "\n")
    return path


async def until(predicate, timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` every 10 ms until it holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
