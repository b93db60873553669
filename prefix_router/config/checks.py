"""The value checks of the configuration (``CHECKS``: one per field that has a range or a
form, applied by ``load.py`` after the type check), the settings earlier releases had
(``REMOVED``) and the plain-string shorthands (``SHORTHAND``).

A check takes a value of the field's type and returns it, maybe normalised (a URL without its
trailing slash), or raises ``Reject`` with what was expected.
"""

from __future__ import annotations

import math

import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from prefix_router.constants import MAX_DATA_PARALLEL_SIZE
from prefix_router.config.schema import (POLICIES, AdmissionConfig, AuthConfig, BreakerConfig, ChangesConfig, DisaggregationConfig, DiscoveryConfig,
                     GatewayConfig, HealthConfig, IndexConfig, KubernetesConfig, KvEventsConfig, LimitsConfig, ReplicaConfig,
                     RoutingConfig, ScrapeConfig, TenantConfig, UpstreamConfig)

__all__ = ["CHECKS", "REMOVED", "SHORTHAND", "Reject"]

# --- value checks ------------------------------------------------------------------------

class Reject(Exception):
    """Raised by a check with the expectation, e.g. 'a value >= 1'. ``secret``: the value is a
    key, so the error does not show it. ``problem``: the whole message instead, for what is not
    the value's fault (an environment variable not set). ``index``: the item of a list at fault."""

    def __init__(self, expected: str, *, secret: bool = False, problem: str | None = None,
                 index: int | None = None) -> None:
        super().__init__(expected)
        self.secret = secret
        self.problem = problem
        self.index = index


_Check = Callable[[Any], Any]  # takes a value of the right type, returns it (maybe normalised)


def _bounded(low: float, high: float | None = None, *, strict: bool = False) -> _Check:
    """Range check: ``low <= value`` (``low < value`` when strict), and ``value <= high``."""
    if high is not None:
        expected = f"a value from {low:g} to {high:g}"
    else:
        expected = f"a value {'>' if strict else '>='} {low:g}"

    def check(value: Any) -> Any:
        ok = value > low if strict else value >= low  # NaN fails either way
        if not ok or (high is not None and not value <= high):
            raise Reject(expected)
        return value
    return check


def _one_of(*allowed: str) -> _Check:
    def check(value: Any) -> Any:
        if value not in allowed:
            raise Reject("one of " + ", ".join(repr(a) for a in allowed))
        return value
    return check


def _non_empty(value: str) -> str:
    if not value.strip():
        raise Reject("a non-empty string")
    return value


def _zmq_tcp(value: str) -> str:
    """A ZMQ TCP address to connect to: tcp://host:port."""
    expected = "a ZMQ address tcp://host:port (the replica's host as the gateway reaches it)"
    if not value.startswith("tcp://"):
        raise Reject(expected)
    host, _, port = value[len("tcp://"):].rpartition(":")
    if not host or host in ("*", "0.0.0.0") or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise Reject(expected)
    return value


def _http_url(value: str) -> str:
    """Return the URL without trailing slashes; reject other schemes, no host, bad port."""
    url = value.rstrip("/")
    expected = "an http:// or https:// URL with a host, without query or fragment"
    if not url.startswith(("http://", "https://")):
        raise Reject(expected)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise Reject(expected) from None
    if not parts.hostname or parts.query or parts.fragment or any(c.isspace() for c in url):
        raise Reject(expected)
    if parts.username is not None or parts.password is not None:  # it would show in every label, log and page
        raise Reject("a URL without user or password (they would show in /replicas, the metrics' labels and the "
                     "logs): vLLM's --api-key goes in auth.upstream_api_key", secret=True)
    if parts.path.rstrip("/").endswith("/v1"):  # the OpenAI base-URL habit: every call would 404
        raise Reject(f"the replica's base URL, {url[:-3]}, without /v1 (the gateway calls "
                     f"{url[:-3]}/health, /metrics and /v1/... itself)")
    return url


def _dns_name(value: str) -> str:
    """A host name (RFC 1123 labels) without scheme, port or path."""
    expected = "a DNS name such as vllm.default.svc.cluster.local (no scheme, port or path)"
    name = value.rstrip(".")
    labels = name.split(".")
    if not name or len(name) > 253 or any(
            not label or len(label) > 63 or label[0] == "-" or label[-1] == "-"
            or not all(c.isascii() and (c.isalnum() or c == "-") for c in label) for label in labels):
        raise Reject(expected)
    return name


