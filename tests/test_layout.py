"""The package's layout holds: the gateway's runtime never imports the tools beside it."""

from __future__ import annotations

import subprocess
import sys


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
