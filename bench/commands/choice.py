"""The routing choice and the cache indexes, in process, as the fleet grows: time a request and memory.

What a gateway process pays per request to choose a replica (``PrefixAffinityPolicy.select``:
the match against every routable replica's index, the bounds, the ranking) at 4, 16, 64 and 256
replicas and prompts of 128 and 2,048 blocks (2k and 32k tokens at 16 tokens a block), with
every replica holding one shared prompt and each request adding ``--own`` blocks of its own:
the shape where a walk of each replica's index costs replicas x matched blocks. Each cell is
the median of ``--reps`` choices, each a new request (its own blocks new to every replica),
timed with ``time.perf_counter_ns``, the indexes and loads fixed (nothing learned between
choices), no gateway and no HTTP: the policy's own cost.

Memory (``--memory-replicas`` x ``--memory-blocks``, half the blocks shared by every replica):
the bytes ``tracemalloc`` sees allocated while the indexes are built, for the gateway's own
guess (``ShadowIndex``) and for the engine's picture (``EngineView`` in the fleet's
``EngineMap``, fed ``BlockStored`` events as vLLM publishes them, engine hashes random as without
a shared ``PYTHONHASHSEED``), each beside the per-block index it replaced (``bench/per_block.py``,
``bench/per_block_view.py``). Defaults: 256 replicas of 30,000 blocks, an H100 serving an 8B
model in 16-token blocks.

    python -m bench choice [--replicas 4,16,64,256] [--blocks 128,2048] [--reps 30]

Writes ``bench/results/choice/``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from pathlib import Path

from prefix_router.cache.blocks import BlockHash, block_hashes, seed_hash
from prefix_router.cache.engine_map import EngineMap
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.events import BlockStored
from prefix_router.cache.shadow import ShadowIndex
from prefix_router.cache.tree import BlockTree
from prefix_router.config import RoutingConfig
from prefix_router.routing.bounds import ReplicaView
from prefix_router.routing.policy import PrefixAffinityPolicy
from prefix_router.routing.prefix_stats import BranchStats
from prefix_router.routing.ring import Ring

from .. import RESULTS
from ..per_block import Holders, PerBlockIndex
from ..per_block_view import PerBlockEngineView
from ..report import command_line, write_results

BLOCK_SIZE = 16  # vLLM's default on CUDA
CAPACITY = 30_000  # blocks an H100 holds for an 8B model (the README's default replica)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


SEED = seed_hash("model")


def _chain(rng: random.Random, n: int) -> list[BlockHash]:
    """``n`` block hashes: random, as only their identity matters to a match."""
    return [BlockHash(rng.getrandbits(63)) for _ in range(n)]


# the indexes compared: a dictionary entry a block per replica, each walked on its own (as when
# issue 41 was filed); the same reporting into one ``Holders`` map, matched in one walk (before
# the tree); the gateway's ``ShadowIndex`` in one ``BlockTree``; the engines' ``EngineView``s in
# one ``EngineMap`` (the walk when KV events are followed)
INDEXES = {"per-block": "per-block LRU sets, each walked", "per-block+map": "per-block sets and the fleet map",
           "tree": "one tree (ShadowIndex)", "engine": "engine views in one map (EngineView, KV events)"}
# the engines' pictures measured for memory: as before the map (``bench/per_block_view.py``),
# alone and reporting into a ``Holders`` map as the gateway had them; in one ``EngineMap``
VIEWS = {"engine-per-block": "EngineView before the map: per-block dicts",
         "engine-per-block+map": "EngineView before the map, with the fleet's Holders map",
         "engine": "EngineView in one EngineMap"}


def _index(kind: str, capacity: int, shared):
    """A factory of one replica's index of ``kind``, all of them sharing ``shared`` (a map or a tree)."""
    if kind == "tree":
        return ShadowIndex(capacity, shared)
    if kind.startswith("engine"):
        view = PerBlockEngineView if kind.startswith("engine-per-block") else EngineView
        return view(BLOCK_SIZE, lambda lora, salt: SEED, max_blocks=2 * capacity, holders=shared)
    return PerBlockIndex(capacity, shared if kind == "per-block+map" else None)


