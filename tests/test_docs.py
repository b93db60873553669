"""The documentation holds: every repository path that the README, ``docs/`` and the docstrings
and comments of the package, the benchmarks and the tests cite exists, the configuration reference is the one the schema
generates, and the README stays a front page."""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import tokenize
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefix_router.config import schema
from prefix_router.config.reference import BEGIN, END, field_comments, reference, splice

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = ".venv/bin/python -m prefix_router.config.reference --write docs/configuration.md"

# Entries of a working tree that are not the project's (virtual environments, caches): a path
# into them is not a citation of the repository.
LOCAL_ONLY = {".git", ".venv", ".venv-vllm", ".venv-peers", ".cache", ".pytest_cache", ".hypothesis",
              ".mypy_cache", ".ruff_cache", "__pycache__", "build", "dist"}
# Top-level entries since renamed: a path through one is a citation the rename missed.
FORMER = {"router": "prefix_router"}
# Other projects' paths that start like one of ours: the Gateway API Inference Extension's
# docs/proposals/ (the Endpoint Picker protocol, cited by prefix_router/epp/).
OTHER_PROJECTS = ("docs/proposals/",)


@dataclass(frozen=True)
class Citation:
    where: str  # file and line, e.g. README.md:12
    path: str  # as cited, relative to the repository root


def top_level(root: Path) -> set[str]:
    """The names a cited path must start with to count: the repository's top-level entries
    (and their former names), so ``../shared/...``, ``vllm/entrypoints/...`` and other projects'
    paths are left alone."""
    names = {p.name for p in root.iterdir() if p.name not in LOCAL_ONLY and not p.name.endswith(".egg-info")}
    return names | set(FORMER)


def _pattern(names: set[str]) -> re.Pattern[str]:
    # not inside a longer path or word: ../shared/x holds "shared/x", which names no path of ours
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"(?<![\w./~$-])((?:{alternatives})/[\w.*/-]*)")


def _clean(path: str) -> str:
    return path.rstrip(".,")


def paths_in(text: str, names: set[str], where: str, first_line: int = 1) -> list[Citation]:
    """Every ``name/...`` path in ``text`` whose first component is one of ``names``."""
    pattern = _pattern(names)
    return [Citation(f"{where}:{first_line + n}", _clean(m.group(1)))
            for n, line in enumerate(text.splitlines()) for m in pattern.finditer(line)
            if not m.group(1).startswith(OTHER_PROJECTS)]


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def markdown_citations(text: str, page: str, root: Path) -> list[Citation]:
    """Paths in a markdown page (``page`` relative to ``root``): repository paths anywhere in
    its text, and relative link targets resolved against the page's folder (anchors dropped)."""
    found = paths_in(text, top_level(root), page)
    folder = (root / page).parent
    for n, line in enumerate(text.splitlines(), start=1):
        for m in _LINK.finditer(line):
            target = m.group(1).split("#", 1)[0]
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            resolved = (folder / target).resolve()
            if resolved.is_relative_to(root.resolve()):
                found.append(Citation(f"{page}:{n}", resolved.relative_to(root.resolve()).as_posix()))
    return found


def python_citations(text: str, module: str, root: Path) -> list[Citation]:
    """Paths in a module's comments and docstrings (not in its code's strings)."""
    names = top_level(root)
    found = [c for token in tokenize.generate_tokens(io.StringIO(text).readline) if token.type == tokenize.COMMENT
             for c in paths_in(token.string, names, module, token.start[0])]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found += paths_in(first.value.value, names, module, first.lineno)
    return found


def missing(citations: list[Citation], root: Path) -> list[str]:
    """``where: path`` for each citation naming nothing in ``root`` (a glob: nothing it matches)."""
    out = []
    for c in citations:
        path = c.path.rstrip("/")
        exists = any(root.glob(path)) if "*" in path else (root / path).exists()
        if not exists:
            first = path.split("/", 1)[0]
            hint = f" ({first}/ is now {FORMER[first]}/)" if first in FORMER else ""
            out.append(f"{c.where}: {c.path}{hint}")
    return out


