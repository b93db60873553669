"""The systems under test: this gateway and the peer routers, each started in front of replicas.

The peers are the vLLM project's router (``vllm-router`` on PyPI, Rust, adapted from SGLang's)
and the SGLang model gateway (``sglang-router`` on PyPI, Rust). ``ensure_peers`` installs the
pinned versions below into their own virtual environment (``.venv-peers``), never into the
project's, so their dependencies cannot shift ours. Each system is started with its defaults
apart from ports and log level: users compare what they get out of the box.

What the peers' policies do (their docs and source, ``src/policies/``):
- ``cache_aware``: an approximate radix tree of the *text* of past requests per worker; a
  request goes to the worker with the longest matching prefix when the match is at least
  ``cache_threshold`` (0.3) of the request, else to the least loaded one; when loads differ
  by more than ``balance_abs_threshold`` (64) and ``balance_rel_threshold`` (1.5x) it goes to
  the least loaded one.
- ``consistent_hash`` (vllm-router): a ring of 160 virtual nodes per worker keyed by the
  ``X-Session-ID`` header (then other id headers and body fields); no key, no affinity.
- ``power_of_two``: the less loaded of two random workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from prefix_router.tools.launch import Server, free_port, gateway_server

__all__ = ["PEER_PACKAGES", "System", "SYSTEMS", "ensure_peers", "cpu_seconds"]

ROOT = Path(__file__).resolve().parents[1]
PEERS_VENV = ROOT / ".venv-peers"
# Newest releases on PyPI on 2026-11-30; bump together with a re-run of bench.compare.
PEER_PACKAGES = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}


def ensure_peers(venv: Path = PEERS_VENV) -> Path:
    """Install ``PEER_PACKAGES`` into ``venv`` unless that exact set is there; returns its bin folder.

    About 15 s with a warm pip cache. Raises ``subprocess.CalledProcessError`` when pip fails
    (no network to the package index, no wheel for this platform).
    """
    stamp = venv / "prefix-router-peers"
    wanted = " ".join(f"{k}=={v}" for k, v in sorted(PEER_PACKAGES.items()))
    if not stamp.exists() or stamp.read_text().strip() != wanted:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *wanted.split()],
                       check=True)
        stamp.write_text(wanted + "\n")
    return venv / "bin"


@dataclass(frozen=True)
class System:
    """One router configuration to benchmark: ``name`` in tables, ``program`` and its ``policy``."""

    name: str
    program: str  # "prefix-router", "vllm-router" or "sglang-router"
    policy: str

    @property
    def is_peer(self) -> bool:
        return self.program != "prefix-router"

    def server(self, replicas: list[str], log_dir: Path, peers_bin: Path | None = None,
               gateway_args: tuple[str, ...] = ()) -> Server:
        """The ``Server`` that runs this system in front of ``replicas`` (base URLs).

        ``gateway_args`` go to this gateway only (a tokenizer, a config file).
        Raises ``ValueError`` for a peer without ``peers_bin``.
        """
        if not self.is_peer:
            return gateway_server(log_dir, replicas, ["--policy", self.policy, *gateway_args])
        if peers_bin is None:
            raise ValueError(f"{self.name}: peers_bin is needed (bench.peers.ensure_peers)")
        port = free_port()
        if self.program == "vllm-router":
            cmd = [str(peers_bin / "vllm-router"), "--log-level", "warning"]
        else:
            cmd = [str(peers_bin / "sglang-router"), "launch", "--log-level", "warn",
                   "--shutdown-grace-period-secs", "1"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", self.policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--worker-urls", *replicas]
        return Server(cmd, port, log_dir / f"{self.name}-{port}.log", env={"NO_COLOR": "1"},
                      startup_s=60.0)


SYSTEMS = (
    System("prefix-router", "prefix-router", "prefix-affinity"),
    System("round-robin", "prefix-router", "round-robin"),
    System("vllm-router cache_aware", "vllm-router", "cache_aware"),
    System("vllm-router consistent_hash", "vllm-router", "consistent_hash"),
    System("vllm-router power_of_two", "vllm-router", "power_of_two"),
    System("sglang-router cache_aware", "sglang-router", "cache_aware"),
)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far (``/proc/PID/stat``).

    Raises ``OSError`` when the process is gone.
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
