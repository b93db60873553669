"""Gateway configuration: one frozen dataclass per component, loaded from YAML and checked once.

``load_config`` reads a YAML file, deep-merges ``overrides`` (what the CLI flags become) over
it, and builds a ``GatewayConfig``. Validation is driven by the dataclass fields and their type
annotations, so a new field needs no new checking code; value ranges live in one table
(``_CHECKS``). Every problem is a ``ConfigError`` whose message starts with the key path, e.g.
``routing.virtual_nodes: expected an integer, got 'many' (str)``, so an operator can find the
line to fix. The rules:

- Unknown keys are errors (a typo such as ``vitrual_nodes`` must not silently keep a default).
- Types are strict: ``true`` is not an integer and ``1`` is not a boolean; an integer is
  accepted where a number (float) is expected; ``null`` only where the field allows None.
- A ``replicas`` entry may be a plain URL string, shorthand for ``{url: ...}``; trailing
  slashes of replica URLs are dropped so ``http://a:8000/`` and ``http://a:8000`` are one
  replica, and the same replica listed twice is an error (use ``weight``).
- Duplicate keys in one YAML mapping are errors (PyYAML would keep the last one silently).

Construct the dataclasses directly only in code and tests that bypass files; direct
construction does not validate or normalise.

Exceptions::

    ValueError
     └── ConfigError   bad file, bad YAML, or a value of the wrong type or out of range

Sources of the defaults are given next to each field.
"""

from __future__ import annotations

import difflib
import functools
import os
import types
import typing
from collections.abc import Callable, Hashable, Mapping
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any
from urllib.parse import urlsplit

import yaml

__all__ = ["POLICIES", "ConfigError", "ReplicaConfig", "RoutingConfig", "IndexConfig",
           "HealthConfig", "ScrapeConfig", "UpstreamConfig", "LimitsConfig", "DiscoveryConfig", "KvEventsConfig", "BreakerConfig",
           "AdmissionConfig", "ChangesConfig", "TenantConfig", "AuthConfig", "GatewayConfig",
           "load_config", "config_from_dict"]

POLICIES = ("prefix-affinity", "round-robin", "least-loaded")
"""Routing policy names accepted in ``routing.policy``."""


