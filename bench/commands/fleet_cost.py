"""The gateway's CPU as the fleet grows and as prompts grow: ms a request, and idle share of a core.

Black box: the gateway (``prefix-router serve``, one worker, no tokenizer, the configuration's
defaults: prefix affinity, health probes every 2 s, ``/metrics`` scraped every 1 s and every
10 s while a replica is idle, ``/v1/models`` read every 10 s) runs in front of fake replicas,
``--replicas`` of them (4 and 256) in one separate
process (``bench/fake_fleet.py``: one event loop, a socket each, answering at once in the
simulator's shapes, so that 256 fit on 2 cores: about a third of a core, idle, answering the
scrapes). One gateway and one fleet per fleet size, all started together; nothing pinned; what
other processes ran on the machine meanwhile is stated (``/proc/stat``).

Requests: ``POST /v1/completions`` of token ids, ``max_tokens`` 1, non-streaming: a prefix of
``--shared-tokens`` ids (32,768, then 896) shared by every request of a cell, then
``--own-tokens`` (128) random ids of its own, so 32,896 and 1,024 tokens; ``--concurrency``
(8) at a time from this process's aiohttp client. A cell is one fleet size and one prompt
size: ``--warmup`` (20) requests, then ``--requests`` (400) timed; the gateway's CPU (user +
system, ``/proc/PID/stat``) from just before the timed requests to just after, divided by them,
is its CPU ms a request. The cells run in turn, ``--reps`` (3) times; the table gives medians
and each repetition, and the same less the gateway's idle rate over the cell's seconds (the
probes and scrapes that run under load too). After each cell, the replicas holding the largest
prefix in the gateway's own picture (``/replicas``): the load bounds spread a hot prefix over
more replicas as a run goes on, and the match's cost grows with them.

Idle: once every replica is on its gateway's ring and ``--settle-seconds`` (10) have passed,
each gateway's CPU over ``--idle-seconds`` (30) with no requests, as % of one core: the cost of
its health probes, scrapes and other pollers. The ratios the issue sets goals for follow, and
last each background task alone at the largest fleet (``bench/background.py``): its CPU, and the
fleet size at which it would take a tenth of a core.

The floor: the same cells (in turn with the gateway's) for ``bench/floor_proxy.py``, an aiohttp
proxy that forwards the same bytes to the smallest fleet's first replica and reads none of them:
what moving a prompt's bytes through one aiohttp process costs, whatever it does with them.

    python -m bench fleet-cost [--replicas 4,256] [--shared-tokens 32768,896] [--requests 400] [--reps 3]

Writes bench/results/fleet-cost/ (README.md and results.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import time
import urllib.request
from pathlib import Path

import aiohttp

from prefix_router.config import load_config
from prefix_router.tools.launch import gateway_server, running
from prefix_router.tools.replay.summary import percentile

from .. import CACHE, RESULTS, background
from ..fake_fleet import MODEL, started
from ..meters import cpu_seconds
from ..systems import Floor
from ..report import command_line, write_results

VOCAB = 128_000  # token ids drawn below this (Llama 3's vocabulary)
GOALS = {"fleet": 1.5, "prompt": 3.0, "idle_pct": 10.0}  # the issue's


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench fleet-cost", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--replicas", type=_ints, default="4,256", help="fleet sizes, comma-separated")
    parser.add_argument("--shared-tokens", type=_ints, default="32768,896",
                        help="prompt sizes: the shared prefix's tokens, comma-separated")
    parser.add_argument("--own-tokens", type=int, default=128, help="tokens of each request's own after the prefix")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--requests", type=int, default=400, help="timed requests a cell")
    parser.add_argument("--warmup", type=int, default=20, help="requests before each cell's timed ones")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every cell, in turn")
    parser.add_argument("--settle-seconds", type=float, default=10.0, help="wait after the fleet is on the ring")
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="idle CPU measured over this long")
    parser.add_argument("--background-seconds", type=float, default=20.0,
                        help="each background task alone at the largest fleet, measured over this long (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "fleet-cost")
    return parser.parse_args(argv)


class Prompts:
    """Request bodies: a shared prefix of ``shared`` ids, then ``own`` random ids of each body's own."""

    def __init__(self, shared: int, own: int, rng: random.Random) -> None:
        self.shared, self.own, self.rng = shared, own, rng
        self.prefix = ",".join(str(rng.randrange(VOCAB)) for _ in range(shared))
        self.tokens = shared + own

    def body(self) -> bytes:
        own = ",".join(str(self.rng.randrange(VOCAB)) for _ in range(self.own))
        prompt = ",".join(p for p in (self.prefix, own) if p)
        return (f'{{"model":"{MODEL}","prompt":[{prompt}],"max_tokens":1,"stream":false}}').encode()


