"""The cost of the hop: the same load sent straight to one simulated replica and through each
system in front of it, one system after another in the same run (``overhead``, and ``compare``'s
overhead sweep).

The replica runs 10,000x faster than modelled time, so its own time (under 0.1 ms a request) is
negligible next to the hop being measured. Every system is given it under two names
(``127.0.0.1`` and ``localhost``): vllm-router's ``power_of_two`` refuses fewer than two workers,
and so every system sees the one process the direct baseline sees. The systems alternate within
every rate and repetition, so the machine's noise falls on all of them alike. The bodies are
``workloads.chat_mix``: ~N-token streaming chats, 8 tokens out; this gateway runs as deployed in
front of real vLLM, with a Hugging Face tokenizer (the tiny BPE), rendering the chat template
and hashing exact token blocks, where the peers hash text and need none.

- ``rates_sweep``: the Python client at fixed rates (``drivers.fixed_rate``). Per cell, the TTFT
  and latency added over sending straight to the replica (p50, p99), and each process's CPU ms
  a request (``meters.tree_cpu_seconds`` over the requests sent).
- ``wrk_sweep``: ``wrk`` at saturation, each system alone on the last core (``taskset``), the
  replica and wrk on the others, so the router's CPU seconds per completed request and its
  requests/s are its own (``unpinned`` rows, a ``--workers`` gateway's, share every core).
- ``profile``: py-spy on one gateway serving a fixed rate, after a run without it that gives
  the CPU a request.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

from prefix_router.tools.launch import Server, running, sim_server

from .drivers import fixed_rate, wrk_run, wrk_script
from .meters import ms, py_spy, tree_cpu_seconds
from .systems import PROXY, ROUTER, Gateway, Started, System, pinned
from .workloads import MODEL, chat_mix

__all__ = ["ADDED_P99_LIMIT_MS", "Entry", "profile", "rates_sweep", "sustained", "wrk_sweep"]

TIME_SCALE = 10_000  # the replica's speed-up over modelled time
WARMUP = 16  # requests sent before CPU is counted: connections opened, first turns seen
ADDED_P99_LIMIT_MS = 10.0  # the bar for "sustained" in compare's table: added TTFT p99 at most this


@dataclass(frozen=True)
class Entry:
    """One row of a hop table: ``system`` under ``label``, sent ``chat_mix`` bodies (every first
    turn first with ``first_turns_first``); under wrk alone on the last core unless ``unpinned``."""

    label: str
    system: System
    first_turns_first: bool = False
    unpinned: bool = False


def _replica(log_dir: Path, tokenizer: Path, cpus: str | None = None) -> Server:
    return pinned(sim_server(log_dir, ["--model", MODEL, "--time-scale", str(TIME_SCALE),
                                       "--tokenizer", str(tokenizer)]), cpus)


def _names(url: str) -> list[str]:
    return [url, url.replace("127.0.0.1", "localhost")]


def _cpu(started: Started) -> dict[str, float]:
    return {role: tree_cpu_seconds(pid) for role, pid in started.pids.items()}


def _at_rate(started: Started, requests: list[list[dict]], rate: float) -> tuple[list, dict[str, float]]:
    """Warm ``started`` with the first ``WARMUP`` requests, then send ``requests`` at ``rate``/s:
    their (TTFT, latency) series and each process's CPU seconds meanwhile."""
    asyncio.run(fixed_rate(started.url, requests[:WARMUP], rate))
    before = _cpu(started)
    series = asyncio.run(fixed_rate(started.url, requests, rate))
    return series, {role: s - before[role] for role, s in _cpu(started).items()}


def rates_sweep(entries: list[Entry], *, rates: list[float], reps: int, seconds: float, tokens: int,
                log_dir: Path, tokenizer: Path) -> list[dict]:
    """Every entry at every rate, ``reps`` times, after the direct baseline of each repetition.

    Returns one dict a cell: system, tokens, rate, rep, requests, errors, cpu_ms (the router's
    CPU ms a request), proxy_cpu_ms (Envoy's, None without), added_ttft_p50_ms / _p99_ms,
    added_latency_p50_ms / _p99_ms, direct_ttft_p50_ms / _p99_ms.
    """
    rows = []
    with running([_replica(log_dir, tokenizer)]) as (url,):
        for rate in rates:
            count = max(int(rate * seconds), WARMUP)
            bodies = {first: chat_mix(tokens, count, first_turns_first=first) for first in (False, True)}
            for rep in range(reps):
                direct = asyncio.run(fixed_rate(url, bodies[False], rate))
                for entry in entries:
                    with entry.system.start(_names(url), log_dir) as started:
                        series, cpu = _at_rate(started, bodies[entry.first_turns_first], rate)
                    n = len(series)
                    row = {"system": entry.label, "tokens": tokens, "rate": rate, "rep": rep, "requests": n,
                           "errors": sum(1 for t, _ in series if t <= 0), "cpu_ms": 1000 * cpu[ROUTER] / n,
                           "proxy_cpu_ms": 1000 * cpu[PROXY] / n if PROXY in cpu else None,
                           **{f"direct_ttft_p{q}_ms": ms(direct, q) for q in (50, 99)}}
                    for q in (50, 99):
                        row[f"added_ttft_p{q}_ms"] = ms(series, q) - ms(direct, q)
                        row[f"added_latency_p{q}_ms"] = ms(series, q, 1) - ms(direct, q, 1)
                    rows.append(row)
                    print(f"{tokens} tokens {rate:g}/s {entry.label}: CPU {row['cpu_ms']:.2f} ms/request"
                          + (f" (+ Envoy {row['proxy_cpu_ms']:.2f})" if row["proxy_cpu_ms"] is not None else "")
                          + f", added TTFT p50 {row['added_ttft_p50_ms']:.1f} p99 {row['added_ttft_p99_ms']:.1f} ms, "
                          f"{row['errors']} errors", flush=True)
    return rows