class ConfigError(ValueError):
    """The configuration cannot be used; the message starts with the key path or file path."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaConfig:
    """One vLLM replica behind the gateway."""

    url: str  # http(s) base URL without trailing slash, e.g. http://vllm-0:8000
    block_size: int | None = None  # tokens per KV block; None: read from vllm:cache_config_info
    num_gpu_blocks: int | None = None  # KV capacity in blocks; None: from vllm:cache_config_info
    weight: int = 1  # virtual-node multiplier on the ring: 2 gets twice the share of keys
    # the replica's KV event publisher and replay socket (vLLM --kv-events-config "endpoint" and
    # "replay_endpoint" as seen from the gateway, e.g. tcp://vllm-0:5557); None: found through
    # the replica's GET /kv_event_sources, or kv_events.port when that is not served
    kv_events: str | None = None
    kv_events_replay: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutingConfig:
    """How a request's replica is chosen."""

    # prefix affinity is the gateway's purpose; the other two are baselines to compare against
    policy: str = "prefix-affinity"
    # ring points per replica (times its weight): 160 as libketama and uhashring use, and the
    # ~150-160 of SGLang's and vLLM's routers; keeps each replica's key share within ~10%
    virtual_nodes: int = 160
    # tokens per block when replicas don't report theirs; None lets the gateway apply vLLM's
    # GPU default of 16
    block_size: int | None = None
    # characters per block without a tokenizer: 64 chars ~ 16 tokens of English, as llm-d uses
    char_block_size: int = 64
    # a block followed by at least this many different next blocks is a shared prefix (say a
    # common system prompt) and the routing key extends past it; 4 tolerates a few variants
    # of one conversation (edits, retries) before calling a block shared
    branch_threshold: int = 4
    # deepest routing key in blocks: 512 x 16 = 8K tokens, past any shared system prompt
    max_key_blocks: int = 512
    # the load bound: a replica may take a request while its load after it is at most
    # ceil(max(load_factor x mean, mean + load_slack)), the mean counting the new request
    # (consistent hashing with bounded loads; KubeAI's CHWBL uses 1.25). Lower spreads more and
    # caches less. Measured on the built-in mixed workload (48 sessions, 4 replicas): 1.25 / 1
    # reused 0.657 with the busiest replica at 1.14x its share, 1.5 / 2 0.671 at 1.41x
    load_factor: float = 1.25
    # requests over the mean any replica may carry whatever the factor: at low load the factor
    # alone turns a second request for a document away from the one replica holding it while
    # the rest of the fleet idles (vLLM batches both; nothing queues)
    load_slack: int = 1
    # the same bound (load_factor, load_slack) also holds each replica's share of the requests
    # sent lately, each counting 1 when sent and half as much every this many seconds: with
    # requests one at a time nothing is ever in flight, and without it every new conversation
    # would follow a shared system prompt to the one replica that computed it first
    share_half_life_s: float = 60.0
    # a replica holding a cold prefix of the prompt (one its holders can serve at their fair
    # share: PrefixDemand) keeps the request up to looser bounds, in flight and in share, with
    # holder_slack in place of load_slack: moving it would recompute the prefix to relieve a
    # load that replicating it cannot cure. Both factors at load_factor and holder_slack at
    # load_slack turn it off. Measured on 4 simulated replicas (bench.compare --quick, one run
    # each): SGLang's shared-prefix shape 0.838 -> 0.882 (the pooled bound) at 1.25x busiest,
    # vLLM's prefix_repetition chat 0.753 -> 0.798, a dozen agent sessions 0.833 -> 0.865, 400
    # sessions of one system prompt 0.924 -> 0.929
    holder_load_factor: float = 2.0
    holder_share_factor: float = 1.5
    holder_slack: int = 2
    # request header whose value keys a session to a replica (multi-turn chats stay together)
    session_header: str = "X-Session-ID"
    # use the OpenAI ``user`` field as a session key when no session header is present
    use_user_field: bool = True
    # without a session key, key a chat by its opening (tools and messages through the first
    # user message) rather than by learned branch points: every turn, and every gateway
    # instance, then agrees from the first request (see README "Several gateway instances")
    chat_opening_key: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexConfig:
    """Bounds of the gateway's in-memory bookkeeping, so memory stays flat under any traffic."""

    # LRU bound of each replica's shadow block index; None: the replica's num_gpu_blocks, as
    # the replica cannot hold more than that either
    max_blocks_per_replica: int | None = None
    # LRU bound of the per-block branch statistics: ~170 B each (measured), so < 100 MB
    max_branch_blocks: int = 500_000
    # conversations remembered to classify misses (changed needs the previous request's block
    # hashes): ~4 KB each for 8k-token prompts (measured), so ~80 MB at most for such traffic
    max_conversations: int = 20_000


@dataclass(frozen=True, kw_only=True, slots=True)
class HealthConfig:
    """Active health checks against each replica's ``GET /health``."""

    interval_s: float = 2.0  # seconds between probes: a dead replica is out within ~4 s
    timeout_s: float = 1.0  # a probe slower than this counts as a failure
    unhealthy_after: int = 2  # consecutive failures before removal: one lost probe is noise
    healthy_after: int = 1  # consecutive successes before a replica is routed to again