def _shared(kind: str):
    if kind in ("per-block+map", "engine-per-block+map"):
        return Holders()
    return BlockTree() if kind == "tree" else EngineMap() if kind == "engine" else None


def _hold(index, rng: random.Random, tokens: list[int], shared: list[BlockHash] | None = None,
          parent: int | None = None) -> int | None:
    """``index`` holds ``tokens``, after the ``shared`` blocks when given (``parent``: the engine
    hash of their last block): a guess inserts the blocks' hashes, a view applies one
    ``BlockStored`` as vLLM publishes it. Returns the engine hash of the last block."""
    if isinstance(index, (EngineView, PerBlockEngineView)):
        event = _stored(rng, tokens, parent)
        index.apply(event)
        return event.block_hashes[-1]
    seed = shared[-1] if shared else SEED
    index.insert((shared or []) + block_hashes(tokens, BLOCK_SIZE, seed))
    return None


def time_choice(replicas: int, blocks: int, own: int, reps: int, kind: str = "tree", seed: int = 0) -> dict:
    """Median and p90 microseconds of ``select`` for ``replicas`` replicas that all hold one
    ``blocks``-block prompt, each request that prompt plus ``own`` blocks of its own, with the
    replicas' indexes of ``kind`` (``INDEXES``)."""
    rng = random.Random(seed)
    config = RoutingConfig()
    ring = Ring(config.virtual_nodes)
    names = [f"replica-{i}" for i in range(replicas)]
    for name in names:
        ring.add(name)
    tokens = [rng.randrange(1 << 17) for _ in range(blocks * BLOCK_SIZE)]
    shared = block_hashes(tokens, BLOCK_SIZE, SEED)
    views = {}
    shared_map = _shared(kind)
    for name in names:
        index = _index(kind, max(CAPACITY, blocks + own), shared_map)
        _hold(index, rng, tokens)
        views[name] = ReplicaView(name, rng.randrange(3), index, recent=rng.random())
    policy = PrefixAffinityPolicy(config, ring, BranchStats(threshold=config.branch_threshold))
    times = []
    gc.disable()
    try:
        for _ in range(reps):
            hashes = shared + _chain(rng, own)
            started = time.perf_counter_ns()
            policy.select(hashes, rng.getrandbits(63), views, max_hit_blocks=len(hashes))
            times.append((time.perf_counter_ns() - started) / 1000)
    finally:
        gc.enable()
    times.sort()
    return {"replicas": replicas, "blocks": blocks, "own": own, "reps": reps, "kind": kind,
            "median_us": statistics.median(times), "p90_us": times[int(0.9 * (len(times) - 1))]}


def _stored(rng: random.Random, tokens: list[int], parent: int | None) -> BlockStored:
    """One ``BlockStored`` event for ``tokens`` (engine hashes random: the view keys by its own)."""
    n = len(tokens) // BLOCK_SIZE
    return BlockStored(block_hashes=[rng.getrandbits(63) for _ in range(n)], parent_block_hash=parent,
                       token_ids=tokens, block_size=BLOCK_SIZE, medium="GPU")


def measure_memory(replicas: int, blocks: int, kind: str, seed: int = 0) -> dict:
    """Bytes allocated building ``replicas`` indexes of ``kind`` (``INDEXES`` or ``VIEWS``), each
    of ``blocks`` blocks, the first half one prompt every replica holds, the rest its own, all
    sharing the map or tree of their kind as in the gateway."""
    rng = random.Random(seed)
    half = blocks // 2
    shared_tokens = [rng.randrange(1 << 17) for _ in range(half * BLOCK_SIZE)]
    shared = block_hashes(shared_tokens, BLOCK_SIZE, SEED)
    gc.collect()
    tracemalloc.start()
    started = time.perf_counter()
    indexes = []
    holders = _shared(kind)
    for _ in range(replicas):
        own_tokens = [rng.randrange(1 << 17) for _ in range((blocks - half) * BLOCK_SIZE)]
        index = _index(kind, blocks, holders)
        if isinstance(index, (EngineView, PerBlockEngineView)):
            _hold(index, rng, own_tokens, parent=_hold(index, rng, shared_tokens))
        else:
            _hold(index, rng, own_tokens, shared)
        indexes.append(index)
        del own_tokens
    gc.collect()
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    built = time.perf_counter() - started
    held = sum(len(i) for i in indexes)
    walk_us = _walk_us(holders, indexes, shared[:2048], rng) if holders is not None else None
    del indexes, holders
    return {"kind": kind, "replicas": replicas, "blocks": blocks, "entries": held, "bytes": current,
            "bytes_per_entry": current / max(held, 1), "build_s": built, "walk_us": walk_us}


