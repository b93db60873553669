"""The demo's picture: token hit rate and TTFT per replica, both policies side by side, as a PNG.

Two panels of grouped bars over ``replica-0`` .. ``replica-N-1`` and ``total``: the token hit
rate, and TTFT in milliseconds, p50 (solid) in front of p99 (light). matplotlib is
optional (the ``demo`` extra): it is imported here only, with the Agg backend (no display),
and without it the demo says how to get it and goes on.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

__all__ = ["MISSING", "plot", "plot_or_say"]

MISSING = "no plot: pip install 'prefix-router[demo]'"
COLOURS = ("#1f77b4", "#ff7f0e")  # a policy each, in the report's order


def plot(per_policy: dict[str, list[dict]], path: Path, ttft: str, title: str = "") -> None:
    """Write the PNG at ``path`` from the report's rows (``per_policy``: policy -> a row per
    replica, then ``total``, with ``hit_rate`` and ``ttft_p50_s`` / ``ttft_p99_s`` in seconds);
    ``ttft`` labels the TTFT panel. Raises ImportError without matplotlib, OSError when the file
    cannot be written."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    policies = list(per_policy)
    names = [row["replica"] for row in per_policy[policies[0]]]
    width = 0.8 / len(policies)
    fig, (hits, ttfts) = plt.subplots(2, 1, figsize=(max(6.0, 1.3 * len(names) + 2), 7), sharex=True)
    top = 0.0
    for k, policy in enumerate(policies):
        rows = {row["replica"]: row for row in per_policy[policy]}
        xs = [i + (k - (len(policies) - 1) / 2) * width for i in range(len(names))]
        colour = COLOURS[k % len(COLOURS)]
        hits.bar(xs, [rows[n]["hit_rate"] * 100 for n in names], width, label=policy, color=colour)
        p50 = [(rows[n]["ttft_p50_s"] or 0) * 1000 for n in names]
        p99 = [(rows[n]["ttft_p99_s"] or 0) * 1000 for n in names]
        ttfts.bar(xs, p99, width, color=colour, alpha=0.35, label=f"{policy} p99")  # behind: p99 >= p50
        ttfts.bar(xs, p50, width, color=colour, label=f"{policy} p50")
        top = max(top, *p99)
    hits.set_ylabel("token hit rate (%)")
    hits.set_ylim(0, 118)  # room for the legend above 100%
    hits.set_yticks(range(0, 101, 20))
    hits.legend(loc="upper center", ncol=len(policies))
    ttfts.set_ylabel(f"{ttft} (ms)")
    ttfts.set_ylim(0, top * 1.25 or 1)
    ttfts.legend(loc="upper center", fontsize="small", ncol=2 * len(policies))
    ttfts.set_xticks(range(len(names)), names)
    for ax in (hits, ttfts):
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(textwrap.fill(title, 100), fontsize="medium")
    fig.tight_layout()
    try:
        # a PNG whatever the name: matplotlib would refuse ``.txt`` with a ValueError after the
        # whole run, write ``out`` as ``out.png`` under another name than the one said, and a
        # folder's name as ``folder.png`` beside it; given the format, it opens ``path`` itself
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)


def plot_or_say(per_policy: dict[str, list[dict]], path: Path, ttft: str, title: str = "") -> Path | None:
    """``plot``, then one line on stdout: ``plot: PATH``, or ``MISSING`` where matplotlib is not
    installed; a file that cannot be written is said on stderr. The path written, or None."""
    try:
        plot(per_policy, path, ttft, title)
    except ImportError:
        print(MISSING)
        return None
    except OSError as exc:
        print(f"prefix-router demo: no plot: {exc}", file=sys.stderr)
        return None
    print(f"plot: {path}")
    return path