def _secret(value: str) -> str:
    """A key, or ``env:NAME``: the value of environment variable NAME (which must be set)."""
    if value.startswith("env:"):
        name = value[4:]
        if not os.environ.get(name):
            raise Reject("", problem=f"environment variable {name} is not set (the key is read from it)")
        value = os.environ[name]
    if len(value) < 8 or value != value.strip():
        raise Reject("a key of at least 8 characters without surrounding spaces", secret=True)
    return value


def _tenant_name(value: str) -> str:
    """Letters, digits, '.', '_' and '-': no '/' or ':', which join salts and session ids."""
    if not value or len(value) > 63 or not all(c.isascii() and (c.isalnum() or c in "._-") for c in value):
        raise Reject("1-63 letters, digits, '.', '_' or '-'")
    return value


def _salt(value: str) -> str:
    """What vLLM 0.32 takes as a ``cache_salt`` (``validate_cache_salt`` in
    ``vllm/entrypoints/generate/base/protocol.py``: 1-128 characters, none of '@', '/', '\\',
    NUL), without '|', which joins a nested client salt to the tenant's (``tenants.SALT_JOIN``)."""
    if not value or len(value) > 64 or any(c in "@/\\\x00|" for c in value):
        raise Reject("a salt of 1-64 characters without '@', '/', '\\', '|' or NUL (vLLM refuses the first four; "
                     "'|' joins a nested client salt)")
    return value


def _paths(values: tuple[str, ...]) -> tuple[str, ...]:
    """URL paths: each starts with '/' and holds no query, fragment or space."""
    for i, value in enumerate(values):
        if not value.startswith("/") or any(c in value for c in "?# ") or len(value) > 200:
            raise Reject("paths such as /v1/new_endpoint (a leading '/', no query)", index=i)
    return values