def _walk_us(fleet, indexes, shared: list[BlockHash], rng: random.Random, reps: int = 30) -> float:
    """Median microseconds of one walk of the fleet's map or tree (``drops``) for the first 2,048
    blocks of the shared prompt and 8 of a request's own, over the full fleet just built: every replica's own
    blocks in it too, as in a gateway, which ``time_choice``'s small fleets leave out."""
    mask = sum(index.bit for index in indexes)
    times = []
    for _ in range(reps):
        hashes = shared + _chain(rng, 8)
        started = time.perf_counter_ns()
        fleet.drops(hashes, mask)
        times.append((time.perf_counter_ns() - started) / 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench choice", description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=_ints, default=[4, 16, 64, 256], help="fleet sizes (comma-separated)")
    ap.add_argument("--blocks", type=_ints, default=[128, 2048], help="shared prompt lengths in blocks")
    ap.add_argument("--own", type=int, default=8, help="blocks of each request's own after the shared prompt")
    ap.add_argument("--reps", type=int, default=30, help="choices timed a cell (the median is reported)")
    ap.add_argument("--memory-replicas", type=int, default=256, help="replicas for the memory measure (0: skip)")
    ap.add_argument("--memory-blocks", type=int, default=CAPACITY, help="blocks each replica holds there")
    ap.add_argument("--out", type=Path, default=RESULTS / "choice")
    args = ap.parse_args(argv)
    cells = [time_choice(r, b, args.own, args.reps, kind)
             for r in args.replicas for b in args.blocks for kind in INDEXES]
    lines = ["`PrefixAffinityPolicy.select` in process, every replica holding one shared prompt of the "
             f"given blocks, each request {args.own} blocks of its own after it; median (p90) of {args.reps} "
             "choices, microseconds, in one run (`bench/commands/choice.py`), the replicas' indexes: "
             + "; ".join(f"{name}: `{kind}`" for kind, name in INDEXES.items())
             + " (`bench/per_block.py` keeps the per-block index as the baseline).", "",
             "| replicas | " + " | ".join(f"{b:,} blocks: {kind}" for b in args.blocks for kind in INDEXES) + " |",
             "|---|" + "---|" * len(INDEXES) * len(args.blocks)]
    for r in args.replicas:
        row = [c for c in cells if c["replicas"] == r]
        lines.append(f"| {r} | " + " | ".join(f"{c['median_us']:,.0f} ({c['p90_us']:,.0f})" for c in row) + " |")
    memory = []
    if args.memory_replicas:
        memory = [measure_memory(args.memory_replicas, args.memory_blocks, kind)
                  for kind in ("per-block", "per-block+map", "tree", *VIEWS)]
        lines += ["", f"Memory of the indexes, {args.memory_replicas} replicas x {args.memory_blocks:,} blocks "
                  "(half one prompt every replica holds), as `tracemalloc` sees it while they are built:", "",
                  "| index | entries | MiB | bytes an entry | built in | one walk of the fleet, median |",
                  "|---|---|---|---|---|---|"]
        for m in memory:
            name = VIEWS[m["kind"]] if m["kind"] in VIEWS else f"the gateway's guess: {INDEXES[m['kind']]}"
            walk = f"{m['walk_us']:,.0f} us" if m["walk_us"] is not None else "(each walked)"
            lines.append(f"| {name} | {m['entries']:,} | {m['bytes'] / 2**20:,.0f} | {m['bytes_per_entry']:.0f} "
                         f"| {m['build_s']:.1f} s | {walk} |")
    write_results(args.out, "The routing choice and the indexes as the fleet grows", command_line(__name__, argv),
                  lines, {"choice": cells, "memory": memory})
    return 0
