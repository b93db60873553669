"""A real vLLM server's data-parallel ranks as replicas, against vLLM's own balancer of them.

One vLLM CPU server (``.venv-vllm``, the tiny model) runs ``--data-parallel-size 2``: two engines,
each its own prefix cache, behind one port. Two gateways in front of it: one with
``replicas[].data_parallel_size: 2`` (each rank a replica, chosen by its cache and named to vLLM
with ``X-data-parallel-rank``), one with the server as one replica (vLLM's balancer picks the rank:
``DPLBAsyncMPClient.get_core_engine_for_request``, by queue lengths, blind to prefixes). The same
traffic through each in turn, fresh conversations each round: ``--conversations`` at once, each
``--turns`` turns sharing nothing with the others. Reported: the token hit rate of the turns after
the first (the engine's ``cached_tokens`` over ``prompt_tokens``), each round and each gateway.

    python -m bench data-parallel-vllm [--rounds 2] [--out bench/results/data-parallel-vllm]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import urllib.request
from pathlib import Path

from prefix_router.tools import launch

from .. import RESULTS
from ..report import command_line, write_results

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
RANKS = 2


def _chat(url: str, messages: list[dict]) -> dict:
    body = json.dumps({"model": "tiny", "max_tokens": 8, "messages": messages}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)["usage"]


def _round(url: str, seed: int, conversations: int, turns: int) -> tuple[int, int]:
    """(cached, prompt) tokens of the turns after the first, conversations sent at once."""
    totals, lock = [0, 0], threading.Lock()

    def conversation(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        messages = [{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(300))}]
        for turn in range(turns):
            messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(30))})
            usage = _chat(url, messages)
            messages.append({"role": "assistant", "content": "noted " * 5})
            if turn:
                with lock:
                    totals[0] += usage["prompt_tokens_details"]["cached_tokens"]
                    totals[1] += usage["prompt_tokens"]

    threads = [threading.Thread(target=conversation, args=(k,)) for k in range(conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return totals[0], totals[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench data-parallel-vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds through each gateway, alternating")
    parser.add_argument("--conversations", type=int, default=8, help="conversations at once in a round")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--vllm-python", default=None, help="a Python that imports vllm (default: .venv-vllm's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "data-parallel-vllm")
    args = parser.parse_args(argv)
    python = launch.find_vllm_python(args.vllm_python)
    if python is None:
        parser.error("no Python that can import vllm: make vllm-env, or --vllm-python")
    work = Path(tempfile.mkdtemp(prefix="bench-dp-"))
    model = launch.build_tiny_model(work / "tiny-model", python)
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{launch.free_port_run(RANKS)}",
              "replay_endpoint": f"tcp://*:{launch.free_port_run(RANKS)}"}
    spec = launch.vllm_server(work, python, model, served_name="tiny", block_size=32, num_blocks=2048,
                              max_model_len=4096, extra=["--data-parallel-size", str(RANKS),
                                                         "--kv-events-config", json.dumps(events)])
    rows, data = [], []
    with launch.running([spec]) as (server,):
        configs = {"each rank a replica": f"  - {{url: {server}, data_parallel_size: {RANKS}}}\n",
                   "vLLM balances its ranks": f"  - {{url: {server}}}\n"}
        gateways = []
        for name, replicas in configs.items():
            config = work / f"{len(gateways)}.yaml"
            config.write_text(f"summary_interval_s: 0\nreplicas:\n{replicas}")
            gateways.append((name, launch.gateway_server(work, [], ["--config", str(config), "--tokenizer", str(model)])))
        with launch.running([spec for _, spec in gateways]) as urls:
            for r in range(args.rounds):
                for (name, _), url in zip(gateways, urls):
                    cached, prompt = _round(url, seed=r * 10 + len(data), conversations=args.conversations,
                                            turns=args.turns)
                    data.append({"round": r, "gateway": name, "cached_tokens": cached, "prompt_tokens": prompt})
                    rows.append(f"| {r + 1} | {name} | {cached / prompt:.3f} | {cached} / {prompt} |")
    lines = [f"One vLLM CPU server, `--data-parallel-size {RANKS}`, the tiny model; {args.conversations} "
             f"conversations at once, {args.turns} turns each, fresh every round. Token hit rate of turns 2-{args.turns}:",
             "", "| round | gateway | hit rate | cached / prompt tokens |", "| --- | --- | --- | --- |", *rows]
    write_results(args.out, "Data-parallel ranks as replicas, real vLLM",
                  command_line(__name__, argv), lines, data)
    return 0
