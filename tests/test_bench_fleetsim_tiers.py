"""``python -m bench fleetsim-tiers``: tier-aware against GPU-only routing with CPU offload tiers."""

from __future__ import annotations

import json

import pytest

from bench.commands import fleetsim_capacity, fleetsim_tiers as command

from .test_bench_fleetsim_capacity import only_groups


@pytest.fixture
def small(monkeypatch, tmp_path):
    variants = {k: v for k, v in command.VARIANTS.items() if k in (command.BASE, "tier-aware (weight 0.75, Dynamo's)")}
    monkeypatch.setattr(command, "VARIANTS", variants)
    with only_groups(monkeypatch, tmp_path, command) as folder:
        yield folder


def test_each_row_is_searched_then_run_at_the_gpu_only_rows_capacity(small):
    out = small / "out"
    argv = ["--replicas", "2", "--workloads", "groups", "--jobs", "1", "--steps", "2", "--out", str(out)]
    assert command.main(argv) == 0
    cells = json.loads((out / "results.json").read_text())["results"]["cells"]
    assert sorted((c["variant"], bool(c.get("at_base_rate"))) for c in cells) == sorted(
        (v, at) for v in command.VARIANTS for at in (False, True))
    base = next(c for c in cells if c["variant"] == command.BASE and not c.get("at_base_rate"))
    assert base["capacity_rps"] > 0
    assert all(c["rate_scale"] == base["rate_scale"] for c in cells if c.get("at_base_rate"))
    readme = (out / "README.md").read_text()
    assert f"| groups | 2 | {command.BASE} | {fleetsim_capacity.served_rps(base):.3g} | 1.00x |" in readme
    before = command.CELLS.read_text()
    assert command.main(argv) == 0 and command.CELLS.read_text() == before  # kept cells are not run again
