"""The pooled-cache bound: the token hit rate no router can beat on a given replay.

One KV cache with the fleet's total capacity serves the requests one after another, under the
simulator's own cache rules (``prefix_router/tools/sim/kv_cache.py``, vLLM's ``KVCacheManager``: longest
cached prefix of full blocks, the request's blocks held while it runs, freed tail first, LRU
eviction). A fleet of replicas can only split that cache, and concurrency only adds pressure,
so a router's hit rate divided by this bound says how much of the reachable reuse it kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefix_router.cache.blocks import block_hashes, seed_hash
from prefix_router.tools.replay.workloads import ReplayRequest
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.kv_cache import KVCache
from prefix_router.tools.sim.requests import parse_chat
from prefix_router.prompts.tokenizer import ByteTokenizer, PromptTokenizer

__all__ = ["pooled_hit_rate", "prompt_token_ids", "spread_hit_rate", "unbounded_hit_rate"]


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
    reused, total = _serve(requests, num_gpu_blocks, block_size, tokenizer)
    return reused / total if total else 0.0


def _serve(requests: Sequence[ReplayRequest], num_gpu_blocks: int, block_size: int,
           tokenizer: PromptTokenizer | None) -> tuple[int, int]:
    """(prompt tokens reused, prompt tokens) of one cache serving ``requests``: ``pooled_hit_rate``."""
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
    return reused, total


def _unbounded_blocks(requests: Sequence[ReplayRequest], block_size: int, tokenizer: PromptTokenizer | None) -> int:
    """Blocks enough for every block of ``requests`` at once: a cache of this size never evicts."""
    return sum((len(prompt_token_ids(r, tokenizer)) + int(r.body.get("max_tokens", 1))) // block_size + 1
               for r in requests) + 2


def spread_hit_rate(requests: Sequence[ReplayRequest], replicas: int, block_size: int,
                    tokenizer: PromptTokenizer | None = None) -> float | None:
    """The token hit rate of a router that keeps each session on one replica and hands the
    sessions to the replicas in turn (the i-th session to start on replica i mod ``replicas``),
    every replica's cache large enough never to evict; None when no request names a session.

    What sessions share (a system prompt, the tools) is computed once on every replica holding
    any of them, where the pooled bound computes it once for the fleet: the difference is the
    price of putting every replica to work. A router passes this figure by grouping the sessions
    that share a prefix (the built-in agent workload's 12 sessions have four system prompts) or
    by giving some replicas more sessions than others.
    """
    if not any(r.session is not None for r in requests):
        return None
    homes: dict = {}
    shares: list[list[ReplayRequest]] = [[] for _ in range(replicas)]
    for i, req in enumerate(requests):
        key = req.session if req.session is not None else ("", i)  # a request alone is its own session
        shares[homes.setdefault(key, len(homes) % replicas)].append(req)
    reused = total = 0
    for share in shares:
        r, t = _serve(share, _unbounded_blocks(share, block_size, tokenizer), block_size, tokenizer)
        reused, total = reused + r, total + t
    return reused / total if total else 0.0


def unbounded_hit_rate(requests: Sequence[ReplayRequest], block_size: int,
                       tokenizer: PromptTokenizer | None = None) -> float:
    """``pooled_hit_rate`` with a cache that holds every block of ``requests``: nothing is ever
    evicted, so no router on any fleet can reuse more."""
    return pooled_hit_rate(requests, _unbounded_blocks(requests, block_size, tokenizer), block_size, tokenizer)
