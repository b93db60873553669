"""What the benchmarks send: conversations for the hop, other projects' traffic shapes, and the
matrix of workloads ``compare`` runs every system on.

- ``chat_mix`` (``overhead``, ``compare``'s overhead sweep): ~N-token chats in 4-turn
  conversations, one request in four opening one with a system prompt of its own, the others
  extending one sent a few requests before; so a prompt stays near N tokens however many are
  sent, and the gateway meets both its paths (a new prompt, and a conversation's next turn).
- SGLang's generated shared prefix, sessions of one system prompt and coding agents: made by
  ``prefix_router/tools/replay/shapes.py`` (the replayer and ``fleetsim`` take them by name too).
- ``VllmBenchShape``: a ``vllm bench serve`` dataset (``drivers.run_vllm_bench`` sends it):
  ``prefix_repetition`` (a few long prefixes, each reused by many single-turn requests with a
  suffix of their own: RAG over shared documents, few-shot and templated prompts) and ``random``
  with ``--random-prefix-len`` (one prefix shared by every request). Its client counts tokens
  with the tiny tokenizer and sends text; the simulated replicas count 4 bytes a token, so
  lengths differ from the flags while the sharing between prompts, which routing sees, is the
  dataset's. ``vllm_bench_requests`` makes the same prompts as a request list (``shapes.py``),
  for the fleet simulator.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

from prefix_router.tools.launch import find_vllm_python
from prefix_router.tools.replay.generate import builtin_workload
from prefix_router.tools.replay.request import ReplayRequest
from prefix_router.tools.replay.shapes import (coding_agents, generated_shared_prefix, one_system_prompt,
                                               prefix_repetition, random_shared_prefix)
from prefix_router.tools.replay.workloads import load_mooncake

from . import ROOT

__all__ = ["MODEL", "SHAPES", "DEFAULT_TRACES", "VLLM_BENCH_SHAPES", "VllmBenchShape", "Workload", "chat_mix",
           "coding_agents", "conversations", "generated_shared_prefix", "matrix", "one_system_prompt", "shape_bound",
           "staggered", "vllm_bench_requests"]

MODEL = "sim"  # the simulated replicas' model name
TRACES = ROOT.parent / "shared" / "traces"
DEFAULT_TRACES = (TRACES / "mooncake_conversation.jsonl", TRACES / "mooncake_synthetic.jsonl")
WORDS = ("request replica cache prefix token block model server client latency queue batch prompt system "
         "user assistant tool result error value config deploy metric trace session agent file line").split()


def conversations(size: int, count: int, turns: int, seed: int = 0) -> list[list[dict]]:
    """Request message lists: ``turns`` rounds over ``count`` conversations of ~``size`` tokens,
    turn ``t`` of conversation ``c`` at ``t x count + c`` (every first turn first)."""
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    # About 3 tokens per word with the tiny tokenizer (2,048-token vocabulary, measured): the
    # system prompt takes ~80% of the size, the turns so far the rest.
    histories = [[{"role": "system", "content": f"conversation {c}. " + words(int(size * 0.27))}] for c in range(count)]
    requests = []
    for _turn in range(turns):
        for history in histories:
            history.append({"role": "user", "content": words(max(size // 600, 5))})
            requests.append([dict(m) for m in history])
            history.append({"role": "assistant", "content": words(max(size // 600, 5))})
    return requests


def staggered(count: int, turns: int, window: int = 64) -> list[tuple[int, int]]:
    """(conversation, turn) pairs in the order they are sent: conversation ``c``'s turn ``t``
    at slot ``c + t x window``, so that once ``turns x window`` bodies have gone, one body in
    ``turns`` opens a conversation and the others extend one whose previous turn went
    ``window`` slots before (long enough to be answered with 8 connections, or at any fixed
    rate here). Shape: ``count x turns`` pairs, each conversation's turns in order."""
    return sorted(((c, t) for c in range(count) for t in range(turns)), key=lambda p: (p[0] + p[1] * window, p[1]))


