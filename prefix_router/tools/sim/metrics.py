"""The simulated replica's ``/metrics``, with vLLM's metric names, labels and buckets.

Names, help texts and histogram buckets follow vLLM 0.32 (``vllm/v1/metrics/loggers.py``,
checked against a running CPU replica): labels ``model_name`` and ``engine`` (the engine's
data-parallel rank, "0" without data parallelism),
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` in tokens, and
``vllm:cache_config_info`` as an info gauge whose labels carry ``block_size`` and
``num_gpu_blocks``. Gauges and counters are read from the scheduler when scraped (nothing is
updated per step); histograms are observed per request, in modelled seconds.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prefix_router.constants import VLLM_LATENCY_BUCKETS, VLLM_TTFT_BUCKETS
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.scheduler import Scheduler, SimRequest

__all__ = ["EngineMetrics"]

LABELS = ("model_name", "engine")


class _StateCollector(Collector):
    """Each engine's gauges and counters, read from its scheduler at every scrape."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.engines: list[tuple[str, Scheduler, EngineMetrics]] = []  # (its engine label, ...)

    def collect(self):
        model, engines = self.config.model, self.engines

        def family(kind, name: str, doc: str, read, extra: tuple = ()):
            out = kind(name, doc, labels=(*LABELS, *extra))
            for rank, scheduler, metrics in engines:
                for more, value in read(scheduler, metrics):
                    out.add_metric([model, rank, *more], value)
            return out

        def one(read):
            return lambda s, m: [((), read(s))]

        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.",
                     one(lambda s: len(s.running)))
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                     one(lambda s: len(s.waiting)))
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                     one(lambda s: s.kv.usage))
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries",
                     "Prefix cache queries, in terms of number of queried tokens.", one(lambda s: s.kv.num_queries))
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                     one(lambda s: s.kv.num_hits))
        yield family(CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                     one(lambda s: s.num_preemptions))
        yield family(CounterMetricFamily, "vllm:prompt_tokens", "Number of prefill tokens processed.",
                     one(lambda s: s.num_prompt_tokens))
        yield family(CounterMetricFamily, "vllm:generation_tokens", "Number of generation tokens processed.",
                     one(lambda s: s.num_generation_tokens))
        yield family(CounterMetricFamily, "vllm:request_success", "Count of successfully processed requests.",
                     lambda s, m: [((reason,), count) for reason, count in sorted(m.finished.items())],
                     ("finished_reason",))
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=("block_size", "enable_prefix_caching", "engine", "num_gpu_blocks",
                                         "prefix_caching_hash_algo", "simulated"))
        for rank, _, _ in engines:
            info.add_metric([str(self.config.block_size), "True", rank, str(self.config.num_gpu_blocks),
                             "xxhash", "True"], 1.0)
        yield info


class EngineMetrics:
    """vLLM's engine metrics for one simulated engine, its series labelled ``engine`` = its
    data-parallel rank.

    The first engine of a server makes the registry (``registry`` may be passed in: tests use a
    fresh one); each further rank passes ``first``, the first's metrics, and shares its registry,
    so one ``/metrics`` page shows every engine as vLLM's does (a family once, a series per
    engine). ``on_first_token`` and ``on_finish`` are called by the engine with modelled times
    already set on the request.
    """

    def __init__(self, config: SimConfig, scheduler: Scheduler, registry: CollectorRegistry | None = None, *,
                 first: EngineMetrics | None = None) -> None:
        if first is None:
            self.registry = registry or CollectorRegistry()
            self._families = tuple(Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry) for name, doc, buckets in (
                ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", VLLM_TTFT_BUCKETS),
                ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", VLLM_LATENCY_BUCKETS),
                ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                 VLLM_LATENCY_BUCKETS)))
            self._collector = _StateCollector(config)
            self.registry.register(self._collector)
        else:
            self.registry, self._families, self._collector = first.registry, first._families, first._collector
        self.rank = len(self._collector.engines)
        self.finished: dict[str, int] = {}
        self.ttft, self.e2e, self.queue = (f.labels(config.model, str(self.rank)) for f in self._families)
        self._collector.engines.append((str(self.rank), scheduler, self))

    def on_first_token(self, request: SimRequest) -> None:
        self.ttft.observe(request.first_token_s - request.arrival_s)

    def on_scheduled(self, request: SimRequest, now_s: float) -> None:
        self.queue.observe(now_s - request.arrival_s)

    def on_finish(self, request: SimRequest) -> None:
        reason = request.finish_reason or "length"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if reason != "abort":
            self.e2e.observe(request.finish_s - request.arrival_s)