@dataclass(frozen=True, kw_only=True, slots=True)
class ScrapeConfig:
    """Polling of each replica's Prometheus ``/metrics``."""

    # seconds between scrapes of vllm:num_requests_waiting / running and cache_config_info;
    # 1 s matches how fast queues change at tens of requests per second
    interval_s: float = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class UpstreamConfig:
    """HTTP client used to forward requests to replicas."""

    connect_timeout_s: float = 5.0  # TCP + TLS connect; a healthy replica answers in ms
    # longest silence between bytes from a replica; 600 s covers a long prefill on a busy one
    read_timeout_s: float = 600.0
    # other ring candidates tried on connect errors or 5xx, only before anything reached the
    # client; 2 rides out one dead and one restarting replica
    max_retries: int = 2
    max_connections: int = 0  # 0: unlimited, one shared pool; vLLM queues requests itself
    # streaming requests: seconds to the replica's response headers, which vLLM's server sends
    # before the request is even queued; a replica that accepts the connection but never
    # answers is given up on after this (and the request retried). Non-streaming answers come
    # with their headers only when complete, so they wait read_timeout_s.
    header_timeout_s: float = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class BreakerConfig:
    """Per-replica circuit breaker on failed requests (router/breaker.py)."""

    # consecutive failed attempts (5xx, connect errors, timeouts, streams cut) that open it:
    # 5 rides out a brief blip that retries absorb (Envoy's outlier detection default)
    failures: int = 5
    # seconds an open breaker keeps the replica out before one trial request; doubled after
    # each failed trial up to max_cooldown_s (Envoy ejects for 30 s x ejections)
    cooldown_s: float = 10.0
    max_cooldown_s: float = 120.0


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmissionConfig:
    """The gateway's admission queue for when every replica is saturated (router/admission.py)."""

    # a replica is saturated at this load (queue depth + requests sent since the last scrape)
    # when its engine reported a queue at all; 0: never, every request goes straight to a
    # replica and queues there. 4 x the spill depth by default: spillover has already spread
    # the load, and more waiting at a replica only grows its TTFT
    saturated_depth: int = 32
    # requests waiting at the gateway at most; more get 429 at once
    max_queue: int = 1024
    # seconds a request waits for a replica below saturation before 503
    timeout_s: float = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class DiscoveryConfig:
    """Replicas found by resolving a DNS name (router/discovery.py), besides the static list."""

    # name whose A/AAAA records are the replicas, e.g. the headless Service of the vLLM pods
    # (vllm.<namespace>.svc.cluster.local); None: the static replicas list only
    dns: str | None = None
    port: int = 8000  # vLLM's OpenAI server default port (vllm serve --port)
    scheme: str = "http"
    # seconds between lookups: CoreDNS answers for Services with a 5 s TTL by default
    interval_s: float = 5.0
    # a replica gone from DNS gets no new requests at once; its state (shadow index, metrics)
    # is kept this long, and until its in-flight requests finish, so streams end cleanly and
    # a pod that comes back (a DNS blip, a brief NotReady) keeps what it had cached
    drain_s: float = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class KvEventsConfig:
    """vLLM's KV cache events: each replica's cache as the engine reports it (router/kvevents.py)."""

    # follow the events of every replica that publishes them (its GET /kv_event_sources names
    # the endpoints, or replicas[].kv_events does); false: the gateway's own guess only
    enabled: bool = True
    # for replicas that do not serve /kv_event_sources (vLLM before 0.32) and have no
    # replicas[].kv_events: the publisher's and replay socket's ports on the replica's host;
    # None: such replicas are routed by the gateway's guess
    port: int | None = None
    replay_port: int | None = None
    topic: str = ""  # vLLM's "topic" (the publisher's default is empty: every message)
    # a replay socket that has not answered in this long leaves the gap unrepaired
    replay_timeout_s: float = 2.0
    # a request the engine finished whose last prompt block the events have not shown this
    # long after is a parity mismatch (events are published once per engine step)
    parity_grace_s: float = 2.0