def chat_mix(size: int, count: int, turns: int = 4, seed: int = 0, window: int = 8,
             first_turns_first: bool = False) -> list[list[dict]]:
    """``count`` request message lists of ~``size`` tokens each: conversations of ``turns``
    turns, ``staggered`` with ``window`` (8 for fixed rates: at 25/s a turn follows its previous
    one 0.3 s later, long after its answer; 64 for wrk's 8 connections). With
    ``first_turns_first``, the same bodies with every conversation's first turn first: a run
    then meets only prompts it has never seen, the tokenizer's prefix cache never helping."""
    num = max(-(-count // turns), 1)
    rounds = conversations(size, num, turns, seed)  # turn t of conversation c at t x num + c
    if first_turns_first:
        return rounds[:count]
    return [rounds[t * num + c] for c, t in staggered(num, turns, window)][:count]


@dataclass(frozen=True)
class VllmBenchShape:
    """One ``vllm bench serve`` workload: dataset flags, endpoint, size and rate (wall requests/s)."""

    name: str
    dataset: str  # "prefix_repetition" or "random"
    chat: bool  # /v1/chat/completions (backend openai-chat) or /v1/completions (openai)
    num_prompts: int
    rate: float
    prefixes: int = 32  # prefix_repetition: distinct prefixes; random: 1
    prefix_len: int = 2000
    suffix_len: int = 200
    output_len: int = 128

    def args(self) -> list[str]:
        if self.dataset == "prefix_repetition":
            return ["--dataset-name", "prefix_repetition",
                    "--prefix-repetition-num-prefixes", str(self.prefixes),
                    "--prefix-repetition-prefix-len", str(self.prefix_len),
                    "--prefix-repetition-suffix-len", str(self.suffix_len),
                    "--prefix-repetition-output-len", str(self.output_len)]
        return ["--dataset-name", "random", "--random-prefix-len", str(self.prefix_len),
                "--random-input-len", str(self.suffix_len), "--random-output-len", str(self.output_len),
                "--random-range-ratio", "0"]


def _vllm_shapes(num_prompts: int) -> tuple[VllmBenchShape, ...]:
    # 20 requests/s wall, as in the run that opened issue 14 (640 requests, 4 replicas)
    return tuple(VllmBenchShape(f"vllm-bench {d.replace('_', '-')}{' shared-prefix' if d == 'random' else ''} "
                                f"{'chat' if chat else 'completions'}", d, chat, num_prompts, 20.0,
                                prefixes=32 if d == "prefix_repetition" else 1)
                 for d in ("prefix_repetition", "random") for chat in (True, False))


VLLM_BENCH_SHAPES = {"quick": _vllm_shapes(320), "full": _vllm_shapes(640)}


def vllm_bench_requests(shape: VllmBenchShape, seed: int = 0) -> list[ReplayRequest]:
    """``shape``'s prompts as a list of completions (``shapes.prefix_repetition`` or
    ``random_shared_prefix``), for the fleet simulator, which runs no ``vllm bench serve``."""
    if shape.dataset == "prefix_repetition":
        return prefix_repetition(num_prompts=shape.num_prompts, prefixes=shape.prefixes, prefix_len=shape.prefix_len,
                                 suffix_len=shape.suffix_len, output_len=shape.output_len, rate=shape.rate, seed=seed)
    return random_shared_prefix(num_prompts=shape.num_prompts, prefix_len=shape.prefix_len, input_len=shape.suffix_len,
                                output_len=shape.output_len, rate=shape.rate, seed=seed)


def shape_bound(shape: VllmBenchShape) -> float:
    """Token hit rate of one unbounded cache on ``shape``: each prefix computed once, then reused
    by every later prompt of its group; suffixes never reused. A slight overestimate, since a
    prefix's last partial block is not reusable."""
    per_prefix = shape.num_prompts / shape.prefixes
    reused = (per_prefix - 1) / per_prefix if per_prefix >= 1 else 0.0
    return reused * shape.prefix_len / (shape.prefix_len + shape.suffix_len)


SHAPES = ("gsp", "system", "dozen", "vllm-bench")  # compare's --shapes
# per mode: SGLang GSP groups and its rate (requests per modelled s), sessions of the shared system
# prompt and their rate (sessions per modelled s)
SHAPE_SIZES = {"quick": {"gsp_groups": 16, "gsp_rate": 8.0, "system_sessions": 400, "system_rate": 4.0},
               "full": {"gsp_groups": 64, "gsp_rate": 16.0, "system_sessions": 2000, "system_rate": 8.0}}


@dataclass
class Workload:
    """One column of ``compare``'s matrix: replayed ``requests``, or a ``vllm bench serve`` ``shape``."""

    name: str
    requests: list | None = None
    shape: VllmBenchShape | None = None
    replicas: int | None = None  # a fixed fleet size, else the mode's


def matrix(traces: list[Path], limit: int, sessions: int, shapes=SHAPES, mode: str = "full") -> list[Workload]:
    """Each trace file present (as text prompts, ``load_mooncake(text=True)``: sglang-router
    refuses token ids), else the built-in chat workload; the built-in agent workload; then the
    chosen ``shapes``. What is missing is left out with a note on stderr."""
    out = []
    for path in traces:
        if path.exists():
            out.append(Workload(path.stem, load_mooncake(path, limit=limit, text=True)))
        else:
            print(f"note: {path} not found; left out", file=sys.stderr)
    if not out:
        out.append(Workload("builtin-chat", builtin_workload("chat", sessions=sessions)))
    out.append(Workload("builtin-agent", builtin_workload("agent", sessions=sessions)))
    size = SHAPE_SIZES[mode]
    if "gsp" in shapes:
        out.append(Workload("sglang generated-shared-prefix",
                            generated_shared_prefix(groups=size["gsp_groups"], rate=size["gsp_rate"])))
    if "system" in shapes:
        out.append(Workload(f"{size['system_sessions']} sessions, one system prompt",
                            one_system_prompt(sessions=size["system_sessions"], rate=size["system_rate"])))
    if "dozen" in shapes:
        out.append(Workload("a dozen agent sessions", builtin_workload("agent", sessions=12, seed=12), replicas=4))
    if "vllm-bench" in shapes:
        if find_vllm_python() is None:
            print("note: no vLLM environment (make vllm-env); vllm bench serve left out", file=sys.stderr)
        else:
            out += [Workload(s.name, shape=s) for s in VLLM_BENCH_SHAPES[mode]]
    return out