async def send(url: str, bodies: list[bytes], tokens: int, concurrency: int) -> dict:
    """POST ``bodies`` to ``url``'s /v1/completions, ``concurrency`` at a time; a 200 whose
    ``usage.prompt_tokens`` is not ``tokens`` counts as an error."""
    latencies, errors = [], []
    pending = iter(bodies)
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def worker() -> None:
            for body in pending:
                started_ = time.perf_counter()
                try:
                    async with http.post(url + "/v1/completions", data=body, headers=headers) as resp:
                        answer = await resp.read()
                    if resp.status != 200:
                        errors.append(f"HTTP {resp.status}: {answer[:200]!r}")
                    elif (got := json.loads(answer)["usage"]["prompt_tokens"]) != tokens:
                        errors.append(f"usage.prompt_tokens {got}, sent {tokens}")
                    else:
                        latencies.append(time.perf_counter() - started_)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
    return {"elapsed_s": elapsed, "errors": len(errors), "first_error": errors[0] if errors else None,
            "latency_p50_ms": 1e3 * percentile(latencies, 50) if latencies else None}


def run_cell(gateway: dict, prompts: Prompts, args: argparse.Namespace) -> dict:
    """Warm-up, then the timed requests with the gateway's CPU read around them."""
    asyncio.run(send(gateway["url"], [prompts.body() for _ in range(args.warmup)], prompts.tokens, args.concurrency))
    bodies = [prompts.body() for _ in range(args.requests)]
    cpu0 = cpu_seconds(gateway["pid"])
    sent = asyncio.run(send(gateway["url"], bodies, prompts.tokens, args.concurrency))
    cpu = cpu_seconds(gateway["pid"]) - cpu0
    if gateway.get("floor"):
        return {"floor": True, "replicas": gateway["replicas"], "tokens": prompts.tokens, "requests": args.requests,
                "cpu_s": round(cpu, 3), "cpu_ms": 1e3 * cpu / args.requests,
                "requests_per_s": args.requests / sent["elapsed_s"], **sent}
    return {"replicas": gateway["replicas"], "tokens": prompts.tokens, "shared": prompts.shared, "own": prompts.own,
            "requests": args.requests, "cpu_s": round(cpu, 3), "cpu_ms": 1e3 * cpu / args.requests,
            "requests_per_s": args.requests / sent["elapsed_s"], **sent,
            "holders": holders(gateway["url"], max(args.shared_tokens))}


def holders(url: str, tokens: int) -> int:
    """The replicas to which the gateway's picture (its ``/replicas`` view) gives at least the
    blocks of a ``tokens``-token prefix: about those holding the largest shared prefix."""
    view = json.loads(urllib.request.urlopen(url + "/replicas", timeout=30).read())
    blocks = tokens // (view["block_size"] or 16)
    return sum(r["shadow_blocks"] >= blocks for r in view["replicas"])


