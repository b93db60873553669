"""The simulated replica's KV connector: vLLM's NixlConnector as a gateway meets it, in either role.

vLLM runs a replica of a disaggregated fleet with ``--kv-transfer-config '{"kv_connector":
"NixlConnector", "kv_role": "kv_producer"}'`` (prefill) or ``"kv_consumer"`` (decode); the
simulator takes the same option (``SimConfig.kv_transfer``) and plays the role as the engine does
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl/`` in vLLM 0.32):

- prefill: a request whose ``kv_transfer_params`` say ``do_remote_decode`` computes its prompt and
  finishes; its blocks are not freed but held for the decode (``Scheduler.held``) until one pulls
  them or ``lease_s`` passes, and its answer carries the parameters a decode needs
  (``answer_params``: ``do_remote_prefill``, ``remote_engine_id``, ``remote_block_ids``,
  ``remote_request_id``, ``remote_host``, ``remote_port``, ``tp_size``);
- decode: a request whose parameters say ``do_remote_prefill`` pulls the blocks from
  ``remote_host:remote_port`` (vLLM: a NIXL read after a handshake on the side channel; here
  ``POST /sim/kv_pull`` on the prefill replica's HTTP port), waits the modelled transfer time
  (``gb_per_s``) and computes only the prompt's last token. A prefill replica it cannot reach is a
  500 (vLLM's ``kv_load_failure_policy`` "fail", after a handshake timeout: here at once).

Whatever departs from the request flow of vLLM's own proxy
(https://github.com/vllm-project/vllm/blob/030ea52/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) is counted in
``sim:kv_contract_violations_total`` by kind (``VIOLATIONS``): a router test asserts there are
none. vLLM itself serves most of these anyway (a late decode reads freed blocks and answers 200),
which is why a router cannot learn them from its answers. Transfers are counted in
``sim:kv_transfers_total`` by outcome: ``pulled``, ``failed`` (the prefill replica could not be
reached), ``computed`` (a decode replica given no parameters computes the prompt itself).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from dataclasses import dataclass

import aiohttp
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["BYTES_PER_TOKEN", "Connector", "ConnectorMetrics", "VIOLATIONS", "expire_leases"]

ROLES = ("kv_producer", "kv_consumer", "kv_both")
# KV bytes per token of the modelled Llama-3.1-8B in bf16 (tools/sim/config.py): 2 x 32 x 8 x 128 x 2
BYTES_PER_TOKEN = 131_072
VIOLATIONS = {
    "prefill_on_decode_replica": "do_remote_decode sent to a kv_consumer",
    "decode_on_prefill_replica": "do_remote_prefill sent to a kv_producer",
    "whole_request_on_prefill_replica": "a request without do_remote_decode on a kv_producer",
    "prefill_streamed": "a prefill leg asked to stream",
    "prefill_not_one_token": "a prefill leg asked for more than one token",
    "several_sequences": "kv_transfer_params with n > 1",
    "unknown_transfer": "a pull of blocks not held: never made, pulled before, or past the lease",
    "prompt_mismatch": "the pulled blocks are not the prompt's",
    "no_connector": "kv_transfer_params sent to a replica without a KV connector",
}


@dataclass(frozen=True, slots=True)
class Leg:
    """What a request's ``kv_transfer_params`` ask of this replica: ``produce`` (hold the blocks
    for a remote decode), ``consume`` (the parameters of a prefill to pull), or neither."""

    produce: bool = False
    consume: dict | None = None


class Connector:
    """One replica's connector. ``config``: the ``--kv-transfer-config`` object (``kv_role``;
    ``kv_connector_extra_config`` may set ``lease_s``, default 30 (vLLM 0.32's
    ``kv_lease_duration``), and ``gb_per_s``, default 25: a 400 Gb/s RDMA link at half its rate).
    ``None``: no connector, as a replica started without the option.

    Raises ValueError for a missing or unknown ``kv_role``, or another ``kv_connector``."""

    def __init__(self, config: dict | None) -> None:
        config = config or {}
        self.role = config.get("kv_role")
        if config and self.role not in ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if config and config.get("kv_connector", "NixlConnector") != "NixlConnector":
            raise ValueError("--kv-transfer-config: the simulator plays NixlConnector's request flow only, "
                             f"not {config.get('kv_connector')!r}")
        extra = config.get("kv_connector_extra_config") or {}
        self.lease_s = float(extra.get("lease_s", 30.0))
        self.gb_per_s = float(extra.get("gb_per_s", 25.0))
        self.engine_id = uuid.uuid4().hex
        self.violations: Counter[str] = Counter()
        self.transfers: Counter[str] = Counter()
        self.leases: dict[str, float] = {}  # held request id -> modelled time its lease ends
        self.http: aiohttp.ClientSession | None = None  # for pulls; the app opens it

    def violate(self, kind: str) -> None:
        """Count one departure from the contract (a kind of ``VIOLATIONS``)."""
        self.violations[kind] += 1

    def leg(self, params, *, stream: bool, max_tokens: int | None, n: int) -> Leg:
        """Read a request's ``kv_transfer_params`` (None when absent), counting what breaks the
        contract; a decode leg's parameters come back in ``Leg.consume`` to pull."""
        producer, consumer = self.role in ("kv_producer", "kv_both"), self.role in ("kv_consumer", "kv_both")
        if not isinstance(params, dict) or not params:
            if self.role == "kv_producer":
                self.violate("whole_request_on_prefill_replica")
            elif consumer:
                self.transfers["computed"] += 1
            return Leg()
        if self.role is None:
            self.violate("no_connector")
            return Leg()
        if n != 1:
            self.violate("several_sequences")
        if params.get("do_remote_decode"):
            if not producer:
                self.violate("prefill_on_decode_replica")
                return Leg()
            if stream:
                self.violate("prefill_streamed")
            if max_tokens != 1:
                self.violate("prefill_not_one_token")
            return Leg(produce=True)
        if params.get("do_remote_prefill"):
            if not consumer:
                self.violate("decode_on_prefill_replica")
                return Leg()
            return Leg(consume=params)
        return Leg()

    def answer_params(self, request_id: str, block_ids: list[int], host: str, port: int, now_s: float,
                      num_tokens: int, cached_tokens: int) -> dict:
        """The ``kv_transfer_params`` of a finished prefill leg whose blocks are now held, its
        lease started at ``now_s`` (modelled seconds), the fields vLLM 0.32's producer answers:
        ``remote_num_tokens`` (the prompt's tokens) and ``remote_prefill_cached_tokens`` (its
        prefix-cache hit here, which the decode replica reports as the request's cached tokens)."""
        self.leases[request_id] = now_s + self.lease_s
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": block_ids,
                "remote_engine_id": self.engine_id, "remote_request_id": request_id, "remote_host": host,
                "remote_port": port, "tp_size": 1, "remote_num_tokens": num_tokens, "transfer_mode": "pull",
                "remote_prefill_cached_tokens": cached_tokens}

    def expired(self, now_s: float) -> list[str]:
        """The held request ids whose lease ended by ``now_s``, forgotten here (the caller frees
        their blocks)."""
        gone = [rid for rid, end in self.leases.items() if end <= now_s]
        for rid in gone:
            del self.leases[rid]
        return gone

    def give(self, request_id: str, engine_id: str, release) -> list | None:
        """A decode's pull of ``request_id``'s blocks: their hashes, freed here through
        ``release(request_id)`` (``Scheduler.release_held``), or None when this engine holds none
        under that id (another engine's, never made, pulled before, or its lease ended)."""
        if engine_id != self.engine_id or self.leases.pop(request_id, None) is None:
            return None
        return release(request_id)

    async def pull(self, params: dict, block_hashes: list, block_size: int) -> int | None:
        """Pull a prefill's blocks for a prompt of ``block_hashes`` (full blocks): the prompt
        tokens now computed, 0 when the pull found nothing usable (counted as a violation; the
        prompt is computed here), or None when the prefill replica could not be reached."""
        url = f"http://{params.get('remote_host')}:{params.get('remote_port')}/sim/kv_pull"
        body = {"remote_request_id": params.get("remote_request_id"), "remote_engine_id": params.get("remote_engine_id")}
        try:
            async with self.http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                answer = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            self.transfers["failed"] += 1
            return None
        if answer is None:
            self.violate("unknown_transfer")
            return 0
        held = answer.get("block_hashes") or []
        full = [h for h in held if h is not None]  # a prompt under one block moves none: nothing to check
        if full[: len(block_hashes)] != list(block_hashes[: len(full)]):
            self.violate("prompt_mismatch")
            return 0
        self.transfers["pulled"] += 1
        return min(len(full), len(block_hashes)) * block_size

    def transfer_s(self, tokens: int) -> float:
        """Modelled seconds to move ``tokens`` tokens' KV over the link."""
        return tokens * BYTES_PER_TOKEN / (self.gb_per_s * 1e9)


