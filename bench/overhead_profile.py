"""Where the gateway's CPU goes per request: py-spy on a gateway serving fixed-rate streaming chats.

One simulated replica at 10,000x, the gateway of each ``--tree`` (default this one; a
``git worktree`` of an older commit for a before-and-after) with the tiny tokenizer, ~N-token
streaming chats of ``gateway_overhead.chat_mix`` at ``--rate``/s. After 16 warm-up requests the
load runs twice, on different requests: unprofiled, for the CPU seconds of the process per
request (``/proc/PID/stat``), then under ``py-spy record --native -r 200 -f raw`` for
``--seconds``.

    git worktree add --detach ../before 8da9842
    python -m bench.overhead_profile --tree ../before --tree . --rate 80

py-spy here records waiting threads too (an event loop in ``epoll_wait``, a thread pool's idle
worker in a futex, a thread waiting for the GIL), so samples with a wait among their three
innermost native frames are dropped (``IDLE``): the rest are the process at work, with asyncio's
loop and uvloop's alike. Each part's figure is its share of those samples, inclusive (a sample
counts for every part with a frame on its stack, so nested parts overlap), times the CPU per
request: milliseconds of CPU a request, comparable between trees whose event loops differ. A
sample inside a system call counts for the Python frame that made it; py-spy's stops land in
system calls more often than their CPU share (at 80/s of 1k-token chats the kernel's time is
under a tenth of the gateway's CPU by ``/proc/PID/stat``, while ``write`` ends a fifth of the
samples), so the socket writes' part is an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

from prefix_router.tools.launch import running, sim_server

from .fleet import ROOT, commit_of, tiny_tokenizer, tree_gateway, write_report
from .gateway_overhead import chat_mix, fixed_rate
from .peers import cpu_seconds

__all__ = ["IDLE", "PARTS", "REST", "active", "parse_raw", "shares", "top_frames"]

# native frames of a thread that waits: epoll (asyncio's selector, uvloop), a lock or condition
# (a thread pool's idle worker in PyThread_acquire_lock_timed, a thread waiting for the GIL in
# take_gil), sleep
IDLE = re.compile(r"^(epoll_wait|epoll_pwait|epoll_pwait2|select|poll|ppoll|pthread_cond_(timed)?wait[@\w.]*|"
                  r"sem_(timed|clock)?wait|do_futex_wait[\w.]*|__futex_abstimed_wait_common[\w.]*|"
                  r"futex_wait|syscall|nanosleep|clock_nanosleep|PyThread_acquire_lock_timed|take_gil) \(")

# (part, pattern over one frame "function (path:line)"); names from both sides of issue 16's
# refactor (8da9842's proxy.py / config.py and today's forward.py / relay.py / learning.py)
PARTS: tuple[tuple[str, str], ...] = (
    ("chat analysis (template, tokenization, hashes, fingerprint)", r"^_?analy[sz]e \("),
    ("  chat template render", r"^(HFTokenizer\._render|PreTrainedTokenizerBase\.apply_chat_template) \("),
    ("  tokenization (encode)", r"^HFTokenizer\.(encode|encode_incremental) \("),
    ("  block hashes", r"/blocks\.py:"),
    ("  cause fingerprint", r"^[A-Za-z_.]*fingerprint[A-Za-z_]* \("),
    ("the policy's choice", r"^[A-Za-z_]*Policy\.select \("),
    ("reading the request (body, checks, tenant)", r"^(read_inbound|_read_raw|_parse|inbound_of) \("),
    ("forward and relay (aiohttp client and server writes)", r"^_?(forward|relay|_attempt) \("),
    ("learning from the answer (miss kind, cause, metrics)", r"^(learn|_account) \("),
    ("socket writes (kernel time included)", r"^StreamWriter\._write(lines)? \("),
)
# the samples in none of the top-level parts (those not indented): the event loop, aiohttp's
# server, handing work to a thread pool and back
REST = "everything else (event loop, aiohttp's server, thread hand-offs)"
_FRAME_RE = {part: re.compile(pattern) for part, pattern in PARTS}


def parse_raw(text: str) -> list[tuple[list[str], int]]:
    """py-spy's ``-f raw`` output (``frame;frame;... count`` per line, outermost first) as
    (frames, samples) pairs; a sample taken with no Python frame on the stack has none. Raises
    ``ValueError`` on a line without a count."""
    stacks = []
    for line in text.splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise ValueError(f"not a py-spy raw line: {line[:80]!r}")
        stacks.append((stack.strip().split(";") if stack.strip() else [], int(count)))
    return stacks


def active(stacks: list[tuple[list[str], int]]) -> list[tuple[list[str], int]]:
    """``stacks`` without the samples of a waiting thread (one of the three innermost frames
    matching ``IDLE``: libc's own frames below ``pthread_cond_wait`` are unnamed) and those with
    no frame at all."""
    return [(frames, n) for frames, n in stacks if frames and not any(IDLE.search(f) for f in frames[-3:])]


def shares(stacks: list[tuple[list[str], int]]) -> dict[str, float]:
    """Each part of ``PARTS``, and ``REST``: its share (0-1) of all samples, inclusive (a sample
    counts once for a part with any frame on the stack matching it)."""
    total = sum(n for _, n in stacks) or 1
    out = {}
    for part, pattern in _FRAME_RE.items():
        out[part] = sum(n for frames, n in stacks if any(pattern.search(f) for f in frames)) / total
    top = [pattern for part, pattern in _FRAME_RE.items() if not part.startswith(" ")]
    out[REST] = sum(n for frames, n in stacks if not any(p.search(f) for p in top for f in frames)) / total
    return out


def top_frames(stacks: list[tuple[list[str], int]], k: int = 12) -> list[tuple[str, float]]:
    """The ``k`` innermost frames the samples ended in most, with their share of all samples
    (the line number dropped, so one function's lines add up)."""
    total = sum(n for _, n in stacks) or 1
    counts: collections.Counter[str] = collections.Counter()
    for frames, n in stacks:
        counts[re.sub(r":\d+\)$", ")", frames[-1]) if frames else "(no Python frame)"] += n
    return [(frame, n / total) for frame, n in counts.most_common(k)]


def profile(tree: Path, rate: float, seconds: float, tokens: int, raw_out: Path, log_dir: Path) -> float:
    """Run the gateway of ``tree`` under load, then under as much again, new requests (no body
    repeated: a repeat would find its prompt in the tokenizer's cache), while py-spy records it
    into ``raw_out``; its CPU milliseconds per request in the run without py-spy. Raises
    ``RuntimeError`` when py-spy fails (not installed, no ptrace permission)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise RuntimeError("py-spy is not installed: pip install -e '.[bench]' (or pip install py-spy)")
    raw_out.unlink(missing_ok=True)  # a failed run must not read an earlier run's samples
    tokenizer = tiny_tokenizer(traces=True)
    count = max(int(rate * (seconds + 2)), 16)
    requests = chat_mix(tokens, 2 * count)  # the first half unprofiled, the second under py-spy
    with running([sim_server(log_dir, ["--model", "sim", "--time-scale", "10000", "--tokenizer", str(tokenizer)])]) \
            as (replica,):
        server = tree_gateway(tree, [replica, replica.replace("127.0.0.1", "localhost")], log_dir, tokenizer)
        with running([server]) as (url,):
            asyncio.run(fixed_rate(url, requests[:16], rate))
            cpu0 = cpu_seconds(server.pid)
            series = asyncio.run(fixed_rate(url, requests[:count], rate))
            cpu = cpu_seconds(server.pid) - cpu0
            spy = subprocess.Popen([py_spy, "record", "-p", str(server.pid), "--native", "-r", "200", "-f", "raw",
                                    "-d", str(int(seconds)), "-o", str(raw_out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            asyncio.run(fixed_rate(url, requests[count:], rate))
            _, err = spy.communicate(timeout=60)
            if spy.returncode != 0 or not raw_out.exists():
                raise RuntimeError(f"py-spy failed: {err.strip()[-300:]}")
    return 1000 * cpu / len(series)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, action="append", help="a gateway's source tree (repeat; default: this one)")
    parser.add_argument("--rate", type=float, default=80.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds sampled")
    parser.add_argument("--tokens", type=int, default=1000, help="prompt size of the chats")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "overhead-profile.md")
    args = parser.parse_args(argv)
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    log_dir = ROOT / ".cache" / "bench-overhead-profile"
    log_dir.mkdir(parents=True, exist_ok=True)
    columns = []
    for tree in trees:
        commit = commit_of(tree)
        raw = log_dir / f"profile-{commit}.txt"
        try:
            cpu = profile(tree, args.rate, args.seconds, args.tokens, raw, log_dir)
        except RuntimeError as exc:
            raise SystemExit(f"overhead_profile: {exc}") from None
        stacks = active(parse_raw(raw.read_text()))
        columns.append((commit, cpu, shares(stacks), top_frames(stacks)))
        print(f"{commit}: {cpu:.2f} ms CPU a request", flush=True)
    lines = [f"py-spy on the gateway (`--native -r 200 -f raw`, {args.seconds:g} s) serving ~{args.tokens}-token "
             f"streaming chats at {args.rate:g}/s to one simulated replica at 10,000x (tiny tokenizer, template "
             "rendered). Each part: its share of the samples at work (waits dropped), inclusive (nested parts "
             "overlap), as milliseconds of the CPU a request measured without py-spy (`/proc/PID/stat`); the "
             "socket writes' figure is an upper bound (see `bench/overhead_profile.py`).", "",
             "| part: CPU ms a request (share of the samples at work) | " + " | ".join(c[0] for c in columns) + " |",
             "|---|" + "---|" * len(columns),
             "| the whole request | " + " | ".join(f"{c[1]:.2f}" for c in columns) + " |"]
    for part in [p for p, _ in PARTS] + [REST]:
        lines.append(f"| {part} | " + " | ".join(f"{c[1] * c[2][part]:.2f} ({100 * c[2][part]:.0f}%)"
                                                  for c in columns) + " |")
    for commit, _, _, frames in columns:
        lines += ["", f"Innermost frames at {commit} (self time, share of the samples at work):", ""]
        lines += [f"- {100 * share:.1f}% `{frame}`" for frame, share in frames]
    lines.append(f"\nCommand: `python -m bench.overhead_profile {' '.join(sys.argv[1:] if argv is None else argv)}`")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
