"""The configuration reference of ``docs/configuration.md``, generated from the schema.

``python -m prefix_router.config.reference`` prints the markdown that sits between the page's
markers; ``--write docs/configuration.md`` puts it there. ``tests/test_docs.py`` fails when the
page differs from what this prints, so the reference follows the schema without a hand-kept
list of fields: every key comes from the dataclasses of ``schema.py`` and ``routing_schema.py``
(walked from ``GatewayConfig``), its meaning from the comment above or beside its field (read with
``tokenize``, since comments are not in the syntax tree), its default from the dataclass, what it
accepts from its type annotation and from the value check ``load.py`` applies
(``checks.CHECKS``, asked with a value every check refuses), and the shorthand and removed keys
from ``checks.SHORTHAND`` and ``checks.REMOVED``.

Fields without a comment of their own share the comment of the field above them when they
follow it on the next line (``cooldown_s`` and ``max_cooldown_s``): the schema writes one
comment for such a group, and the reference gives the group one row.

A documentation tool: the gateway's runtime never imports it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import sys
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

from prefix_router.config import checks, routing_schema, schema

__all__ = ["BEGIN", "END", "field_comments", "reference", "splice"]

BEGIN = "<!-- BEGIN GENERATED: python -m prefix_router.config.reference -->"
END = "<!-- END GENERATED -->"


@dataclasses.dataclass(frozen=True)
class _Comment:
    text: str  # the comment's words, '#' and line breaks removed
    above: bool  # written on the lines above the field (so the fields right after share it)


def _comment_lines(source: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text, whether the comment is the line's only content)."""
    found: dict[int, tuple[str, bool]] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            alone = not token.line[:col].strip()
            found[row] = (token.string.lstrip("#").strip(), alone)
    return found


