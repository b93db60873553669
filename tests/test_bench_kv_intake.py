"""``python -m bench kv-intake``: a busy step's KV events applied to each kind of view."""

from __future__ import annotations

from bench.commands.kv_intake import main, measure


def test_a_cell_times_both_views_on_the_same_messages():
    cell = measure(requests=4, blocks=2, held=500, reps=3, together=3)
    assert cell["events"] == 4 * 3 and cell["read_together"] == 3
    assert cell["per-block"] > 0 and cell["engine"] > 0 and cell["together"] > 0


def test_the_command_writes_its_results_folder(tmp_path):
    assert main(["--requests", "2", "--blocks", "1", "--held", "300", "--reps", "2", "--out", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert "python -m bench kv-intake" in readme and "| 2 | 1 | 4 |" in readme
