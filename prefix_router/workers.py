"""``prefix-router serve --workers N``: N gateway processes sharing one port.

Each worker is a whole gateway (its own event loop, replica state, shadow indexes and KV-event
subscriptions) bound to the same host and port with ``SO_REUSEPORT``, so the kernel spreads new
connections over them evenly (one listening socket shared by all would let the busiest-awake
worker take most). ``GET /replicas`` and ``/debug/changes`` answer for the worker that took the
connection. The port is checked free before the workers start; a second gateway started on
the same port with workers would still join this one's (SO_REUSEPORT lets processes of one
user share it). They agree without talking to each other: the ring is a function of the
replica names, and with KV events on (``prefix_router/cache/stream.py``) every worker reads the engines'
own picture of their caches; without events each learns only from the requests it served.

Metrics: prometheus-client's multiprocess mode. The supervisor gives the workers one empty
directory (``PROMETHEUS_MULTIPROC_DIR``), each writes its values there, and ``GET /metrics`` on
any worker sums them (``GatewayMetrics.page``). Gauges combine as their meaning asks: requests
in flight add up over live workers, a replica counts as healthy only if every live worker sees
it healthy (``prefix_router/metrics.py``).

The supervisor restarts a worker that dies (after ``RESTART_DELAY_S``), and on SIGTERM or
SIGINT passes the signal on and waits for every worker's drain (``drain_s``) before it exits;
a worker whose supervisor died (even by SIGKILL) gets SIGTERM and drains.
A worker that exits with status 2 (a configuration error), or workers that die within
``EARLY_EXIT_S`` of starting ``EARLY_EXITS`` times in a row (the port taken), stop the whole
gateway.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

__all__ = ["listen_error", "MULTIPROC_ENV", "WORKER_ENV", "supervise", "worker_index"]

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's own variable
WORKER_ENV = "PREFIX_ROUTER_WORKER"  # set in each worker process: its index, from 0
RESTART_DELAY_S = 1.0
CONFIG_ERROR = 2  # what ``prefix-router serve`` exits with for a bad configuration
# a worker that dies this soon after it started, this many times in a row, cannot start at all
# (the port taken by another program, a replica list it cannot read): stop rather than loop
EARLY_EXIT_S, EARLY_EXITS = 10.0, 5


def worker_index() -> int | None:
    """This process's worker index, or None when it is not a worker of ``supervise``."""
    value = os.environ.get(WORKER_ENV)
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


def _die_with_parent() -> None:
    """In a worker, before it runs: SIGTERM when the supervisor dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG), so no worker keeps serving the port without it."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def listen_error(host: str, port: int, exc: OSError) -> str:
    """One line saying why ``host:port`` could not be listened on, and for a port in use how to
    find its holder and pick another."""
    text = f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    if exc.errno == errno.EADDRINUSE:
        text += f" (`ss -ltnp 'sport = :{port}'` names the program holding it; or choose another with --port)"
    return text


def port_problem(host: str, port: int) -> str | None:
    """Why the gateway could not listen on ``host:port`` (taken by another program, an address
    this machine does not have), tried without ``SO_REUSEPORT``; None when it can."""
    try:
        socket.create_server((host, port)).close()
    except OSError as exc:
        return listen_error(host, port, exc)
    return None


def supervise(argv: list[str], workers: int, drain_s: float, host: str, port: int) -> int:
    """Run ``workers`` copies of ``python -m prefix_router.cli *argv`` (the serve command line) until
    SIGTERM or SIGINT, restarting any that dies. ``host:port`` is tried first without
    ``SO_REUSEPORT``, so a port another program holds fails at once, in one line. Returns the
    exit status: 0 after a clean stop, 1 when the port cannot be had or workers keep dying as
    they start (``EARLY_EXITS``), ``CONFIG_ERROR`` when a worker reported a bad configuration.
    Raises ValueError for fewer than 2 workers."""
    if workers < 2:
        raise ValueError(f"supervise needs at least 2 workers, got {workers}")
    problem = port_problem(host, port)
    if problem:
        print(f"prefix-router serve: {problem}", file=sys.stderr)
        return 1
    own_dir = MULTIPROC_ENV not in os.environ
    metrics_dir = tempfile.mkdtemp(prefix="prefix-router-metrics-") if own_dir else os.environ[MULTIPROC_ENV]
    env = {**os.environ, MULTIPROC_ENV: metrics_dir}
    stopping = False

    started: dict[int, float] = {}
    early = 0  # early exits in a row

    def spawn(index: int) -> subprocess.Popen:
        started[index] = time.monotonic()
        return subprocess.Popen([sys.executable, "-m", "prefix_router.cli", *argv], env={**env, WORKER_ENV: str(index)},
                                preexec_fn=_die_with_parent)

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signum)

    children = {i: spawn(i) for i in range(workers)}
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        while not stopping:
            time.sleep(0.2)
            for index, child in list(children.items()):
                code = child.poll()
                if code is None or stopping:
                    continue
                _forget(child.pid, metrics_dir)
                early = early + 1 if time.monotonic() - started[index] < EARLY_EXIT_S else 0
                if code == CONFIG_ERROR or early >= EARLY_EXITS:
                    if code != CONFIG_ERROR:
                        log.error("gateway workers exited %d times within %g s of starting; stopping", early,
                                  EARLY_EXIT_S)
                    status = CONFIG_ERROR if code == CONFIG_ERROR else 1
                    stop(signal.SIGTERM, None)
                    break
                log.warning("gateway worker %d (pid %d) exited with %s; restarting it", index, child.pid, code)
                time.sleep(RESTART_DELAY_S)
                children[index] = spawn(index)
        _reap(children.values(), drain_s + 10.0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if own_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return status


def _reap(children, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` seconds in all for ``children`` (Popen objects told to stop) to
    exit, then kill those still running."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _forget(pid: int, metrics_dir: str) -> None:
    """Drop a dead worker's live gauges (its counters and histograms stay counted)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, metrics_dir)
