"""Every POST route of the installed vLLM, read from its own router, is known to the gateway and
keeps tenants apart: routed or passed with the tenant's salt, passed without a body the engine
generates from, or refused.

The routes come from vLLM's ``build_app`` (``vllm/entrypoints/launchers/app.py``) with every task
it supports, dev mode and fault tolerance on, run in the vLLM environment (no engine starts);
a route a later vLLM adds fails ``test_every_vllm_post_route_has_a_kind`` until
``prefix_router/endpoints.py`` sorts it. The requests then go through the gateway to a recording fake
replica (tests/e2e/test_isolation.py), as tenant bolt forging tenant acme's salt.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from prefix_router.endpoints import Kind, kind_of

from ..e2e.test_isolation import _body_for, _key, gateway  # noqa: F401 (a fixture)
from .harness import require_vllm

pytestmark = pytest.mark.vllm

ROUTES = r"""
import json, logging, os, sys, warnings
from typing import get_args
os.environ["VLLM_SERVER_DEV_MODE"] = "1"
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.tasks import SupportedTask
from vllm.utils.argparse_utils import FlexibleArgumentParser

class PoolingModel:  # what register_pooling_api_routers reads of a model's configuration
    architecture = "any"
    io_processor_plugin = None
    def get_pooling_task(self, supported_tasks):
        return "embed"
    def __getattr__(self, name):
        return None

args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
args.enable_fault_tolerance = True
app = build_app(args, get_args(SupportedTask), PoolingModel())
json.dump(sorted({r.path for r in app.routes if "POST" in (getattr(r, "methods", None) or ())}), sys.stdout)
"""


@pytest.fixture(scope="module")
def vllm_posts() -> list[str]:
    python = require_vllm()
    done = subprocess.run([str(python), "-c", ROUTES], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_every_vllm_post_route_has_a_kind(vllm_posts):
    assert len(vllm_posts) > 40, vllm_posts  # the app was built with its routers
    unknown = [p for p in vllm_posts if kind_of("POST", p.replace("{response_id}", "resp_x")) is Kind.UNKNOWN]
    assert unknown == [], f"vLLM POST routes prefix_router/endpoints.py does not sort: {unknown}"


async def test_every_vllm_post_route_keeps_a_tenants_cache_its_own(gateway, vllm_posts):  # noqa: F811
    replica, client = await gateway()
    outcomes: dict[str, str] = {}
    for route in vllm_posts:
        path = route.replace("{response_id}", "resp_of_acme")
        seen = len(replica.seen)
        resp = await client.post(path, json=_body_for(path), headers=_key("bolt"))
        reached = [raw for _, p, _, raw in replica.seen[seen:] if p == path]
        kind = kind_of("POST", path)
        if resp.status in (401, 403, 404):
            assert reached == [], path
            outcomes[path] = f"refused {resp.status}"
        elif kind in (Kind.ROUTED, Kind.GENERATES):
            (raw,) = reached
            sent = json.loads(raw)
            assert sent["cache_salt"] == "tenant:bolt" and b"tenant:acme" not in raw, path
            assert "kv_cache_report_mode" not in sent["vllm_xargs"], path
            outcomes[path] = "salted"
        else:
            assert kind is Kind.SERVES, (path, kind, resp.status)
            assert [json.loads(raw) for raw in reached] == [_body_for(path)], path  # as it came
            outcomes[path] = "passed"
    assert outcomes["/invocations"] == "salted" and outcomes["/v1/chat/completions/batch"] == "salted"
    assert outcomes["/reset_prefix_cache"] == "refused 403"
    assert outcomes["/v1/responses/resp_of_acme/cancel"] == "refused 404"
