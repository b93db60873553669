"""``bench.report``: every results folder says how, where and when its figures were made."""

from __future__ import annotations

import json

from bench.report import command_line, commit_of, write_results


def test_the_readme_header_gives_command_commit_date_and_machine(tmp_path):
    command = command_line("bench.commands.hostile_bodies", ["--tree", "../a b"])
    assert command == "python -m bench hostile-bodies --tree '../a b'"
    write_results(tmp_path / "out", "A title", command, ["| a | b |"], {"figure": 1.5}, echo=False)
    readme = (tmp_path / "out" / "README.md").read_text().splitlines()
    assert readme[0] == "# A title"
    assert readme[2] == f"- Command: `{command}`"
    assert readme[3].startswith("- Commit: ") and readme[4].startswith("- Date: 20")
    assert readme[5].startswith("- Machine: ") and "cores" in readme[5] and "Python" in readme[5]
    assert readme[-1] == "| a | b |"
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["command"] == command and data["results"] == {"figure": 1.5} and data["machine"]["cores"] >= 1


def test_a_folder_outside_git_is_named_by_its_name(tmp_path):
    assert commit_of(tmp_path) == tmp_path.name
