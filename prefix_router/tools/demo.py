"""``prefix-router demo``: the gateway doing its job on this machine, in about a minute.

Starts replicas on loopback (4 simulated vLLM replicas by default, or real vLLM with
``--engine vllm``) and a gateway in front of them, replays a workload (the built-in mixed one:
sessions sharing system prompts and tool lists, agent loops, clients that break their own
cache), then does the same with a round-robin gateway on fresh replicas, and prints per
replica: requests, prompt and reused tokens, token hit rate, the miss breakdown, spillovers and
TTFT; then both policies side by side and where clients changed their prefix.

Reused tokens are the engine's own ``usage.prompt_tokens_details.cached_tokens``; the miss
breakdown and spillovers are the gateway's ``/metrics``; TTFT is measured at the client. With
simulated replicas time runs ``--time-scale`` times faster than modelled, and TTFT is reported
in modelled time (wall time x scale). Replicas and the gateway share the tiny byte-level BPE
tokenizer of ``prefix_router/tools/tiny_model.py`` (built once into the cache folder), so routing is on
exact token blocks. The demo is not on the gateway's request path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from prefix_router.tools import launch
from prefix_router.misses.diagnosis import FIXES, Cause
from prefix_router.metrics import sample_sum
from prefix_router.tools.replay.client import Record, replay
from prefix_router.tools.replay.summary import percentile
from prefix_router.tools.replay.workloads import load_workload

__all__ = ["add_parser", "run"]

POLICIES = ("prefix-affinity", "round-robin")
MISSES = ("miss_cold", "miss_changed", "miss_routed", "miss_evicted")
SERVED_NAME = "demo"
# Real vLLM on CPU computes a few thousand prompt tokens a second on 2 cores (measured with the
# tiny model: the whole mixed workload took about 7 minutes a policy), so by default the vLLM
# demo replays the first sessions of the workload only.
VLLM_DEFAULT_LIMIT = 120
# The mixed workload's longest prompt is 29,597 tokens with the tiny tokenizer; 8,192 blocks of 32
# tokens (262,144 tokens, 128 MiB of the tiny model's bf16 KV cache) hold a few sessions each.
VLLM_MAX_MODEL_LEN = 32_768
VLLM_NUM_BLOCKS = 8_192


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="prefix affinity against round-robin on local replicas, in about a minute",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("--replicas", type=int, default=None, help="replicas (default: 4 simulated, 2 vLLM)")
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="simulated replicas, or real vLLM (CPU or GPU build) where it is installed")
    p.add_argument("--trace", default=None,
                   help="a Mooncake .jsonl trace, a SWE-agent .traj file or a folder of them (default: built-in mixed)")
    p.add_argument("--limit", type=int, default=None,
                   help=f"first N requests of the workload (default: all; {VLLM_DEFAULT_LIMIT} of the built-in "
                        "one with --engine vllm)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="send requests this many times faster than the workload's clock; simulated replicas "
                        "run this much faster too (default: 10)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per replica (default: 28000 of 16 tokens sim, as an H100 with an 8B model; "
                        f"{VLLM_NUM_BLOCKS} of 32 for the tiny vLLM model; vLLM's own sizing with --model)")
    p.add_argument("--vllm-python", default=None, help="a Python that can import vllm (default: .venv-vllm)")
    p.add_argument("--model", default=None,
                   help="vLLM: a local model folder with its tokenizer (default: a tiny random model built here)")
    p.add_argument("--cache-dir", default=None, help="where the tiny tokenizer and model are built "
                                                     "(default: $XDG_CACHE_HOME/prefix-router)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    p.set_defaults(func=run)


@dataclass
class PolicyRun:
    """One policy's replay: the client's records and the gateway's views."""

    policy: str
    replicas: list[str]  # gateway replica names (host:port), in start order
    records: list[Record]
    metrics: str  # the gateway's /metrics page after the replay
    change_sites: list[dict]
    wall_s: float


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read()