@dataclass(frozen=True, kw_only=True, slots=True)
class LimitsConfig:
    """Limits on what clients may send, and on clients that stop reading."""

    # request bodies above this get 413; 32 MiB fits a 128K-token prompt as JSON many times
    max_body_bytes: int = 32 * 1024 * 1024
    # a streaming client that accepts no data for this long (its socket buffer full) is cut
    # off, so the replica stops generating for it and frees its KV blocks; a live client
    # reads within milliseconds
    client_write_timeout_s: float = 60.0
    # bodies up to this size are tokenized and hashed on the event loop; bigger ones in a
    # worker thread, which lets the loop serve other streams meanwhile (the tokenizer's Rust
    # encode releases the GIL) at the cost of the hop (futures, a wake-up, GIL hand-offs: about
    # a sixth of the CPU of a 1k-token chat, measured with py-spy). Measured on one core: a
    # warm 1k-token chat analyses in 0.5 ms, 8k in 1.3 ms; a cold 4k-token prompt in about 9 ms
    inline_analysis_bytes: int = 16 * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class ChangesConfig:
    """Why clients changed their prefixes (router/changes.py, ``GET /debug/changes``)."""

    # distinct divergence sites (cause, message index, role, token position) kept; later new
    # sites are counted by cause only. 1,000 sites take about 300 KB
    max_sites: int = 1000
    # keep a redacted excerpt of the changed message per site (dates, times, ids, numbers,
    # e-mail addresses and key-like strings masked). Prompt text: off unless an operator opts in
    snippets: bool = False
    snippet_chars: int = 160  # an excerpt's length at most, in characters


@dataclass(frozen=True, kw_only=True, slots=True)
class TenantConfig:
    """One tenant: the API keys that act for it and the cache salt its requests get."""

    name: str  # bounded by the configuration, so safe as a metric label and a log field
    # API keys (Authorization: Bearer KEY); "env:NAME" reads one from the environment (a
    # Kubernetes Secret), so keys stay out of ConfigMaps
    keys: tuple[str, ...]
    # vLLM cache_salt for its requests; None: "tenant:<name>". Need not be secret: clients
    # cannot set it (see AuthConfig.client_salt) as long as replicas are reachable only
    # through the gateway
    cache_salt: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class AuthConfig:
    """API keys, tenants and their KV cache isolation (router/tenants.py). Empty: open gateway."""

    tenants: tuple[TenantConfig, ...] = ()
    # keys for GET /replicas; once any key is configured, those views need one of these
    admin_keys: tuple[str, ...] = ()
    # a client's own cache_salt under tenants: "override" replaces it with the tenant's;
    # "nest" keeps it inside the tenant's ("<tenant salt>/<client salt>"), so a client can
    # partition its own cache further but never reach another tenant's
    client_salt: str = "override"
    # the key sent to replicas (vllm serve --api-key) in place of the client's; tenant keys are
    # never forwarded. None: no Authorization header upstream
    upstream_api_key: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class GatewayConfig:
    """The whole gateway; built by ``load_config`` or ``config_from_dict``."""

    host: str = "0.0.0.0"  # listen on all interfaces: the gateway usually runs in a container
    port: int = 8080  # a common unprivileged HTTP port; 0 picks a free one (tests)
    replicas: tuple[ReplicaConfig, ...] = ()  # may be empty at load time; the CLI decides
    # local folder or Hugging Face id found in the local HF cache; None: character blocks,
    # approximate routing
    tokenizer: str | None = None
    log_prompts: bool = False  # prompt text stays out of logs unless an operator opts in
    # JSONL file with one line per request (replica, route, predicted and reported cached
    # tokens, miss kind; no prompt text): router/requestlog.py. None: off
    request_log: str | None = None
    # also write each request's body (prompt text: an operator's explicit choice) and path to
    # the request log, so ``prefix-router audit`` and ``gate`` can read it
    request_log_bodies: bool = False
    changes: ChangesConfig = ChangesConfig()
    routing: RoutingConfig = RoutingConfig()  # instances are frozen, so sharing one is safe
    index: IndexConfig = IndexConfig()
    health: HealthConfig = HealthConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    limits: LimitsConfig = LimitsConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    breaker: BreakerConfig = BreakerConfig()
    admission: AdmissionConfig = AdmissionConfig()
    auth: AuthConfig = AuthConfig()
    kv_events: KvEventsConfig = KvEventsConfig()
    # seconds SIGTERM waits for in-flight requests (streams included) to finish before exit;
    # Kubernetes' default terminationGracePeriodSeconds is 30, so 25 leaves the rest for exit
    drain_s: float = 25.0
    # gateway processes sharing the port (SO_REUSEPORT), one event loop each: router/workers.py.
    # One process serves about as many requests a second as one core allows
    # (bench/results/overhead.md); raise it when the gateway's core is the bottleneck
    workers: int = 1