class ConnectorMetrics(Collector):
    """``sim:kv_contract_violations_total{kind}`` (every kind, 0 included, so a test reads a
    zero) and ``sim:kv_transfers_total{outcome}``, read from the connector when scraped."""

    def __init__(self, connector: Connector) -> None:
        self.connector = connector

    def collect(self):
        violations = CounterMetricFamily("sim:kv_contract_violations", "Requests that broke vLLM's P/D request flow.",
                                         labels=("kind",))
        for kind in VIOLATIONS:
            violations.add_metric([kind], self.connector.violations[kind])
        yield violations
        transfers = CounterMetricFamily("sim:kv_transfers", "Decode legs by how their prompt's KV came.",
                                        labels=("outcome",))
        for outcome in ("pulled", "failed", "computed"):
            transfers.add_metric([outcome], self.connector.transfers[outcome])
        yield transfers


async def expire_leases(ranks, connector: Connector) -> None:
    """Free the blocks of prefill legs no decode pulled within the lease (vLLM frees them too),
    every quarter second until cancelled; ``ranks``: the server's ``data_parallel.Ranks``."""
    while True:
        await asyncio.sleep(0.25)
        for request_id in connector.expired(ranks.engines[0].now_s()):
            engine = ranks.holding(request_id)
            if engine is not None:
                engine.scheduler.release_held(request_id)