def _secrets(values: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for i, value in enumerate(values):
        try:
            out.append(_secret(value))
        except Reject as exc:
            exc.index = i
            raise
    return tuple(out)


_POSITIVE = _bounded(1)
_NON_NEGATIVE = _bounded(0)


def _FINITE_NON_NEGATIVE(value: Any) -> Any:  # noqa: N802 (a check, named as the others)
    if not 0 <= value < math.inf:
        raise Reject("a finite value >= 0")
    return value


_TIME = _bounded(0, strict=True)  # seconds


def _SUMMARY_INTERVAL(value: Any) -> Any:  # noqa: N802 (a check, named as the others)
    """0 (no line), or at least a second: each line renders the whole /metrics page, and 1e-9
    logged some 1,300 lines a second, burning the event loop the requests share."""
    if not (value == 0 or 1 <= value < math.inf):
        raise Reject("0 (none) or a finite value >= 1")
    return value
CHECKS: dict[tuple[type, str], _Check] = {
    # Applied after the type check, skipped for None.
    (ReplicaConfig, "url"): _http_url,
    (ReplicaConfig, "block_size"): _POSITIVE,
    (ReplicaConfig, "num_gpu_blocks"): _POSITIVE,
    (ReplicaConfig, "weight"): _POSITIVE,
    (ReplicaConfig, "role"): _one_of("prefill", "decode", "both"),
    (ReplicaConfig, "data_parallel_size"): _bounded(1, MAX_DATA_PARALLEL_SIZE),
    (DisaggregationConfig, "connector"): _one_of("nixl"),
    (DisaggregationConfig, "min_prefill_tokens"): _NON_NEGATIVE,
    (RoutingConfig, "policy"): _one_of(*POLICIES),
    (RoutingConfig, "virtual_nodes"): _POSITIVE,
    (RoutingConfig, "block_size"): _POSITIVE,
    (RoutingConfig, "char_block_size"): _POSITIVE,
    (RoutingConfig, "branch_threshold"): _bounded(2),  # 1 would make every block "shared"
    (RoutingConfig, "max_key_blocks"): _POSITIVE,
    (RoutingConfig, "load_factor"): _bounded(1),
    (RoutingConfig, "load_slack"): _NON_NEGATIVE,
    (RoutingConfig, "share_half_life_s"): _TIME,
    (RoutingConfig, "holder_load_factor"): _bounded(1),
    (RoutingConfig, "holder_share_factor"): _bounded(1),
    (RoutingConfig, "holder_slack"): _NON_NEGATIVE,
    (RoutingConfig, "match_threshold"): _bounded(0, 1),
    (RoutingConfig, "prefill_queue_weight"): _FINITE_NON_NEGATIVE,  # inf x an empty queue would be nan
    (RoutingConfig, "cpu_hit_weight"): _bounded(0, 1),
    (RoutingConfig, "storage_hit_weight"): _bounded(0, 1),
    (RoutingConfig, "session_header"): _non_empty,
    (IndexConfig, "max_blocks_per_replica"): _POSITIVE,
    (IndexConfig, "max_branch_blocks"): _POSITIVE,
    (IndexConfig, "max_conversations"): _POSITIVE,
    (IndexConfig, "max_responses"): _POSITIVE,
    (IndexConfig, "response_history_mb"): _POSITIVE,
    (IndexConfig, "tokenizer_cache_tokens"): _POSITIVE,
    (HealthConfig, "interval_s"): _TIME,
    (HealthConfig, "timeout_s"): _TIME,
    (HealthConfig, "unhealthy_after"): _POSITIVE,
    (HealthConfig, "healthy_after"): _POSITIVE,
    (ScrapeConfig, "interval_s"): _TIME,
    (ScrapeConfig, "models_interval_s"): _NON_NEGATIVE,  # 0: at every scrape
    (ScrapeConfig, "idle_interval_s"): _NON_NEGATIVE,  # at most interval_s: every scrape
    (UpstreamConfig, "connect_timeout_s"): _TIME,
    (UpstreamConfig, "read_timeout_s"): _TIME,
    (UpstreamConfig, "max_retries"): _NON_NEGATIVE,
    (UpstreamConfig, "max_connections"): _NON_NEGATIVE,
    (UpstreamConfig, "header_timeout_s"): _TIME,
    (BreakerConfig, "failures"): _POSITIVE,
    (BreakerConfig, "cooldown_s"): _TIME,
    (BreakerConfig, "max_cooldown_s"): _TIME,
    (AdmissionConfig, "saturated_depth"): _NON_NEGATIVE,
    (AdmissionConfig, "max_queue"): _NON_NEGATIVE,
    (AdmissionConfig, "timeout_s"): _TIME,
    (GatewayConfig, "drain_s"): _TIME,  # aiohttp reads 0 as "wait forever"
    (GatewayConfig, "workers"): _POSITIVE,
    (TenantConfig, "name"): _tenant_name,
    (TenantConfig, "keys"): _secrets,
    (TenantConfig, "cache_salt"): _salt,
    (AuthConfig, "admin_keys"): _secrets,
    (AuthConfig, "client_salt"): _one_of("override", "nest"),
    (AuthConfig, "upstream_api_key"): _secret,
    (LimitsConfig, "max_body_bytes"): _POSITIVE,
    (ChangesConfig, "max_sites"): _POSITIVE,
    (ChangesConfig, "snippet_chars"): _bounded(16, 4096),
    (LimitsConfig, "client_write_timeout_s"): _TIME,
    (LimitsConfig, "inline_analysis_bytes"): _bounded(0),
    (LimitsConfig, "max_json_elements"): _POSITIVE,
    (LimitsConfig, "body_timeout_s"): _TIME,
    (AuthConfig, "tenant_paths"): _paths,
    (ReplicaConfig, "kv_events"): _zmq_tcp,
    (ReplicaConfig, "kv_events_replay"): _zmq_tcp,
    (KvEventsConfig, "port"): _bounded(1, 65535),
    (KvEventsConfig, "replay_port"): _bounded(1, 65535),
    (KvEventsConfig, "replay_timeout_s"): _TIME,
    (KvEventsConfig, "parity_grace_s"): _TIME,
    (DiscoveryConfig, "dns"): _dns_name,
    (DiscoveryConfig, "prefill_dns"): _dns_name,
    (DiscoveryConfig, "port"): _bounded(1, 65535),
    (DiscoveryConfig, "scheme"): _one_of("http", "https"),
    (DiscoveryConfig, "interval_s"): _TIME,
    (KubernetesConfig, "label_selector"): _non_empty,
    (KubernetesConfig, "namespace"): _non_empty,
    (KubernetesConfig, "port"): _bounded(1, 65535),
    (KubernetesConfig, "role_label"): _non_empty,
    (KubernetesConfig, "resync_s"): _TIME,
    (KubernetesConfig, "kubeconfig"): _non_empty,
    (DiscoveryConfig, "drain_s"): _NON_NEGATIVE,
    (GatewayConfig, "host"): _non_empty,
    (GatewayConfig, "port"): _bounded(0, 65535),
    (GatewayConfig, "tokenizer"): _non_empty,
    (GatewayConfig, "summary_interval_s"): _SUMMARY_INTERVAL,
}

# Settings that earlier releases had, with what replaced them.
REMOVED: dict[tuple[type, str], str] = {
    (RoutingConfig, "spill_queue_depth"): "the load bound is routing.load_factor (a multiple of the mean load)",
}

# A plain string where this dataclass is expected stands for {field: string}.
SHORTHAND: dict[type, str] = {ReplicaConfig: "url"}
