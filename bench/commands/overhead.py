"""The cost of the hop: CPU a request and added TTFT, this gateway beside the aiohttp floor and the peers.

One simulated replica 10,000x faster than modelled time, ~N-token streaming chats in 4-turn
conversations (``workloads.chat_mix``), and each system in front of it in turn (``bench/hop.py``).
The drivers (``--drivers``, comma-separated; the default reproduces the README's figures):

- ``wrk``: ``wrk`` at saturation, each system alone on the last core: CPU ms a completed request,
  requests/s. ``--workers N`` adds this gateway with ``--workers 1`` and ``--workers N``,
  unpinned (N processes need N cores), and states the saturation ratio of the two.
- ``rates``: the Python client at fixed ``--rates``: CPU ms a request, and the TTFT and latency
  added over sending straight to the replica.
- ``profile``: py-spy on each tree's gateway at ``--profile-rate``: where the CPU goes, as CPU ms
  a request per part (``meters.PARTS``; parts nest and overlap).
- ``decision``: the routing decision (template, incremental tokenization, hashes, choice) timed
  in-process, this tree's code only, against a full tokenization of the same prompt.

Systems (``--systems``, comma-separated; default per driver below): ``gateway`` (each
``--tree``'s gateway, with the tiny tokenizer), ``no-tokenizer`` (the same on 64-character
blocks), ``first-turns`` (the same bodies with every first turn first: only new prompts),
``floor`` (``bench/floor_proxy.py``), ``vllm-router`` (its ``consistent_hash``), ``epp-buffered``
and ``epp-duplex`` (``prefix-router epp`` behind Envoy; Envoy's CPU in its own column), or a
name of ``compare``'s systems. ``--tree [LABEL=]PATH`` (repeat) runs the gateway of another
source tree (a ``git worktree`` of another commit) beside this one's:

    git worktree add --detach ../before 8da9842
    python -m bench overhead --tree before=../before --tree . --drivers rates --reps 3

Writes ``--out`` (``bench/results/overhead``): README.md (medians over the repetitions) and
results.json (every cell).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

from .. import CACHE, RESULTS, ROOT
from ..drivers import decision_times
from ..hop import Entry, profile, rates_sweep, wrk_sweep
from ..meters import PARTS, REST, active, parse_raw, shares, top_frames
from ..report import command_line, commit_of, write_results
from ..systems import SYSTEMS, Floor, Gateway, Picker, System, tiny_tokenizer, with_gateway_args
from ..workloads import chat_mix

DRIVERS = ("wrk", "rates", "profile", "decision")
DEFAULT_SYSTEMS = {"wrk": "gateway,first-turns,no-tokenizer,floor,vllm-router", "rates": "gateway,floor,vllm-router"}
PEER = "vllm-router consistent_hash"  # the peer every table is read against
DECISION_REQUESTS = 1000  # bodies timed in-process per prompt size


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench overhead", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--drivers", default="wrk,rates", help=f"comma-separated, of {','.join(DRIVERS)}")
    parser.add_argument("--tokens", default="1000", help="prompt sizes, comma-separated: a section each")
    parser.add_argument("--systems", help="comma-separated (see above); default: "
                        + "; ".join(f"{d}: {s}" for d, s in DEFAULT_SYSTEMS.items()))
    parser.add_argument("--tree", action="append", help="[LABEL=]PATH of a gateway's source tree (repeat; "
                        "default: this clone, labelled prefix-router)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of every cell (rates, wrk)")
    parser.add_argument("--rates", default="50,100,150,200", help="rates: requests per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=12.0, help="rates: seconds of load per cell")
    parser.add_argument("--connections", type=int, default=8, help="wrk: connections, each kept busy")
    parser.add_argument("--wrk-seconds", type=float, default=10.0, help="wrk: seconds of load per cell")
    parser.add_argument("--bodies", type=int, default=32_768,
                        help="wrk: distinct bodies (4 turns of a quarter as many conversations)")
    parser.add_argument("--workers", type=int, default=0, help="wrk: also --workers 1 against --workers N, unpinned")
    parser.add_argument("--profile-rate", type=float, default=80.0, help="profile: requests per second")
    parser.add_argument("--profile-seconds", type=float, default=20.0, help="profile: seconds sampled")
    parser.add_argument("--envoy", default=shutil.which("envoy") or str(Path(sys.executable).with_name("envoy")),
                        help="epp-*: Envoy's binary")
    parser.add_argument("--out", type=Path, default=RESULTS / "overhead")
    args = parser.parse_args(argv)
    args.driver_list = [d.strip() for d in args.drivers.split(",") if d.strip()]
    if bad := [d for d in args.driver_list if d not in DRIVERS]:
        parser.error(f"unknown drivers {bad}; choose from {list(DRIVERS)}")
    if "wrk" in args.driver_list and shutil.which("wrk") is None:
        parser.error("wrk is not installed (Debian: apt-get install wrk)")
    args.token_list = [int(t) for t in args.tokens.split(",")]
    args.rate_list = [float(r) for r in args.rates.split(",")]
    args.trees = [tree(t) for t in (args.tree or [str(ROOT)])]
    for driver in ("wrk", "rates"):  # refuse an unknown name before anything runs
        entries(names(args, driver), args.trees, Path("tokenizer"), args.workers if driver == "wrk" else 0,
                args.envoy, parser.error)
    return args


def tree(spec: str) -> Gateway:
    """The gateway of ``[LABEL=]PATH``: labelled ``prefix-router`` for this clone, else its commit."""
    label, _, path = spec.rpartition("=")
    folder = Path(path).resolve()
    return Gateway(label or ("prefix-router" if folder == ROOT else commit_of(folder)), tree=folder)


def names(args: argparse.Namespace, driver: str) -> list[str]:
    return [n.strip() for n in (args.systems or DEFAULT_SYSTEMS[driver]).split(",") if n.strip()]


def entries(wanted: list[str], trees: list[Gateway], tokenizer: Path, workers: int, envoy: str,
            error=None) -> list[Entry]:
    """The rows for the system names ``wanted``, each tree's gateway where a name means it, then
    the ``--workers`` pair. ``error`` is called with a message for an unknown name."""
    tok = ("--tokenizer", str(tokenizer))
    known: dict[str, System] = {s.name: s for s in SYSTEMS}
    out = []
    for name in wanted:
        if name == "gateway":
            out += [Entry(g.name, with_gateway_args(g, tok)) for g in trees]
        elif name == "no-tokenizer":
            out += [Entry(f"{g.name}, no tokenizer", g) for g in trees]
        elif name == "first-turns":
            out += [Entry(f"{g.name}, first turns only", with_gateway_args(g, tok), first_turns_first=True)
                    for g in trees]
        elif name == "floor":
            out.append(Entry(Floor().name, Floor()))
        elif name in ("epp-buffered", "epp-duplex"):
            picker = Picker(mode=name.split("-")[1], args=tok, envoy=envoy)
            out.append(Entry(picker.name, picker))
        elif name in known or name == "vllm-router":
            system = with_gateway_args(known[PEER if name == "vllm-router" else name], tok)
            out.append(Entry(system.name, system))
        elif error:
            error(f"unknown system {name!r}; choose from gateway, no-tokenizer, first-turns, floor, vllm-router, "
                  f"epp-buffered, epp-duplex, {', '.join(known)}")
    for g in trees if workers > 1 else ():
        out += [Entry(f"{g.name} --workers {n}, unpinned", with_gateway_args(g, tok + ("--workers", str(n))),
                      unpinned=True) for n in (1, workers)]
    return out


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def base_of(labels: list[str], trees: list[Gateway]) -> str | None:
    """What the CPU ratios divide by: the first tree in an A/B of trees, else vllm-router."""
    if len(trees) > 1 and trees[0].name in labels:
        return trees[0].name
    return PEER if PEER in labels else None


def wrk_lines(rows: list[dict], facts: dict, args, trees: list[Gateway]) -> list[str]:
    """The wrk section: one row per system, medians over the repetitions."""
    by = {name: [r for r in rows if r["system"] == name] for name in dict.fromkeys(r["system"] for r in rows)}
    base = base_of(list(by), trees)
    envoy = any(r["proxy_cpu_ms"] is not None for r in rows)
    where = (f"the router on CPU {facts['router_cpu']}, the replica and wrk on CPUs {facts['other_cpus']} (taskset)"
             if facts["router_cpu"] else "nothing pinned (one core)")
    lines = [f"wrk, one thread, {args.connections} connections, {args.wrk_seconds:g} s a cell after 2 s of warm-up, "
             f"medians of {args.reps}; {where}; "
             + ("a gateway's bodies ran out and repeated (raise --bodies)." if facts["cycled"] else
                f"no body sent twice to one gateway ({facts['bodies']:,} distinct).")
             + (" The first-turns rows met later turns too (raise --bodies)." if facts["first_ran_out"] else ""), "",
             "| system | CPU ms / request | " + ("Envoy CPU ms / request | " if envoy else "")
             + "requests/s | wrk latency p50 |" + (f" CPU vs {base} |" if base else ""),
             "|---" * (4 + envoy + bool(base)) + "|"]
    for name, cells in by.items():
        cpu = median(cells, "cpu_ms")
        lines.append(f"| {name} | {cpu:.2f} | " + (f"{_fmt(median(cells, 'proxy_cpu_ms'))} | " if envoy else "")
                     + f"{median(cells, 'requests_per_s'):.0f} | {cells[len(cells) // 2]['latency_p50']} |"
                     + (f" {cpu / median(by[base], 'cpu_ms'):.2f}x |" if base else ""))
    workers = [n for n in by if "--workers" in n]
    if len(workers) == 2:
        one, many = (median(by[n], "requests_per_s") for n in workers)
        lines.append(f"\nSaturation, {workers[1].split(',')[0]} over --workers 1 (nothing pinned): {many / one:.2f}x "
                     f"({many:.0f} against {one:.0f} requests/s).")
    return lines


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def rates_lines(rows: list[dict], args, trees: list[Gateway]) -> list[str]:
    """The fixed-rate section: one row per rate and system, medians over the repetitions."""
    labels = list(dict.fromkeys(r["system"] for r in rows))
    base = base_of(labels, trees)
    envoy = any(r["proxy_cpu_ms"] is not None for r in rows)
    lines = [f"The Python client at fixed rates, {args.seconds:g} s a cell, medians of {args.reps}; added: through "
             "the system minus straight to the replica, in the same repetition.", "",
             "| rate | system | CPU ms / request | " + ("Envoy CPU ms / request | " if envoy else "")
             + "added TTFT p50 / p99 (ms) | added latency p50 / p99 (ms) | errors |"
             + (f" CPU vs {base} |" if base else ""),
             "|---" * (6 + envoy + bool(base)) + "|"]
    for rate in dict.fromkeys(r["rate"] for r in rows):
        at = {name: [r for r in rows if r["rate"] == rate and r["system"] == name] for name in labels}
        for name, cells in at.items():
            cpu = median(cells, "cpu_ms")
            cols = [f"{rate:g}/s", name, f"{cpu:.2f}"] + ([_fmt(median(cells, "proxy_cpu_ms"))] if envoy else [])
            cols += [f"{median(cells, f'added_{k}_p50_ms'):.1f} / {median(cells, f'added_{k}_p99_ms'):.1f}"
                     for k in ("ttft", "latency")]
            cols.append(str(sum(c["errors"] for c in cells)))
            cols += [f"{cpu / median(at[base], 'cpu_ms'):.2f}x"] if base else []
            lines.append("| " + " | ".join(cols) + " |")
    return lines


def summary_lines(tokens: int, wrk: list[dict], rates: list[dict]) -> list[str]:
    """The README's table: CPU ms a request per system (columns), under wrk and at each rate (rows)."""
    labels = list(dict.fromkeys(r["system"] for r in wrk + rates if "--workers" not in r["system"]))
    lines = [f"| CPU ms a request, ~{tokens:,} tokens | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    if wrk:
        cells = [[r for r in wrk if r["system"] == name] for name in labels]
        lines.append("| wrk, saturation | " + " | ".join(
            f"{median(c, 'cpu_ms'):.2f} ({median(c, 'requests_per_s'):,.0f}/s)" if c else "-" for c in cells) + " |")
    for rate in dict.fromkeys(r["rate"] for r in rates):
        cells = [[r for r in rates if r["system"] == name and r["rate"] == rate] for name in labels]
        lines.append(f"| {rate:g}/s | " + " | ".join(f"{median(c, 'cpu_ms'):.2f}" if c else "-" for c in cells) + " |")
    return lines


def profile_lines(columns: list[tuple[str, float, dict, list]], args) -> list[str]:
    """The py-spy section: each part as CPU ms a request (share of the samples at work), per tree."""
    lines = [f"py-spy (`--native -r 200 -f raw`, {args.profile_seconds:g} s) at {args.profile_rate:g}/s. Each part: "
             "its share of the samples at work (waits dropped), inclusive (nested parts overlap), times the CPU a "
             "request measured without py-spy; the socket writes' figure is an upper bound (`bench/meters.py`).", "",
             "| part: CPU ms a request (share of the samples at work) | " + " | ".join(c[0] for c in columns) + " |",
             "|---|" + "---|" * len(columns),
             "| the whole request | " + " | ".join(f"{c[1]:.2f}" for c in columns) + " |"]
    for part in [p for p, _ in PARTS] + [REST]:
        lines.append(f"| {part} | " + " | ".join(f"{c[1] * c[2][part]:.2f} ({100 * c[2][part]:.0f}%)"
                                                  for c in columns) + " |")
    for label, _, _, frames in columns:
        lines += ["", f"Innermost frames of {label} (self time, share of the samples at work):", ""]
        lines += [f"- {100 * share:.1f}% `{frame}`" for frame, share in frames]
    return lines


def run_profiles(args, tokens: int, tokenizer: Path, log_dir: Path) -> tuple[list, list[str]]:
    columns = []
    for gateway in args.trees:
        raw = log_dir / f"profile-{gateway.name}-{tokens}.txt"
        try:
            cpu = profile(with_gateway_args(gateway, ("--tokenizer", str(tokenizer))), rate=args.profile_rate,
                          seconds=args.profile_seconds, tokens=tokens, raw_out=raw, log_dir=log_dir, tokenizer=tokenizer)
        except RuntimeError as exc:
            raise SystemExit(f"overhead: {exc}") from None
        stacks = active(parse_raw(raw.read_text()))
        columns.append((gateway.name, cpu, shares(stacks), top_frames(stacks)))
        print(f"{gateway.name}: {cpu:.2f} ms CPU a request under py-spy's run", flush=True)
    data = [{"system": c[0], "tokens": tokens, "cpu_ms": c[1], "shares": c[2], "top_frames": c[3]} for c in columns]
    return data, profile_lines(columns, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = CACHE / "bench-overhead"
    log_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(traces=True)
    results: dict = {"rates": [], "wrk": [], "wrk_facts": [], "profile": [], "decision": []}
    lines = [f"This gateway ({', '.join(f'{g.name}: {commit_of(g.tree)}' for g in args.trees)}) and the systems "
             "beside it in front of one simulated replica at 10,000x, ~N-token streaming chats in 4-turn "
             "conversations (one request in four opens one with a system prompt of its own), 8 tokens out; "
             "CPU: the process's user and system time (`/proc/PID/stat`) over the requests (`bench/hop.py`)."]
    for tokens in args.token_list:
        sections: list[str] = []
        wrk, rates = [], []
        if "wrk" in args.driver_list:
            wrk, facts = wrk_sweep(entries(names(args, "wrk"), args.trees, tokenizer, args.workers, args.envoy),
                                   tokens=tokens, connections=args.connections, seconds=args.wrk_seconds,
                                   reps=args.reps, bodies=args.bodies, log_dir=log_dir, tokenizer=tokenizer)
            results["wrk"] += wrk
            results["wrk_facts"].append({"tokens": tokens, **facts})
            sections += ["", "### wrk at saturation", ""] + wrk_lines(wrk, facts, args, args.trees)
        if "rates" in args.driver_list:
            rates = rates_sweep(entries(names(args, "rates"), args.trees, tokenizer, 0, args.envoy),
                                rates=args.rate_list, reps=args.reps, seconds=args.seconds, tokens=tokens,
                                log_dir=log_dir, tokenizer=tokenizer)
            results["rates"] += rates
            sections += ["", "### Fixed rates", ""] + rates_lines(rates, args, args.trees)
        if "profile" in args.driver_list:
            data, text = run_profiles(args, tokens, tokenizer, log_dir)
            results["profile"] += data
            sections += ["", "### Where the CPU goes", ""] + text
        if "decision" in args.driver_list:
            row = {"tokens": tokens, **decision_times(chat_mix(tokens, DECISION_REQUESTS), tokenizer)}
            results["decision"].append(row)
            sections += ["", "### The routing decision in-process (this tree)", "",
                         f"{DECISION_REQUESTS:,} bodies in order: prompt tokens p50 {row['prompt_tokens_p50']:.0f}; "
                         f"analyze + select p50 {row['routing_p50_ms']:.2f} ms, p99 {row['routing_p99_ms']:.2f} ms; "
                         f"a full tokenization of the same prompt p50 {row['full_tokenization_p50_ms']:.2f} ms."]
        head = summary_lines(tokens, wrk, rates) if wrk or rates else []
        lines += ["", f"## ~{tokens:,}-token chats", ""] + head + sections
    write_results(args.out, "The cost of the hop", command_line(__name__, argv), lines, results)
    return 0
