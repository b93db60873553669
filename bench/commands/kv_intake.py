"""What following a replica's KV events costs the gateway: a busy step's message applied to its view.

A message is one vLLM engine step on a full cache, shaped as its block pool publishes it
(``vllm/v1/core/block_pool.py``; ``bench/commands/kv_event_sizes.py``): for each of ``--requests``
requests a ``BlockRemoved`` for every block evicted to make room (one block an event) and one
``BlockStored`` of its new blocks (``--blocks`` each, chained onto its own earlier ones), the
requests one after another. The view holds ``--held`` blocks already. Each message is applied as
``cache/stream.py`` applies it (``cache/intake.py``'s runs) to an ``EngineView`` in its fleet map,
and event by event to the per-block view it replaced (``bench/per_block_view.py``), side by side
in one run; CPU time (``time.process_time``), the median of ``--reps`` messages a cell. A
third column applies ``--together`` messages as one stretch of events, as the stream does with
the messages that wait unread when it falls behind (``EventStream._apply``), a message's share.

    python -m bench kv-intake [--requests 1,8,64,256] [--blocks 1,16] [--together 8]

Writes ``bench/results/kv-intake/``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from prefix_router.cache.blocks import seed_hash
from prefix_router.cache.engine_map import EngineMap
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.events import BlockRemoved, BlockStored
from prefix_router.cache.intake import runs
from prefix_router.cache.stream import SLICE_BLOCKS

from .. import RESULTS
from ..per_block import Holders
from ..per_block_view import PerBlockEngineView
from ..report import command_line, write_results

BLOCK_SIZE = 16
SEED = seed_hash("model")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _message(rng: random.Random, held: list[int], requests: int, blocks: int) -> list:
    """One step's events: a request at a time, its evictions (of blocks held), then its store."""
    events = []
    for _ in range(requests):
        for _ in range(blocks):
            events.append(BlockRemoved([held.pop(rng.randrange(len(held)))]))
        keys = [rng.getrandbits(63) for _ in range(blocks)]
        events.append(BlockStored(keys, None, [rng.randrange(1 << 17) for _ in range(blocks * BLOCK_SIZE)], BLOCK_SIZE))
        held += keys
    return events


def measure(requests: int, blocks: int, held: int, reps: int, seed: int = 0, together: int = 8) -> dict:
    """Median CPU microseconds a message for each view, fed the same messages; ``together``: the
    EngineView fed that many messages as one stretch, a message's share."""
    out = {"requests": requests, "blocks": blocks, "events": requests * (blocks + 1), "read_together": together}
    for kind in ("per-block", "engine", "together"):
        rng = random.Random(seed)
        if kind != "per-block":
            view = EngineView(BLOCK_SIZE, lambda lora, salt: SEED, max_ghosts=2 * held, holders=EngineMap())
        else:
            view = PerBlockEngineView(BLOCK_SIZE, lambda lora, salt: SEED, max_ghosts=2 * held, holders=Holders())
        keys = [rng.getrandbits(63) for _ in range(held)]
        view.apply(BlockStored(keys, None, [rng.randrange(1 << 17) for _ in range(held * BLOCK_SIZE)], BLOCK_SIZE))
        times = []
        for _ in range(reps):
            n = together if kind == "together" else 1
            message = [e for _ in range(n) for e in _message(rng, keys, requests, blocks)]
            started = time.process_time()
            if kind == "per-block":
                for event in message:
                    view.apply(event)
            else:
                for run in runs(message, SLICE_BLOCKS):
                    for _ in view.apply_run(run, SLICE_BLOCKS):
                        pass
            times.append((time.process_time() - started) * 1e6 / n)
        out[kind] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench kv-intake", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=_ints, default=[1, 8, 64, 256], help="requests a step (comma-separated)")
    ap.add_argument("--blocks", type=_ints, default=[1, 16], help="blocks each request stores a step")
    ap.add_argument("--held", type=int, default=28_000, help="blocks the view holds")
    ap.add_argument("--reps", type=int, default=40, help="messages a cell")
    ap.add_argument("--together", type=int, default=8, help="messages applied as one stretch in the third column")
    ap.add_argument("--out", type=Path, default=RESULTS / "kv-intake")
    args = ap.parse_args(argv)
    cells = [measure(r, b, args.held, args.reps, together=args.together) for b in args.blocks for r in args.requests]
    lines = [f"A busy step's KV events applied to a view holding {args.held:,} blocks, CPU microseconds a message "
             f"(median of {args.reps}), the per-block view and the EngineView side by side in one run "
             "(`bench/commands/kv_intake.py`).", "",
             f"| requests a step | blocks each | events | per-block view | EngineView in its map | ratio | "
             f"EngineView, {args.together} messages together | ratio |", "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['requests']} | {c['blocks']} | {c['events']:,} | {c['per-block']:,.0f} | "
                     f"{c['engine']:,.0f} | {c['engine'] / c['per-block']:.2f}x | {c['together']:,.0f} | "
                     f"{c['together'] / c['per-block']:.2f}x |")
    write_results(args.out, "KV event intake", command_line(__name__, argv), lines, {"cells": cells})
    return 0
