"""Fleets for the benchmarks: simulated replicas and a gateway on loopback (``prefix_router/tools/launch.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import urllib.request
from pathlib import Path

from prefix_router.tools.launch import Server, build_tiny_model, free_port, gateway_server, running, sim_server
from prefix_router.metrics import sample_sum
from prefix_router.routing.decision import Route

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "agent_traces"  # SWE-agent trajectories, where this clone has them
# the policy's routes, the values of prefix_router_requests_total{route} (retry is the proxy's)
ROUTES = tuple(r.value for r in Route if r is not Route.RETRY)

__all__ = ["ROOT", "ROUTES", "TRACES", "free_port", "fleet", "gateway", "scrape", "metric_sum", "pinned", "tiny_tokenizer",
           "commit_of", "tree_gateway", "write_report"]


@contextlib.contextmanager
def fleet(n: int, log_dir: Path, sim_args: list[str]):
    """``n`` simulated replicas; yields their base URLs."""
    with running([sim_server(log_dir, sim_args) for _ in range(n)]) as urls:
        yield urls


@contextlib.contextmanager
def gateway(replicas: list[str], log_dir: Path, extra: list[str] = ()):
    """A gateway in front of ``replicas``; yields its base URL."""
    with running([gateway_server(log_dir, replicas, extra)]) as (url,):
        yield url


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


metric_sum = sample_sum  # (page, name, **labels) -> sum of matching samples


def pinned(server: Server, cpus: str | None) -> Server:
    """``server`` started under ``taskset -c cpus``; as it is when ``cpus`` is None or empty."""
    return server if not cpus else dataclasses.replace(server, cmd=["taskset", "-c", cpus, *server.cmd])


def tiny_tokenizer(traces: bool) -> Path:
    """The tiny model's tokenizer, built once into ``.cache``: its vocabulary trained on the
    agent trajectories in ``TRACES`` when ``traces`` (and they are there), so agent text
    tokenizes about as a real model's does; else on generated text, as in a clone without
    ``../shared`` (the routing benchmarks' committed figures were taken with that one). A
    folder for each, so that benchmarks run side by side never rebuild each other's."""
    folder = "tiny-tokenizer-traces" if traces else "tiny-tokenizer-generated"
    return build_tiny_model(ROOT / ".cache" / folder, corpus=TRACES if traces else None, tokenizer_only=True)


def tree_gateway(tree: Path, replicas: list[str], log_dir: Path, tokenizer: Path) -> Server:
    """This gateway as the source tree ``tree`` has it (a ``git worktree`` of another commit, or
    this clone): started with ``tree`` as its working directory, so ``python -m <package>.cli``
    imports that tree's package (``router`` before issue 40 renamed it ``prefix_router``); policy
    prefix-affinity, the tokenizer in ``tokenizer``."""
    server = gateway_server(log_dir, replicas, ["--policy", "prefix-affinity", "--tokenizer", str(tokenizer)])
    package = "prefix_router" if (tree / "prefix_router").is_dir() else "router"
    cmd = [package + ".cli" if part == "prefix_router.cli" else part for part in server.cmd]
    return dataclasses.replace(server, cmd=cmd, cwd=tree)


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


def write_report(path: Path, lines: list[str]) -> None:
    """Write a benchmark's markdown report (``lines``) to ``path``, its folder made, and print it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
