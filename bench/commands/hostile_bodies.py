"""What hostile bodies cost a gateway: its peak memory, its answer and how long ``/health`` waits.

For each source tree (``--tree``: this clone, or a ``git worktree`` of another commit), a gateway
(``prefix-router serve``, no tokenizer) in front of one simulated replica gets, one at a time:

- 30 MB amplification bodies (a chat whose extra key holds ``[]``, ``{}``, ``"ab"`` or
  ``123456`` repeated): each parses to many times its bytes;
- bodies just under ``limits.max_json_elements`` of the same shapes (the most a body may hold);
- 30 MB of prompt text in one message: a word, numbers (which the change classifier masks), and
  JSON escapes (which it parses as JSON).

to a routed path (``/v1/chat/completions``) and a passthrough one (``/invocations``), while a
thread asks ``/health`` every 20 ms and another reads the gateway's resident memory (``VmRSS``
from /proc) every 5 ms. Reported per body: the status, the seconds to answer, the most the
resident memory rose above what it was just before the body was sent, and the slowest
``/health`` while it was handled (``meters.RssWatch``, ``meters.HealthWatch``).

    python -m bench hostile-bodies --tree . [--tree ../before]

Writes ``README.md`` to ``--out`` (``bench/results/hostile-bodies``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from prefix_router.config import LimitsConfig
from prefix_router.serve.bodies import elements_bound
from prefix_router.tools.launch import running, sim_server

from .. import RESULTS
from ..meters import HealthWatch, RssWatch, rss_mb
from ..report import command_line, commit_of, write_results
from ..systems import Gateway
from ..workloads import MODEL

__all__ = ["PATHS", "SHAPES", "TEXTS", "body", "main", "text_body"]

SHAPES = {"lists": b"[],", "objects": b"{},", "strings": b'"ab",', "numbers": b"123456,"}
PATHS = ("/v1/chat/completions", "/invocations")
# (name, opening, unit, closing) of one message's text: a long word, numbers the change classifier
# masks, and a JSON array written in escapes (the body's bound counts none of it), which it parses
TEXTS = (("a word", b"", b"ab", b""), ("numbers", b"", b"1.a", b""),
         ("escaped JSON", b"\\u005b", b"\\u007b\\u0022a\\u0022:1\\u007d\\u002c", b"1\\u005d"))


def body(shape: str, *, size: int | None = None, bound: int | None = None) -> bytes:
    """A chat body of ``size`` bytes of ``shape``, or the largest whose ``elements_bound`` is at
    most ``bound`` (the most ``limits.max_json_elements`` = ``bound`` lets through)."""
    head = b'{"model":"' + MODEL.encode() + b'","max_tokens":1,"messages":[{"role":"user","content":"hi"}],"x":['
    unit = SHAPES[shape]
    if size is not None:
        count = (size - len(head)) // len(unit)
    else:
        count = (bound - elements_bound(head + b"0]}")) // (elements_bound(unit) - 1)
    return head + unit * count + b"0]}"


def text_body(opening: bytes, unit: bytes, closing: bytes, size: int) -> bytes:
    """A chat of one user message: ``unit`` repeated between ``opening`` and ``closing`` to
    ``size`` bytes (a prompt vLLM would refuse as too long, but the gateway reads it first)."""
    head = b'{"model":"' + MODEL.encode() + b'","max_tokens":1,"messages":[{"role":"user","content":"' + opening
    tail = closing + b'"}]}'
    return head + unit * ((size - len(head) - len(tail)) // len(unit)) + tail


def post(url: str, data: bytes) -> int:
    """POST ``data`` as JSON; the answer's status, 0 when the connection failed."""
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError):
        return 0


def measure(tree: Path, log_dir: Path) -> list[str]:
    """The table rows of one tree's gateway."""
    cap = LimitsConfig().max_json_elements
    cases = [(f"{shape}, at the {cap // 1000}k bound", body(shape, bound=cap)) for shape in SHAPES]
    cases += [(f"{shape}, 30 MB", body(shape, size=30_000_000)) for shape in SHAPES]
    cases += [(f"text: {name}, 30 MB", text_body(*parts, 30_000_000)) for name, *parts in TEXTS]
    rows = []
    with running([sim_server(log_dir, ["--model", MODEL, "--time-scale", "1000"])]) as (replica,):
        gateway = Gateway(policy=None, tree=tree).server([replica], log_dir)  # its defaults
        with running([gateway]) as (url,):
            post(url + PATHS[0], body("lists", bound=100))
            watch, memory = HealthWatch(url), RssWatch(gateway.pid)
            watch.start()
            memory.start()
            for name, data in cases:
                for path in PATHS:
                    time.sleep(0.2)
                    before, started = rss_mb(gateway.pid), time.perf_counter()
                    memory.peak(), watch.worst()
                    status = post(url + path, data)
                    elapsed = time.perf_counter() - started
                    time.sleep(0.1)
                    rows.append(f"| {commit_of(tree)} | {name} ({len(data) / 1e6:.1f} MB) | {path} | {status} | "
                                f"{elapsed:.2f} | {memory.peak() - before:+.0f} | {watch.worst() * 1000:.0f} |")
            watch.done.set()
            memory.done.set()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench hostile-bodies", description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, action="append", help="a source tree (repeat; default: this clone)")
    parser.add_argument("--out", type=Path, default=RESULTS / "hostile-bodies")
    args = parser.parse_args(argv)
    trees = args.tree or [Path(".")]
    lines = ["| tree | body | path | status | s to answer | RSS rise MB | slowest /health ms |",
             "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as logs:
        for tree in trees:
            lines += measure(tree.resolve(), Path(logs))
    write_results(args.out, "What hostile bodies cost a gateway", command_line(__name__, argv), lines)
    return 0
