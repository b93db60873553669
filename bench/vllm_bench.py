"""vLLM's own benchmark client, ``vllm bench serve``, as a load generator for ``bench.compare``.

Its datasets are traffic this project did not write: ``prefix_repetition`` (a few long
prefixes, each reused by many single-turn requests with a suffix of their own: RAG over shared
documents, few-shot and templated prompts) and ``random`` with ``--random-prefix-len`` (one
prefix shared by every request). It runs from the vLLM CPU environment (``make vllm-env``),
which has no GPU and needs none for the client; the tokenizer is ``prefix_router/tools/tiny_model.py``'s,
built locally (nothing is downloaded). The client counts tokens with that tokenizer and sends
text; the simulated replicas count 4 bytes a token, so lengths differ from the flags while the
sharing between prompts, which is what routing sees, is the dataset's.

The pooled-cache bound of these datasets is computed from their shape (``shape_bound``): every
prefix computed once, everything else reused, in the prompts' own proportions.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["VllmBenchShape", "VLLM_BENCH_SHAPES", "run_vllm_bench", "shape_bound"]


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


def _shapes(num_prompts: int) -> tuple[VllmBenchShape, ...]:
    # 20 requests/s wall, as in the run that opened issue 14 (640 requests, 4 replicas)
    return tuple(VllmBenchShape(f"vllm-bench {d.replace('_', '-')}{' shared-prefix' if d == 'random' else ''} "
                                f"{'chat' if chat else 'completions'}", d, chat, num_prompts, 20.0,
                                prefixes=32 if d == "prefix_repetition" else 1)
                 for d in ("prefix_repetition", "random") for chat in (True, False))


VLLM_BENCH_SHAPES = {"quick": _shapes(320), "full": _shapes(640)}


def shape_bound(shape: VllmBenchShape) -> float:
    """Token hit rate of one unbounded cache on ``shape``: each prefix computed once, then reused
    by every later prompt of its group; suffixes never reused. A slight overestimate, since a
    prefix's last partial block is not reusable."""
    per_prefix = shape.num_prompts / shape.prefixes
    reused = (per_prefix - 1) / per_prefix if per_prefix >= 1 else 0.0
    return reused * shape.prefix_len / (shape.prefix_len + shape.suffix_len)


def run_vllm_bench(python: Path, url: str, shape: VllmBenchShape, tokenizer: Path, out_dir: Path,
                   model: str, seed: int = 0, cpus: str | None = None) -> dict:
    """Run ``vllm bench serve`` against ``url`` and return its result JSON (times in ms, wall).

    ``cpus``: a ``taskset`` CPU list to pin the client to. Raises ``subprocess.CalledProcessError``
    when the client fails (its output is in ``out_dir``).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    filename = f"vllm-bench-{seed}.json"
    cmd = [str(python), "-m", "vllm.entrypoints.cli.main", "bench", "serve",
           "--backend", "openai-chat" if shape.chat else "openai",
           "--endpoint", "/v1/chat/completions" if shape.chat else "/v1/completions",
           "--base-url", url, "--model", model, "--tokenizer", str(tokenizer),
           "--num-prompts", str(shape.num_prompts), "--request-rate", str(shape.rate), "--seed", str(seed),
           "--ignore-eos", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", filename, "--disable-tqdm",
           *shape.args()]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    env_cmd = ["env", "HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "VLLM_TARGET_DEVICE=cpu", *cmd]
    with open(out_dir / f"vllm-bench-{seed}.log", "w") as log:
        subprocess.run(env_cmd, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    return json.loads((out_dir / filename).read_text())
