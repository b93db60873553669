"""The package's layout holds: the gateway's runtime never imports the tools beside it, its pure
layers (routing, the cache picture) import no HTTP, no module imports one that imports it, and
it reads in one sitting."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import prefix_router


def test_the_gateway_runtime_imports_none_of_the_tools_beside_it():
    """``prefix_router/tools/`` (simulator, replayer, demo, audit, gate, launcher) stays off the request
    path: serving with every runtime module loaded pulls in none of them."""
    package = Path(prefix_router.__file__).parent
    runtime = [".".join(("prefix_router", *p.relative_to(package).with_suffix("").parts))
               for p in _runtime_files() if p.name != "__init__.py" and p != package / "cli.py"]
    assert len(runtime) > 40  # the walk found the package
    code = ("import importlib, sys\n"
            f"for name in {runtime!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(n for n in sys.modules if n.startswith('prefix_router.tools')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# Issue 16's reading rule for the gateway's runtime: no function over about 60 lines, no file over
# about 400 (docstrings included); the margins are the "about".
MAX_FUNCTION_LINES = 65
MAX_FILE_LINES = 420


def _runtime_files() -> list[Path]:
    package = Path(prefix_router.__file__).parent
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


def _imports(package: Path) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports (``from . import``, ``from .x import y``,
    ``import prefix_router.x``), lazy and ``TYPE_CHECKING`` imports included: a circle hidden in a
    function is still a circle a reader must hold in mind."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                for alias in node.names:
                    found = next((t for t in (f"{target}.{alias.name}", target) if t in modules), None)
                    if found is not None and found != name:
                        graph[name].add(found)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules and a.name != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it():
    graph = _imports(Path(prefix_router.__file__).parent)
    assert len(graph) > 40 and graph["prefix_router.serve.proxy"]  # the walk found the package and its imports
    assert _circles(graph) == [], "import circles (each a group of modules that import each other)"
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check sees one


PURE_LAYERS = ("prefix_router.routing", "prefix_router.cache")


@pytest.mark.parametrize("layer", PURE_LAYERS)
def test_routing_and_the_cache_picture_import_no_http(layer):
    """The choice and the cache picture are pure: importing every module of ``layer`` (in a fresh
    interpreter, so what they pull in transitively counts) loads neither aiohttp nor the HTTP layer
    (``prefix_router.serve``). The fleet simulator and the Endpoint Picker reuse them without a
    web server."""
    code = ("import importlib, pkgutil, sys\n"
            f"layer = importlib.import_module({layer!r})\n"
            "for m in pkgutil.walk_packages(layer.__path__, layer.__name__ + '.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(len(list(pkgutil.walk_packages(layer.__path__))))\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'aiohttp' and n.count('.') == 0\n"
            "             or n.startswith('prefix_router.serve')))\n")
    count, loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   check=True).stdout.split("\n", 1)
    assert int(count) >= 3  # the walk found the layer's modules
    assert loaded.strip() == "[]"
