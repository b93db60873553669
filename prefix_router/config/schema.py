"""The gateway's configuration schema: one frozen dataclass per component, with the source of
each default next to its field.

``load.py`` builds these from YAML and checks every value; construct them directly only in code
and tests that bypass files (direct construction does not validate or normalise).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefix_router.config.routing_schema import RoutingConfig
from prefix_router.constants import TOKENIZER_CACHE_TOKENS

__all__ = ["POLICIES", "ConfigError", "ReplicaConfig", "RoutingConfig", "IndexConfig", "HealthConfig",
           "ScrapeConfig", "UpstreamConfig", "LimitsConfig", "DisaggregationConfig", "DiscoveryConfig", "KubernetesConfig", "KvEventsConfig", "BreakerConfig",
           "AdmissionConfig", "ChangesConfig", "TenantConfig", "AuthConfig", "GatewayConfig"]

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
    # its part in a disaggregated fleet (vllm serve --kv-transfer-config, kv_role kv_producer:
    # prefill; kv_consumer: decode); both: it serves whole requests, as without disaggregation.
    # With prefill replicas in the fleet a request is computed on one and generated on a decode
    # replica (prefix_router/serve/disagg.py)
    role: str = "both"
    # vllm serve --data-parallel-size: each rank (an engine, its own prefix cache) a replica,
    # host:port@rank, sent X-data-parallel-rank; 1: one replica (vLLM balances its ranks)
    data_parallel_size: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class DisaggregationConfig:
    """Prefill/decode disaggregation (prefix_router/serve/disagg.py): in effect when replicas
    have ``role: prefill``."""

    # the KV connector the replicas run: nixl (vLLM's NixlConnector, the prefill leg first, its
    # kv_transfer_params handed to the decode leg); vLLM's MooncakeConnector is not spoken yet
    connector: str = "nixl"
    # send a request whole to its decode replica when that replica lacks fewer than this many
    # of its prompt's tokens, as it would compute them faster than a transfer round trip
    # (llm-d's prefix-based decider, off there by default too); 0: every request is split
    min_prefill_tokens: int = 0


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
    # stored Responses whose replica is remembered (``response_homes.py``): ~160 B each, 16 MB
    max_responses: int = 100_000
    # of those routed by prefix, the histories a ``previous_response_id`` continues, in millions
    # of characters of message text (``response_homes.py``): a bound on their memory
    response_history_mb: int = 64
    # token ids of rendered prompts kept so that a conversation's next turn tokenizes only its
    # new text (``tokenizer.HFTokenizer``): 8 bytes each plus ~2.5 of block hashes, so ~170 MB
    # at the default; too few for the conversations in flight and every turn encodes anew
    tokenizer_cache_tokens: int = TOKENIZER_CACHE_TOKENS


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
    # seconds between reads of each replica's /v1/models (its served names and LoRA adapters),
    # at a scrape; a request naming a model no replica lists reads them all at once
    models_interval_s: float = 10.0
    # seconds between scrapes of a replica idle at its last one (an empty engine, nothing sent
    # since) where this gateway is the only router (routing.sole_router): nothing else loads it
    idle_interval_s: float = 10.0


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
    # streaming requests: seconds to the replica's response headers, which vLLM sends before the
    # request is queued: a replica that never answers is given up on (and the request retried).
    # Non-streaming answers send headers only when complete, so they wait read_timeout_s
    header_timeout_s: float = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class BreakerConfig:
    """Per-replica circuit breaker on failed requests (prefix_router/fleet/breaker.py)."""

    # consecutive failed attempts (5xx, connect errors, timeouts, streams cut) that open it:
    # 5 rides out a brief blip that retries absorb (Envoy's outlier detection default)
    failures: int = 5
    # seconds an open breaker keeps the replica out before one trial request; doubled after
    # each failed trial up to max_cooldown_s (Envoy ejects for 30 s x ejections)
    cooldown_s: float = 10.0
    max_cooldown_s: float = 120.0


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmissionConfig:
    """The gateway's admission queue for when every replica is saturated (prefix_router/fleet/admission.py)."""

    # a replica is saturated at this load (queue depth + requests sent since the last scrape)
    # when its engine reported a queue at all; 0: never. A queue this deep means the load bound
    # has spread the load already, and more waiting at a replica only grows its TTFT
    saturated_depth: int = 32
    # requests waiting at the gateway at most; more get 429 at once
    max_queue: int = 1024
    # seconds a request waits for a replica below saturation before 503
    timeout_s: float = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class KubernetesConfig:
    """Replicas found through the Kubernetes API (prefix_router/fleet/kubernetes.py): the pods a
    label selector matches, each while it is Ready and not terminating."""

    # label selector of the vLLM pods, e.g. app.kubernetes.io/name=vllm; None: off
    label_selector: str | None = None
    # None: the gateway pod's own namespace (its service account's), else "default"
    namespace: str | None = None
    port: int = 8000  # vLLM's OpenAI server port on each pod
    # the pod label naming its role in a disaggregated fleet (prefill, decode, both): llm-d's
    # name for it; a pod without it serves whole requests (both)
    role_label: str = "llm-d.ai/role"
    # seconds between full lists of the pods besides the watch, which a missed event cannot
    # outlast (SGLang's gateway resyncs every 30 s)
    resync_s: float = 30.0
    # a kubeconfig file; None: the pod's in-cluster credentials, else $KUBECONFIG or ~/.kube/config
    kubeconfig: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class DiscoveryConfig:
    """Replicas found by resolving a DNS name (prefix_router/fleet/discovery.py), besides the static list."""

    # name whose A/AAAA records are the replicas, e.g. the headless Service of the vLLM pods
    # (vllm.<namespace>.svc.cluster.local); None: the static replicas list only
    dns: str | None = None
    # the same for the prefill replicas of a disaggregated fleet (the headless Service of the
    # kv_producer pods); dns then names the decode replicas. None: no discovered prefill pool
    prefill_dns: str | None = None
    port: int = 8000  # vLLM's OpenAI server default port (vllm serve --port)
    scheme: str = "http"
    # seconds between lookups: CoreDNS answers for Services with a 5 s TTL by default
    interval_s: float = 5.0
    # a replica gone from DNS gets no new requests at once; its state (shadow index, metrics)
    # is kept this long, and until its in-flight requests finish, so streams end cleanly and
    # a pod that comes back (a DNS blip, a brief NotReady) keeps what it had cached
    drain_s: float = 30.0
    # or the pods themselves, from the Kubernetes API (not with dns)
    kubernetes: KubernetesConfig = KubernetesConfig()


