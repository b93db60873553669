"""Fleets for the benchmarks: simulated replicas and a gateway on loopback (``router/tools/launch.py``)."""

from __future__ import annotations

import contextlib
import urllib.request
from pathlib import Path

from router.tools.launch import free_port, gateway_server, running, sim_server
from router.metrics import sample_sum

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "free_port", "fleet", "gateway", "scrape", "metric_sum"]


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
