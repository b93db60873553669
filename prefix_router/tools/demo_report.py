"""The demo's report: per-replica tables, both policies side by side, where clients changed their
prefix, and a one-line verdict, from each policy's replay (``PolicyRun``).

Replicas are named ``replica-0`` .. ``replica-N-1`` in the order they were launched (their loopback
ports change from run to run; the figures keep each one's URL). TTFT is the simulated replicas'
own modelled time to the first token (``sim_modelled_ttft_s``: the engine steps a request waited
through, from its arrival at the engine, so the machine's load does not move it) or, with real
vLLM, the client's wall clock. Ratios are prefix affinity's figure over round-robin's.

The verdict calls one policy's TTFT faster only where the two percentiles' 95% ranges (from order
statistics, so no distribution assumed) do not overlap: a p99 of a few hundred requests is its few
slowest ones, and which those are (a request that arrives during another's long prefill, a session
round-robin sends away from its history) changes from run to run.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from prefix_router.metrics import sample_sum
from prefix_router.misses.diagnosis import FIXES, Cause
from prefix_router.tools.replay.client import Record
from prefix_router.tools.replay.summary import percentile

__all__ = ["POLICIES", "PolicyRun", "percentile_range", "ratios", "report", "replica_names", "verdict"]

POLICIES = ("prefix-affinity", "round-robin")
MISSES = ("miss_cold", "miss_changed", "miss_routed", "miss_evicted")
MODELLED, WALL = "TTFT (modelled)", "TTFT (wall clock)"


@dataclass
class PolicyRun:
    """One policy's replay: the client's records and the gateway's views."""

    policy: str
    urls: list[str]  # the replicas' base URLs, in launch order
    records: list[Record]
    metrics: str  # the gateway's /metrics page after the replay
    change_sites: list[dict]
    wall_s: float


def replica_names(urls: list[str]) -> dict[str, str]:
    """The gateway's name of each replica (``host:port``, as its header and metric labels give it)
    -> ``replica-i``, ``i`` its place in ``urls``."""
    return {u.removeprefix("http://").removeprefix("https://").rstrip("/"): f"replica-{i}" for i, u in enumerate(urls)}


def percentile_range(values: list[float], q: float, z: float = 1.96) -> tuple[float, float] | None:
    """A distribution-free confidence range of the ``q``-th percentile (0-100) of ``values`` (95%
    for ``z`` 1.96): the order statistics ``n p -+ z sqrt(n p (1 - p))``, where the count of values
    below the percentile is binomial (``p`` = ``q`` / 100). None for no values."""
    if not values:
        return None
    ordered, p = sorted(values), q / 100
    n, half = len(ordered), z * math.sqrt(len(ordered) * p * (1 - p))
    lo, hi = max(math.floor(n * p - half), 1), min(math.ceil(n * p + half), n)
    return ordered[lo - 1], ordered[max(hi, lo) - 1]


def _ttft(record: Record, modelled: bool) -> float | None:
    return record.replica_modelled_ttft_s if modelled else record.ttft_s


def _replica_rows(run: PolicyRun, modelled: bool) -> list[dict]:
    """A row per replica in launch order, then ``total``: counts, tokens, hit rate, the gateway's
    miss classification and spillovers, TTFT p50 and p99 in seconds."""
    by_replica: dict[str, list[Record]] = defaultdict(list)
    for r in run.records:
        if r.status == 200 and r.error is None:
            by_replica[r.replica].append(r)
    names = replica_names(run.urls)
    rows = []
    for gateway_name, url in [*zip(names, run.urls), ("total", None)]:
        total = url is None
        recs = [r for rs in by_replica.values() for r in rs] if total else by_replica.get(gateway_name, [])
        labels = {} if total else {"replica": gateway_name}
        prompt = sum(r.prompt_tokens or 0 for r in recs)
        reused = sum(r.cached_tokens or 0 for r in recs)
        ttft = [t for t in (_ttft(r, modelled) for r in recs) if t is not None]
        spill = sample_sum(run.metrics, "prefix_router_spillovers_total", **({} if total else {"to_replica": gateway_name}))
        rows.append({"replica": "total" if total else names[gateway_name], **({} if total else {"url": url}),
                     "requests": len(recs), "prompt_tokens": prompt, "reused_tokens": reused,
                     "hit_rate": reused / prompt if prompt else 0.0,
                     **{k: int(sample_sum(run.metrics, "prefix_router_cache_requests_total", result=k, **labels))
                        for k in ("hit", *MISSES)},
                     "spilled_in": int(spill), "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
                     "ttft_p50_range_s": percentile_range(ttft, 50), "ttft_p99_range_s": percentile_range(ttft, 99)})
    return rows


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _ms_range(row: dict, q: int) -> str:
    """``p`` ms and its 95% range, as ``54 ms (51-57)``."""
    value, span = row[f"ttft_p{q}_s"], row[f"ttft_p{q}_range_s"]
    return _ms(value) if span is None else f"{_ms(value)} ({span[0] * 1000:.0f}-{span[1] * 1000:.0f})"