# --- value checks ------------------------------------------------------------------------

class _Reject(Exception):
    """Raised by a check with the expectation, e.g. 'a value >= 1'. ``secret``: the value is a
    key, so the error does not show it."""

    def __init__(self, expected: str, *, secret: bool = False) -> None:
        super().__init__(expected)
        self.secret = secret


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
            raise _Reject(expected)
        return value
    return check


def _one_of(*allowed: str) -> _Check:
    def check(value: Any) -> Any:
        if value not in allowed:
            raise _Reject("one of " + ", ".join(repr(a) for a in allowed))
        return value
    return check


def _non_empty(value: str) -> str:
    if not value.strip():
        raise _Reject("a non-empty string")
    return value


def _zmq_tcp(value: str) -> str:
    """A ZMQ TCP address to connect to: tcp://host:port."""
    expected = "a ZMQ address tcp://host:port (the replica's host as the gateway reaches it)"
    if not value.startswith("tcp://"):
        raise _Reject(expected)
    host, _, port = value[len("tcp://"):].rpartition(":")
    if not host or host in ("*", "0.0.0.0") or not port.isdigit() or not 0 < int(port) < 65536:
        raise _Reject(expected)
    return value


def _http_url(value: str) -> str:
    """Return the URL without trailing slashes; reject other schemes, no host, bad port."""
    url = value.rstrip("/")
    expected = "an http:// or https:// URL with a host, without query or fragment"
    if not url.startswith(("http://", "https://")):
        raise _Reject(expected)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise _Reject(expected) from None
    if not parts.hostname or parts.query or parts.fragment or any(c.isspace() for c in url):
        raise _Reject(expected)
    return url


def _dns_name(value: str) -> str:
    """A host name (RFC 1123 labels) without scheme, port or path."""
    expected = "a DNS name such as vllm.default.svc.cluster.local (no scheme, port or path)"
    name = value.rstrip(".")
    labels = name.split(".")
    if not name or len(name) > 253 or any(
            not label or len(label) > 63 or label[0] == "-" or label[-1] == "-"
            or not all(c.isascii() and (c.isalnum() or c == "-") for c in label) for label in labels):
        raise _Reject(expected)
    return name


def _secret(value: str) -> str:
    """A key, or ``env:NAME``: the value of environment variable NAME (which must be set)."""
    if value.startswith("env:"):
        name = value[4:]
        if not os.environ.get(name):
            raise _Reject(f"environment variable {name} to be set (the key is read from it)")
        value = os.environ[name]
    if len(value) < 8 or value != value.strip():
        raise _Reject("a key of at least 8 characters without surrounding spaces", secret=True)
    return value


def _tenant_name(value: str) -> str:
    """Letters, digits, '.', '_' and '-': no '/' or ':', which join salts and session ids."""
    if not value or len(value) > 63 or not all(c.isascii() and (c.isalnum() or c in "._-") for c in value):
        raise _Reject("1-63 letters, digits, '.', '_' or '-'")
    return value


def _salt(value: str) -> str:
    if not value or "/" in value:
        raise _Reject("a non-empty salt without '/' (nested client salts follow a '/')")
    return value


def _secrets(values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_secret(v) for v in values)


