"""KV events in the fleet simulator: each replica's engine publishes its cache's changes after
every step, and each gateway instance takes them, late by a delay, as ``serve`` takes them.

The bytes are the real ones both ways: a step's events leave the simulated engine as vLLM's
publisher encodes them (``tools/sim/kv_events.py: encode_batch``) and reach an ``EngineView`` the
way ``cache/stream.py`` applies a live message (``decode_events``, ``to_event``, ``runs``,
``apply_run``), seeded as ``fleet/kv_follower.py`` seeds it. What the simulator leaves out is the
socket: no message is lost (so no gap, no replay), and each arrives ``delay_s`` after its step.
"""

from __future__ import annotations

from prefix_router.cache.blocks import seed_hash
from prefix_router.cache.engine_map import EngineMap
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.events import decode_events, to_event
from prefix_router.cache.intake import runs
from prefix_router.cache.stream import SLICE_BLOCKS
from prefix_router.tools.sim.kv_events import encode_batch

__all__ = ["EventFeed", "publish"]


def publish(events: list, t: float) -> bytes:
    """One replica's events of a step ending at ``t`` (virtual s), as its publisher sends them."""
    return encode_batch(events, t)


class EventFeed:
    """One replica's events as one gateway instance's ``EngineView`` of it: ``block_size`` tokens
    a block, ``capacity`` blocks, in the instance's ``holders`` map (one per instance, as one
    ``serve`` process keeps one). ``model``: the name the gateway seeds a prompt's first block by."""

    def __init__(self, block_size: int, capacity: int, holders: EngineMap, model: str = "") -> None:
        self.view = EngineView(block_size, lambda lora, salt: seed_hash(lora or model, salt),
                               max_blocks=2 * capacity + 1024, max_ghosts=2 * capacity, holders=holders)
        self.batches = 0

    def receive(self, payload: bytes) -> None:
        """Apply one message's events, a run of one kind at a time (``EventStream._steps``).
        Raises ValueError for bytes that are not an event batch (the simulator sends none)."""
        events = [e for e in map(to_event, decode_events(payload)[1]) if e is not None]
        for run in runs(events, SLICE_BLOCKS):
            for _ in self.view.apply_run(run, SLICE_BLOCKS):
                pass
        self.batches += 1
