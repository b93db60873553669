"""``python -m bench fleetsim-knobs``: each routing knob moved alone, its capacity over the defaults'."""

from __future__ import annotations

import json

import pytest

from bench.commands import fleetsim_capacity, fleetsim_knobs as command

from .test_bench_fleetsim_capacity import only_groups


@pytest.fixture
def small(monkeypatch, tmp_path):
    monkeypatch.setattr(command, "KNOBS", {"load_factor": (4.0,), "sole_router": (False,)})
    with only_groups(monkeypatch, tmp_path, command) as folder:
        yield folder


def test_each_knob_value_is_run_once_and_set_over_the_defaults(small):
    out = small / "out"
    argv = ["--replicas", "2", "--workloads", "groups", "--jobs", "1", "--steps", "2", "--out", str(out)]
    with pytest.raises(SystemExit):
        command.main(["--replicas", "2,4", "--workloads", "groups"])  # two sizes, one workload
    assert command.main(argv) == 0
    cells = json.loads((out / "results.json").read_text())["results"]["cells"]
    assert sorted((c["knob"], c["value"]) for c in cells) == [("default", None), ("load_factor", 4.0),
                                                              ("sole_router", False)]
    by = {c["knob"]: c for c in cells}
    assert all(c["capacity_rps"] and c["ttft_p99_s"] <= 0.5 for c in cells)
    readme = (out / "README.md").read_text()
    ratio = fleetsim_capacity.served_rps(by["load_factor"]) / fleetsim_capacity.served_rps(by["default"])
    assert f"| load_factor (default 1.25) | 4.0 | {ratio:.2f} (" in readme
    before = command.CELLS.read_text()
    assert command.main(argv) == 0 and command.CELLS.read_text() == before  # kept cells are not run again
