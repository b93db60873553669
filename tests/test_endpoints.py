"""What each vLLM endpoint is to the gateway (``prefix_router/endpoints.py``): the kind every
method and path is sorted into, and the id of a stored Response. The tables against the routes
of the installed vLLM: ``tests/vllm_tier/test_endpoints_vllm.py``; what a tenant's request of
each kind gets: ``tests/e2e/test_isolation.py``."""

from __future__ import annotations

import pytest

from prefix_router.endpoints import GENERATES, OPERATOR_POSTS, ROUTED, SERVES, UNSALTABLE, Kind, kind_of, stored_id


@pytest.mark.parametrize("method, path, kind", [
    ("POST", "/v1/chat/completions", Kind.ROUTED),
    ("POST", "/v1/completions/", Kind.ROUTED),  # a trailing slash: Starlette redirects it to the route
    ("PUT", "/v1/completions", Kind.UNKNOWN),
    ("GET", "/v1/models", Kind.SERVES),
    ("POST", "/tokenize", Kind.SERVES),
    ("POST", "/invocations", Kind.GENERATES),
    ("POST", "/v1/audio/transcriptions", Kind.UNSALTABLE),
    ("POST", "/reset_prefix_cache", Kind.OPERATOR),
    ("GET", "/v1/responses/resp_1", Kind.STORED),
    ("POST", "/v1/responses/resp_1/cancel/", Kind.STORED),
    ("DELETE", "/v1/responses/resp_1", Kind.UNKNOWN),
    ("POST", "/v1/not_in_vllm", Kind.UNKNOWN),
])
def test_each_method_and_path_has_its_kind(method, path, kind):
    assert kind_of(method, path) is kind


def test_an_unknown_post_an_operator_opened_to_tenants_generates():
    assert kind_of("POST", "/v1/custom", ("/v1/custom",)) is Kind.GENERATES
    assert kind_of("POST", "/v1/other", ("/v1/custom",)) is Kind.UNKNOWN


@pytest.mark.parametrize("path, rid", [
    ("/v1/responses/resp_1", "resp_1"), ("/v1/responses/resp_1/", "resp_1"), ("/v1/responses/resp_1/cancel", "resp_1"),
    ("/v1/responses", None), ("/v1/responses/", None), ("/v1/responses/a/b", None), ("/v1/responses/" + "x" * 201, None),
])
def test_a_stored_response_id_is_one_path_segment(path, rid):
    assert stored_id(path) == rid


def test_no_path_is_in_two_tables():
    tables = [set(ROUTED), GENERATES, UNSALTABLE, SERVES, OPERATOR_POSTS]
    assert sum(len(t) for t in tables) == len(set().union(*tables))
