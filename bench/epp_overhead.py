"""The Endpoint Picker's path against ``serve``'s, side by side on the same load.

One simulated replica 10,000x faster than modelled time; ~N-token streaming chats at fixed
rates (``bench/gateway_overhead.py``), straight to the replica (the baseline), through
``prefix-router serve``, and through a real Envoy asking ``prefix-router epp`` (ext_proc,
``launch.ENVOY_CONFIG``) in each of the filter's body modes (``launch.PROCESSING_MODES``:
plain Envoy's buffered request and streamed answer, and Istio's full duplex). Per request: the TTFT added over the baseline (p50, p99) and the CPU
milliseconds of the processes on the path, from ``/proc/PID/stat``: the gateway's for
``serve``; the picker's and Envoy's (the proxy the picker's users run anyway) for the EPP. The
systems alternate within every rate and repetition, so the machine's noise falls on both.

    python -m bench.epp_overhead --rates 25,50 --reps 2

Prints one line per cell and writes ``--out`` (markdown: medians over the repetitions).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
from pathlib import Path

from prefix_router.tools.launch import envoy_server, epp_server, gateway_server, running, sim_server
from prefix_router.tools.replay.summary import percentile

from .fleet import ROOT, tiny_tokenizer, write_report
from .gateway_overhead import conversations, fixed_rate
from .overhead import cpu_seconds


def _ms(series, q: float) -> float:
    return 1e3 * percentile([t for t, _ in series if t > 0], q)


def _run(url: str, pids: list[int], requests, rate: float) -> tuple[list, list[float]]:
    asyncio.run(fixed_rate(url, requests[:16], rate))  # connections and first turns
    before = [cpu_seconds(p) for p in pids]
    series = asyncio.run(fixed_rate(url, requests, rate))
    return series, [cpu_seconds(p) - b for p, b in zip(pids, before)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="25,50", help="requests per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of load per cell")
    parser.add_argument("--tokens", type=int, default=1000, help="prompt size of the chats")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of every cell")
    parser.add_argument("--modes", default="buffered,duplex", help="the ext_proc filter's body modes to run")
    parser.add_argument("--envoy", default=shutil.which("envoy") or str(Path(sys.executable).with_name("envoy")))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "epp-overhead.md")
    args = parser.parse_args(argv)
    log_dir = ROOT / ".cache" / "bench-epp"
    log_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(traces=True)
    gateway_args = ["--tokenizer", str(tokenizer)]
    cells: dict[tuple[float, str], list[tuple[float, float, float, float]]] = {}
    sim = sim_server(log_dir, ["--model", "sim", "--time-scale", "10000", "--tokenizer", str(tokenizer)])
    with running([sim]) as (replica,):
        for rate in [float(r) for r in args.rates.split(",")]:
            requests = conversations(args.tokens, 16, max(int(rate * args.seconds) // 16, 1))
            for _ in range(args.reps):
                direct = asyncio.run(fixed_rate(replica, requests, rate))
                serve = gateway_server(log_dir, [replica], gateway_args)
                with running([serve]) as (url,):
                    series, (cpu,) = _run(url, [serve.pid], requests, rate)
                rows = {"serve": (series, cpu, 0.0)}
                for mode in args.modes.split(","):
                    epp, grpc_port = epp_server(log_dir, [replica], gateway_args)
                    with running([epp]):
                        envoy = envoy_server(log_dir, grpc_port, args.envoy, mode=mode, replicas=[replica])
                        with running([envoy]) as (url,):
                            series, (picker, proxy) = _run(url, [epp.pid, envoy.pid], requests, rate)
                    rows[f"epp + envoy, {mode}"] = (series, picker, proxy)
                for name, (series, cpu, proxy) in rows.items():
                    n = len(series)
                    row = (1000 * cpu / n, 1000 * proxy / n, _ms(series, 50) - _ms(direct, 50),
                           _ms(series, 99) - _ms(direct, 99))
                    cells.setdefault((rate, name), []).append(row)
                    errors = sum(1 for t, _ in series if t <= 0)
                    print(f"{args.tokens} tokens {rate:g}/s {name}: CPU {row[0]:.2f} ms/request (+ Envoy "
                          f"{row[1]:.2f}), added TTFT p50 {row[2]:.1f} p99 {row[3]:.1f} ms, {errors} errors", flush=True)
    lines = [f"The Endpoint Picker behind Envoy against serve: ~{args.tokens}-token streaming chats, one simulated "
             f"replica, {args.seconds:g} s a cell, medians of {args.reps}.", "",
             "| rate | path | gateway or picker CPU ms / request | Envoy CPU ms / request | added TTFT p50 / p99 (ms) |",
             "|---|---|---|---|---|"]
    for (rate, name), rows in cells.items():
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        proxy = "-" if name == "serve" else f"{med[1]:.2f}"
        lines.append(f"| {rate:g}/s | {name} | {med[0]:.2f} | {proxy} | {med[2]:.1f} / {med[3]:.1f} |")
    lines += ["", f"Command: `python -m bench.epp_overhead {' '.join(sys.argv[1:] if argv is None else argv)}`"]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
