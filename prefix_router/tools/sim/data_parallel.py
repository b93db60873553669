"""A simulated server's data-parallel ranks (``SimConfig.data_parallel_size``): which engine a
request runs on, as vLLM 0.32's serving layer and its data-parallel client choose it.

A request naming a rank in the ``X-data-parallel-rank`` header runs on that engine
(``vllm/entrypoints/generate/base/serving.py``: a value that is not an integer is ignored); one
out of range is refused with vLLM's message (``vllm/v1/engine/input_processor.py``, a 400). Any
other request goes to the engine vLLM's balancer picks (``DPLBAsyncMPClient.
get_core_engine_for_request`` in ``vllm/v1/engine/core_client.py``): the least score, waiting +
running plus a penalty of 6 x waiting x (KV usage - 0.5) where the cache is over half full, the
scan starting one engine further each time so ties rotate. vLLM reads the counts from its
coordinator every 100 ms; the simulator reads them now.
"""

from __future__ import annotations

from prefix_router.constants import DP_RANK_HEADER
from prefix_router.tools.sim.engine import Engine
from prefix_router.tools.sim.requests import ApiError

__all__ = ["Ranks", "check_event_ports", "offset_endpoint"]


class Ranks:
    """The engines of one simulated server, in rank order (``engines[0]`` is rank 0)."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = engines
        self._start = 0  # where the balancer's next scan starts

    def __len__(self) -> int:
        return len(self.engines)

    def pick(self, headers) -> Engine:
        """The engine a request with ``headers`` runs on. Raises ApiError (400) for a rank out of
        range."""
        value = headers.get(DP_RANK_HEADER)
        try:
            rank = int(value) if value is not None else None
        except ValueError:
            rank = None
        if rank is not None:
            if not 0 <= rank < len(self.engines):
                raise ApiError(f"data_parallel_rank {rank} is out of range [0, {len(self.engines)}).")
            return self.engines[rank]
        return self.balance()

    def balance(self) -> Engine:
        """vLLM's choice for a request naming no rank (module docstring)."""
        n = len(self.engines)
        if n == 1:
            return self.engines[0]
        best, best_score = 0, float("inf")
        for i in range(n):
            idx = (self._start + i) % n
            scheduler = self.engines[idx].scheduler
            waiting = len(scheduler.waiting)
            score = waiting + len(scheduler.running)
            if waiting:
                score += waiting * 6.0 * max(0.0, scheduler.kv.usage - 0.5)
            if score < best_score:
                best, best_score = idx, score
        self._start = (self._start + 1) % n
        return self.engines[best]

    def holding(self, request_id: str) -> Engine | None:
        """The engine holding a finished prefill leg's blocks under ``request_id``, if any."""
        return next((e for e in self.engines if request_id in e.scheduler.held), None)


def check_event_ports(config) -> None:
    """Raise ValueError where the ranks' publishers would take one port twice, or one past 65535
    (each rank binds its endpoint and replay socket at its configured port plus its rank)."""
    events = config.kv_events or {}
    if not events.get("enable_kv_cache_events"):
        return
    taken: dict[int, str] = {}
    for rank in range(config.data_parallel_size):
        for what in ("endpoint", "replay_endpoint"):
            port = (offset_endpoint(events.get(what, "tcp://*:5557" if what == "endpoint" else None), rank) or "").rpartition(":")[2]
            if not port.isdigit() or not int(port):
                continue
            if int(port) > 65535:
                raise ValueError(f"kv events: rank {rank}'s {what} would be port {port}, past 65535")
            if int(port) in taken:
                raise ValueError(f"kv events: rank {rank}'s {what} would take port {port}, which {taken[int(port)]} "
                                 f"has: each rank binds its ports plus its rank, so leave {config.data_parallel_size} "
                                 "ports between endpoint and replay_endpoint")
            taken[int(port)] = f"rank {rank}'s {what}"


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A bind address with ``rank`` added to its TCP port, as vLLM's ``offset_endpoint_port``
    (``vllm/distributed/kv_events.py``) gives each rank its own; port 0 stays 0."""
    if not endpoint or not rank or not endpoint.startswith("tcp://"):
        return endpoint
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + rank}" if port.isdigit() and int(port) else endpoint
