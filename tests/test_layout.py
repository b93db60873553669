"""The package's layout holds: the gateway's runtime never imports the tools beside it, and
reads in one sitting."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import router


def test_the_gateway_runtime_imports_none_of_the_tools_beside_it():
    """``router/tools/`` (simulator, replayer, demo, audit, gate, launcher) stays off the request
    path: serving with every runtime module loaded pulls in none of them."""
    code = ("import pkgutil, importlib, sys, router\n"
            "for m in pkgutil.iter_modules(router.__path__):\n"
            "    if m.name not in ('tools', 'cli'):\n"
            "        importlib.import_module('router.' + m.name)\n"
            "print(sorted(n for n in sys.modules if n.startswith('router.tools')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# Issue 16's reading rule for the gateway's runtime: no function over about 60 lines, no file over
# about 400 (docstrings included); the margins are the "about".
MAX_FUNCTION_LINES = 65
MAX_FILE_LINES = 420


def _runtime_files() -> list[Path]:
    package = Path(router.__file__).parent
    return sorted(p for p in package.rglob("*.py") if "tools" not in p.relative_to(package).parts)


def test_the_runtime_reads_in_one_sitting():
    """Every runtime module stays under MAX_FILE_LINES and every function in it under
    MAX_FUNCTION_LINES; the message names each offender and its length."""
    files, too_long = _runtime_files(), []
    for path in files:
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            too_long.append(f"{path.name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
    assert len(files) > 20  # the walk found the package
    assert too_long == []
