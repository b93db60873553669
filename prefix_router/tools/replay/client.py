"""Send a workload to an OpenAI-compatible endpoint and measure what the client sees.

Requests are streamed by default (``stream_options.include_usage`` on), so time to first
token is measured at the first event that carries generated text, and the final usage chunk
gives ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``. Independent requests go
out at their ``at_s / time_scale``; the turns of a session go out one after another, each
``think_s / time_scale`` after the previous response ended. ``concurrency`` caps requests in
flight (0: no cap). Every request yields one ``Record``; failures are recorded, not raised.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import aiohttp

from prefix_router.constants import REPLICA_HEADER
from prefix_router.tools.replay.workloads import ReplayRequest

__all__ = ["Record", "replay", "REPLICA_HEADER"]



@dataclass(slots=True)
class Record:
    """What one request did, as the client saw it. Times in seconds of wall clock."""

    index: int
    session: str | None
    turn: int
    send_s: float  # since the replay started
    ttft_s: float | None  # to the first generated text
    latency_s: float | None  # to the end of the response
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    status: int  # HTTP status; 0 when no response came
    error: str | None
    replica: str | None  # from the gateway's response header, when present
    replica_ttft_s: float | None = None  # the simulated replica's own part of ttft_s (its ``sim_ttft_s``)
    # the simulated replica's time to the first token in modelled seconds, machine load left out
    # (its ``sim_modelled_ttft_s``)
    replica_modelled_ttft_s: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def _usage(record: Record, usage: dict | None) -> None:
    if not usage:
        return
    record.prompt_tokens = usage.get("prompt_tokens")
    record.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens")


async def _send(http: aiohttp.ClientSession, target: str, model: str | None, stream: bool,
                req: ReplayRequest, record: Record, t0: float, headers: dict) -> None:
    body = dict(req.body)
    if model is not None:
        body["model"] = model
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    record.send_s = start - t0
    try:
        async with http.post(target + req.path, json=body, headers=headers) as resp:
            record.status = resp.status
            record.replica = resp.headers.get(REPLICA_HEADER)
            if resp.status != 200:
                record.error = (await resp.text())[:500]
                return
            if not stream:
                data = await resp.json()
                record.ttft_s = record.latency_s = time.perf_counter() - start
                _usage(record, data.get("usage"))
                return
            own = modelled = None  # the simulator's times to its first token, on the event that carried it
            async for raw in resp.content:
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(raw[6:])
                if "error" in event:
                    record.error = json.dumps(event["error"])[:500]
                own = event.get("sim_ttft_s", own)
                modelled = event.get("sim_modelled_ttft_s", modelled)
                for choice in event.get("choices") or ():
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text and record.ttft_s is None:
                        record.ttft_s = time.perf_counter() - start
                        record.replica_ttft_s, record.replica_modelled_ttft_s = own, modelled
                _usage(record, event.get("usage"))
            record.latency_s = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:500]


async def replay(requests: list[ReplayRequest], target: str | Sequence[str], *, model: str | None = None,
                 time_scale: float = 1.0, concurrency: int = 0, stream: bool = True,
                 timeout_s: float = 600.0, headers: dict | None = None,
                 session_header: str | None = "X-Session-ID",
                 on_record: Callable[[Record], None] | None = None) -> list[Record]:
    """Replay ``requests`` against ``target`` (base URL, no trailing /v1); records in input order.
    Several targets: requests go to them in turn as they are sent, as a round-robin load
    balancer in front of several gateway instances would spread them.

    ``model`` fills each body's model (None: leave it out, the server's default). A request that
    belongs to a session carries its id in ``session_header`` (the gateway's default session
    header; None sends none), as a client that keys its conversations would.
    """
    targets = [t.rstrip("/") for t in ([target] if isinstance(target, str) else target)]
    turn = itertools.count()
    records = [Record(i, r.session, r.turn, 0.0, None, None, None, None, None, 0, None, None)
               for i, r in enumerate(requests)]
    limit = asyncio.Semaphore(concurrency) if concurrency > 0 else None
    sessions: dict[str | None, list[int]] = defaultdict(list)
    for i, r in enumerate(requests):
        sessions[r.session if r.session is not None else f"#{i}"].append(i)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    t0 = time.perf_counter()

    async def run_chain(indices: list[int]) -> None:
        for n, i in enumerate(indices):
            req = requests[i]
            if n == 0:
                delay = t0 + req.at_s / time_scale - time.perf_counter()
            else:
                delay = req.think_s / time_scale
            if delay > 0:
                await asyncio.sleep(delay)
            sent = dict(headers or {})
            if session_header and req.session is not None:
                sent[session_header] = req.session
            target = targets[next(turn) % len(targets)]
            if limit is None:
                await _send(http, target, model, stream, req, records[i], t0, sent)
            else:
                async with limit:
                    await _send(http, target, model, stream, req, records[i], t0, sent)
            if on_record is not None:
                on_record(records[i])

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await asyncio.gather(*(run_chain(ix) for ix in sessions.values()))
    return records
