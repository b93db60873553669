"""``python -m bench fleetsim-disagg``: a disaggregated fleet, the prefill replica chosen by each policy."""

from __future__ import annotations

import json

import pytest

from bench.commands import fleetsim_capacity, fleetsim_disagg as command

from .test_bench_fleetsim_capacity import only_groups


@pytest.fixture
def small(monkeypatch, tmp_path):
    monkeypatch.setattr(command, "RULES", {"prefix-router": ("prefix-router", 0), "round-robin": ("round-robin", 0)})
    with only_groups(monkeypatch, tmp_path, command) as folder:
        yield folder


def test_each_policy_has_its_capacity_and_its_figures_at_round_robins_rate(small):
    out = small / "out"
    argv = ["--pools", "2+2", "--workloads", "groups", "--jobs", "1", "--steps", "2", "--out", str(out)]
    with pytest.raises(SystemExit):
        command.main(["--pools", "2x2", "--workloads", "groups"])
    assert command.main(argv) == 0
    cells = json.loads((out / "results.json").read_text())["results"]["cells"]
    by = {(c["policy"], c["reading"]): c for c in cells}
    assert set(by) == {(p, r) for p in ("prefix-router", "round-robin") for r in ("capacity", "common rate")}
    base = by[("round-robin", "capacity")]
    assert all(c["prefill"] == 2 and c["decode"] == 2 and c["transfer_tokens"] > 0 for c in cells)
    assert {c["rate_scale"] for (_, r), c in by.items() if r == "common rate"} == {base["rate_scale"]}
    readme = (out / "README.md").read_text()
    ours = by[("prefix-router", "capacity")]
    ratio = fleetsim_capacity.served_rps(ours) / fleetsim_capacity.served_rps(base)
    assert f"| groups | 2 + 2 | prefix-router | {fleetsim_capacity.served_rps(ours):.3g} | {ratio:.2f}x |" in readme
    before = command.CELLS.read_text()
    assert command.main(argv) == 0 and command.CELLS.read_text() == before  # kept cells are not run again
