"""The systems under test, each started in front of replicas: this gateway (at this tree or at
another commit's), the floor of an aiohttp hop, the peer routers, the Endpoint Picker behind Envoy.

Every system is a frozen dataclass with a ``name`` (its row in a table) and ``start(replicas,
log_dir, cpus)``, a context manager that starts its processes, waits until they answer and
yields ``Started``: the base URL to send requests to, and the pid of each process on the path
(``ROUTER`` always, ``PROXY`` for Envoy in front of the picker), whose CPU the meters read.
``cpus`` pins them (``taskset``), so that a router's own CPU is its own.

The peers are the vLLM project's router (``vllm-router`` on PyPI, Rust, adapted from SGLang's)
and the SGLang model gateway (``sglang-router`` on PyPI, Rust). ``ensure_peers`` installs the
pinned versions below into their own virtual environment (``.venv-peers``), never into the
project's, so their dependencies cannot shift ours. Each is started with its defaults apart from
ports and log level: users compare what they get out of the box. Their policies (their docs and
``src/policies/``):

- ``cache_aware``: an approximate radix tree of the *text* of past requests per worker; a
  request goes to the worker with the longest matching prefix when the match is at least
  ``cache_threshold`` (0.3) of the request, else to the least loaded one; when loads differ by
  more than ``balance_abs_threshold`` (64) and ``balance_rel_threshold`` (1.5x) it goes to the
  least loaded one.
- ``consistent_hash`` (vllm-router): a ring of 160 virtual nodes per worker keyed by the
  ``X-Session-ID`` header (then other id headers and body fields); no key, no affinity.
- ``power_of_two``: the less loaded of two random workers.

The floor (``floor_proxy.py``) forwards bytes with aiohttp's server and client on uvloop and does
nothing else: the least any gateway written on aiohttp spends on this machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prefix_router.tools.launch import (Server, build_tiny_model, envoy_server, epp_server, free_port,
                                        gateway_server, running, sim_server)

from . import CACHE, ROOT

__all__ = ["PEER_PACKAGES", "PROXY", "ROUTER", "SYSTEMS", "TRACES", "Floor", "Gateway", "Peer", "Picker", "Started",
           "System", "ensure_peers", "fleet", "pinned", "tiny_tokenizer", "with_gateway_args"]

PEERS_VENV = ROOT / ".venv-peers"
# Newest releases on PyPI on 2026-11-30; bump together with a re-run of ``python -m bench compare``.
PEER_PACKAGES = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}
TRACES = ROOT.parent / "shared" / "agent_traces"  # SWE-agent trajectories, where this clone has them
ROUTER, PROXY = "router", "envoy"  # the roles of ``Started.pids``


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


def pinned(server: Server, cpus: str | None) -> Server:
    """``server`` started under ``taskset -c cpus``; as it is when ``cpus`` is None or empty."""
    return server if not cpus else dataclasses.replace(server, cmd=["taskset", "-c", cpus, *server.cmd])


def tiny_tokenizer(traces: bool) -> Path:
    """The tiny model's tokenizer (``prefix_router/tools/tiny_model.py``), built once into
    ``.cache``: its vocabulary trained on the agent trajectories in ``TRACES`` when ``traces``
    (and they are there), so agent text tokenizes about as a real model's does; else on
    generated text, as in a clone without ``../shared`` (the routing benchmarks' committed
    figures were taken with that one). A folder for each, so that benchmarks run side by side
    never rebuild each other's."""
    folder = "tiny-tokenizer-traces" if traces else "tiny-tokenizer-generated"
    return build_tiny_model(CACHE / folder, corpus=TRACES if traces else None, tokenizer_only=True)


@contextlib.contextmanager
def fleet(n: int, log_dir: Path, sim_args: list[str], cpus: str | None = None) -> Iterator[list[str]]:
    """``n`` simulated replicas (``prefix-router sim`` with ``sim_args``); yields their base URLs."""
    with running([pinned(sim_server(log_dir, sim_args), cpus) for _ in range(n)]) as urls:
        yield urls


@dataclass(frozen=True)
class Started:
    """A system up and answering: the base URL to send to, and the pid of each process on the path."""

    url: str
    pids: dict[str, int]  # ROUTER, and PROXY where Envoy is in front


class _OneServer:
    """A system of one process, which ``server(replicas, log_dir)`` describes."""

    def server(self, replicas: list[str], log_dir: Path) -> Server:
        raise NotImplementedError

    @contextlib.contextmanager
    def start(self, replicas: list[str], log_dir: Path, cpus: str | None = None) -> Iterator[Started]:
        server = pinned(self.server(replicas, log_dir), cpus)
        with running([server]) as (url,):
            yield Started(url, {ROUTER: server.pid})


