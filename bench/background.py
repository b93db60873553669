"""What each of the gateway's background tasks costs in front of a fake fleet, and the fleet size
at which it would take a tenth of a core (``python -m bench fleet-cost``'s last table).

One gateway at a time in front of the same fake fleet (``bench/fake_fleet.py``), each with one
task left at its rate and the others slowed to once an hour; its CPU over ``seconds`` with no
requests, once every replica is on the ring. A task's cost a replica a second is its share of a
core over the replicas and its rate; a tenth of a core divided by that is the fleet it takes to
reach one."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefix_router.tools.launch import gateway_server, running

from .meters import cpu_seconds

OFF = 3600.0  # seconds: a task slowed this far costs nothing over a measurement

# (task, its rate a replica, per second, at the defaults; the configuration that leaves it alone)
TASKS = (
    ("health probes (`/health` every `health.interval_s`, 2 s)", 0.5,
     {"health": {"interval_s": 2.0}, "scrape": {"interval_s": OFF, "idle_interval_s": OFF, "models_interval_s": OFF}}),
    ("scrapes of a busy replica (`/metrics` every `scrape.interval_s`, 1 s)", 1.0,
     {"health": {"interval_s": OFF}, "scrape": {"interval_s": 1.0, "idle_interval_s": 0, "models_interval_s": OFF}}),
    ("scrapes of an idle replica (every `scrape.idle_interval_s`, 10 s)", 0.1,
     {"health": {"interval_s": OFF}, "scrape": {"interval_s": 1.0, "idle_interval_s": 10.0, "models_interval_s": OFF}}),
    ("`/v1/models` reads (every `scrape.models_interval_s`, 10 s; measured at one a second)", 0.1,
     {"health": {"interval_s": OFF}, "scrape": {"interval_s": 1.0, "idle_interval_s": 0, "models_interval_s": 0}}),
)


def measure(urls: list[str], log_dir: Path, wait_on_ring, seconds: float, settle_s: float = 5.0) -> list[dict]:
    """Each task's idle CPU, % of one core, in front of ``urls``; ``wait_on_ring(url, n)`` returns
    once a gateway has them all on its ring. The models row is measured on top of busy scrapes
    (a read rides on a scrape) and reported less them, scaled from one a second to its rate."""
    rows = []
    for task, rate, config in TASKS:
        path = log_dir / f"gateway-background-{len(rows)}.yaml"
        path.write_text(json.dumps({"replicas": urls, **config}) + "\n")  # YAML
        server = gateway_server(log_dir, [], ["--config", str(path)])
        with running([server]) as (url,):
            wait_on_ring(url, len(urls))
            time.sleep(settle_s)
            began, cpu = time.monotonic(), cpu_seconds(server.pid)
            time.sleep(seconds)
            pct = 100 * (cpu_seconds(server.pid) - cpu) / (time.monotonic() - began)
        rows.append({"task": task, "rate_per_s": rate, "pct": pct})
    busy = rows[1]["pct"]
    rows[3]["pct"] = max(rows[3]["pct"] - busy, 0.0) * rows[3]["rate_per_s"]  # per read, at its own rate
    for row in rows:
        per_replica = row["pct"] / len(urls)  # % of a core one replica's share of the task costs
        row["ms_each"] = 10 * per_replica / (row["rate_per_s"] or 1)  # 1% of a core is 10 ms a second
        row["tenth_of_a_core_at"] = round(10.0 / per_replica) if per_replica > 0 else None
    return rows


def lines(rows: list[dict], replicas: int, seconds: float) -> list[str]:
    """The report's table."""
    out = ["", f"Each background task alone, {replicas} fake replicas, {seconds:g} s idle a task "
           "(`bench/background.py`), and the fleet at which it would take a tenth of a core:", "",
           "| task | % of one core | CPU ms each | a tenth of a core at |", "|---|---|---|---|"]
    for r in rows:
        at = f"{r['tenth_of_a_core_at']:,} replicas" if r["tenth_of_a_core_at"] else "-"
        out.append(f"| {r['task']} | {r['pct']:.1f}% | {r['ms_each']:.2f} | {at} |")
    return out
