"""What the benchmarks read: CPU seconds and memory from /proc, TTFT percentiles, py-spy stacks,
and the replicas' and the gateway's Prometheus metrics.

CPU is the kernel's count of a process's user and system time (``/proc/PID/stat``, in ticks of
10 ms), read before and after a load: the process's own cost, whatever the load generator or
the machine's other processes spend. Memory is ``VmRSS`` (resident now) and ``VmHWM`` (its peak)
from ``/proc/PID/status``.

py-spy (``record --native -f raw``) records waiting threads too (an event loop in ``epoll_wait``,
a thread pool's idle worker in a futex, a thread waiting for the GIL), so samples with a wait
among their three innermost native frames are dropped (``IDLE``): the rest are the process at
work, with asyncio's loop and uvloop's alike. Each part of ``PARTS`` is its share of those
samples, inclusive (a sample counts for every part with a frame on its stack, so nested parts
overlap). A sample inside a system call counts for the Python frame that made it; py-spy's
stops land in system calls more often than their CPU share, so the socket writes' part is an
upper bound.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from prefix_router.metrics import sample_sum
from prefix_router.routing.decision import Route
from prefix_router.tools.replay.summary import percentile

__all__ = ["CACHE_RESULTS", "IDLE", "PARTS", "REST", "ROUTES", "HealthWatch", "RssWatch", "active", "cpu_seconds",
           "hop_ttfts", "memory_mib", "metric_sum", "ms", "parse_raw", "py_spy", "rss_mb", "scrape", "shares",
           "top_frames", "tree_cpu_seconds"]

# the policy's routes, the values of prefix_router_requests_total{route} (retry is the proxy's)
ROUTES = tuple(r.value for r in Route if r is not Route.RETRY)
CACHE_RESULTS = ("hit", "miss_cold", "miss_changed", "miss_routed", "miss_evicted")  # ..._cache_requests_total{result}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far (``/proc/PID/stat``).

    Raises ``OSError`` when the process is gone.
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def memory_mib(pid: int) -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` (peak RSS) of ``pid`` in MiB, from /proc/PID/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def rss_mb(pid: int) -> float:
    """``VmRSS`` of ``pid`` in MiB; NaN when the file has none (a zombie)."""
    return memory_mib(pid).get("VmRSS", float("nan"))


class RssWatch(threading.Thread):
    """The resident memory of ``pid`` every 5 ms; ``peak()`` gives and resets the highest (MiB)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.highest, self.done = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.highest = max(self.highest, rss_mb(self.pid))
            time.sleep(0.005)

    def peak(self) -> float:
        highest, self.highest = self.highest, 0.0
        return highest


class HealthWatch(threading.Thread):
    """``GET /health`` every 20 ms: how long the event loop keeps a trivial request waiting;
    ``worst()`` gives and resets the slowest answer (s)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.slowest, self.done = url, 0.0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            started = time.perf_counter()
            try:
                urllib.request.urlopen(self.url + "/health", timeout=60).read()
            except (urllib.error.URLError, ConnectionError):
                pass
            self.slowest = max(self.slowest, time.perf_counter() - started)
            time.sleep(0.02)

    def worst(self) -> float:
        worst, self.slowest = self.slowest, 0.0
        return worst


def scrape(url: str) -> str:
    """The Prometheus page of the server at base URL ``url``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


metric_sum = sample_sum  # (page, name, **labels) -> sum of matching samples


def ms(series: list[tuple[float, float]], q: float, column: int = 0) -> float:
    """Percentile ``q`` of a fixed-rate series' (TTFT, latency) pairs in ms: ``column`` 0 TTFT,
    1 latency; failed requests (TTFT 0) left out."""
    return 1e3 * percentile([s[column] for s in series if s[0] > 0], q)


def hop_ttfts(records, time_scale: float) -> list[float]:
    """Each answered request's TTFT with only the replica's part modelled: wall TTFT +
    (``time_scale`` - 1) x its replica's own time to the first token (``Record.replica_ttft_s``),
    so the client's, the network's and the router's time count once, as on real GPUs. Seconds;
    requests without the replica's figure (a replica that is not the simulator) are left out."""
    return [r.ttft_s + (time_scale - 1) * r.replica_ttft_s for r in records
            if r.status == 200 and r.error is None and r.ttft_s is not None and r.replica_ttft_s is not None]


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


def py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    """Start ``py-spy record --native -r 200 -f raw`` on ``pid`` for ``seconds`` into ``out``.
    Raises ``RuntimeError`` when py-spy is not installed (``pip install -e '.[bench]'``)."""
    path = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(path).exists():
        raise RuntimeError("py-spy is not installed: pip install -e '.[bench]' (or pip install py-spy)")
    out.unlink(missing_ok=True)  # a failed run must not read an earlier run's samples
    return subprocess.Popen([path, "record", "-p", str(pid), "--native", "-r", "200", "-f", "raw",
                             "-d", str(int(seconds)), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


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
