"""``prefix-router demo``: the gateway doing its job on this machine, in about a minute.

Starts replicas on loopback (4 simulated vLLM replicas by default, or real vLLM with
``--engine vllm``) and a gateway in front of them, replays a workload (the built-in mixed one:
sessions sharing system prompts and tool lists, agent loops, clients that break their own
cache), then does the same with a round-robin gateway on fresh replicas, and prints per
replica (``replica-0`` .. in launch order): requests, prompt and reused tokens, token hit rate,
the miss breakdown, spillovers and TTFT; then both policies side by side, where clients changed
their prefix, and a one-line verdict; and draws hit rate and TTFT per replica in a PNG.

Reused tokens are the engine's own ``usage.prompt_tokens_details.cached_tokens``; the miss
breakdown and spillovers are the gateway's ``/metrics``. With simulated replicas (time running
``--time-scale`` times faster than modelled) TTFT is each replica's modelled time to the first
token (``sim_modelled_ttft_s``: queueing and prefill counted in engine steps, so the machine's
load does not move it); with real vLLM it is the client's wall clock. Replicas and the gateway
share the tiny byte-level BPE tokenizer of ``prefix_router/tools/tiny_model.py`` (built once into
the cache folder), so routing is on exact token blocks. The demo is not on the gateway's request
path; the report is ``demo_report.py``, the picture ``demo_plot.py``.
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
from pathlib import Path

from prefix_router.tools import launch
from prefix_router.tools.demo_plot import plot_or_say
from prefix_router.tools.demo_report import POLICIES, PolicyRun, report
from prefix_router.tools.replay.client import Record, replay
from prefix_router.tools.replay.workloads import load_workload

__all__ = ["add_parser", "run"]

SERVED_NAME = "demo"
# Real vLLM on CPU computes a few thousand prompt tokens a second on 2 cores (measured with the
# tiny model: the whole mixed workload took about 7 minutes a policy), so by default the vLLM
# demo replays the first sessions of the workload only.
VLLM_DEFAULT_LIMIT = 120
# The mixed workload's longest prompt is 29,597 tokens with the tiny tokenizer; 8,192 blocks of 32
# tokens (262,144 tokens, 128 MiB of the tiny model's bf16 KV cache) hold a few sessions each.
VLLM_MAX_MODEL_LEN = 32_768
VLLM_NUM_BLOCKS = 8_192
DEFAULT_PLOT = "prefix-router-demo.png"


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
    p.add_argument("--plot", default=None, metavar="PATH",
                   help=f"where to draw hit rate and TTFT per replica as a PNG (default: beside --json FILE, else "
                        f"{DEFAULT_PLOT} in the current folder; needs matplotlib, the demo extra)")
    p.add_argument("--no-plot", action="store_true", help="draw no PNG")
    p.set_defaults(func=run)


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
    gateway = launch.gateway_server(log_dir, urls, ["--policy", policy, "--tokenizer", str(tokenizer)])
    with launch.running([gateway]) as (gw,):
        started = time.monotonic()
        records = asyncio.run(replay(requests, gw, model=SERVED_NAME, time_scale=args.time_scale,
                                     on_record=_Progress(policy, len(requests))))
        wall = time.monotonic() - started
        metrics = _get(gw + "/metrics").decode()
        sites = json.loads(_get(gw + "/replicas"))["change_sites"]
    return PolicyRun(policy, list(urls), records, metrics, sites, wall)


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


def _cache_dir(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefix-router"


def _plot_path(args: argparse.Namespace) -> Path | None:
    """``--plot``, else beside ``--json`` (its name, ``.png``), else ``DEFAULT_PLOT`` here."""
    if args.no_plot:
        return None
    if args.plot:
        return Path(args.plot)
    return Path(args.json).with_suffix(".png") if args.json else Path(DEFAULT_PLOT)


def _output(runs: list[PolicyRun], args: argparse.Namespace, title: str, modelled: bool) -> None:
    """Print the report, draw the PNG (its path, or why not, on a line), end on the verdict;
    write the figures (the plot's path among them) to ``--json``."""
    text, figures = report(runs, title, modelled)
    print(text + "\n")
    path = _plot_path(args)
    figures["plot"] = None if path is None else plot_or_say(figures["per_replica"], path, figures["ttft"], title)
    figures["plot"] = None if figures["plot"] is None else str(figures["plot"])
    print(figures["verdict"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every request succeeded, 1 otherwise, 2 on a setup error."""
    vllm = args.engine == "vllm"
    args.replicas = args.replicas or (2 if vllm else 4)
    args.time_scale = args.time_scale or 10.0
    if vllm and args.limit is None and args.trace is None:
        args.limit = VLLM_DEFAULT_LIMIT
    cache = _cache_dir(args.cache_dir)
    try:
        for flag, out in (("--json", args.json), ("--plot", args.plot)):  # before the minutes-long run
            if out and not Path(out).resolve().parent.is_dir():
                raise ValueError(f"{flag} {out}: there is no folder {Path(out).parent}")
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
             "workload's clock; TTFT " +
             ("at the client, wall clock" if vllm else "modelled by the replicas, from their engine steps"))
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
    _output(runs, args, title, modelled=not vllm)  # vLLM runs in real time: its TTFT is the client's
    errors = sum(1 for run in runs for r in run.records if r.status != 200 or r.error)
    if errors:
        print(f"prefix-router demo: {errors} requests failed (the replicas' and gateways' logs are in {log_dir})",
              file=sys.stderr)
        return 1
    shutil.rmtree(log_dir, ignore_errors=True)  # nothing to look at: leave nothing behind
    return 0
