"""The pooled-cache bound: the token hit rate no router can beat on a given replay.

One KV cache with the fleet's total capacity serves the requests one after another, under the
simulator's own cache rules (``router/tools/sim/kv_cache.py``, vLLM's ``KVCacheManager``: longest
cached prefix of full blocks, the request's blocks held while it runs, freed tail first, LRU
eviction). A fleet of replicas can only split that cache, and concurrency only adds pressure,
so a router's hit rate divided by this bound says how much of the reachable reuse it kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.blocks import block_hashes, seed_hash
from router.tools.replay.workloads import ReplayRequest
from router.tools.sim.config import SimConfig
from router.tools.sim.kv_cache import KVCache
from router.tools.sim.requests import parse_chat
from router.tokenizer import ByteTokenizer, PromptTokenizer

__all__ = ["prompt_token_ids", "pooled_hit_rate", "unbounded_hit_rate"]


def prompt_token_ids(req: ReplayRequest, tokenizer: PromptTokenizer | None = None) -> list[int]:
    """The token ids a simulated replica computes for ``req`` (its built-in byte tokenizer unless
    ``tokenizer`` is given): a token-id prompt as is, a text prompt encoded, a chat rendered."""
    tok = tokenizer or ByteTokenizer()
    if "messages" in req.body:
        return tok.render_chat(**parse_chat(req.body, SimConfig())[1])
    prompt = req.body["prompt"]
    return tok.encode(prompt) if isinstance(prompt, str) else list(prompt)


def pooled_hit_rate(requests: Sequence[ReplayRequest], num_gpu_blocks: int, block_size: int,
                    tokenizer: PromptTokenizer | None = None) -> float:
    """Token hit rate (cached prompt tokens / prompt tokens) of one cache of ``num_gpu_blocks``
    blocks of ``block_size`` tokens serving ``requests`` in order.

    Each request hits its longest cached prefix, then holds its prompt and ``max_tokens``
    output blocks (output blocks get unique hashes, as generated tokens do) and frees them.
    A request too long for the whole cache is skipped, as a replica would refuse it.
    """
    kv = KVCache(num_gpu_blocks, block_size)
    seed = seed_hash("pooled", None)
    reused = total = 0
    unique = iter(range(1 << 62, 1 << 63))
    for req in requests:
        prompt = prompt_token_ids(req, tokenizer)
        hashes = block_hashes(prompt, block_size, seed)
        hit = kv.find_longest_cache_hit(hashes, len(prompt))
        num_tokens = len(prompt) + int(req.body.get("max_tokens", 1)) - 1
        held: list = []
        if not kv.allocate(held, hit, num_tokens):
            continue
        full = num_tokens // block_size
        chain = list(hashes[:full]) + [next(unique) for _ in range(full - len(hashes[:full]))]
        kv.cache_full_blocks(held, chain, len(hit), full)
        kv.free(held)
        reused += len(hit) * block_size
        total += len(prompt)
    return reused / total if total else 0.0


def unbounded_hit_rate(requests: Sequence[ReplayRequest], block_size: int,
                       tokenizer: PromptTokenizer | None = None) -> float:
    """``pooled_hit_rate`` with a cache that holds every block of ``requests``: nothing is ever
    evicted, so no router on any fleet can reuse more."""
    blocks = sum((len(prompt_token_ids(r, tokenizer)) + int(r.body.get("max_tokens", 1))) // block_size + 1
                 for r in requests)
    return pooled_hit_rate(requests, blocks + 2, block_size, tokenizer)
