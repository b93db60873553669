"""``python -m bench``: one tool whose ``--help`` lists every command module, each runnable by name.

A command module that ``bench.commands.COMMANDS`` forgets would be a benchmark nobody finds: the
first test lists ``bench/commands/`` and checks each file against ``--help``'s output.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import bench
from bench.__main__ import main
from bench.commands import COMMANDS, module_of

COMMAND_DIR = Path(bench.__file__).with_name("commands")


def _help() -> str:
    return subprocess.run([sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, check=True,
                          cwd=bench.ROOT).stdout


def test_help_lists_every_command_module():
    modules = sorted(p.stem for p in COMMAND_DIR.glob("*.py") if p.name != "__init__.py")
    assert sorted(c.replace("-", "_") for c in COMMANDS) == modules
    listed = _help()
    for command in COMMANDS:
        assert f"    {command}" in listed, f"{command} missing from python -m bench --help"


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_a_main_and_a_one_line_description(command):
    path = Path(module_of(command).replace(".", "/") + ".py")
    tree = ast.parse((bench.ROOT / path).read_text())
    assert any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body), path
    doc = ast.get_docstring(tree)
    assert doc and doc.split("\n\n")[0].strip().endswith((".", ")")), path
    assert not any(isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) for node in tree.body), (
        f"{path}: run it as python -m bench {command}, not as a module of its own")


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "kv-event-sizes"])  # that one needs vLLM's venv
def test_each_command_answers_help_with_its_own_name(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert f"usage: python -m bench {command}" in capsys.readouterr().out


def test_an_unknown_command_is_refused_with_the_list():
    out = subprocess.run([sys.executable, "-m", "bench", "no-such-bench"], capture_output=True, text=True,
                         cwd=bench.ROOT)
    assert out.returncode == 2 and "invalid choice" in out.stderr and "overhead" in out.stderr
