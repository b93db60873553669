"""PNG plots of a ``python -m bench compare`` run (matplotlib, the ``bench`` extra).

- ``ttft.png``: TTFT distribution (empirical CDF, modelled seconds, log scale) per system, one
  panel per workload.
- ``reused_per_replica.png``: reused prompt tokens (the replica's ``vllm:prefix_cache_hits_total``)
  per replica per system, one panel per workload.
- ``hit_rate_over_time.png``: token hit rate of the requests sent in each tenth of the replay,
  per system, one panel per workload.
- ``overhead.png``: added TTFT p99 against request rate per system, with the 10 ms bar.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot_all"]

BINS = 10  # time windows for the hit rate over time


def _panels(n: int, title: str):
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.5), squeeze=False)
    fig.suptitle(title)
    return fig, axes[0]


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _ttft(results: dict, out: Path) -> Path:
    fig, axes = _panels(len(results["workloads"]), "Time to first token (modelled s)")
    for ax, w in zip(axes, results["workloads"]):
        for row in w["rows"]:
            values = sorted(r["ttft_s"] for r in row["records"] if r["ttft_s"] is not None)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=row["system"])
        ax.set_xscale("log")
        ax.set(title=w["name"], xlabel="TTFT (s)", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, out / "ttft.png")


def _reused(results: dict, out: Path) -> Path:
    fig, axes = _panels(len(results["workloads"]), "Reused prompt tokens per replica")
    for ax, w in zip(axes, results["workloads"]):
        width = 0.8 / max(len(w["rows"]), 1)
        for k, row in enumerate(w["rows"]):
            xs = [i + k * width for i in range(len(row["reused_per_replica"]))]
            ax.bar(xs, row["reused_per_replica"], width, label=row["system"])
        ax.set(title=w["name"], xlabel="replica", ylabel="reused tokens")
    axes[0].legend(fontsize=8)
    return _save(fig, out / "reused_per_replica.png")


def _over_time(results: dict, out: Path) -> Path:
    fig, axes = _panels(len(results["workloads"]), "Token hit rate over the replay (client-reported cached tokens)")
    for ax, w in zip(axes, results["workloads"]):
        for row in w["rows"]:
            recs = [r for r in row["records"] if r["prompt_tokens"]]
            if not recs:
                continue
            end = max(r["send_s"] for r in recs) or 1.0
            prompt, cached = [0] * BINS, [0] * BINS
            for r in recs:
                b = min(int(r["send_s"] / end * BINS), BINS - 1)
                prompt[b] += r["prompt_tokens"]
                cached[b] += r["cached_tokens"] or 0
            xs = [(b + 0.5) * end / BINS for b in range(BINS) if prompt[b]]
            ax.plot(xs, [cached[b] / prompt[b] for b in range(BINS) if prompt[b]], marker="o", label=row["system"])
        ax.set(title=w["name"], xlabel="send time (modelled s)", ylabel="token hit rate", ylim=(0, 1))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, out / "hit_rate_over_time.png")


def _overhead(overhead: dict, out: Path) -> Path:
    from .hop import ADDED_P99_LIMIT_MS

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["system"] for r in overhead["rows"]):
        rows = [r for r in overhead["rows"] if r["system"] == name]
        ax.plot([r["rate"] for r in rows], [r["added_ttft_p99_ms"] for r in rows], marker="o", label=name)
    ax.axhline(ADDED_P99_LIMIT_MS, color="grey", linestyle="--", label=f"{ADDED_P99_LIMIT_MS:g} ms")
    ax.set(title="Added TTFT p99 through each system", xlabel="requests per second", ylabel="ms", xscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "overhead.png")


def plot_all(results: dict, out: Path) -> list[Path]:
    """Write every plot of ``results`` (``compare``'s, with per-request records) into ``out``."""
    paths = [_ttft(results, out), _reused(results, out), _over_time(results, out)]
    if results.get("overhead"):
        paths.append(_overhead(results["overhead"], out))
    return paths