def sustained(rows: list[dict], rates: list[float], limit_ms: float = ADDED_P99_LIMIT_MS) -> dict:
    """Per system of ``rows`` (one repetition), the highest rate before the first that fails
    the bar (an error, or added TTFT p99 over ``limit_ms``); None when the lowest fails it."""
    out = {}
    for name in dict.fromkeys(r["system"] for r in rows):
        ok = [r["rate"] for r in rows if r["system"] == name and r["errors"] == 0
              and r["added_ttft_p99_ms"] <= limit_ms]
        below = [r for r in rates if r not in ok]
        out[name] = max((r for r in ok if not below or r < min(below)), default=None)
    return out


def _cores() -> tuple[str | None, str | None]:
    """(the router's CPU, the replica's and wrk's CPUs) for ``taskset``; (None, None) on one core."""
    cores = os.cpu_count() or 1
    if cores < 2:
        return None, None
    return str(cores - 1), "0" if cores == 2 else f"0-{cores - 2}"


def wrk_sweep(entries: list[Entry], *, tokens: int, connections: int, seconds: float, reps: int,
              bodies: int, log_dir: Path, tokenizer: Path) -> tuple[list[dict], dict]:
    """Every entry under wrk, ``reps`` times in turn, after 2 s of warm-up each.

    ``bodies`` distinct bodies (4 turns of a quarter as many conversations), none repeated until
    they have all gone. Returns one dict a cell (system, tokens, rep, requests, cpu_ms,
    proxy_cpu_ms, requests_per_s, latency_p50) and the run's facts: where things were pinned, and
    whether a gateway's bodies ran out (``cycled``: a repeat finds its prompt in the tokenizer's
    cache; ``first_ran_out``: the first-turns row met later turns).
    """
    count = max(bodies // 4, 1)
    scripts = {first: wrk_script(chat_mix(tokens, 4 * count, window=64, first_turns_first=first), log_dir,
                                 f"bodies-{tokens}-{'first' if first else 'mix'}") for first in (False, True)}
    router_cpu, others = _cores()
    rows, cycled, first_ran_out = [], False, False
    with running([_replica(log_dir, tokenizer, others)]) as (url,):
        for rep in range(reps):
            for entry in entries:
                pin, load_cpus = (None, None) if entry.unpinned else (router_cpu, others)
                script = scripts[entry.first_turns_first]
                with entry.system.start(_names(url), log_dir, pin) as started:
                    warm, _, _ = wrk_run(started.url, script, connections, 2.0, load_cpus)
                    before = _cpu(started)
                    done, rate, p50 = wrk_run(started.url, script, connections, seconds, load_cpus, start=warm)
                    cpu = {role: s - before[role] for role, s in _cpu(started).items()}
                # a repeated body is cheaper only where something remembers bodies: this gateway's
                # tokenizer cache; the floor and the peers keep nothing of them
                cycled |= isinstance(entry.system, Gateway) and warm + done > 4 * count
                first_ran_out |= entry.first_turns_first and warm + done > count
                rows.append({"system": entry.label, "tokens": tokens, "rep": rep, "requests": done,
                             "cpu_ms": 1000 * cpu[ROUTER] / done,
                             "proxy_cpu_ms": 1000 * cpu[PROXY] / done if PROXY in cpu else None,
                             "requests_per_s": rate, "latency_p50": p50})
                print(f"{tokens} tokens, wrk {connections} connections, {entry.label}: CPU "
                      f"{rows[-1]['cpu_ms']:.2f} ms/request, {rate:.0f} requests/s, latency p50 {p50}", flush=True)
    return rows, {"router_cpu": router_cpu, "other_cpus": others, "bodies": 4 * count, "cycled": cycled,
                  "first_ran_out": first_ran_out}


def profile(system: System, *, rate: float, seconds: float, tokens: int, raw_out: Path, log_dir: Path,
            tokenizer: Path) -> float:
    """Run ``system`` (this gateway) under load, then under as much again, new requests (no body
    repeated: a repeat would find its prompt in the tokenizer's cache), while py-spy records it
    into ``raw_out``; its CPU ms a request in the run without py-spy. Raises ``RuntimeError``
    when py-spy fails (not installed, no ptrace permission)."""
    count = max(int(rate * (seconds + 2)), WARMUP)
    requests = chat_mix(tokens, 2 * count)  # the first half unprofiled, the second under py-spy
    with running([_replica(log_dir, tokenizer)]) as (url,):
        with system.start(_names(url), log_dir) as started:
            series, cpu = _at_rate(started, requests[:count], rate)
            spy = py_spy(started.pids[ROUTER], seconds, raw_out)
            asyncio.run(fixed_rate(started.url, requests[count:], rate))
            _, err = spy.communicate(timeout=60)
            if spy.returncode != 0 or not raw_out.exists():
                raise RuntimeError(f"py-spy failed: {err.strip()[-300:]}")
    return 1000 * cpu[ROUTER] / len(series)
