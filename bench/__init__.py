"""The project's benchmarks, one tool: ``python -m bench <command>`` (``python -m bench --help`` lists them).

Where things are:

- ``commands/``: one module per command, named after it (``commands/overhead.py`` is
  ``python -m bench overhead``); each has ``main(argv) -> int`` and a docstring whose first line
  ``--help`` shows.
- ``systems.py``: the systems under test, started in front of replicas: this gateway (at this
  tree or another commit's), the aiohttp floor (``floor_proxy.py``, the program it runs), the peer
  routers, the Endpoint Picker behind Envoy.
- ``workloads.py``: what is sent: conversations, other projects' traffic shapes, the matrix of
  ``compare``; ``pooled.py``: the hit rate no router can beat on a workload.
- ``drivers.py``: how it is sent: at fixed rates (Python client), ``wrk`` at saturation,
  ``vllm bench serve``, and the routing code timed in-process.
- ``meters.py``: what is read: CPU seconds and memory from /proc, TTFT, py-spy stacks, the
  replicas' and the gateway's metrics.
- ``hop.py``: the cost of the hop (one fast replica, each system in front of it), shared by
  ``overhead`` and ``compare``.
- ``report.py`` and ``plots.py``: a results folder, ``results/<command>/``, whose ``README.md``
  gives the command line, the commit, the date and the machine above the figures.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the clone
RESULTS = ROOT / "bench" / "results"  # one folder per command, committed
CACHE = ROOT / ".cache"  # logs, tokenizers and scratch results, never committed
