"""``python -m bench choice``: the choice timed in process, and the indexes' memory."""

from __future__ import annotations

from bench.commands.choice import INDEXES, VIEWS, main, measure_memory, time_choice


def test_a_cell_times_the_choice_with_each_kind_of_index():
    for kind in INDEXES:
        cell = time_choice(replicas=8, blocks=32, own=4, reps=5, kind=kind)
        assert cell["replicas"] == 8 and cell["blocks"] == 32 and cell["kind"] == kind
        assert 0 < cell["median_us"] <= cell["p90_us"]


def test_memory_counts_every_block_each_replica_holds():
    """Half the blocks are one prompt every replica holds: the per-block indexes store it once per
    replica, the tree once."""
    memory = {kind: measure_memory(replicas=8, blocks=2048, kind=kind) for kind in (*INDEXES, *VIEWS) if kind != "engine"}
    memory["views"] = measure_memory(replicas=8, blocks=2048, kind="engine")
    assert all(m["entries"] == 8 * 2048 for m in memory.values())
    assert 0 < memory["per-block"]["bytes"] < memory["per-block+map"]["bytes"]  # the map is counted
    assert 0 < memory["engine-per-block"]["bytes"] < memory["engine-per-block+map"]["bytes"]
    assert memory["tree"]["bytes"] < memory["per-block"]["bytes"] / 4
    assert memory["views"]["bytes"] < memory["engine-per-block"]["bytes"] / 4


def test_the_command_writes_its_results_folder(tmp_path):
    assert main(["--replicas", "2", "--blocks", "16", "--reps", "3", "--memory-replicas", "2",
                 "--memory-blocks", "32", "--out", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert "python -m bench choice" in readme and "| 2 |" in readme and "EngineView" in readme
    assert (tmp_path / "results.json").exists()