def _table(rows: list[dict], ttft: str) -> list[str]:
    head = (f"{'replica':<12}{'requests':>9}{'prompt tok':>12}{'reused tok':>12}{'hit rate':>9}"
            f"{'cold':>6}{'changed':>8}{'routed':>7}{'evicted':>8}{'spill in':>9}{ttft + ' p50':>22}{'p99':>9}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['replica']:<12}{r['requests']:>9}{r['prompt_tokens']:>12}{r['reused_tokens']:>12}"
                     f"{r['hit_rate']:>9.1%}{r['miss_cold']:>6}{r['miss_changed']:>8}{r['miss_routed']:>7}"
                     f"{r['miss_evicted']:>8}{r['spilled_in']:>9}{_ms(r['ttft_p50_s']):>22}{_ms(r['ttft_p99_s']):>9}")
    return lines


def ratios(totals: dict[str, dict]) -> dict[str, float | None]:
    """Prefix affinity's total over round-robin's (None where round-robin's is 0 or missing):
    reused tokens, token hit rate, prefill tokens computed, TTFT p50 and p99."""
    a, b = (totals[p] for p in POLICIES)

    def ratio(x, y):
        return x / y if x is not None and y else None

    return {"reused_tokens": ratio(a["reused_tokens"], b["reused_tokens"]),
            "hit_rate": ratio(a["hit_rate"], b["hit_rate"]),
            "prefill_tokens": ratio(a["prompt_tokens"] - a["reused_tokens"], b["prompt_tokens"] - b["reused_tokens"]),
            "ttft_p50": ratio(a["ttft_p50_s"], b["ttft_p50_s"]), "ttft_p99": ratio(a["ttft_p99_s"], b["ttft_p99_s"])}


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _side_by_side(totals: dict[str, dict], runs: list[PolicyRun], ttft: str) -> list[str]:
    a, b = (totals[p] for p in POLICIES)
    x = {k: _x(v) for k, v in ratios(totals).items()}
    lost = {run.policy: {cause: int(sample_sum(run.metrics, "prefix_router_lost_tokens_total", cause=cause))
                         for cause in ("changed", "routed", "evicted")} for run in runs}
    errors = {run.policy: sum(1 for r in run.records if r.status != 200 or r.error) for run in runs}
    rows = [("requests (errors)", f"{a['requests']} ({errors[POLICIES[0]]})", f"{b['requests']} ({errors[POLICIES[1]]})", ""),
            ("reused tokens", a["reused_tokens"], b["reused_tokens"], x["reused_tokens"]),
            ("token hit rate", f"{a['hit_rate']:.1%}", f"{b['hit_rate']:.1%}", x["hit_rate"]),
            ("prefill tokens computed", a["prompt_tokens"] - a["reused_tokens"], b["prompt_tokens"] - b["reused_tokens"],
             x["prefill_tokens"]),
            ("hits", a["hit"], b["hit"], "")]
    rows += [(f"{k.replace('_', ' ')} (lost tokens)", f"{a[k]} ({lost[POLICIES[0]][k[5:]] if k != 'miss_cold' else '-'})",
              f"{b[k]} ({lost[POLICIES[1]][k[5:]] if k != 'miss_cold' else '-'})", "") for k in MISSES]
    rows += [("spillovers", a["spilled_in"], b["spilled_in"], ""),
             (f"{ttft} p50 (95% range)", _ms_range(a, 50), _ms_range(b, 50), x["ttft_p50"]),
             (f"{ttft} p99 (95% range)", _ms_range(a, 99), _ms_range(b, 99), x["ttft_p99"])]
    lines = [f"{'':<36}{POLICIES[0]:>18}{POLICIES[1]:>18}{'ratio':>9}"]
    lines += [f"{name:<36}{v!s:>18}{w!s:>18}{r:>9}".rstrip() for name, v, w, r in rows]
    return lines


