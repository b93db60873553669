"""The gateway's metrics (``prefix_router/metrics.py``): every declared family on the page from the
start, a replica's series forgotten with it and the others' kept, and ``sample_sum`` reading a
page back. Each family's samples after a real request: ``tests/e2e/test_gateway_http.py``."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from prefix_router.metrics import METRIC_NAMES, GatewayMetrics, sample_sum


def test_every_declared_family_is_on_the_page_before_any_request():
    page = GatewayMetrics().page().decode()
    # the parser drops a counter family's _total; the _created families are prometheus-client's
    names = {f.name + "_total" if f.type == "counter" else f.name for f in text_string_to_metric_families(page)
             if not f.name.endswith("_created")}
    assert {n for n in names if n.startswith("prefix_router_")} == set(METRIC_NAMES)


def test_forgetting_a_replica_removes_each_of_its_series_and_keeps_the_others():
    metrics = GatewayMetrics()
    metrics.requests.labels("a:1", "affinity", "200").inc()
    metrics.requests.labels("b:1", "affinity", "200").inc()
    metrics.spillovers.labels("b:1", "a:1").inc()  # from b to a: a's too
    metrics.inflight.labels("a:1").set(2)
    assert metrics.forget_replica("a:1") == 3
    page = metrics.page().decode()
    assert '"a:1"' not in page
    assert sample_sum(page, "prefix_router_requests_total", replica="b:1") == 1
    assert metrics.forget_replica("a:1") == 0


def test_sample_sum_adds_the_samples_whose_labels_include_the_ones_asked():
    page = ('x_total{replica="a",code="200"} 2\nx_total{replica="a",code="503"} 1\n'
            'x_total{replica="b",code="200"} 4\ny_total{replica="a"} 100\n')
    assert sample_sum(page, "x_total") == 7
    assert sample_sum(page, "x_total", replica="a") == 3
    assert sample_sum(page, "x_total", replica="a", code="200") == 2
    assert sample_sum(page, "x_total", replica="c") == 0


def test_counter_samples_are_the_pages_counters_without_rendering_it():
    """What the status page and the summary line read: the named counters' samples, equal to the
    same series parsed from the page; cached and predicted tokens kept apart."""
    m = GatewayMetrics()
    for replica, (hits, prompt, cached, predicted) in {"a": (3, 900, 400, 380), "b": (1, 100, 0, 16)}.items():
        m.cache_requests.labels(replica, "hit").inc(hits)
        m.cache_requests.labels(replica, "miss_cold").inc(1)
        m.prompt_tokens.labels(replica).inc(prompt)
        m.cached.labels(replica).inc(cached)
        m.cached_predicted.labels(replica).inc(predicted)
        m.ttft.labels(replica).observe(0.2)
    names = ("prefix_router_cache_requests_total", "prefix_router_cached_tokens_total",
             "prefix_router_cached_tokens_predicted_total", "prefix_router_lost_tokens_total")
    found = m.counter_samples(names)
    parsed = {n: [] for n in names}
    for family in text_string_to_metric_families(m.page().decode()):
        for sample in family.samples:
            if sample.name in parsed:
                parsed[sample.name].append((sample.labels, sample.value))
    for name in names:
        assert sorted(map(repr, found[name])) == sorted(map(repr, parsed[name])), name
    assert len(found["prefix_router_cache_requests_total"]) == 4 and found["prefix_router_lost_tokens_total"] == []
