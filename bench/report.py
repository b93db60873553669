"""A benchmark's results folder: ``README.md`` (where the figures came from, then the figures) and
``results.json`` (the same provenance and the raw figures).

The header gives what a reader needs to trust or redo a figure: the exact command line, the
commit it ran at (``commit_of``: ``+`` when the tree differed from it), the date, and the
machine (cores, CPU model, memory, kernel, Python). Standard library only, so that a command run
from another environment (``kv-event-sizes`` in vLLM's) can write one too.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from . import ROOT

__all__ = ["commit_of", "command_line", "machine", "header", "write_results"]


def commit_of(tree: Path) -> str:
    """The short commit checked out in ``tree`` (a ``git worktree`` or this clone), with ``+``
    when its tracked files other than ``bench/results`` (what a benchmark writes) differ from
    it; the folder's name where git cannot say."""
    def git(*args):
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return tree.name
    return head.stdout.strip() + ("+" if git("diff", "--quiet", "HEAD", "--", ".", ":!bench/results").returncode else "")


def command_line(module: str, argv: list[str] | None, python: str = "python") -> str:
    """``python -m bench <command> <args>`` for the command module named ``module`` (its
    ``__name__``) run with ``argv`` (None: this process's arguments after the command);
    ``python``: the interpreter to name, where it must be another environment's."""
    name = module.rsplit(".", 1)[-1].replace("_", "-")
    args = sys.argv[2:] if argv is None else argv
    return " ".join([python, "-m bench", name, *(shlex.quote(a) for a in args)])


def machine() -> dict:
    """The facts that move benchmark figures: cores, CPU model, memory (GiB), kernel, Python."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cores": os.cpu_count(), "cpu": model, "memory_gib": round(memory, 1),
            "platform": platform.platform(), "python": platform.python_version()}


def header(title: str, command: str, tree: Path = ROOT) -> tuple[list[str], dict]:
    """The README's first lines and the same facts as a dict for ``results.json``."""
    facts = {"command": command, "commit": commit_of(tree),
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "machine": machine()}
    m = facts["machine"]
    lines = [f"# {title}", "", f"- Command: `{command}`",
             f"- Commit: {facts['commit']}" + (" (`+`: the tree differed from it)" if facts["commit"].endswith("+") else ""),
             f"- Date: {facts['date']}",
             f"- Machine: {m['cores']} cores ({m['cpu']}), {m['memory_gib']:g} GiB, {m['platform']}, "
             f"Python {m['python']}", ""]
    return lines, facts


def write_results(out: Path, title: str, command: str, lines: list[str], data: dict | list | None = None,
                  echo: bool = True) -> Path:
    """Write ``out/README.md`` (``header`` then ``lines``, markdown) and, with ``data``,
    ``out/results.json`` (the header's facts and ``data`` under ``"results"``); print the
    README unless ``echo`` is false. Returns the README's path."""
    head, facts = header(title, command)
    out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(head + lines) + "\n"
    (out / "README.md").write_text(text)
    if data is not None:
        (out / "results.json").write_text(json.dumps({**facts, "results": data}, indent=1) + "\n")
    if echo:
        print(text)
    return out / "README.md"
