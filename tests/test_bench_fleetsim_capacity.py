"""``python -m bench fleetsim-capacity``: each policy's capacity per workload and fleet size, kept
cell by cell, a table with this gateway over the best baseline, and a plot."""

from __future__ import annotations

import contextlib
import json
import random

import pytest

from bench.commands import fleetsim_capacity as command
from prefix_router.tools.replay.request import COMPLETIONS, ReplayRequest


def _groups(n: int) -> list[ReplayRequest]:
    """Prompts of 4 shared 2,048-token prefixes and 256 tokens of their own, one a second, 80 a
    replica: too many to serve at once, so every policy has a capacity."""
    rng = random.Random(n)
    prefixes = [[rng.randrange(300, 30_000) for _ in range(2048)] for _ in range(4)]
    return [ReplayRequest(COMPLETIONS, {"prompt": prefixes[i % 4] + [rng.randrange(300, 30_000) for _ in range(256)],
                                        "max_tokens": 8}, at_s=float(i)) for i in range(80 * n)]


@contextlib.contextmanager
def only_groups(monkeypatch, tmp_path, *commands):
    """fleetsim-capacity's workloads, and those of the ``commands`` built on them, the one small
    ``groups`` (objective 0.5 s, fleets of 2 and 4); each command's cells kept in ``tmp_path``."""
    workloads = {"groups": (_groups, 0.5, (2, 4))}
    for module in (command, *commands):
        monkeypatch.setattr(module, "WORKLOADS", workloads)
        monkeypatch.setattr(module, "CELLS", tmp_path / f"{module.__name__.rsplit('.', 1)[-1]}.jsonl")
    command._requests.cache_clear()
    yield tmp_path
    command._requests.cache_clear()


@pytest.fixture
def small(monkeypatch, tmp_path):
    with only_groups(monkeypatch, tmp_path) as folder:
        yield folder


def test_each_cell_is_found_kept_and_reported_beside_the_best_baseline(small):
    out = small / "out"
    argv = ["--sizes", "2,4,8", "--policies", "prefix-router,round-robin", "--jobs", "1", "--steps", "2",
            "--out", str(out)]
    assert command.main(argv) == 0
    cells = json.loads((out / "results.json").read_text())["results"]["cells"]
    assert sorted((c["replicas"], c["policy"]) for c in cells) == [(2, "prefix-router"), (2, "round-robin"),
                                                                   (4, "prefix-router"), (4, "round-robin")]
    for c in cells:  # each served within the objective, and more replicas serve more
        assert c["ttft_p99_s"] <= 0.5 and c["capacity_rps"] > 0
    by = {(c["replicas"], c["policy"]): c for c in cells}
    assert by[(4, "round-robin")]["capacity_rps"] > by[(2, "round-robin")]["capacity_rps"]
    ratio = command.served_rps(by[(4, "prefix-router")]) / command.served_rps(by[(4, "round-robin")])
    readme = (out / "README.md").read_text()
    ours = by[(4, "prefix-router")]
    span = ours["requests"] / command.served_rps(ours)  # the run at capacity: how long its requests took to come
    assert f"| groups (0.5 s) | 4 | " in readme and f"| {ratio:.2f}x | {span:,.0f} |" in readme
    assert (out / "capacity.png").stat().st_size > 1000
    kept = command.CELLS.read_text()

    def no_run(*args, **kwargs):
        raise AssertionError("a kept cell was run again")

    command.capacity, real = no_run, command.capacity
    try:
        assert command.main(argv) == 0  # every cell kept: the report is written again, nothing run
    finally:
        command.capacity = real
    assert command.CELLS.read_text() == kept


def test_a_closed_loop_is_reported_at_the_rate_that_came_not_the_rate_asked():
    """Sessions that wait for their answers come slower than asked: what came is what was served,
    so the table and the ratio read ``offered_rps``; a cell kept without it (an open trace) reads
    the rate asked, and an unbounded one none."""
    ours = {"capacity_rps": 68.0, "offered_rps": 32.0, "token_hit_rate": 0.8}
    theirs = {"capacity_rps": 50.0, "offered_rps": 26.0, "token_hit_rate": 0.8}
    assert command.served_rps(ours) == 32.0
    assert command.served_rps({"capacity_rps": 10.0}) == 10.0
    assert command.served_rps({"capacity_rps": None, "offered_rps": 5.0}) is None
    assert command._ratio({"prefix-router": ours, "round-robin": theirs}) == f"{32 / 26:.2f}x"
    assert command._capacity(ours).startswith("32 ")


def test_unknown_names_are_refused(small):
    with pytest.raises(SystemExit):
        command.main(["--workloads", "nope", "--jobs", "1"])
