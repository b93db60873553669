"""``python -m bench choice``: the choice timed in process, and the indexes' memory."""

from __future__ import annotations

from bench.commands.choice import main, measure_memory, time_choice


def test_a_cell_times_the_choice_either_way():
    for fleet_map in (False, True):
        cell = time_choice(replicas=8, blocks=32, own=4, reps=5, fleet_map=fleet_map)
        assert cell["replicas"] == 8 and cell["blocks"] == 32 and cell["fleet_map"] is fleet_map
        assert 0 < cell["median_us"] <= cell["p90_us"]


def test_memory_counts_every_block_each_replica_holds():
    """Half the blocks are one prompt every replica holds; each index still stores its own copy."""
    for kind in ("shadow", "engine"):
        alone, mapped = (measure_memory(replicas=3, blocks=64, kind=kind, fleet_map=f) for f in (False, True))
        assert alone["entries"] == mapped["entries"] == 3 * 64
        assert 0 < alone["bytes"] < mapped["bytes"]  # the map is counted


def test_the_command_writes_its_results_folder(tmp_path):
    assert main(["--replicas", "2", "--blocks", "16", "--reps", "3", "--memory-replicas", "2",
                 "--memory-blocks", "32", "--out", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert "python -m bench choice" in readme and "| 2 |" in readme and "EngineView" in readme
    assert (tmp_path / "results.json").exists()
