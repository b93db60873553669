"""Loading the gateway configuration (``schema.py``) from YAML, checked once.

``load_config`` reads a YAML file, deep-merges ``overrides`` (what the CLI flags become) over
it, and builds a ``GatewayConfig``. Validation is driven by the dataclass fields and their type
annotations, so a new field needs no new checking code; value ranges live in one table
(``CHECKS``). Every problem is a ``ConfigError`` whose message starts with the key path, e.g.
``routing.virtual_nodes: expected an integer, got 'many' (str)``, so an operator can find the
line to fix. The rules:

- Unknown keys are errors (a typo such as ``vitrual_nodes`` must not silently keep a default).
- Types are strict: ``true`` is not an integer and ``1`` is not a boolean; an integer is
  accepted where a number (float) is expected; ``null`` only where the field allows None.
- A ``replicas`` entry may be a plain URL string, shorthand for ``{url: ...}``; trailing
  slashes of replica URLs are dropped so ``http://a:8000/`` and ``http://a:8000`` are one
  replica, and the same replica listed twice is an error (use ``weight``).
- Duplicate keys in one YAML mapping are errors (PyYAML would keep the last one silently).

Exceptions::

    ValueError
     └── ConfigError   bad file, bad YAML, or a value of the wrong type or out of range
"""

from __future__ import annotations

import difflib
import functools
import os
import types
import typing
from collections.abc import Hashable, Mapping
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

import yaml

from prefix_router.endpoints import Kind, kind_of
from prefix_router.config.checks import CHECKS, REMOVED, SHORTHAND, Reject
from prefix_router.config.schema import AuthConfig, ConfigError, GatewayConfig

__all__ = ["load_config", "config_from_dict"]


# --- generic conversion ------------------------------------------------------------------

def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _optional_inner(tp: Any) -> Any | None:
    """``X`` for an annotation ``X | None``, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _describe(tp: Any) -> str:
    """What a value of annotation ``tp`` looks like in YAML, for error messages."""
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{_describe(inner)} or null"
    if typing.get_origin(tp) is tuple:
        return "a list"
    if is_dataclass(tp):
        return "a URL string or a mapping" if tp in SHORTHAND else "a mapping"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names[tp]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp`` and return it in the field's type.

    Raises:
        ConfigError: on a type mismatch, here or in a nested mapping or list.
        TypeError: for an annotation this loader does not support (a programming error).
    """
    declared = tp
    inner = _optional_inner(tp)
    if inner is not None:
        if value is None:
            return None
        tp = inner
    if is_dataclass(tp):
        if isinstance(value, str) and tp in SHORTHAND:
            value = {SHORTHAND[tp]: value}
        if isinstance(value, Mapping):
            return _build(tp, value, path)
    elif typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"unsupported config annotation {declared!r} at {path}")
        if isinstance(value, (list, tuple)):
            items, problems = [], []
            for i, item in enumerate(value):  # every item's problems, not only the first's
                try:
                    items.append(_convert(args[0], item, f"{path}[{i}]"))
                except ConfigError as exc:
                    problems += str(exc).splitlines()
            if problems:
                raise ConfigError("\n".join(problems))
            return tuple(items)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported config annotation {declared!r} at {path}")
    raise ConfigError(f"{path}: expected {_describe(declared)}, got {_show(value)} "
                      f"({type(value).__name__})")


def _build(cls: type, data: Mapping[Any, Any], path: str) -> Any:
    """Build dataclass ``cls`` from a mapping, checking keys, types and ranges. Raises
    ConfigError naming every problem found in it and in what it holds, one a line."""
    known = [f.name for f in fields(cls)]
    problems: list[str] = []
    for key in data:
        if (cls, key) in REMOVED:
            problems.append(f"{_join(path, str(key))}: no longer a setting; {REMOVED[cls, key]}")
        elif key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            problems.append(f"{_join(path, str(key))}: unknown key; expected one of: {', '.join(known)}{suggestion}")
    values: dict[str, Any] = {}
    for f in fields(cls):
        key_path = _join(path, f.name)
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                problems.append(f"{key_path}: required key missing")
            continue
        try:
            values[f.name] = _checked(cls, f.name, _convert(_hints(cls)[f.name], data[f.name], key_path), key_path)
        except ConfigError as exc:
            problems += str(exc).splitlines()
    if problems:
        raise ConfigError("\n".join(problems))
    return cls(**values)


def _checked(cls: type, name: str, value: Any, key_path: str) -> Any:
    """``value`` after the range check of ``cls``'s field ``name``, if it has one. Raises
    ConfigError naming ``key_path``."""
    check = CHECKS.get((cls, name))
    if check is None or value is None:
        return value
    try:
        return check(value)
    except Reject as exc:
        where = key_path if exc.index is None else f"{key_path}[{exc.index}]"
        if exc.problem:
            raise ConfigError(f"{where}: {exc.problem}") from None
        shown = value if exc.index is None else value[exc.index]
        got = "a key that is not shown" if exc.secret else _show(shown)
        raise ConfigError(f"{where}: expected {exc}, got {got}") from None