@dataclass(frozen=True, kw_only=True, slots=True)
class KvEventsConfig:
    """vLLM's KV cache events: each replica's cache as the engine reports it (prefix_router/cache/events.py)."""

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
    # a sixth of the CPU of a 1k-token chat under py-spy, docs/performance-notes.md);
    # 16 KiB (about 4k tokens) keeps a warm prompt's analysis near a millisecond
    inline_analysis_bytes: int = 16 * 1024
    # JSON values a body may hold (an upper bound counted before parsing: its commas, brackets
    # and braces, those in strings too), so a body's parsed size stays within a small multiple
    # of its bytes: 30 MB of "[]," parse to ~1 GB of empty lists. 1,000,000 holds a 1M-token prompt
    # sent as token ids; bodies at the bound parse to at most ~80 MB in ~0.2 s
    # (bench/results/hostile-bodies/README.md)
    max_json_elements: int = 1_000_000
    # a request whose body has not fully arrived this long after its headers gets 408, so slow
    # clients cannot hold connections and buffers open for ever
    body_timeout_s: float = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ChangesConfig:
    """Why clients changed their prefixes (prefix_router/misses/change_sites.py, ``GET /debug/changes``)."""

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

    @property
    def salt(self) -> str:
        """The cache_salt its requests go upstream with: ``cache_salt``, else ``tenant:<name>``."""
        return self.cache_salt or f"tenant:{self.name}"


@dataclass(frozen=True, kw_only=True, slots=True)
class AuthConfig:
    """API keys, tenants and their KV cache isolation (prefix_router/fleet/tenants.py). Empty: open gateway."""

    tenants: tuple[TenantConfig, ...] = ()
    # keys for GET /replicas; once any key is configured, those views need one of these
    admin_keys: tuple[str, ...] = ()
    # a client's own cache_salt under tenants: "override" replaces it with the tenant's;
    # "nest" keeps it inside the tenant's ("<tenant salt>|<client salt>", tenants.SALT_JOIN), so a client can
    # partition its own cache further but never reach another tenant's
    client_salt: str = "override"
    # the key sent to replicas (vllm serve --api-key) in place of the client's; tenant keys are
    # never forwarded. None: no Authorization header upstream
    upstream_api_key: str | None = None
    # POST paths the gateway does not know (an endpoint of a later vLLM, a plugin's) that
    # tenants may call: forwarded to one replica with the tenant's cache_salt set in a JSON
    # body, as /invocations is. Under tenants any other unknown path is refused (403), since
    # the gateway cannot tell whether the engine generates from its body
    tenant_paths: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class GatewayConfig:
    """The whole gateway; built by ``load_config`` or ``config_from_dict``."""

    host: str = "0.0.0.0"  # listen on all interfaces: the gateway usually runs in a container
    port: int = 8080  # a common unprivileged HTTP port; 0 picks a free one (tests)
    replicas: tuple[ReplicaConfig, ...] = ()  # may be empty at load time; the CLI decides
    # local folder or Hugging Face id found in the local HF cache; None: character blocks,
    # approximate routing
    tokenizer: str | None = None
    # fetch a tokenizer id missing from the local Hugging Face cache from the Hub at start (its
    # tokenizer files alone, with $HF_TOKEN if set); off, and whenever HF_HUB_OFFLINE=1, the
    # gateway downloads nothing
    tokenizer_download: bool = False
    log_prompts: bool = False  # prompt text stays out of logs unless an operator opts in
    # seconds between INFO summary lines (requests, token hit rate, misses by kind, per
    # replica) in the log; 0: none
    summary_interval_s: float = 60.0
    # JSONL file with one line per request (replica, route, predicted and reported cached
    # tokens, miss kind; no prompt text): prefix_router/misses/request_log.py. None: off
    request_log: str | None = None
    # also write each request's body (prompt text: an operator's explicit choice) and path to
    # the request log, so ``prefix-router audit`` and ``gate`` can read it
    request_log_bodies: bool = False
    # also write each prompt's chain of block hashes, each under a keyed BLAKE2b (the key: the
    # operator's secret PREFIX_ROUTER_REQUEST_LOG_KEY), so no guessed prompt can be checked:
    # ``prefix-router fleetsim --trace LOG`` replays the traffic on a fleet of any size
    request_log_blocks: bool = False
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
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    # seconds SIGTERM waits for in-flight requests (streams included) to finish before exit;
    # Kubernetes' default terminationGracePeriodSeconds is 30, so 25 leaves the rest for exit
    drain_s: float = 25.0
    # gateway processes sharing the port (SO_REUSEPORT), one event loop each: prefix_router/workers.py.
    # One process serves about as many requests a second as one core allows
    # (docs/benchmarks.md); raise it when the gateway's core is the bottleneck
    workers: int = 1
