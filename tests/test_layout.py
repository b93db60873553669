"""The package's layout holds: the gateway's runtime never imports the tools beside it, its pure
layers (routing, the cache picture) import no HTTP, no module imports one that imports it, it
reads in one sitting, and every module with logic has a test module named after it."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
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


# The reading rule for the gateway's runtime: no function over about 60 lines, no file over
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


# --- a test module per runtime module ----------------------------------------------------------

TESTS = Path(__file__).resolve().parent

# Modules with logic of their own but no test module named after them, each with the reason and
# the tests that cover it. Keep it short: a module that can be tested alone gets its test module.
NO_TEST_MODULE = {
    "config/reference.py": "writes docs/configuration.md from the schema; tests/test_docs.py checks the file is its output",
    "epp/server.py": "the gRPC server Envoy calls and its health services: tests/e2e/test_epp.py, behind a real Envoy",
    "tools/sim/kv_events.py": "vLLM's KV event structs re-declared: tests/vllm_tier/test_kv_events_vllm.py holds them to "
                              "vLLM's own; tests/cache/ decodes and follows them",
    "tools/tiny_model.py": "builds the real-engine tier's model (torch): tests/vllm_tier/ serves it; "
                           "tests/prompts/test_tokenizer.py builds its tokenizer",
}


def _has_logic(path: Path) -> bool:
    """A function, or a class with a method, at the module's top level (constants, enums and
    plain dataclasses need no test module of their own)."""
    methods = (ast.FunctionDef, ast.AsyncFunctionDef)
    return any(isinstance(node, methods) or isinstance(node, ast.ClassDef) and any(isinstance(n, methods) for n in node.body)
               for node in ast.parse(path.read_text()).body)


def _mirror(module: Path) -> Path:
    """``prefix_router/<pkg>/<module>.py`` -> ``tests/<pkg>/test_<module>.py``."""
    return TESTS.joinpath(*module.parts[:-1], f"test_{module.name}")


def test_every_runtime_module_with_logic_has_a_test_module():
    """Each module under ``prefix_router/`` (tools included; package ``__init__`` files re-export
    and hold no logic) that defines a function or a class with methods has its unit tests in
    ``tests/<package>/test_<module>.py``, or an entry in ``NO_TEST_MODULE`` saying why not. The
    message names each missing test module."""
    package = Path(prefix_router.__file__).parent
    modules = sorted(p.relative_to(package) for p in package.rglob("*.py") if p.name != "__init__.py")
    with_logic = [m for m in modules if _has_logic(package / m)]
    assert len(with_logic) > 60  # the walk found the package
    missing = [f"tests/{_mirror(m).relative_to(TESTS).as_posix()} (for prefix_router/{m.as_posix()})"
               for m in with_logic if m.as_posix() not in NO_TEST_MODULE and not _mirror(m).exists()]
    assert missing == [], "runtime modules without a test module named after them (write it, or give the reason " \
                          "in NO_TEST_MODULE):\n  " + "\n  ".join(missing)
    stale = [name for name in NO_TEST_MODULE if Path(name) not in with_logic or _mirror(Path(name)).exists()]
    assert stale == [], f"NO_TEST_MODULE names modules that are gone, have no logic or have a test module: {stale}"


def test_every_test_folder_is_a_package():
    """pytest names a test module by its package path (rootdir ``tests`` with ``__init__.py``
    files), so ``tests/fleet/test_tenants.py`` and another ``test_tenants.py`` elsewhere do not
    collide; a folder without ``__init__.py`` would make them."""
    folders = {p.parent for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts}
    assert sorted(f.relative_to(TESTS).as_posix() for f in folders if not (f / "__init__.py").exists()) == []


# What a lab notebook looks like in a comment: a date, an A/B arrow between two figures, a timing.
# Measurements live in docs/ and bench/results/ beside their command; code keeps the reason.
NOTEBOOK = re.compile(r"\b20\d\d-\d\d-\d\d\b"  # a date
                      r"|\b\d+(?:\.\d+)?x? -> \d+(?:\.\d+)?"  # before -> after
                      r"|\b\d+(?:\.\d+)? ?ms\b")  # a timing in milliseconds


def _notes(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in a module's source."""
    notes = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                notes.append((node.body[0].lineno, doc))
    return notes


def test_no_runtime_comment_carries_benchmark_figures():
    """Runtime docstrings and comments give a rule and its reason, and link the figures
    (``docs/routing-rule.md``, ``docs/performance-notes.md``, ``bench/results/``): a dated A/B
    history or a timing measured on one machine goes stale in code nobody re-measures."""
    found = [f"{path.relative_to(Path(prefix_router.__file__).parent.parent)}:{line}: {m.group(0)!r}"
             for path in _runtime_files() for line, note in _notes(path.read_text())
             for m in NOTEBOOK.finditer(note)]
    assert found == []
    assert NOTEBOOK.search("# took 0.852 -> 0.860 (3 runs)") and NOTEBOOK.search("took 1.3 ms")
    assert not NOTEBOOK.search("# block -> replica map, 16 tokens a block")