def _check_unique_replicas(config: GatewayConfig) -> None:
    """Each URL listed once, in one role; prefill replicas with somewhere to send the decode leg."""
    seen: dict[str, int] = {}
    for i, replica in enumerate(config.replicas):
        if replica.url in seen:
            first = config.replicas[seen[replica.url]]
            if first.role != replica.role:
                raise ConfigError(f"replicas[{i}].url: {replica.url!r} is already replicas[{seen[replica.url]}] "
                                  f"with role {first.role}; a replica has one role (its vLLM kv_role)")
            raise ConfigError(f"replicas[{i}].url: {replica.url!r} is already replicas"
                              f"[{seen[replica.url]}]; use weight to give a replica more share")
        seen[replica.url] = i
    if (config.discovery.dns or config.discovery.prefill_dns) and config.discovery.kubernetes.label_selector:
        raise ConfigError("discovery.kubernetes.label_selector: replicas come from DNS (discovery.dns, prefill_dns) "
                          "or from the Kubernetes API, not both (each would drain the other's)")
    prefill = [i for i, r in enumerate(config.replicas) if r.role == "prefill"]
    discovered = config.discovery.dns or config.discovery.kubernetes.label_selector
    if (prefill or config.discovery.prefill_dns) and len(prefill) == len(config.replicas) and not discovered:
        where = f"replicas[{prefill[0]}].role" if prefill else "discovery.prefill_dns"
        raise ConfigError(f"{where}: prefill replicas need decode replicas to hand their requests to "
                          "(role decode, --decode URL, or discovery.dns)")


def _check_keys(auth: AuthConfig) -> None:
    """Tenant names unique; every key acts for one tenant or for admins, never both; no two
    tenants with one effective cache salt."""
    owner: dict[str, str] = {}
    names: set[str] = set()
    for i, tenant in enumerate(auth.tenants):
        if tenant.name in names:
            raise ConfigError(f"auth.tenants[{i}].name: tenant {tenant.name!r} is listed twice")
        names.add(tenant.name)
        if not tenant.keys:
            raise ConfigError(f"auth.tenants[{i}].keys: expected at least one key")
        for key in tenant.keys:
            if key in owner:
                raise ConfigError(f"auth.tenants[{i}].keys: a key of {tenant.name!r} is also one of {owner[key]}")
            owner[key] = repr(tenant.name)
    for key in auth.admin_keys:
        if key in owner:
            raise ConfigError(f"auth.admin_keys: a key is also one of tenant {owner[key]}; give admins their own")
    salts: dict[str, str] = {}
    for i, tenant in enumerate(auth.tenants):
        salt = tenant.salt
        if salt in salts:
            raise ConfigError(f"auth.tenants[{i}].cache_salt: tenants {salts[salt]!r} and {tenant.name!r} would both "
                              f"get the cache salt {salt!r} and share one KV cache")
        salts[salt] = tenant.name
    for i, path in enumerate(auth.tenant_paths):
        kind = kind_of("POST", path)
        if kind is not Kind.UNKNOWN:
            raise ConfigError(f"auth.tenant_paths[{i}]: {path} is an endpoint the gateway knows ({kind.value}); "
                              "only paths it does not know can be opened to tenants")


def config_from_dict(data: Mapping[str, Any]) -> GatewayConfig:
    """Build and validate a ``GatewayConfig`` from a nested mapping shaped like the YAML file.

    Raises:
        ConfigError: naming the key path of each problem found, one a line (those checked
            across keys once every key is well formed).
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"(top level): expected a mapping, got {_show(data)} "
                          f"({type(data).__name__})")
    config = _build(GatewayConfig, data, "")
    _check_unique_replicas(config)
    _check_keys(config.auth)
    if config.breaker.max_cooldown_s < config.breaker.cooldown_s:
        raise ConfigError(f"breaker.max_cooldown_s: expected a value >= breaker.cooldown_s "
                          f"({config.breaker.cooldown_s:g}), got {config.breaker.max_cooldown_s:g}")
    return config


# --- files and overrides -----------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping instead of keeping the last."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' may override keys
            continue
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, Hashable) and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None


def _merge(base: Mapping[Any, Any], override: Mapping[Any, Any]) -> dict[Any, Any]:
    """``base`` with ``override`` laid over it: mappings merge key by key, anything else
    (lists included) is replaced. Neither input is modified."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | os.PathLike[str] | None = None, *,
                overrides: Mapping[str, Any] | None = None) -> GatewayConfig:
    """Read, merge and validate the gateway configuration.

    ``path``: a YAML file shaped like ``configs/gateway.yaml``; None: defaults only. An empty
    file is the same as no keys. ``overrides``: a nested mapping of the same shape laid over
    the file (CLI flags become this); a ``None`` in it sets the value to null, so leave out
    flags the user did not give. A ``replicas`` list in ``overrides`` replaces the file's.

    Raises:
        ConfigError: file missing or unreadable (names the path), YAML syntax error (names the
            line), or an invalid value (names the key path, e.g. ``routing.virtual_nodes``).
    """
    data: Any = {}
    if path is not None:
        shown = os.fspath(path)
        data = _read_yaml(shown)
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{shown}: expected a mapping at the top level, got "
                              f"{type(data).__name__}")
    if overrides:
        if not isinstance(overrides, Mapping):
            raise ConfigError(f"overrides: expected a mapping, got {type(overrides).__name__}")
        data = _merge(data, overrides)
    return config_from_dict(data)