class _Progress:
    """``[policy] done/total`` on stderr: redrawn on a terminal, a line per quarter otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.tty = label, total, 0, sys.stderr.isatty()
        self.started = time.monotonic()

    def __call__(self, _record: Record) -> None:
        self.done += 1
        line = f"[{self.label}] {self.done}/{self.total} requests, {time.monotonic() - self.started:.0f} s"
        if self.tty:
            print("\r" + line, end="\n" if self.done == self.total else "", file=sys.stderr, flush=True)
        elif self.done == self.total or self.done % max(self.total // 4, 1) == 0:
            print(line, file=sys.stderr, flush=True)


def _replay_through(policy: str, urls: list[str], requests, args, tokenizer: Path, log_dir: Path) -> PolicyRun:
    names = [u.removeprefix("http://") for u in urls]
    gateway = launch.gateway_server(log_dir, urls, ["--policy", policy, "--tokenizer", str(tokenizer)])
    with launch.running([gateway]) as (gw,):
        started = time.monotonic()
        records = asyncio.run(replay(requests, gw, model=SERVED_NAME, time_scale=args.time_scale,
                                     on_record=_Progress(policy, len(requests))))
        wall = time.monotonic() - started
        metrics = _get(gw + "/metrics").decode()
        sites = json.loads(_get(gw + "/replicas"))["change_sites"]
    return PolicyRun(policy, names, records, metrics, sites, wall)


def _run_sim(requests, args, tokenizer: Path, log_dir: Path) -> list[PolicyRun]:
    sim_args = ["--model", SERVED_NAME, "--tokenizer", str(tokenizer), "--time-scale", str(args.time_scale),
                "--num-blocks", str(args.num_blocks or 28_000)]
    runs = []
    for policy in POLICIES:  # fresh replicas per policy: neither inherits the other's cache
        with launch.running([launch.sim_server(log_dir, sim_args) for _ in range(args.replicas)]) as urls:
            runs.append(_replay_through(policy, urls, requests, args, tokenizer, log_dir))
    return runs


def _run_vllm(requests, args, model: Path, python: Path, log_dir: Path) -> list[PolicyRun]:
    print(f"starting {args.replicas} vLLM replicas (30-75 s each on CPU, started together)", file=sys.stderr)
    if args.model:  # the user's model: vLLM sizes its KV cache and context itself
        sizing = {"num_blocks": None, "max_model_len": None}
    else:
        sizing = {"num_blocks": args.num_blocks or VLLM_NUM_BLOCKS, "max_model_len": VLLM_MAX_MODEL_LEN}
    servers = [launch.vllm_server(log_dir, python, model, served_name=SERVED_NAME, **sizing)
               for _ in range(args.replicas)]
    for s in servers:  # /reset_prefix_cache between policies instead of a second start
        s.env["VLLM_SERVER_DEV_MODE"] = "1"
    runs = []
    with launch.running(servers) as urls:
        for policy in POLICIES:
            for url in urls:
                urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", method="POST"), timeout=60)
            runs.append(_replay_through(policy, urls, requests, args, model, log_dir))
    return runs


def _vocab_size(tokenizer: Path) -> int:
    """Token ids a Mooncake trace may use: the tokenizer's vocabulary, which replicas check."""
    from tokenizers import Tokenizer

    path = tokenizer / "tokenizer.json"
    return Tokenizer.from_file(str(path)).get_vocab_size() if path.exists() else 32_000


