"""Before and after a change to the gateway, side by side in one run, next to vllm-router.

The overhead sweep of ``bench/overhead.py`` (one simulated replica 10,000x faster than modelled
time, ~N-token streaming chats at fixed rates, CPU seconds of the router's process per request
from ``/proc/PID/stat``) with the gateway of two source trees: ``--before`` (a ``git worktree``
of the commit before the change) and ``--after`` (default: this tree), each started with the
tree as its working directory, then the floor of an aiohttp hop (``bench/floor_proxy.py``: forwarding
only, what aiohttp costs) and vllm-router ``consistent_hash``. The systems alternate
within every rate and repetition, so the machine's noise falls on all of them alike.

    git worktree add --detach ../before HEAD~3
    python -m bench.overhead_ab --before ../before --rates 25,50,100 --reps 2

Prints one line per cell and writes ``--out`` (markdown: medians over the repetitions).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

from prefix_router.tools.launch import Server, free_port, running, sim_server
from prefix_router.tools.replay.summary import percentile

from .fleet import ROOT, commit_of, tiny_tokenizer, tree_gateway, write_report
from .gateway_overhead import chat_mix, fixed_rate
from .overhead import measured_run
from .peers import System, ensure_peers

PEER = System("vllm-router consistent_hash", "vllm-router", "consistent_hash")
FLOOR = "aiohttp floor"


def _floor_server(replica: str, log_dir: Path) -> Server:
    port = free_port()
    return Server([sys.executable, "-m", "bench.floor_proxy", "--port", str(port), "--upstream", replica], port,
                  log_dir / f"floor-{port}.log", cwd=ROOT)


def _ms(series, q: float) -> float:
    return 1e3 * percentile([t for t, _ in series], q)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="the gateway's tree before the change (none: this tree alone)")
    parser.add_argument("--after", type=Path, default=ROOT, help="the tree after it (default: this one)")
    parser.add_argument("--rates", default="25,50,100", help="requests per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=12.0, help="seconds of load per cell")
    parser.add_argument("--tokens", type=int, default=1000, help="prompt size of the chats")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of every cell")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "overhead-ab.md")
    args = parser.parse_args(argv)
    log_dir = ROOT / ".cache" / "bench-overhead-ab"
    log_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(traces=True)
    peers = ensure_peers()
    trees = {"before": args.before.resolve()} if args.before else {}
    trees["after" if args.before else "prefix-router"] = args.after.resolve()
    base = next(iter(trees))  # the ratios' denominator
    cells: dict[tuple[float, str], list[tuple[float, float, float]]] = {}
    sim = sim_server(log_dir, ["--model", "sim", "--time-scale", "10000", "--tokenizer", str(tokenizer)])
    with running([sim]) as (replica,):
        aliases = [replica, replica.replace("127.0.0.1", "localhost")]
        for rate in [float(r) for r in args.rates.split(",")]:
            requests = chat_mix(args.tokens, max(int(rate * args.seconds), 16))
            for _ in range(args.reps):
                direct = asyncio.run(fixed_rate(replica, requests, rate))
                for name in (*trees, FLOOR, PEER.name):
                    if name == FLOOR:
                        server = _floor_server(replica, log_dir)
                    elif name in trees:
                        server = tree_gateway(trees[name], aliases, log_dir, tokenizer)
                    else:
                        server = PEER.server(aliases, log_dir, peers)
                    series, cpu = measured_run(server, requests, rate)
                    ok = [s for s in series if s[0] > 0]
                    row = (1000 * cpu / len(series), _ms(ok, 50) - _ms(direct, 50), _ms(ok, 99) - _ms(direct, 99))
                    cells.setdefault((rate, name), []).append(row)
                    print(f"{args.tokens} tokens {rate:g}/s {name}: CPU {row[0]:.2f} ms/request, added TTFT "
                          f"p50 {row[1]:.1f} p99 {row[2]:.1f} ms, {len(series) - len(ok)} errors", flush=True)
    lines = [f"Gateway {', '.join(f'{k} ({commit_of(v)})' for k, v in trees.items())}, next to {FLOOR} and {PEER.name}: "
             f"~{args.tokens}-token streaming chats, one simulated replica, {args.seconds:g} s a cell, medians of "
             f"{args.reps}.", "", f"| rate | system | CPU ms / request | added TTFT p50 / p99 (ms) | CPU vs {base} |",
             "|---|---|---|---|---|"]
    for (rate, name), rows in cells.items():
        cpu = statistics.median(r[0] for r in rows)
        before = statistics.median(r[0] for r in cells[(rate, base)])
        lines.append(f"| {rate:g}/s | {name} | {cpu:.2f} | {statistics.median(r[1] for r in rows):.1f} / "
                     f"{statistics.median(r[2] for r in rows):.1f} | {cpu / before:.2f}x |")
    lines.append(f"\nCommand: `python -m bench.overhead_ab {' '.join(sys.argv[1:] if argv is None else argv)}`")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
