"""The container for real: the image built from ``deploy/docker/Dockerfile`` with ``make image``,
the host-network compose stack (``deploy/docker/compose.host.yaml``: two simulated replicas, the
gateway, Prometheus) run from it with ``docker-compose``, requests sent through the gateway in
its container, and Prometheus scraping it.

Needs a Docker engine and ``docker-compose``; without them the test skips, unless
``PREFIX_ROUTER_REQUIRE_DOCKER=1`` (CI) makes that a failure. With no image registry in reach,
the base image is made locally (``deploy/docker/base-image.sh``: Debian's minimal root file
system with python3, about 90 s once) and Prometheus' image from the host's own binary (Debian
package ``prometheus``). ``PREFIX_ROUTER_IMAGE_BASE`` names another base (``python:3.12-slim``
where a registry is reachable).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from prefix_router.constants import REPLICA_HEADER
from prefix_router.tools.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "deploy" / "docker" / "compose.host.yaml"
BASE = os.environ.get("PREFIX_ROUTER_IMAGE_BASE", "local/python:3.11")
IMAGE = "prefix-router:test"
PROMETHEUS_IMAGE = "local/prometheus:test"


def _docker() -> tuple[str, str]:
    """The docker and docker-compose commands, or skip (fail under PREFIX_ROUTER_REQUIRE_DOCKER=1)."""
    docker = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker")
    compose = shutil.which("docker-compose")
    problem = None
    if docker is None or compose is None:
        problem = "docker and docker-compose are not installed"
    elif subprocess.run([docker, "info"], capture_output=True).returncode != 0:
        problem = "no Docker engine answers (start dockerd)"
    if problem:
        if os.environ.get("PREFIX_ROUTER_REQUIRE_DOCKER") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return docker, compose


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    docker, compose = _docker()
    env = {**os.environ, "DOCKER": docker}
    if BASE.startswith("local/"):
        root = [] if os.geteuid() == 0 else ["sudo", "-E"]  # debootstrap needs root
        _run(root + [str(ROOT / "deploy" / "docker" / "base-image.sh"), BASE], env=env, timeout=900)
    # pip in the build trusts what pip here trusts (a proxy that re-signs TLS), when that is set
    ca = next((c for c in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE")) if c and Path(c).is_file()), "")
    _run(["make", "-C", str(ROOT), "image", f"BASE={BASE}", f"IMAGE={IMAGE}", f"DOCKER={docker}", f"CA_BUNDLE={ca}"],
         timeout=900)
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.fail("the prometheus binary (Debian package prometheus) is needed for the stack's Prometheus")
    context = tmp_path_factory.mktemp("prometheus-image")
    shutil.copy(prometheus, context / "prometheus")
    (context / "Dockerfile").write_text(f'FROM {BASE}\nCOPY prometheus /bin/prometheus\nENTRYPOINT ["/bin/prometheus"]\n')
    _run([docker, "build", "-q", "-t", PROMETHEUS_IMAGE, str(context)], timeout=300)
    return docker, compose


def _wait(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer 200 within {seconds:g} s")
        time.sleep(0.5)


def _prometheus_value(port: int, query: str) -> float:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as resp:
        result = json.loads(resp.read())["data"]["result"]
    return sum(float(r["value"][1]) for r in result)


def test_the_image_runs_the_compose_stack_and_prometheus_scrapes_the_gateway(images, tmp_path):
    docker, compose = images
    ports = {name: free_port() for name in ("SIM_PORT_0", "SIM_PORT_1", "GATEWAY_PORT", "PROMETHEUS_PORT")}
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": "prefix-router", "static_configs": [{"targets": [f"127.0.0.1:{ports['GATEWAY_PORT']}"]}]},
            {"job_name": "vllm", "static_configs": [{"targets": [f"127.0.0.1:{ports['SIM_PORT_0']}",
                                                                  f"127.0.0.1:{ports['SIM_PORT_1']}"]}]}]}))
    config.chmod(0o644)
    env = {**os.environ, **{k: str(v) for k, v in ports.items()}, "IMAGE": IMAGE,
           "PROMETHEUS_IMAGE": PROMETHEUS_IMAGE, "PROMETHEUS_CONFIG": str(config), "DOCKER_HOST": os.environ.get(
               "DOCKER_HOST", "unix:///var/run/docker.sock")}
    stack = [compose, "-f", str(COMPOSE_FILE), "-p", f"prtest{uuid.uuid4().hex[:8]}"]
    _run(stack + ["up", "-d"], env=env, timeout=300)
    try:
        gateway = f"http://127.0.0.1:{ports['GATEWAY_PORT']}"
        _wait(gateway + "/ready", 60)  # both replicas checked and scraped
        replicas = set()
        for i in range(8):
            body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"conversation {i}: hello from the container test"}]}
            request = urllib.request.Request(gateway + "/v1/chat/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as resp:
                assert resp.status == 200
                assert json.loads(resp.read())["usage"]["prompt_tokens"] > 0
                replicas.add(resp.headers[REPLICA_HEADER])
        assert replicas <= {f"127.0.0.1:{ports['SIM_PORT_0']}", f"127.0.0.1:{ports['SIM_PORT_1']}"}
        _wait(f"http://127.0.0.1:{ports['PROMETHEUS_PORT']}/-/ready", 60)
        for query, wanted in (('sum(prefix_router_requests_total{code="200"})', 8),  # the gateway's count
                              ('up{job="prefix-router"}', 1), ('sum(up{job="vllm"})', 2)):  # every target scraped
            deadline = time.monotonic() + 60
            while (got := _prometheus_value(ports["PROMETHEUS_PORT"], query)) < wanted:
                assert time.monotonic() < deadline, f"Prometheus: {query} = {got} after 60 s, not {wanted}"
                time.sleep(1)
    except AssertionError:
        logs = subprocess.run(stack + ["logs", "--tail", "30"], capture_output=True, text=True, env=env)
        print(logs.stdout[-6000:])
        raise
    finally:
        subprocess.run(stack + ["down", "--timeout", "5"], capture_output=True, env=env, timeout=120)