def _replica_rows(run: PolicyRun, scale: float) -> list[dict]:
    by_replica: dict[str, list[Record]] = defaultdict(list)
    for r in run.records:
        if r.status == 200 and r.error is None:
            by_replica[r.replica].append(r)
    rows = []
    for name in run.replicas + ["total"]:
        recs = [r for rs in by_replica.values() for r in rs] if name == "total" else by_replica.get(name, [])
        labels = {} if name == "total" else {"replica": name}
        prompt = sum(r.prompt_tokens or 0 for r in recs)
        reused = sum(r.cached_tokens or 0 for r in recs)
        ttft = [r.ttft_s * scale for r in recs if r.ttft_s is not None]
        spill = sample_sum(run.metrics, "prefix_router_spillovers_total",
                           **({} if name == "total" else {"to_replica": name}))
        rows.append({"replica": name, "requests": len(recs), "prompt_tokens": prompt, "reused_tokens": reused,
                     "hit_rate": reused / prompt if prompt else 0.0,
                     **{k: int(sample_sum(run.metrics, "prefix_router_cache_requests_total", result=k, **labels))
                        for k in ("hit", *MISSES)},
                     "spilled_in": int(spill), "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)})
    return rows


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _table(rows: list[dict]) -> list[str]:
    head = (f"{'replica':<22}{'requests':>9}{'prompt tok':>12}{'reused tok':>12}{'hit rate':>9}"
            f"{'cold':>6}{'changed':>8}{'routed':>7}{'evicted':>8}{'spill in':>9}{'TTFT p50':>10}{'p99':>9}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['replica']:<22}{r['requests']:>9}{r['prompt_tokens']:>12}{r['reused_tokens']:>12}"
                     f"{r['hit_rate']:>9.1%}{r['miss_cold']:>6}{r['miss_changed']:>8}{r['miss_routed']:>7}"
                     f"{r['miss_evicted']:>8}{r['spilled_in']:>9}{_ms(r['ttft_p50_s']):>10}{_ms(r['ttft_p99_s']):>9}")
    return lines


def _side_by_side(totals: dict[str, dict], runs: list[PolicyRun]) -> list[str]:
    a, b = (totals[p] for p in POLICIES)
    lost = {run.policy: {cause: int(sample_sum(run.metrics, "prefix_router_lost_tokens_total", cause=cause))
                         for cause in ("changed", "routed", "evicted")} for run in runs}
    errors = {run.policy: sum(1 for r in run.records if r.status != 200 or r.error) for run in runs}

    def ratio(x, y):
        return f"{x / y:.2f}x" if y else "-"

    rows = [("requests (errors)", f"{a['requests']} ({errors[POLICIES[0]]})", f"{b['requests']} ({errors[POLICIES[1]]})", ""),
            ("reused tokens", a["reused_tokens"], b["reused_tokens"], ratio(a["reused_tokens"], b["reused_tokens"])),
            ("token hit rate", f"{a['hit_rate']:.1%}", f"{b['hit_rate']:.1%}", ratio(a["hit_rate"], b["hit_rate"])),
            ("prefill tokens computed", a["prompt_tokens"] - a["reused_tokens"], b["prompt_tokens"] - b["reused_tokens"],
             ratio(a["prompt_tokens"] - a["reused_tokens"], b["prompt_tokens"] - b["reused_tokens"])),
            ("hits", a["hit"], b["hit"], "")]
    rows += [(f"{k.replace('_', ' ')} (lost tokens)", f"{a[k]} ({lost[POLICIES[0]][k[5:]] if k != 'miss_cold' else '-'})",
              f"{b[k]} ({lost[POLICIES[1]][k[5:]] if k != 'miss_cold' else '-'})", "") for k in MISSES]
    rows += [("spillovers", a["spilled_in"], b["spilled_in"], ""),
             ("TTFT p50", _ms(a["ttft_p50_s"]), _ms(b["ttft_p50_s"]), ratio(a["ttft_p50_s"] or 0, b["ttft_p50_s"] or 0)),
             ("TTFT p99", _ms(a["ttft_p99_s"]), _ms(b["ttft_p99_s"]), ratio(a["ttft_p99_s"] or 0, b["ttft_p99_s"] or 0))]
    lines = [f"{'':<28}{POLICIES[0]:>18}{POLICIES[1]:>16}{'ratio':>9}"]
    lines += [f"{name:<28}{x!s:>18}{y!s:>16}{r:>9}".rstrip() for name, x, y, r in rows]
    return lines


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


def report(runs: list[PolicyRun], scale: float, title: str) -> tuple[str, dict]:
    """The demo's printed report and its figures (``runs``: prefix affinity, then round-robin)."""
    lines = [title, ""]
    per_policy = {}
    for run in runs:
        rows = _replica_rows(run, scale)
        per_policy[run.policy] = rows
        lines += [f"{run.policy} ({run.wall_s:.0f} s)", *_table(rows), ""]
    totals = {p: rows[-1] for p, rows in per_policy.items()}
    lines += ["side by side", *_side_by_side(totals, runs), ""]
    for run in runs:
        failed = [r for r in run.records if r.status != 200 or r.error]
        if failed:
            lines += [f"{run.policy}: {len(failed)} requests failed; the first: HTTP {failed[0].status} "
                      f"{(failed[0].error or '')[:300]}", ""]
    lines += [f"where clients changed their prefix ({runs[0].policy}; message index and token position, no text)",
              *_change_sites(runs[0])]
    return "\n".join(lines), {"per_replica": per_policy, "change_sites": runs[0].change_sites}


def _cache_dir(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefix-router"


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every request succeeded, 1 otherwise, 2 on a setup error."""
    vllm = args.engine == "vllm"
    args.replicas = args.replicas or (2 if vllm else 4)
    args.time_scale = args.time_scale or 10.0
    if vllm and args.limit is None and args.trace is None:
        args.limit = VLLM_DEFAULT_LIMIT
    cache = _cache_dir(args.cache_dir)
    try:
        python = None
        if vllm:
            python = launch.find_vllm_python(args.vllm_python)
            if python is None:
                raise RuntimeError("no Python that can import vllm: run `make vllm-env` (the CPU build), or "
                                   "pass --vllm-python")
            model = Path(args.model) if args.model else launch.build_tiny_model(cache / "tiny-model", python)
        else:
            model = launch.build_tiny_model(cache / "tiny-tokenizer", tokenizer_only=True)
        requests = load_workload(args.trace, workload="mixed", limit=args.limit, vocab_size=_vocab_size(model))
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"prefix-router demo: {exc}", file=sys.stderr)
        return 2
    sessions = len({r.session for r in requests if r.session is not None})
    what = args.trace or "built-in mixed workload"
    kind = "vLLM" if vllm else "simulated vLLM"
    title = (f"prefix-router demo: {args.replicas} {kind} replicas, {what}: {len(requests)} requests"
             f"{f' in {sessions} sessions' if sessions else ''}, sent {args.time_scale:g}x faster than the "
             "workload's clock; TTFT in " +
             ("wall-clock time" if vllm else "modelled time"))
    log_dir = Path(tempfile.mkdtemp(prefix="prefix-router-demo-"))
    # SIGTERM as Ctrl-C: unwind, so that every replica and gateway started is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"prefix-router demo: {len(requests)} requests through {args.replicas} {kind} replicas, with prefix "
          "affinity and then round-robin", file=sys.stderr)
    try:
        runs = (_run_vllm(requests, args, model, python, log_dir) if vllm
                else _run_sim(requests, args, model, log_dir))
    except (RuntimeError, OSError) as exc:
        print(f"prefix-router demo: {exc}\n(the replicas' and gateways' logs are in {log_dir})", file=sys.stderr)
        return 2
    text, figures = report(runs, 1.0 if vllm else args.time_scale, title)  # vLLM runs in real time
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    errors = sum(1 for run in runs for r in run.records if r.status != 200 or r.error)
    if errors:
        print(f"prefix-router demo: {errors} requests failed (the replicas' and gateways' logs are in {log_dir})",
              file=sys.stderr)
        return 1
    shutil.rmtree(log_dir, ignore_errors=True)  # nothing to look at: leave nothing behind
    return 0