def all_citations(root: Path) -> list[Citation]:
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    found = [c for page in pages if page.exists()
             for c in markdown_citations(page.read_text(encoding="utf-8"), page.relative_to(root).as_posix(), root)]
    for folder in ("prefix_router", "bench", "tests"):  # the package, and what measures and tests it
        for module in sorted((root / folder).rglob("*.py")):
            found += python_citations(module.read_text(encoding="utf-8"), module.relative_to(root).as_posix(), root)
    return found


def test_cited_paths_exist():
    citations = all_citations(ROOT)
    assert len(citations) > 100  # the walk found the README, the docs and the package
    broken = missing(citations, ROOT)
    assert not broken, "cited paths that do not exist (where: path):\n" + "\n".join(broken)


def test_the_citation_check_on_a_small_repository(tmp_path):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "load.md").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("")
    (tmp_path / ".venv").mkdir()
    page = ("See `bench/results/load.md`, `bench/results/gone.md` and [the design](design.md),\n"
            "[a lost page](lost.md#anchor), [vLLM](https://github.com/vllm-project/vllm/tree/main/docs/x.md),\n"
            "`../shared/traces/x.jsonl`, `vllm/entrypoints/cli.py`, `.venv/bin/python`, bench/results/*.md\n"
            "and the old `router/kvstream.py`; sglang-router/docs/x.md is another project's.\n")
    citations = markdown_citations(page, "docs/index.md", tmp_path)
    assert [c.path for c in citations] == ["bench/results/load.md", "bench/results/gone.md", "bench/results/*.md",
                                           "router/kvstream.py", "docs/design.md", "docs/lost.md"]
    assert missing(citations, tmp_path) == ["docs/index.md:1: bench/results/gone.md",
                                            "docs/index.md:4: router/kvstream.py (router/ is now prefix_router/)",
                                            "docs/index.md:2: docs/lost.md"]
    module = ('"""Reads ``bench/results/load.md``."""\n'
              'PATH = "bench/results/code-string.md"  # written to bench/results/gone.md\n'
              'def f():\n    """See docs/design.md\n    and docs/nothing.md."""\n')
    assert [(c.where, c.path) for c in python_citations(module, "m.py", tmp_path)] == [
        ("m.py:2", "bench/results/gone.md"), ("m.py:1", "bench/results/load.md"),
        ("m.py:4", "docs/design.md"), ("m.py:5", "docs/nothing.md")]


def test_configuration_reference_is_current():
    """docs/configuration.md holds, between its markers, what the generator prints now: the
    schema's comments change, and the page must follow them."""
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert BEGIN in page and END in page, f"docs/configuration.md lacks its markers; restore them and run {REGENERATE}"
    assert splice(page, reference()) == page, (
        f"docs/configuration.md's reference differs from prefix_router/config/schema.py: run {REGENERATE}")