def _direction(r: float | None, below: str, above: str) -> str:
    """``below`` or ``above`` 1 as the ratio reads at two decimals, else "about the same"."""
    if r is None:
        return "not measured"
    shown = round(r, 2)
    return below if shown < 1 else above if shown > 1 else "about the same"


def _faster(a: tuple[float, float] | None, b: tuple[float, float] | None) -> str:
    """Prefix affinity's TTFT against round-robin's from their percentile's ranges (seconds)."""
    if a is None or b is None:
        return "not measured"
    return "faster" if a[1] < b[0] else "slower" if a[0] > b[1] else "no clear difference"


def verdict(totals: dict[str, dict], ttft: str = MODELLED) -> str:
    """One line: prefix affinity's reused tokens, prefill tokens computed and TTFT p50 and p99 as
    ratios of round-robin's (the side-by-side table's), each with its direction in words: a TTFT
    is faster or slower only where the percentile's ranges (``percentile_range``) do not overlap."""
    r = ratios(totals)
    a, b = (totals[p] for p in POLICIES)
    return (f"verdict: {POLICIES[0]} reused {_x(r['reused_tokens'])} the tokens of {POLICIES[1]} "
            f"({_direction(r['reused_tokens'], 'fewer', 'more')}), computed {_x(r['prefill_tokens'])} the prefill "
            f"tokens ({_direction(r['prefill_tokens'], 'fewer', 'more')}); {ttft} p50 {_x(r['ttft_p50'])} "
            f"({_faster(a.get('ttft_p50_range_s'), b.get('ttft_p50_range_s'))}), p99 {_x(r['ttft_p99'])} "
            f"({_faster(a.get('ttft_p99_range_s'), b.get('ttft_p99_range_s'))})")


def _change_sites(run: PolicyRun) -> list[str]:
    if not run.change_sites:
        return ["  none: no client rewrote text it had sent before"]
    out = []
    for site in run.change_sites[:5]:
        m = site["message_index"]
        role = f" ({site['role']})" if site.get("role") else ""
        where = "the tool list" if m == -1 else f"message {m}{role}" if m >= 0 else "the prompt"
        count = site["count"]
        out.append(f"  {count:>4} request{'s' if count != 1 else ''}: {site['cause']} at {where}, token "
                   f"{site['token_position']} ({site.get('lost_tokens', 0):,} tokens recomputed); "
                   f"fix: {FIXES[Cause(site['cause'])]}")
    return out


def report(runs: list[PolicyRun], title: str, modelled: bool = True) -> tuple[str, dict]:
    """The demo's printed report, verdict excluded, and its figures (``runs``: prefix affinity,
    then round-robin; ``modelled``: TTFT from the simulated replicas' modelled times, else the
    client's wall clock). The figures hold ``per_replica`` rows, ``ratios``, ``verdict``,
    ``ttft`` (which TTFT) and ``change_sites``."""
    ttft = MODELLED if modelled else WALL
    lines = [title, ""]
    per_policy = {}
    for run in runs:
        rows = _replica_rows(run, modelled)
        per_policy[run.policy] = rows
        lines += [f"{run.policy} ({run.wall_s:.0f} s)", *_table(rows, ttft), ""]
    totals = {p: rows[-1] for p, rows in per_policy.items()}
    lines += ["side by side", *_side_by_side(totals, runs, ttft), ""]
    for run in runs:
        failed = [r for r in run.records if r.status != 200 or r.error]
        if failed:
            lines += [f"{run.policy}: {len(failed)} requests failed; the first: HTTP {failed[0].status} "
                      f"{(failed[0].error or '')[:300]}", ""]
    lines += [f"where clients changed their prefix ({runs[0].policy}; message index and token position, no text)",
              *_change_sites(runs[0])]
    figures = {"ttft": ttft, "per_replica": per_policy, "ratios": ratios(totals), "verdict": verdict(totals, ttft),
               "change_sites": runs[0].change_sites}
    return "\n".join(lines), figures
