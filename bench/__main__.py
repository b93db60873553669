"""``python -m bench <command> [args]``: run one benchmark; ``python -m bench --help`` lists them,
``python -m bench <command> --help`` gives a command's options.

The list is read from each command module's docstring without importing it, and only the
chosen command is imported: ``kv-event-sizes`` runs in vLLM's environment, where the gateway's
dependencies may be missing, and the others never import vLLM.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path

from .commands import COMMANDS, module_of


def describe(command: str) -> str:
    """The first line of ``command``'s module docstring."""
    path = Path(__file__).with_name("commands") / (command.replace("-", "_") + ".py")
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m bench", description="Every benchmark of prefix-router, one "
                                  "command each; python -m bench <command> --help gives its options.",
                                  epilog="Each writes bench/results/<command>/ (README.md: the command line, the "
                                         "commit, the date and the machine, then the figures).")
    commands = top.add_subparsers(title="commands", metavar="<command>")
    for command in COMMANDS:
        commands.add_parser(command, help=describe(command), add_help=False)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return importlib.import_module(module_of(argv[0])).main(argv[1:])
    parser().parse_args(argv or ["--help"])  # --help, or an error naming the commands
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