def _keys(cls: type, path: str = "") -> list[str]:
    """Every leaf key of ``cls`` as the YAML names it (``routing.load_factor``, ``replicas[].url``)."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if typing.get_origin(tp) is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            out += _keys(typing.get_args(tp)[0], f"{path}{f.name}[].")
        elif dataclasses.is_dataclass(tp):
            out += _keys(tp, f"{path}{f.name}.")
        else:
            out.append(f"{path}{f.name}")
    return out


def test_the_reference_names_every_key():
    text = reference()
    keys = _keys(schema.GatewayConfig)
    assert "routing.load_factor" in keys and "auth.tenants[].name" in keys
    for key in keys:
        assert f"`{key}`" in text, f"the configuration reference lacks {key}"


def test_the_reference_reads_each_fields_comment():
    source = ("class C:\n"
              "    a: int = 1  # beside a\n"
              "    # above b,\n"
              "    # two lines\n"
              "    b: int = 2\n"
              "    c: int = 3\n"
              "\n"
              "    d: int = 4\n"
              "    e: int = 5  # beside e\n"
              "    f: int = 6\n")
    assert field_comments(source) == {"C": [(["a"], "beside a"), (["b", "c"], "above b, two lines"),
                                            (["d"], ""), (["e"], "beside e"), (["f"], "")]}


def test_the_readme_stays_a_front_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.count("\n") <= 250
    for command in ("make demo", "make test"):
        assert command in readme
    for page in ("design.md", "configuration.md", "operations.md", "deploying.md", "benchmarks.md"):
        assert f"(docs/{page})" in readme, f"the README does not link docs/{page}"


def slug(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_anchors(root: Path) -> list[str]:
    """``page:line: target#anchor`` for each link between markdown pages whose anchor names no
    heading of the target page."""
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    headings = {p.resolve(): {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", p.read_text(encoding="utf-8"), re.M)}
                for p in pages}
    out = []
    for page in pages:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
            for m in _LINK.finditer(line):
                target, _, anchor = m.group(1).partition("#")
                resolved = (page.parent / target).resolve() if target else page.resolve()
                if anchor and resolved in headings and anchor not in headings[resolved]:
                    out.append(f"{page.relative_to(root).as_posix()}:{n}: {m.group(1)}")
    return out


def test_links_between_pages_reach_their_headings():
    assert slug("### `random` with one shared prefix: the two bars cannot both hold".lstrip("# ")) == \
        "random-with-one-shared-prefix-the-two-bars-cannot-both-hold"
    assert slug("/debug/changes") == "debugchanges"
    broken = broken_anchors(ROOT)
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme_or_another_page():
    pages = sorted((ROOT / "docs").rglob("*.md"))
    linked = {c.path for page in [ROOT / "README.md", *pages]
              for c in markdown_citations(page.read_text(encoding="utf-8"), page.relative_to(ROOT).as_posix(), ROOT)
              if c.path != page.relative_to(ROOT).as_posix()}
    orphans = [p.relative_to(ROOT).as_posix() for p in pages if p.relative_to(ROOT).as_posix() not in linked]
    assert not orphans, f"docs pages nothing links to: {orphans}"


@pytest.mark.parametrize("page", ["design.md", "configuration.md", "operations.md", "deploying.md",
                                  "simulator-and-replay.md", "testing.md", "benchmarks.md", "routing-rule.md"])
def test_every_docs_page_is_there(page):
    assert (ROOT / "docs" / page).is_file()


def test_the_design_page_names_every_module_of_the_package():
    """docs/design.md's architecture (a table row per folder of ``prefix_router/``, then the
    modules at the top) names each module where it is, so the layout it describes stays the
    package's: a module added, moved or renamed fails here until the page follows."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    architecture = text[text.index("## Architecture"):]
    package = ROOT / "prefix_router"
    rows = dict(re.findall(r"^\| `prefix_router/(\w+)/` \| (.*) \|$", architecture, re.M))
    problems = []
    for folder in sorted(p for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        named = set(re.findall(r"`([\w/]+(?:\.py|/))`", rows.get(folder.name, "")))
        actual = {p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                  if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())}
        problems += [f"prefix_router/{folder.name}/{m} is not named" for m in sorted(actual - named)]
        problems += [f"prefix_router/{folder.name}/{m} is named but not there" for m in sorted(named - actual)]
    top = architecture[architecture.index("At the top"):]
    problems += [f"prefix_router/{p.name} is not named" for p in sorted(package.glob("*.py"))
                 if p.name != "__init__.py" and f"`{p.name}`" not in top]
    assert not problems, "docs/design.md's architecture differs from the package:\n" + "\n".join(problems)


def test_the_gateway_never_imports_the_reference_generator():
    """``prefix_router/config/reference.py`` is a documentation tool: no module of the package
    imports it (``prefix_router/config/__init__.py`` included), so serving never loads it."""
    importers = []
    for module in sorted((ROOT / "prefix_router").rglob("*.py")):
        if module.name == "reference.py" and module.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # from X import reference, from .reference import Y
                targets = [node.module or "", *(f"{node.module or ''}.{a.name}" for a in node.names)]
            else:
                continue
            if any(t.split(".")[-1] == "reference" and "config" in module.parts + tuple(t.split(".")) for t in targets):
                importers.append(module.relative_to(ROOT).as_posix())
    assert importers == []