@dataclass(frozen=True)
class Gateway(_OneServer):
    """This gateway (``prefix-router serve``) with ``policy`` and ``args``, as the source tree
    ``tree`` has it: None for this clone; else another tree (a ``git worktree`` of another
    commit), started with it as its working directory so that ``python -m <package>.cli``
    imports that tree's package (``router`` before issue 40 renamed it ``prefix_router``)."""

    name: str = "prefix-router"
    policy: str | None = "prefix-affinity"  # None: the configuration's
    args: tuple[str, ...] = ()  # more of serve's flags: a tokenizer, --workers, --config
    tree: Path | None = None

    def server(self, replicas: list[str], log_dir: Path) -> Server:
        policy = ["--policy", self.policy] if self.policy else []
        server = gateway_server(log_dir, replicas, [*policy, *self.args])
        if self.tree is None:
            return server
        package = "prefix_router" if (self.tree / "prefix_router").is_dir() else "router"
        cmd = [package + ".cli" if part == "prefix_router.cli" else part for part in server.cmd]
        return dataclasses.replace(server, cmd=cmd, cwd=self.tree)


@dataclass(frozen=True)
class Peer(_OneServer):
    """A peer router (``program``: ``vllm-router`` or ``sglang-router``) with ``policy``,
    installed by ``ensure_peers`` on first use."""

    name: str
    program: str
    policy: str

    def server(self, replicas: list[str], log_dir: Path) -> Server:
        peers_bin = ensure_peers()
        port = free_port()
        if self.program == "vllm-router":
            cmd = [str(peers_bin / "vllm-router"), "--log-level", "warning"]
        else:
            cmd = [str(peers_bin / "sglang-router"), "launch", "--log-level", "warn",
                   "--shutdown-grace-period-secs", "1"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", self.policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--worker-urls", *replicas]
        return Server(cmd, port, log_dir / f"{self.program}-{port}.log", env={"NO_COLOR": "1"}, startup_s=60.0)


@dataclass(frozen=True)
class Floor(_OneServer):
    """The floor of an aiohttp hop (``bench/floor_proxy.py``) in front of the first replica."""

    name: str = "aiohttp floor"

    def server(self, replicas: list[str], log_dir: Path) -> Server:
        port = free_port()
        return Server([sys.executable, "-m", "bench.floor_proxy", "--port", str(port), "--upstream", replicas[0]],
                      port, log_dir / f"floor-{port}.log", cwd=ROOT)


@dataclass(frozen=True)
class Picker:
    """``prefix-router epp`` with ``args`` behind a real Envoy whose ext_proc filter asks it where
    each request goes, in the filter's body ``mode`` (``launch.PROCESSING_MODES``: ``buffered``,
    plain Envoy's; ``duplex``, Istio's). One replica: Envoy's pool takes addresses, not names."""

    mode: str = "buffered"
    args: tuple[str, ...] = ()
    envoy: str = shutil.which("envoy") or str(Path(sys.executable).with_name("envoy"))

    @property
    def name(self) -> str:
        return f"epp + envoy, {self.mode}"

    @contextlib.contextmanager
    def start(self, replicas: list[str], log_dir: Path, cpus: str | None = None) -> Iterator[Started]:
        pool = replicas[:1]
        epp, grpc_port = epp_server(log_dir, pool, self.args)
        epp = pinned(epp, cpus)
        with running([epp]):  # Envoy is healthy once a request goes through the picker
            envoy = pinned(envoy_server(log_dir, grpc_port, self.envoy, mode=self.mode, replicas=pool), cpus)
            with running([envoy]) as (url,):
                yield Started(url, {ROUTER: epp.pid, PROXY: envoy.pid})


System = Gateway | Peer | Floor | Picker


def with_gateway_args(system: System, args: tuple[str, ...]) -> System:
    """``system`` with ``args`` added to this gateway's flags (a tokenizer, a config file); a
    system that is not this gateway as it is."""
    if isinstance(system, (Gateway, Picker)):
        return dataclasses.replace(system, args=system.args + tuple(args))
    return system


# the systems of ``python -m bench compare``, its ``--systems`` names
SYSTEMS: tuple[System, ...] = (
    Gateway("prefix-router", "prefix-affinity"),
    Gateway("round-robin", "round-robin"),
    Peer("vllm-router cache_aware", "vllm-router", "cache_aware"),
    Peer("vllm-router consistent_hash", "vllm-router", "consistent_hash"),
    Peer("vllm-router power_of_two", "vllm-router", "power_of_two"),
    Peer("sglang-router cache_aware", "sglang-router", "cache_aware"),
)
