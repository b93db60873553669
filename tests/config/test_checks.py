"""The configuration's value checks (``prefix_router/config/checks.py``): ranges, their edges,
policy names and replica URLs, each refusal naming the key path."""

from __future__ import annotations

import dataclasses

import pytest

from prefix_router.config import POLICIES, config_from_dict
from prefix_router.config import checks as config_checks

from .test_load import error_for


def test_every_range_check_names_a_real_field():
    for cls, name in config_checks.CHECKS:
        assert name in {f.name for f in dataclasses.fields(cls)}, (cls.__name__, name)


@pytest.mark.parametrize("data, key_path", [
    ({"routing": {"virtual_nodes": 0}}, "routing.virtual_nodes:"),
    ({"routing": {"load_factor": 0.9}}, "routing.load_factor:"),
    ({"routing": {"branch_threshold": 1}}, "routing.branch_threshold:"),
    ({"routing": {"prefill_queue_weight": -0.1}}, "routing.prefill_queue_weight:"),
    ({"routing": {"prefill_queue_weight": float("inf")}}, "routing.prefill_queue_weight:"),  # inf x 0 is nan
    ({"health": {"timeout_s": 0}}, "health.timeout_s:"),
    ({"scrape": {"interval_s": -1.0}}, "scrape.interval_s:"),
    ({"upstream": {"max_retries": -1}}, "upstream.max_retries:"),
    ({"limits": {"max_body_bytes": 0}}, "limits.max_body_bytes:"),
    ({"port": 70000}, "port:"),
    ({"replicas": [{"url": "http://a:1", "weight": 0}]}, "replicas[0].weight:"),
    ({"index": {"max_blocks_per_replica": 0}}, "index.max_blocks_per_replica:"),
    # a summary line every nanosecond: some 1,300 lines a second, each rendering /metrics
    ({"summary_interval_s": 1e-9}, "summary_interval_s:"), ({"summary_interval_s": 0.5}, "summary_interval_s:"),
    ({"summary_interval_s": -1}, "summary_interval_s:"), ({"summary_interval_s": float("nan")}, "summary_interval_s:"),
    ({"summary_interval_s": float("inf")}, "summary_interval_s:"), ({"summary_interval_s": "60"}, "summary_interval_s:"),
    ({"summary_interval_s": True}, "summary_interval_s:"),
])
def test_an_out_of_range_value_names_the_key_path(data, key_path):
    assert error_for(data).startswith(key_path)


def test_the_edges_of_the_ranges_are_allowed():
    config = config_from_dict({"routing": {"load_factor": 1}, "upstream": {"max_retries": 0},
                               "port": 0})
    assert (config.routing.load_factor, config.upstream.max_retries, config.port) == (1.0, 0, 0)
    assert [config_from_dict({"summary_interval_s": v}).summary_interval_s for v in (0, 1)] == [0, 1]


def test_an_unknown_policy_names_the_key_and_the_allowed_ones():
    message = error_for({"routing": {"policy": "random"}})
    assert message.startswith("routing.policy:")
    assert all(policy in message for policy in POLICIES)


@pytest.mark.parametrize("url", ["vllm-0:8000", "ftp://a", "http://", "http://a:port",
                                 "http://a:1?x=1", "", "http://user:secret@a:1", "http://token@a:1"])
def test_a_bad_replica_url_names_the_key_path(url):
    data = {"replicas": ["http://ok:1", url]}
    assert error_for(data).startswith("replicas[1].url:")


def test_credentials_in_a_replica_url_are_refused_without_repeating_them():
    message = error_for({"replicas": ["http://user:s3cret@a:1"]})
    assert "s3cret" not in message and "auth.upstream_api_key" in message