def wait_on_ring(url: str, n: int, timeout_s: float = 120.0) -> None:
    """Until the gateway at ``url`` has all ``n`` replicas routable (its ``/replicas`` view)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = json.loads(urllib.request.urlopen(url + "/replicas", timeout=10).read())
        if sum(r["routable"] for r in view["replicas"]) == n:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not all {n} replicas on the ring after {timeout_s:.0f} s")


@contextlib.contextmanager
def systems(sizes: list[int], log_dir: Path):
    """A fake fleet and a gateway (its replicas listed in a config file) per fleet size, and the
    floor proxy in front of the smallest, all running; yields one dict per system: replicas, url,
    pid, fleet_pid, config, and ``floor`` True for the floor."""
    with contextlib.ExitStack() as stack:
        out = []
        for n in sizes:
            urls, fleet_pid = stack.enter_context(started(n, log_dir))
            config = log_dir / f"gateway-{n}.yaml"
            config.write_text(json.dumps({"replicas": urls}) + "\n")  # YAML
            server = gateway_server(log_dir, [], ["--config", str(config)])
            (url,) = stack.enter_context(running([server]))
            out.append({"replicas": n, "url": url, "pid": server.pid, "fleet_pid": fleet_pid, "config": config})
            if n == min(sizes):
                floor = Floor().server(urls, log_dir)
                (floor_url,) = stack.enter_context(running([floor]))
                out.append({"replicas": n, "url": floor_url, "pid": floor.pid, "fleet_pid": fleet_pid,
                            "config": config, "floor": True})
        for s in out:
            if not s.get("floor"):
                wait_on_ring(s["url"], s["replicas"])
        yield out


def snapshot(gateways: list[dict]) -> tuple[float, float, float]:
    """(now, CPU seconds the machine has been busy on all its cores (``/proc/stat``), CPU seconds
    of this benchmark's processes: the gateways, the fleets and this one)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
    ours = sum(map(cpu_seconds, {g[k] for g in gateways for k in ("pid", "fleet_pid")})) + sum(os.times()[:2])
    return time.monotonic(), busy, ours


def elsewhere(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """What other processes on the machine ran between two snapshots, % of one core on average."""
    return 100 * ((after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0])


def measure_idle(gateways: list[dict], seconds: float) -> tuple[list[dict], float]:
    """Each gateway's and its fleet's CPU over ``seconds`` of no requests, % of one core; and
    what other processes ran meanwhile, % of one core."""
    pids = [(g["pid"], g["fleet_pid"]) for g in gateways]
    machine0 = snapshot(gateways)
    before = [(cpu_seconds(a), cpu_seconds(b)) for a, b in pids]
    began = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - began
    after = [(cpu_seconds(a), cpu_seconds(b)) for a, b in pids]
    return [{"replicas": g["replicas"], "seconds": round(wall, 1), "gateway_pct": 100 * (a1 - a0) / wall,
             "fleet_pct": 100 * (b1 - b0) / wall} for g, (a0, b0), (a1, b1) in zip(gateways, before, after)], \
        elsewhere(machine0, snapshot(gateways))


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report_lines(cells: list[dict], idle: list[dict], facts: dict, args) -> list[str]:
    floors = [c for c in cells if c.get("floor")]
    cells = [c for c in cells if not c.get("floor")]
    idle_of = {i["replicas"]: i["gateway_pct"] for i in idle}
    for c in cells:  # less the gateway's idle rate over the cell's seconds
        c["net_cpu_ms"] = c["cpu_ms"] - 1e3 * idle_of[c["replicas"]] / 100 * c["elapsed_s"] / c["requests"]
    keys = list(dict.fromkeys((c["replicas"], c["tokens"]) for c in cells))
    by = {k: [c for c in cells if (c["replicas"], c["tokens"]) == k] for k in keys}
    lines = [f"The gateway ({facts['gateway']}) in front of fake replicas in one process (`bench/fake_fleet.py`); "
             f"`POST /v1/completions` of token ids, `max_tokens` 1, non-streaming, {args.concurrency} at a time "
             f"from the benchmark's aiohttp client; each cell {args.warmup} requests of warm-up, then "
             f"{args.requests:,} timed; the gateway's CPU (user + system, `/proc/PID/stat`) over the timed "
             f"requests divided by them (the kernel counts it in ticks of 10 ms); medians of {args.reps} "
             "repetitions, the cells in turn. Less idle: "
             "the same less the gateway's idle rate over the cell's seconds. Holding: the replicas to which the "
             "gateway's own picture (`/replicas`, `shadow_blocks`) gives at least the largest prefix's blocks, the "
             "copies of the hot prefix the load bounds have spread. Nothing pinned; every gateway and fleet ran "
             "at once.", "",
             f"| replicas | prompt tokens (shared + own) | gateway CPU ms / request | each repetition | less idle "
             f"| requests/s | latency p50 (ms) | errors | replicas holding {max(args.shared_tokens):,} tokens' blocks "
             "after each repetition |", "|---" * 9 + "|"]
    for (n, tokens), rows in by.items():
        lines.append(f"| {n} | {tokens:,} ({rows[0]['shared']:,} + {rows[0]['own']}) | {_median(rows, 'cpu_ms'):.2f} "
                     f"| {', '.join(format(r['cpu_ms'], '.2f') for r in rows)} | {_median(rows, 'net_cpu_ms'):.2f} "
                     f"| {_median(rows, 'requests_per_s'):.0f} | {_median(rows, 'latency_p50_ms'):.1f} "
                     f"| {sum(r['errors'] for r in rows)} | {', '.join(str(r['holders']) for r in rows)} |")
    lines += ["", f"Idle, {idle[0]['seconds']:g} s with no requests, {args.settle_seconds:g} s after every replica "
              "was on the ring (all gateways idle together):", "",
              "| replicas | gateway, % of one core | the fake fleet's process, % of one core |", "|---|---|---|"]
    lines += [f"| {i['replicas']} | {i['gateway_pct']:.1f}% | {i['fleet_pct']:.1f}% |" for i in idle]
    lines += ["", "The ratios the issue sets goals for:", "", "| ratio | measured | less idle | goal |",
              "|---|---|---|---|"]
    for text, value, net, goal in ratios(by, idle_of):
        lines.append(f"| {text} | {value} | {net} | {goal} |")
    if floors:
        sizes = sorted({c["tokens"] for c in floors})
        median = {t: _median([c for c in floors if c["tokens"] == t], "cpu_ms") for t in sizes}
        lines += ["", "The floor beside it, in the same turns: `bench/floor_proxy.py` forwarding the same requests to "
                  "one replica of the smallest fleet, reading none of their bytes:", "",
                  "| prompt tokens | floor CPU ms / request | each repetition |", "|---|---|---|"]
        for t in sizes:
            each = ", ".join(format(c["cpu_ms"], ".2f") for c in floors if c["tokens"] == t)
            lines.append(f"| {t:,} | {median[t]:.2f} | {each} |")
        if len(sizes) > 1 and median[sizes[0]] > 0:
            ratio = median[sizes[-1]] / median[sizes[0]]
            lines += ["", f"The floor's {sizes[-1]:,} / {sizes[0]:,} tokens: {ratio:.2f}x."]
    if "elsewhere_idle_pct" in facts:
        lines += ["", f"Other processes on the machine (all its busy CPU in `/proc/stat` less this benchmark's "
                  f"processes'): {max(facts['elsewhere_idle_pct'], 0):.0f}% of one core on average while idle, "
                  f"{max(facts['elsewhere_cells_pct'], 0):.0f}% during the cells."]
    first = next((c["first_error"] for c in cells if c["first_error"]), None)
    return lines + ([f"\nFirst error: `{first}`"] if first else [])


def ratios(by: dict, idle_of: dict) -> list[tuple[str, str, str, str]]:
    """(what, measured, less idle, goal): the largest fleet over the smallest on the largest
    prompts, the largest prompts over the smallest at each fleet size, idle at the largest fleet."""
    sizes = sorted({n for n, _ in by})
    prompts = sorted({t for _, t in by})
    small, large = sizes[0], sizes[-1]

    def ratio(a, b, key):
        below = _median(by[b], key)
        return f"{_median(by[a], key) / below:.2f}x" if below > 0 else "-"  # under a tick of CPU: no ratio
    out = []
    if large != small:
        top = prompts[-1]
        out.append((f"{large} / {small} replicas, {top:,}-token prompts", ratio((large, top), (small, top), "cpu_ms"),
                     ratio((large, top), (small, top), "net_cpu_ms"), f"at most {GOALS['fleet']:g}x"))
    if len(prompts) > 1:
        for n in sizes:
            a, b = (n, prompts[-1]), (n, prompts[0])
            out.append((f"{prompts[-1]:,} / {prompts[0]:,} tokens, {n} replicas", ratio(a, b, "cpu_ms"),
                        ratio(a, b, "net_cpu_ms"), f"at most {GOALS['prompt']:g}x"))
    out.append((f"idle, {large} replicas: % of one core", f"{idle_of[large]:.1f}%", "-",
                f"at most {GOALS['idle_pct']:g}%"))
    return out


def gateway_facts(config_path: Path) -> dict:
    """What the gateway ran with, read back from its configuration file as it loads it."""
    c = load_config(config_path)
    text = (f"`prefix-router serve --config` listing the replicas, policy {c.routing.policy}, "
            f"{'a tokenizer' if c.tokenizer else 'no tokenizer'}, {c.workers} worker; health probes every "
            f"{c.health.interval_s:g} s (timeout {c.health.timeout_s:g} s), `/metrics` scraped every "
            f"{c.scrape.interval_s:g} s (a replica idle at its last scrape every {c.scrape.idle_interval_s:g} s), "
            f"`/v1/models` read every {c.scrape.models_interval_s:g} s, KV events "
            + ("on (the fakes publish none)" if c.kv_events.enabled else "off"))
    return {"gateway": text, "policy": c.routing.policy, "workers": c.workers, "health_interval_s": c.health.interval_s,
            "health_timeout_s": c.health.timeout_s, "scrape_interval_s": c.scrape.interval_s,
            "idle_scrape_interval_s": c.scrape.idle_interval_s, "models_interval_s": c.scrape.models_interval_s,
            "kv_events": c.kv_events.enabled}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = CACHE / "bench-fleet-cost"
    log_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    prompts = [Prompts(shared, args.own_tokens, rng) for shared in args.shared_tokens]
    cells: list[dict] = []
    with systems(args.replicas, log_dir) as gateways:
        facts = gateway_facts(gateways[0]["config"])
        print(f"{len(gateways) - 1} gateways and the floor up; settling {args.settle_seconds:g} s, then idle for "
              f"{args.idle_seconds:g} s", flush=True)
        time.sleep(args.settle_seconds)
        idle, facts["elsewhere_idle_pct"] = measure_idle([g for g in gateways if not g.get("floor")],
                                                         args.idle_seconds)
        machine0 = snapshot(gateways)
        for rep in range(args.reps):
            for p in prompts:
                for g in gateways:
                    cells.append({"rep": rep, **run_cell(g, p, args)})
                    c = cells[-1]
                    who = "the floor" if c.get("floor") else f"{c['replicas']} replicas"
                    print(f"rep {rep}: {who}, {c['tokens']:,} tokens: {c['cpu_ms']:.2f} ms CPU a "
                          f"request, {c['requests_per_s']:.0f}/s, {c['errors']} errors", flush=True)
        facts["elsewhere_cells_pct"] = elsewhere(machine0, snapshot(gateways))
        largest = max((g for g in gateways if not g.get("floor")), key=lambda g: g["replicas"])
        urls = json.loads(largest["config"].read_text())["replicas"]
        tasks = (background.measure(urls, log_dir, wait_on_ring, args.background_seconds)
                 if args.background_seconds > 0 else [])
    lines = report_lines(cells, idle, facts, args)
    if tasks:
        lines += background.lines(tasks, len(urls), args.background_seconds)
    write_results(args.out, "The gateway's CPU as the fleet and the prompts grow", command_line(__name__, argv), lines,
                  {"gateway": facts, "idle": idle, "cells": cells, "background": tasks})
    return 0 if not any(c["errors"] for c in cells) else 1
