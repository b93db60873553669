"""The cost of the extra hop, per system: the same fixed-rate streaming load sent straight to one
simulated replica and through each system in front of it.

The replica runs 10,000x faster than modelled time, so its modelled GPU time (under 0.1 ms) is
negligible next to the hop being measured. Every system is given the replica under two names
(``127.0.0.1`` and ``localhost``), as vllm-router's ``power_of_two`` needs two workers. Requests
are chats of about 1,000 tokens (``gateway_overhead.chat_mix``: conversations of 4 turns, one
request in four opening one, the others extending one), with 8 output tokens. (Until
2026-12-04 it sent 16 conversations a turn each in turn, so at 100/s for 12 s a prompt grew to
~3,000 tokens and 150 messages; the committed results before then were taken so.) At each
rate, direct first, then every system, one after another in the same run, so each added
latency is a difference of neighbours on the same machine.

This gateway runs as deployed in front of real vLLM: with a Hugging Face tokenizer (the tiny
BPE of ``prefix_router/tools/tiny_model.py``), rendering the chat template and hashing exact token blocks;
the peers hash text and need none. Per system and rate: added TTFT p50/p99 (system minus
direct), and CPU seconds of the router's process per 1,000 requests (``/proc/PID/stat``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from prefix_router.tools.launch import running, sim_server
from prefix_router.tools.replay.summary import percentile

from .fleet import tiny_tokenizer
from .gateway_overhead import MODEL, chat_mix, fixed_rate
from .peers import System, cpu_seconds

__all__ = ["measured_run", "overhead_sweep", "overhead_table", "ADDED_P99_LIMIT_MS"]

ADDED_P99_LIMIT_MS = 10.0  # the bar for "sustained": added TTFT p99 at most this
# CPU per request is read at one rate for every system: idle costs (health checks, scrapes)
# inflate it at low rates and contention for the 2 cores at high ones
CPU_REFERENCE_RATE = 50.0


def _ttft_ms(series, q: float) -> float:
    return 1e3 * percentile([t for t, _ in series], q)


def measured_run(server, requests: list[list[dict]], rate: float) -> tuple[list[tuple[float, float]], float]:
    """Start ``server``, warm it with the first 16 requests (connections, first turns), then
    send ``requests`` at ``rate``/s: (their (TTFT, latency) series, the server's CPU seconds)."""
    with running([server]) as (url,):
        asyncio.run(fixed_rate(url, requests[:16], rate))
        cpu0 = cpu_seconds(server.pid)
        series = asyncio.run(fixed_rate(url, requests, rate))
        return series, cpu_seconds(server.pid) - cpu0


def overhead_sweep(systems: list[System], rates: list[float], seconds: float, peers_bin: Path | None,
                   log_dir: Path, prompt_tokens: int = 1000) -> dict:
    """Added TTFT per system and rate, and the highest rate each sustains (added p99 at most
    ``ADDED_P99_LIMIT_MS``; None when even the lowest rate exceeds it).

    Returns {"rates", "rows": [{system, rate, requests, added_ttft_p50_ms, added_ttft_p99_ms,
    direct_ttft_p50_ms, direct_ttft_p99_ms, errors, cpu_s_per_1k}], "sustained": {system: rate}}.
    """
    tokenizer = tiny_tokenizer(traces=True)
    sim_args = ["--model", MODEL, "--time-scale", "10000", "--tokenizer", str(tokenizer)]
    rows = []
    with running([sim_server(log_dir, sim_args)]) as (replica,):
        # two names for the one replica: power_of_two refuses fewer than 2 workers, and every
        # system gets the same pair, so all see the one process the direct baseline sees
        aliases = [replica, replica.replace("127.0.0.1", "localhost")]
        for rate in rates:
            requests = chat_mix(prompt_tokens, max(int(rate * seconds), 16))
            direct = asyncio.run(fixed_rate(replica, requests, rate))
            for system in systems:
                server = system.server(aliases, log_dir, peers_bin, ("--tokenizer", str(tokenizer)))
                series, cpu = measured_run(server, requests, rate)
                ok = [s for s in series if s[0] > 0]
                rows.append({
                    "system": system.name, "rate": rate, "requests": len(series), "errors": len(series) - len(ok),
                    "direct_ttft_p50_ms": _ttft_ms(direct, 50), "direct_ttft_p99_ms": _ttft_ms(direct, 99),
                    "added_ttft_p50_ms": _ttft_ms(ok, 50) - _ttft_ms(direct, 50),
                    "added_ttft_p99_ms": _ttft_ms(ok, 99) - _ttft_ms(direct, 99),
                    "cpu_s_per_1k": 1000 * cpu / len(series),
                })
    sustained = {}
    for system in systems:
        ok_rates = [r["rate"] for r in rows if r["system"] == system.name
                    and r["errors"] == 0 and r["added_ttft_p99_ms"] <= ADDED_P99_LIMIT_MS]
        below = [r for r in rates if r not in ok_rates]
        # the highest rate before the first one that fails the bar
        sustained[system.name] = max((r for r in ok_rates if not below or r < min(below)), default=None)
    return {"rates": rates, "prompt_tokens": prompt_tokens, "rows": rows, "sustained": sustained}


def overhead_table(overhead: dict) -> str:
    """Markdown: one row per system, added TTFT p50/p99 at each rate, sustained rate, CPU."""
    rates = overhead["rates"]
    cpu_rate = CPU_REFERENCE_RATE if CPU_REFERENCE_RATE in rates else rates[0]
    head = ("| system | " + " | ".join(f"added TTFT p50 / p99 at {r:g}/s (ms)" for r in rates)
            + f" | highest rate with added p99 <= {ADDED_P99_LIMIT_MS:g} ms | CPU s per 1,000 requests at {cpu_rate:g}/s |")
    lines = [f"Overhead: ~{overhead['prompt_tokens']}-token streaming chat requests, one replica; "
             "direct TTFT p50 / p99 (ms): " + ", ".join(
                 f"{r['rate']:g}/s {r['direct_ttft_p50_ms']:.1f} / {r['direct_ttft_p99_ms']:.1f}"
                 for r in overhead["rows"] if r["system"] == overhead["rows"][0]["system"]), "",
             head, "|---" * (len(rates) + 3) + "|"]
    for name in dict.fromkeys(r["system"] for r in overhead["rows"]):
        by_rate = {r["rate"]: r for r in overhead["rows"] if r["system"] == name}
        cells = [f"{by_rate[r]['added_ttft_p50_ms']:.1f} / {by_rate[r]['added_ttft_p99_ms']:.1f}"
                 + (f" ({by_rate[r]['errors']} errors)" if by_rate[r]["errors"] else "") for r in rates]
        best = overhead["sustained"].get(name)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'none tested' if best is None else f'{best:g}/s'}"
                     f"{' (every rate tested)' if best == max(rates) else ''} | {by_rate[cpu_rate]['cpu_s_per_1k']:.2f} |")
    return "\n".join(lines)