_POSITIVE = _bounded(1)
_NON_NEGATIVE = _bounded(0)
_TIME = _bounded(0, strict=True)  # seconds
_CHECKS: dict[tuple[type, str], _Check] = {
    # Applied after the type check, skipped for None.
    (ReplicaConfig, "url"): _http_url,
    (ReplicaConfig, "block_size"): _POSITIVE,
    (ReplicaConfig, "num_gpu_blocks"): _POSITIVE,
    (ReplicaConfig, "weight"): _POSITIVE,
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
    (RoutingConfig, "session_header"): _non_empty,
    (IndexConfig, "max_blocks_per_replica"): _POSITIVE,
    (IndexConfig, "max_branch_blocks"): _POSITIVE,
    (IndexConfig, "max_conversations"): _POSITIVE,
    (HealthConfig, "interval_s"): _TIME,
    (HealthConfig, "timeout_s"): _TIME,
    (HealthConfig, "unhealthy_after"): _POSITIVE,
    (HealthConfig, "healthy_after"): _POSITIVE,
    (ScrapeConfig, "interval_s"): _TIME,
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
    (ReplicaConfig, "kv_events"): _zmq_tcp,
    (ReplicaConfig, "kv_events_replay"): _zmq_tcp,
    (KvEventsConfig, "port"): _bounded(1, 65535),
    (KvEventsConfig, "replay_port"): _bounded(1, 65535),
    (KvEventsConfig, "replay_timeout_s"): _TIME,
    (KvEventsConfig, "parity_grace_s"): _TIME,
    (DiscoveryConfig, "dns"): _dns_name,
    (DiscoveryConfig, "port"): _bounded(1, 65535),
    (DiscoveryConfig, "scheme"): _one_of("http", "https"),
    (DiscoveryConfig, "interval_s"): _TIME,
    (DiscoveryConfig, "drain_s"): _NON_NEGATIVE,
    (GatewayConfig, "host"): _non_empty,
    (GatewayConfig, "port"): _bounded(0, 65535),
    (GatewayConfig, "tokenizer"): _non_empty,
}

# Settings that earlier releases had, with what replaced them.
_REMOVED: dict[tuple[type, str], str] = {
    (RoutingConfig, "spill_queue_depth"): "the load bound is routing.load_factor (a multiple of the mean load)",
}

# A plain string where this dataclass is expected stands for {field: string}.
_SHORTHAND: dict[type, str] = {ReplicaConfig: "url"}


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
        return "a URL string or a mapping" if tp in _SHORTHAND else "a mapping"
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
        if isinstance(value, str) and tp in _SHORTHAND:
            value = {_SHORTHAND[tp]: value}
        if isinstance(value, Mapping):
            return _build(tp, value, path)
    elif typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"unsupported config annotation {declared!r} at {path}")
        if isinstance(value, (list, tuple)):
            return tuple(_convert(args[0], item, f"{path}[{i}]") for i, item in enumerate(value))
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
    """Build dataclass ``cls`` from a mapping, checking keys, types and ranges."""
    known = [f.name for f in fields(cls)]
    for key in data:
        if (cls, key) in _REMOVED:
            raise ConfigError(f"{_join(path, str(key))}: no longer a setting; {_REMOVED[cls, key]}")
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{_join(path, str(key))}: unknown key; expected one of: "
                              f"{', '.join(known)}{suggestion}")
    values: dict[str, Any] = {}
    for f in fields(cls):
        key_path = _join(path, f.name)
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"{key_path}: required key missing")
            continue
        value = _convert(_hints(cls)[f.name], data[f.name], key_path)
        check = _CHECKS.get((cls, f.name))
        if check is not None and value is not None:
            try:
                value = check(value)
            except _Reject as exc:
                got = "a key that is not shown" if exc.secret else _show(value)
                raise ConfigError(f"{key_path}: expected {exc}, got {got}") from None
        values[f.name] = value
    return cls(**values)


def _check_unique_replicas(config: GatewayConfig) -> None:
    seen: dict[str, int] = {}
    for i, replica in enumerate(config.replicas):
        if replica.url in seen:
            raise ConfigError(f"replicas[{i}].url: {replica.url!r} is already replicas"
                              f"[{seen[replica.url]}]; use weight to give a replica more share")
        seen[replica.url] = i


def _check_keys(auth: AuthConfig) -> None:
    """Tenant names unique; every key acts for one tenant or for admins, never both."""
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


def config_from_dict(data: Mapping[str, Any]) -> GatewayConfig:
    """Build and validate a ``GatewayConfig`` from a nested mapping shaped like the YAML file.

    Raises:
        ConfigError: naming the key path of the first problem found.
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
