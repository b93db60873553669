"""CPU per request under a C load generator: ``wrk`` (Debian package) in front of this gateway, the
floor of an aiohttp hop and vllm-router ``consistent_hash``, side by side in one run.

The Python client of ``bench/overhead.py`` sends at fixed rates and measures added TTFT; this one
takes the client's own cost out of the picture: ``wrk`` (one thread, ``--connections`` kept
busy, closed loop) sends ~N-token streaming chats, each body the next turn of one of many
conversations (``bench.gateway_overhead.conversations``, cycled when the run outlasts them; one
body in four opens a conversation, ``staggered``), to one simulated replica at 10,000x behind
each system. Each system runs alone on the last core (``taskset``), the replica and ``wrk`` on
the others, so the router's CPU seconds (``/proc``) per completed request and its saturation
throughput are its own. The systems alternate within
every repetition, so the machine's noise falls on all of them alike. This gateway runs twice: on
that conversation mix, and on the same bodies with every first turn first (only new prompts: the
tokenizer's prefix cache never helps); and a third time on the mix without a tokenizer (routing
on 64-character blocks, as a gateway started without ``--tokenizer`` does): what exact token
blocks cost.

    python -m bench.overhead_wrk [--tokens 1000] [--connections 8] [--seconds 10] [--reps 2] [--workers 2]

``--workers N`` adds this gateway with ``--workers 1`` and ``--workers N``, nothing pinned (N
processes need N cores, and the replica and ``wrk`` then share them), CPU counted over each
gateway's process tree, and states the saturation ratio of the two.

Prints one line per cell and writes ``--out`` (markdown, medians over the repetitions).
Raises ``SystemExit`` when ``wrk`` is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from prefix_router.tools.launch import running, sim_server

from .fleet import ROOT, pinned, tiny_tokenizer, write_report
from .gateway_overhead import MODEL, conversations, staggered
from .overhead_ab import FLOOR, PEER, _floor_server
from .peers import System, cpu_seconds, ensure_peers

GATEWAY = "prefix-router"
FIRST_TURNS = "prefix-router, first turns only"
CHARS = "prefix-router, no tokenizer"
# wrk's Lua: each request the next body of the file (one JSON object a line), in turn
_SCRIPT = """
local bodies = {}
for line in io.lines("%s") do bodies[#bodies + 1] = line end
local i = 0
init = function(args) i = tonumber(args[1]) or 0 end  -- where this run starts in the file
local headers = {["Content-Type"] = "application/json"}
request = function()
  i = i %% #bodies + 1
  return wrk.format("POST", "/v1/chat/completions", headers, bodies[i])
end
"""


def parse_wrk(out: str) -> tuple[int, float, str]:
    """(requests completed, requests/s, latency p50 as wrk prints it) from the output of
    ``wrk --latency``. Raises ValueError when the output has no such figures or reports
    non-2xx answers or socket errors."""
    done = re.search(r"(\d+) requests in", out)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"^\s+50%\s+(\S+)$", out, re.MULTILINE)
    if not done or not rate or not p50 or "Non-2xx" in out or "Socket errors" in out:
        raise ValueError(f"wrk: no clean run:\n{out}")
    return int(done.group(1)), float(rate.group(1)), p50.group(1)


def wrk_run(url: str, script: Path, connections: int, seconds: float, cpus: str | None,
            start: int = 0) -> tuple[int, float, str]:
    """``parse_wrk`` of one closed-loop ``wrk`` run whose first request is body ``start + 1``
    of the script's file. Raises ValueError for a run with errors (``parse_wrk``),
    ``subprocess.CalledProcessError`` when wrk fails."""
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", str(script), url, "--", str(start)]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    return parse_wrk(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=seconds + 60).stdout)


def tree_cpu_seconds(pid: int) -> float:
    """``cpu_seconds`` of ``pid`` and its live descendants (a ``--workers`` gateway's workers),
    found through ``/proc/PID/task/TID/children``."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            total += cpu_seconds(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # exited meanwhile
            continue
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000, help="prompt size of the chats")
    parser.add_argument("--connections", type=int, default=8, help="wrk's connections, each kept busy")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of load per cell")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of every cell")
    parser.add_argument("--workers", type=int, default=0, help="also --workers 1 against --workers N, unpinned")
    parser.add_argument("--bodies", type=int, default=32_768,
                        help="distinct request bodies (4 turns of a quarter as many conversations)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "overhead-wrk.md")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (Debian: apt-get install wrk)")
    log_dir = ROOT / ".cache" / "bench-overhead-wrk"
    log_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(traces=True)
    # 4 turns of each conversation: every body ~N tokens, the first turn of each unseen, later
    # turns extending it (the incremental path); none repeats until ``--bodies`` have gone.
    # Two orders of the same bodies: a conversation mix (``staggered``: one body in four opens a
    # conversation with a system prompt of its own) and every conversation's first turn first
    # (a run of ~10,000 requests then meets only new ~N-token prompts: the worst case)
    count = max(args.bodies // 4, 1)
    # one JSON line a body, turn t of conversation c at t x count + c: every first turn first
    lines = [json.dumps({"model": MODEL, "messages": messages, "max_tokens": 8, "stream": True}) + "\n"
             for messages in conversations(args.tokens, count, 4)]
    scripts = {}
    for order, at in (("mix", [t * count + c for c, t in staggered(count, 4)]), ("first", range(len(lines)))):
        bodies = log_dir / f"bodies-{args.tokens}-{order}.jsonl"
        bodies.write_text("".join(lines[i] for i in at))
        scripts[order] = log_dir / f"bodies-{order}.lua"
        scripts[order].write_text(_SCRIPT % bodies)
    cores = os.cpu_count() or 1
    router_cpu, others = (str(cores - 1), "0" if cores == 2 else f"0-{cores - 2}") if cores >= 2 else (None, None)
    peers = ensure_peers()
    cells: dict[str, list[tuple[float, float, str]]] = {}
    cycled = first_ran_out = False
    sim = pinned(sim_server(log_dir, ["--model", "sim", "--time-scale", "10000", "--tokenizer", str(tokenizer)]),
                  others)
    with running([sim]) as (replica,):
        aliases = [replica, replica.replace("127.0.0.1", "localhost")]
        names = [GATEWAY, FIRST_TURNS, CHARS, FLOOR, PEER.name]
        if args.workers > 1:
            names += [f"{GATEWAY} --workers 1, unpinned", f"{GATEWAY} --workers {args.workers}, unpinned"]
        for _ in range(args.reps):
            for name in names:
                pin, load_cpus = (None, None) if "--workers" in name else (router_cpu, others)
                if "--workers" in name:
                    workers = name.split("--workers ")[1].split(",")[0]
                    server = System(name, "prefix-router", "prefix-affinity").server(
                        aliases, log_dir, None, ("--tokenizer", str(tokenizer), "--workers", workers))
                elif name == FLOOR:
                    server = _floor_server(replica, log_dir)
                elif name in (GATEWAY, FIRST_TURNS, CHARS):
                    server = System(name, "prefix-router", "prefix-affinity").server(
                        aliases, log_dir, None, () if name == CHARS else ("--tokenizer", str(tokenizer)))
                else:
                    server = PEER.server(aliases, log_dir, peers)
                server = pinned(server, pin)
                script = scripts["first" if name == FIRST_TURNS else "mix"]
                with running([server]) as (url,):
                    warm, _, _ = wrk_run(url, script, args.connections, 2.0, load_cpus)  # connections, the loop
                    cpu0 = tree_cpu_seconds(server.pid)
                    done, rate, p50 = wrk_run(url, script, args.connections, args.seconds, load_cpus, start=warm)
                    cpu = tree_cpu_seconds(server.pid) - cpu0
                # a repeated body is cheaper only where something remembers bodies: this gateway's
                # tokenizer cache; the floor and vllm-router keep nothing of them
                cycled |= name not in (FLOOR, PEER.name) and warm + done > args.bodies
                first_ran_out |= name == FIRST_TURNS and warm + done > count
                row = (1000 * cpu / done, rate, p50)
                cells.setdefault(name, []).append(row)
                print(f"{args.tokens} tokens, wrk {args.connections} connections, {name}: CPU {row[0]:.2f} ms/request, "
                      f"{rate:.0f} requests/s, latency p50 {p50}", flush=True)
    base = statistics.median(r[0] for r in cells[PEER.name])
    cpus = f"CPUs {others}" if others and "-" in others else f"CPU {others}"
    where = (f"the router on CPU {router_cpu}, the replica and wrk on {cpus} (taskset)" if router_cpu
             else "nothing pinned (one core)")
    lines = [f"~{args.tokens}-token streaming chats through each system to one simulated replica at 10,000x; wrk, "
             f"one thread, {args.connections} connections, {args.seconds:g} s a cell after 2 s of warm-up, medians of "
             f"{args.reps}; {where}; "
             + ("this gateway's bodies ran out and repeated (raise --bodies)." if cycled else
                f"no body sent twice to one gateway ({args.bodies:,} distinct)."),
             "", f"Each conversation has 4 turns; each body is the next turn of one, one in four opening a "
             f"conversation with a ~{args.tokens}-token system prompt of its own (`staggered`), except in "
             f"`{FIRST_TURNS}`: the same bodies with every first turn first, so a run meets only prompts "
             "it has never seen" + (f" (not so here: its runs outlasted the {count:,} first turns; raise --bodies)."
                                    if first_ran_out else ".") + f" `{CHARS}`: the mix, routed on 64-character blocks.",
             "", f"| system | CPU ms / request | requests/s | wrk latency p50 | CPU vs {PEER.name} |", "|---|---|---|---|---|"]
    for name, rows in cells.items():
        cpu = statistics.median(r[0] for r in rows)
        lines.append(f"| {name} | {cpu:.2f} | {statistics.median(r[1] for r in rows):.0f} | "
                     f"{rows[len(rows) // 2][2]} | {cpu / base:.2f}x |")
    if args.workers > 1:
        one, many = (statistics.median(r[1] for r in cells[n]) for n in names[-2:])
        lines.append(f"\nSaturation, --workers {args.workers} over --workers 1 (nothing pinned): {many / one:.2f}x "
                     f"({many:.0f} against {one:.0f} requests/s).")
    lines.append(f"\nCommand: `python -m bench.overhead_wrk {' '.join(sys.argv[1:] if argv is None else argv)}`")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