def field_comments(source: str) -> dict[str, list[tuple[list[str], str]]]:
    """Class name -> its fields in groups, each ``(field names, comment)``, in source order.

    A field's comment is the block of comment-only lines right above it, else the comment at the
    end of its line; a field with neither, on the line after the previous field, joins that
    field's group when the group's comment was written above it. Any other field without a
    comment gets ``""``.
    """
    comments = _comment_lines(source)
    lines = source.splitlines()
    out: dict[str, list[tuple[list[str], str]]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        groups: list[tuple[list[str], _Comment]] = []
        previous_end = -1
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            comment = _comment_for(stmt, comments, lines)
            if comment is None and groups and groups[-1][1].above and stmt.lineno == previous_end + 1:
                groups[-1][0].append(stmt.target.id)
            else:
                groups.append(([stmt.target.id], comment or _Comment("", False)))
            previous_end = stmt.end_lineno or stmt.lineno
        if groups:
            out[node.name] = [(names, comment.text) for names, comment in groups]
    return out


def _comment_for(stmt: ast.AnnAssign, comments: dict[int, tuple[str, bool]], lines: list[str]) -> _Comment | None:
    above: list[str] = []
    row = stmt.lineno - 1
    while row in comments and comments[row][1]:
        above.insert(0, comments[row][0])
        row -= 1
    if above:
        return _Comment(" ".join(above), True)
    beside = [comments[r][0] for r in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
              if r in comments and not comments[r][1]]
    return _Comment(" ".join(beside), False) if beside else None


# --- what a field accepts and defaults to ---------------------------------------------------------

def _optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _type_text(inner: Any) -> str:
    if typing.get_origin(inner) is tuple:
        item = typing.get_args(inner)[0]
        return "a list of mappings" if dataclasses.is_dataclass(item) else f"a list of {_TYPE_NAMES[item][2:]}s"
    return _TYPE_NAMES[inner]


def _probe(inner: Any) -> Any:
    """A value of type ``inner`` that every check of such a field refuses: NaN fails every range,
    the empty string every form, a list holding one empty string every list check."""
    if typing.get_origin(inner) is tuple:
        return ("",)
    return float("nan") if inner in (int, float) else ""


def _expectation(check: Any, inner: Any) -> str | None:
    try:
        check(_probe(inner))
    except checks.Reject as exc:
        return exc.problem or str(exc)
    return None  # pragma: no cover - a check that accepts the probe says nothing more


def _accepts(cls: type, name: str, tp: Any) -> str:
    """What the field takes, as the loader checks it: its type, narrowed by the expectation its
    value check states in a ``ConfigError`` ("an integer >= 1", "one of 'http', 'https'")."""
    inner, optional = _optional(tp)
    text = _type_text(inner)
    check = checks.CHECKS.get((cls, name))
    expected = _expectation(check, inner) if check is not None else None
    if expected and expected.startswith("a value "):
        text = f"{text} {expected[len('a value '):]}"
    elif expected and inner is str:
        text = expected
    elif expected:
        text = f"{text}: {expected}"
    return f"{text}, or null" if optional else text


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if value == "":
        return '""'
    return str(value)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _yaml(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _yaml(f.default_factory())
    return "(required)"


# --- the page ------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    """Comment text as a table cell: no '|' to end the cell, no '<' to open an HTML tag."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;") or "-"


def _sections(cls: type, path: str) -> list[tuple[str, type]]:
    """``(key path, dataclass)`` of ``cls`` and every dataclass nested in it, depth first."""
    found = [(path, cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner, _ = _optional(hints[f.name])
        sub = f"{path}.{f.name}" if path else f.name
        if typing.get_origin(inner) is tuple and dataclasses.is_dataclass(typing.get_args(inner)[0]):
            found += _sections(typing.get_args(inner)[0], sub + "[]")
        elif dataclasses.is_dataclass(inner):
            found += _sections(inner, sub)
    return found


def _section(path: str, cls: type, groups: list[tuple[list[str], str]]) -> list[str]:
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    title = f"`{path}`" if path else "Top level"
    doc = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    out = [f"### {title}", "", f"{doc} Schema: `{cls.__name__}`.", ""]
    if cls in checks.SHORTHAND:
        out += [f"A plain string in place of the mapping is shorthand for `{{{checks.SHORTHAND[cls]}: ...}}`.", ""]
    out += ["| key | default | accepts | meaning |", "| --- | --- | --- | --- |"]
    prefix = f"{path}." if path else ""
    for names, comment in groups:
        leaves = [n for n in names if not _is_section(hints[n])]
        if not leaves:
            continue
        keys = ", ".join(f"`{prefix}{n}`" for n in leaves)
        defaults = ", ".join(_default(by_name[n]) for n in leaves)
        by_text: dict[str, list[str]] = {}
        for n in leaves:
            by_text.setdefault(_accepts(cls, n, hints[n]), []).append(n)
        accepts = (next(iter(by_text)) if len(by_text) == 1 else "; ".join(
            ", ".join(f"`{n}`" for n in group) + f": {text}" for text, group in by_text.items()))
        out.append(f"| {keys} | {_cell(defaults)} | {_cell(accepts)} | {_cell(comment)} |")
    return out + [""]


def _is_section(tp: Any) -> bool:
    inner, _ = _optional(tp)
    if typing.get_origin(inner) is tuple:
        return dataclasses.is_dataclass(typing.get_args(inner)[0])
    return dataclasses.is_dataclass(inner)


def reference(source: str | None = None) -> str:
    """The reference's markdown, from the text of ``schema.py`` and ``routing_schema.py``
    (``source``: one text holding every class, for tests)."""
    sources = [source] if source is not None else [Path(m.__file__).read_text(encoding="utf-8")
                                                   for m in (schema, routing_schema)]
    comments = {name: groups for text in sources for name, groups in field_comments(text).items()}
    sections = _sections(schema.GatewayConfig, "")
    out = ["Generated from `prefix_router/config/schema.py` by `python -m prefix_router.config.reference`;",
           "each meaning is the comment on its field there. \"accepts\" is what the loader checks; a",
           "value it refuses stops the gateway at start with the key's path and that expectation.", ""]
    for path, cls in sections:
        out += _section(path, cls, comments.get(cls.__name__, []))
    paths = {cls: path for path, cls in sections}
    if checks.REMOVED:
        out += ["### Removed keys", "",
                "Settings of earlier releases; a file that still sets one is refused with what replaced it:", ""]
        for cls, name in sorted(checks.REMOVED, key=lambda k: (paths[k[0]], k[1])):
            key = f"{paths[cls]}.{name}" if paths[cls] else name
            out.append(f"- `{key}`: {checks.REMOVED[cls, name]}")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def splice(page: str, generated: str) -> str:
    """``page`` with the text between its markers replaced by ``generated``.

    Raises:
        ValueError: the page lacks a marker.
    """
    if BEGIN not in page or END not in page:
        raise ValueError(f"the page lacks the markers {BEGIN!r} and {END!r}")
    head, _, rest = page.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{generated}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefix_router.config.reference",
                                     description="Print the configuration reference generated from the schema.")
    parser.add_argument("--write", metavar="PAGE", help="replace the text between the markers of PAGE "
                                                        "(docs/configuration.md) instead of printing it")
    args = parser.parse_args(argv)
    text = reference()
    if args.write is None:
        sys.stdout.write(text)
        return 0
    page = Path(args.write)
    page.write_text(splice(page.read_text(encoding="utf-8"), text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
