"""``prefix-router`` command line: ``serve`` (the gateway), ``epp`` (the gateway as Envoy's
Endpoint Picker), ``sim`` (one simulated vLLM replica), ``replay`` (a trace against an endpoint),
``demo`` (prefix affinity against round-robin), ``audit`` (where clients broke their own prefixes
in a request log) and ``gate`` (fail CI when a change lowers the hit rate)."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys

__all__ = ["main"]


def _add_sim(sub: argparse._SubParsersAction) -> None:
    from prefix_router.tools.sim.config import SimConfig

    d = SimConfig()
    p = sub.add_parser("sim", help="run one simulated vLLM replica (OpenAI API, APC, vLLM metrics)",
                       description="A stand-in vLLM replica: same HTTP API, prefix-cache rules and "
                                   "metrics; timing modelled on one H100 serving an 8B model.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--model", default=d.model, help="served model name (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--num-blocks", type=int, default=d.num_gpu_blocks,
                   help="KV capacity in blocks, as vLLM's num_gpu_blocks (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"default: {d.max_model_len}, or the KV capacity when smaller")
    p.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s)
    p.add_argument("--decode-ms-per-token", type=float, default=d.decode_ms_per_token)
    p.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="run this many times faster than modelled time (default: %(default)s)")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                   help="output length when a request sets no max_tokens (default: %(default)s)")
    p.add_argument("--tokenizer", default=None,
                   help="Hugging Face tokenizer folder (needed for exact chat token ids); "
                        "default: built-in byte tokenizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-events-config", type=json.loads, default=None, metavar="JSON",
                   help="publish KV cache events as vLLM does, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                        "\"replay_endpoint\": \"tcp://*:5558\"}'")
    p.add_argument("--kv-transfer-config", type=json.loads, default=None, metavar="JSON",
                   help="play one role of a disaggregated fleet as vLLM's NixlConnector does, e.g. "
                        "'{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_producer\"}' (prefill) "
                        "or \"kv_consumer\" (decode)")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="K",
                   help="run K engines behind this server, as vllm serve --data-parallel-size: each its own "
                        "KV cache and event publisher (ports + rank), chosen by X-data-parallel-rank or by "
                        "vLLM's balancer (default: %(default)s)")
    p.add_argument("--cpu-offload-blocks", type=int, default=0, metavar="N",
                   help="keep N blocks in a CPU offload tier past the GPU's, as vLLM's OffloadingConnector "
                        "does, announced as its self-describing KV events (default: off)")
    p.set_defaults(func=_run_sim)


def _run_sim(args: argparse.Namespace) -> int:
    from aiohttp import web

    from prefix_router.tools.sim.config import SimConfig
    from prefix_router.tools.sim.server import create_app
    from prefix_router.prompts.tokenizer import load_tokenizer

    capacity = (args.num_blocks - 1) * args.block_size
    max_model_len = args.max_model_len or min(SimConfig().max_model_len, capacity)
    config = SimConfig(
        model=args.model, block_size=args.block_size, num_gpu_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len, prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_ms_per_token=args.decode_ms_per_token, time_scale=args.time_scale,
        default_max_tokens=args.default_max_tokens, tokenizer=args.tokenizer, seed=args.seed,
        kv_events=args.kv_events_config, kv_transfer=args.kv_transfer_config,
        data_parallel_size=args.data_parallel_size, cpu_offload_blocks=args.cpu_offload_blocks,
    )
    try:
        app = create_app(config, load_tokenizer(args.tokenizer))
    except (ValueError, OSError) as exc:
        print(f"prefix-router sim: {exc}", file=sys.stderr)
        return 2
    try:
        web.run_app(app, host=args.host, port=args.port, access_log=None, backlog=4096,
                    print=lambda *_: print(f"simulated vLLM replica on http://{args.host}:{args.port} "
                                           f"model={config.model} blocks={config.num_gpu_blocks}x{config.block_size}"
                                           + (f" kv_role={config.kv_transfer['kv_role']}" if config.kv_transfer
                                              else "")
                                           + (f" data_parallel_size={config.data_parallel_size}"
                                              if config.data_parallel_size > 1 else ""), flush=True))
    except OSError as exc:  # the port taken, an address this machine does not have
        from prefix_router.workers import listen_error

        print(f"prefix-router sim: {listen_error(args.host, args.port, exc)}", file=sys.stderr)
        return 1
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the prefix-affinity gateway in front of vLLM replicas",
                       description="OpenAI-compatible gateway: routes each request to the replica most "
                                   "likely to hold its prompt's prefix, bounded by load.")
    _gateway_arguments(p)
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="gateway processes sharing the port (the workers setting; default 1)")
    p.set_defaults(func=_run_serve, grpc_port=None, fallbacks=0)


def _add_epp(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("epp", help="run the gateway as an Endpoint Picker for Envoy (ext_proc, Gateway API)",
                       description="Envoy external processor following the Gateway API Inference Extension's "
                                   "Endpoint Picker protocol: the same routing, metrics and miss accounting "
                                   "as serve, without a second proxy hop (prefix_router/epp/picker.py). The HTTP port "
                                   "serves /metrics, /replicas, /debug/changes, /health and /ready; requests "
                                   "go through the gateway that asks the picker, never through the picker.")
    _gateway_arguments(p)
    p.add_argument("--grpc-port", type=int, default=9002, help="the ext_proc gRPC port (default: %(default)s)")
    p.add_argument("--fallbacks", type=int, default=0, metavar="N",
                   help="name N more endpoints after the chosen one in x-gateway-destination-endpoint, for "
                        "gateways that try them in order when it fails (Envoy's original-destination "
                        "cluster takes one address: default %(default)s)")
    p.set_defaults(func=_run_serve, workers=None)


def _gateway_arguments(p: argparse.ArgumentParser) -> None:
    from prefix_router.config import POLICIES

    p.add_argument("--config", default=None, help="YAML configuration (see configs/)")
    p.add_argument("--replica", action="append", default=None, metavar="URL",
                   help="replica base URL, repeatable (replaces the configured list)")
    p.add_argument("--prefill", action="append", default=None, metavar="URL",
                   help="a prefill replica of a disaggregated fleet (vLLM kv_role kv_producer), repeatable; "
                        "with --decode, replaces the configured list")
    p.add_argument("--decode", action="append", default=None, metavar="URL",
                   help="a decode replica of a disaggregated fleet (kv_role kv_consumer), repeatable")
    p.add_argument("--host", default=None, help="address to listen on (default 0.0.0.0, or the config's host)")
    p.add_argument("--port", type=int, default=None, help="port to listen on (default 8080, or the config's port)")
    p.add_argument("--policy", default=None, choices=POLICIES)
    p.add_argument("--tokenizer", default=None,
                   help="the served model's tokenizer: a folder, or a model id in the local Hugging Face cache "
                        "(exact token blocks; nothing is downloaded without --tokenizer-download)")
    p.add_argument("--tokenizer-download", action="store_true", default=None,
                   help="fetch a --tokenizer model id missing from the local Hugging Face cache from the Hub at start "
                        "(its tokenizer files alone; never with HF_HUB_OFFLINE=1)")
    p.add_argument("--discover", default=None, metavar="DNS_NAME",
                   help="also take as replicas every address this name resolves to, e.g. the "
                        "headless Service of the vLLM pods (discovery.dns)")
    p.add_argument("--discover-prefill", default=None, metavar="DNS_NAME",
                   help="take every address this name resolves to as a prefill replica of a disaggregated "
                        "fleet (discovery.prefill_dns); --discover then names the decode replicas")
    p.add_argument("--request-log", default=None, metavar="FILE",
                   help="append one JSON line per request (routing and cache outcome, no prompt text)")
    p.add_argument("--request-log-bodies", action="store_true", default=None,
                   help="also write each request's body (prompt text) to the request log, for "
                        "prefix-router audit and gate (request_log_bodies)")
    p.add_argument("--request-log-blocks", action="store_true", default=None,
                   help="also write each prompt's chain of block hashes, keyed with $PREFIX_ROUTER_REQUEST_LOG_KEY "
                        "(no text), for prefix-router fleetsim (request_log_blocks)")


def _event_loop():
    """uvloop's event loop where it is installed (Linux, macOS), else asyncio's: the gateway's
    loop runs every request's I/O, and uvloop's costs less CPU per request
    (docs/benchmarks.md)."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _quiet_gc() -> None:
    """Collect cycles less often once the gateway is loaded: ``gc.freeze()`` moves everything
    allocated so far (modules, the tokenizer, the compiled chat template) to a generation the
    collector never scans, and a young generation of 20,000 objects in place of 700 runs it
    about 30 times less often. Each request allocates thousands of short-lived dicts and lists
    (the parsed body, the template's context), and the default thresholds spent 6% of the
    gateway's busy CPU in the collector on ~1,000-token chats (py-spy --native, 50/s). vLLM's
    server freezes its startup heap the same way (``freeze_gc_heap`` in ``vllm/utils/gc_utils.py``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


def _run_serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from prefix_router.app import create_app
    from prefix_router.config import ConfigError, load_config
    from prefix_router.prompts.tokenizer import HFTokenizer, fetch_tokenizer
    from prefix_router.workers import port_problem, supervise, worker_index

    name = "prefix-router serve" if args.grpc_port is None else "prefix-router epp"
    try:
        config = _with_replicas(load_config(args.config, overrides=_serve_overrides(args)))
        worker = worker_index()
        if config.tokenizer_download and worker is None:  # once, before any worker starts
            fetch_tokenizer(config.tokenizer)
        if config.workers > 1 and worker is None:
            return supervise(sys.argv[1:], config.workers, config.drain_s, config.host, config.port)
        problem = port_problem(config.host, config.port) if worker is None else None
        if problem is None and args.grpc_port is not None:
            problem = port_problem(config.host, args.grpc_port)
        if problem:  # before the replicas are checked, so the error is the one line printed
            print(f"{name}: {problem}", file=sys.stderr)
            return 1
        tokenizer = (HFTokenizer(config.tokenizer, max_cached_tokens=config.index.tokenizer_cache_tokens)
                     if config.tokenizer else None)
        app = create_app(config, tokenizer, proxy=args.grpc_port is None)
        if args.grpc_port is not None:
            if config.workers > 1:
                raise ConfigError("workers: the endpoint picker runs in one process")
            ranked = next((i for i, r in enumerate(config.replicas) if r.data_parallel_size > 1), None)
            if ranked is not None:  # Envoy's destination is ip:port: no header of the picker's reaches a rank
                raise ConfigError(f"replicas[{ranked}].data_parallel_size: the endpoint picker names an endpoint by "
                                  "ip:port, which cannot carry a data-parallel rank; leave it at 1 (vLLM balances "
                                  "its ranks) or use prefix-router serve")
            try:
                from prefix_router.epp.server import add_picker
            except ImportError as exc:
                raise ConfigError(f"the endpoint picker needs grpcio and Envoy's protos ({exc.name} is missing): "
                                  "pip install 'prefix-router[epp]'") from None
            if args.fallbacks < 0:
                raise ConfigError("--fallbacks: a number of endpoints, 0 or more")
            add_picker(app, args.grpc_port, config.host, args.fallbacks)
    except (ConfigError, OSError, ValueError) as exc:  # ValueError: PREFIX_ROUTER_REQUEST_LOG_KEY too short
        for line in str(exc).splitlines() or [""]:  # a configuration names each of its problems on a line
            print(f"{name}: {line}", file=sys.stderr)
        return 2
    # SIGTERM (and Ctrl-C): stop accepting, give in-flight requests drain_s, then exit 0
    # backlog: aiohttp's default of 128 pending connections resets clients in a burst of new
    # connections (measured at 400 requests/s); the kernel caps it at net.core.somaxconn
    _quiet_gc()
    try:
        web.run_app(app, host=config.host, port=config.port, access_log=None, handler_cancellation=True,
                    shutdown_timeout=config.drain_s, backlog=4096, loop=_event_loop(), reuse_port=worker is not None,
                    print=lambda *_: worker or print(_banner(config, args.grpc_port, worker is not None), flush=True))
    except OSError as exc:  # the port taken, an address this machine does not have
        from prefix_router.workers import listen_error

        where = listen_error(config.host, config.port, exc) if exc.errno else str(exc)
        print(f"{name}: {where}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # found at startup: discovery.kubernetes without its library or credentials
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    return 0


def _with_replicas(config):
    """``config``, or ConfigError where it names no replica and no way to find one."""
    from prefix_router.config import ConfigError

    if not (config.replicas or config.discovery.dns or config.discovery.prefill_dns
            or config.discovery.kubernetes.label_selector):
        raise ConfigError("replicas: at least one replica is needed (--replica URL, --discover DNS_NAME "
                          "or the config file)")
    return config


def _serve_overrides(args: argparse.Namespace) -> dict:
    """The command line's settings of ``serve`` and ``epp``, as overrides of the config file."""
    overrides: dict = {}
    for key in ("host", "port", "tokenizer", "tokenizer_download", "request_log", "request_log_bodies",
                "request_log_blocks", "workers"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if args.replica or args.prefill or args.decode:
        overrides["replicas"] = [*(args.replica or []), *({"url": u, "role": "prefill"} for u in args.prefill or ()),
                                 *({"url": u, "role": "decode"} for u in args.decode or ())]
    if args.policy:
        overrides["routing"] = {"policy": args.policy}
    if args.discover or args.discover_prefill:
        overrides["discovery"] = {k: v for k, v in (("dns", args.discover), ("prefill_dns", args.discover_prefill)) if v}
    return overrides


def _banner(config, grpc_port: int | None, workers: bool) -> str:
    """The line printed once the gateway (or the endpoint picker) listens."""
    what = (f"prefix-router endpoint picker: gRPC (Envoy ext_proc) on {config.host}:{grpc_port}, metrics and views"
            if grpc_port is not None else "prefix-router gateway")
    n = len(config.replicas)
    prefill = sum(r.role == "prefill" for r in config.replicas)
    pools = f"{prefill} prefill and {n - prefill} decode replicas" if prefill else f"{n} replica{'' if n == 1 else 's'}"
    return (f"{what} on http://{config.host}:{config.port} ({config.routing.policy}, {pools}"
            + (f", discovering {config.discovery.dns}" if config.discovery.dns else "")
            + (f", prefill replicas from {config.discovery.prefill_dns}" if config.discovery.prefill_dns else "")
            + (f", {config.workers} workers" if workers else "") + ")")


class _ClientErrorFilter(logging.Filter):
    """aiohttp logs every malformed HTTP request (a bad header, an oversized line) at ERROR with
    a traceback, though it answers 400 and nothing failed here: keep one warning line, without
    the offending bytes, so a misbehaving client cannot flood the logs or write into them."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = "malformed HTTP request answered %s (%s)", (exc.code, type(exc).__name__)
            record.exc_info = record.exc_text = None
        return True


class _JsonFormatter(logging.Formatter):
    """One JSON object a line (``--log-format json``): time (ISO 8601, UTC), level, logger,
    message, and the exception's traceback when there is one; for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime

        line = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(),
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def _logging_options(parser: argparse.ArgumentParser, default_level, default_format) -> None:
    parser.add_argument("--log-level", default=default_level, type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="default: INFO for serve (replicas joining, leaving, failing; drain), WARNING otherwise")
    parser.add_argument("--log-format", default=default_format, choices=("text", "json"),
                        help="text lines, or one JSON object a line (default: text)")


def _setup_logging(args: argparse.Namespace) -> None:
    level = args.log_level or ("INFO" if args.command == "serve" else "WARNING")
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter() if args.log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.getLogger("aiohttp.server").addFilter(_ClientErrorFilter())


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``prefix-router`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="prefix-router", description=__doc__)
    _logging_options(parser, None, "text")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_epp(sub)
    _add_sim(sub)
    from prefix_router.tools.audit import add_parser as add_audit
    from prefix_router.tools.demo import add_parser as add_demo
    from prefix_router.tools.fleetsim.cli import add_parser as add_fleetsim
    from prefix_router.tools.gate import add_parser as add_gate
    from prefix_router.tools.replay.cli import add_parser as add_replay

    add_replay(sub)
    add_fleetsim(sub)
    add_demo(sub)
    add_audit(sub)
    add_gate(sub)
    for command in sub.choices.values():  # also accepted after the command: serve --log-level INFO
        _logging_options(command, argparse.SUPPRESS, argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _setup_logging(args)
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader left (``audit --json | head``): stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's recipe (library/signal)
        return 1


if __name__ == "__main__":
    sys.exit(main())
