"""Summaries of replay records: hit rate and latency percentiles."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence

from prefix_router.tools.replay.client import Record

__all__ = ["percentile", "summarize", "format_summary"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation, or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(records: Sequence[Record], time_scale: float = 1.0) -> dict:
    """Totals over ``records``: requests, errors (and ``error_kinds``: the commonest reasons, as
    ``[count, reason]``), prompt and cached tokens, token hit rate, TTFT p50/p90/p99 and latency
    p50/p99 (wall seconds, and x ``time_scale`` as modelled seconds).
    """
    ok = [r for r in records if r.status == 200 and r.error is None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    latency = [r.latency_s for r in ok if r.latency_s is not None]
    span = max((r.send_s + (r.latency_s or 0) for r in records), default=0.0)
    out = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_kinds": [[n, reason] for reason, n in Counter(_reason(r) for r in records
                                                            if r.status != 200 or r.error is not None).most_common(3)],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "duration_s": span,
        "requests_per_s": len(records) / span if span else 0.0,
        "time_scale": time_scale,
    }
    for q in (50, 90, 99):
        out[f"ttft_p{q}_s"] = percentile(ttft, q)
    for q in (50, 99):
        out[f"latency_p{q}_s"] = percentile(latency, q)
    return out


def _reason(record: Record) -> str:
    """Why a request failed, in one short line: the HTTP status and the error's message."""
    message = record.error or ""
    try:
        message = json.loads(message)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    status = f"HTTP {record.status}" if record.status else "no response"
    return f"{status}: {' '.join(str(message).split())[:160]}" if message else status


def format_summary(s: dict) -> str:
    """Human-readable lines for ``summarize``'s output."""
    def ms(v):
        return "-" if v is None else f"{v * 1000:.1f} ms"

    lines = [
        f"requests {s['requests']}  errors {s['errors']}  duration {s['duration_s']:.1f} s "
        f"({s['requests_per_s']:.1f} req/s)",
        f"prompt tokens {s['prompt_tokens']}  cached {s['cached_tokens']}  "
        f"token hit rate {100 * s['token_hit_rate']:.1f}%",
        f"TTFT p50 {ms(s['ttft_p50_s'])}  p90 {ms(s['ttft_p90_s'])}  p99 {ms(s['ttft_p99_s'])}  "
        f"latency p50 {ms(s['latency_p50_s'])}  p99 {ms(s['latency_p99_s'])}  (wall clock)",
    ]
    for n, reason in s.get("error_kinds", []):
        lines.append(f"  {n} x {reason}")
    if s["time_scale"] != 1.0:
        k = s["time_scale"]
        lines.append(f"x time scale {k:g} (modelled): TTFT p50 {ms(s['ttft_p50_s'] and s['ttft_p50_s'] * k)}  "
                     f"p99 {ms(s['ttft_p99_s'] and s['ttft_p99_s'] * k)}")
    return "\n".join(lines)
