"""``prefix-router replay`` on the command line (``prefix_router/tools/replay/cli.py``)."""

from __future__ import annotations

import argparse

import pytest

from prefix_router.tools.replay.cli import add_parser as add_replay_parser
from prefix_router.tools.replay.cli import run as replay_cli_run


@pytest.mark.parametrize("name", ["missing.jsonl", "missing.traj"])
def test_the_replay_cli_exits_2_when_the_trace_file_is_missing(tmp_path, capsys, name):
    parser = argparse.ArgumentParser()
    add_replay_parser(parser.add_subparsers())
    args = parser.parse_args(["replay", "--target", "http://127.0.0.1:9", "--trace", str(tmp_path / name)])
    assert replay_cli_run(args) == 2
    assert "prefix-router replay:" in capsys.readouterr().err
