"""Paged KV cache with automatic prefix caching, rule for rule as vLLM's v1 engine.

The simulator's cache must give the same ``cached_tokens`` as a real vLLM replica for the same
sequence of requests, so every rule below mirrors vLLM 0.32 (``vllm/v1/core/``):

- Blocks of ``block_size`` tokens; only full blocks get a hash and can be hit
  (``BlockPool.cache_full_blocks``).
- Block identity is chained: a block's hash covers its parent's hash, so a block only hits
  under the same prefix (``kv_cache_utils.hash_block_tokens``). ``cache_salt`` (and here the
  requested model name, which stands for vLLM's LoRA extra key) enters the first block only
  (``generate_block_hash_extra_keys``), which separates every later block too.
- Lookup walks from the first block and stops at the first miss, and never covers the last
  prompt token: the hit is capped at ``num_tokens - 1``
  (``KVCacheManager.get_computed_blocks``, ``FullAttentionManager.find_longest_cache_hit``).
- Running requests hold a reference on each of their blocks (``BlockPool.touch``).
- Freed blocks keep their hash and stay hittable until reused. The free queue is ordered by
  eviction priority: a finishing request frees its blocks tail first; hashed blocks go to the
  back (least recently freed is evicted first), unhashed blocks (a partial last block) to the
  front so they are reused before any cached block (``BlockPool.free_blocks``).
- Allocation pops from the front of the free queue and evicts that block's hash
  (``BlockPool.get_new_blocks``, ``_maybe_evict_cached_block``). A hit on a free block takes it
  out of the queue, so it counts against the free capacity of the allocation
  (``get_num_blocks_to_allocate``).
- Block 0 is vLLM's null block and never holds data: ``num_gpu_blocks - 1`` blocks are usable
  (``BlockPool.__init__``) and usage is reported over those (``BlockPool.get_usage``).
- Two blocks may hold the same hash (two requests computed the same block before either was
  cached); lookups return the first one inserted (``BlockHashToBlockMap``).

Block hashes come from ``prefix_router/cache/blocks.py`` (shared with the gateway); the digests differ from
vLLM's (xxhash here, sha256 there): only their equality matters.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prefix_router.cache.blocks import BlockHash, extend_block_hashes, seed_hash
from prefix_router.tools.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from prefix_router.tools.sim.offload import CpuTier

__all__ = ["BlockHash", "Block", "KVCache", "seed_hash", "extend_block_hashes"]


class Block:
    """One KV cache block: ``block_size`` token slots on the (modelled) GPU."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id  # index in KVCache.blocks; 0 is the null block
        self.ref_cnt = 0  # running requests holding this block
        self.block_hash: BlockHash | None = None  # set once full and cached


class KVCache:
    """The block pool and prefix cache of one replica (vLLM's ``BlockPool`` + manager).

    Args:
        num_gpu_blocks: blocks in the pool as vLLM reports ``num_gpu_blocks`` (block 0 is the
            null block, so one fewer is usable). Must be at least 2.
        block_size: tokens per block (vLLM: 16 on GPU by default).

    Counters ``num_queries`` / ``num_hits`` (tokens) follow ``PrefixCacheStats.record``: one
    query of ``num_tokens`` per request admitted for the first time (not after a preemption).
    """

    def __init__(self, num_gpu_blocks: int, block_size: int) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be at least 2, got {num_gpu_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        # Free blocks in eviction order, front first, as vLLM's ``FreeKVCacheBlockQueue`` holds
        # them (a doubly linked list: O(1) removal from the middle, a hit on a free block;
        # OrderedDict gives the same in C), in three parts, so that a pool of 28,000 blocks
        # costs nothing until used (a fleet of 256 replicas is 7 million blocks): blocks a
        # request freed uncached, put first; then the blocks never used, ids ``_fresh`` up,
        # made when taken; then the blocks freed cached, in the order freed. Every block
        # freed goes to either end, so the never-used ones stay in one run between.
        self._front: OrderedDict[int, Block] = OrderedDict()
        self._fresh = 1  # block 0 is the null block
        self._back: OrderedDict[int, Block] = OrderedDict()
        self.blocks: dict[int, Block] = {}  # the blocks made so far, by id
        # hash -> block, or block_id -> block when several blocks hold the same hash.
        self.cached: dict[BlockHash, Block | dict[int, Block]] = {}
        self.num_queries = 0
        self.num_hits = 0
        # KV events as vLLM queues them (``BlockPool.kv_event_queue``), when a publisher is on
        self.record_events = False
        self.events: list = []
        self.cpu: CpuTier | None = None  # the CPU offload tier (``offload.py``), when configured

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (cached-but-idle blocks count as free)."""
        return len(self._front) + self.num_gpu_blocks - self._fresh + len(self._back)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by running requests (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / (self.num_gpu_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        """The first block cached under ``block_hash``, or None."""
        entry = self.cached.get(block_hash)
        if entry is None or isinstance(entry, Block):
            return entry
        return next(iter(entry.values()))

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> list[Block]:
        """Cached blocks for the longest prefix of a request of ``num_tokens`` tokens.

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is always computed,
        so a prompt of exactly k full blocks reuses at most k - 1 of them.
        """
        max_blocks = (num_tokens - 1) // self.block_size
        hit: list[Block] = []
        cached = self.cached
        for block_hash in block_hashes[:max_blocks]:
            entry = cached.get(block_hash)
            if entry is None:
                break
            hit.append(entry if isinstance(entry, Block) else next(iter(entry.values())))
        return hit

    def record_query(self, num_tokens: int, num_hits: int) -> None:
        """Count one request's lookup, in tokens (``KVCacheManager.record_prefix_cache_stats``)."""
        self.num_queries += num_tokens
        self.num_hits += num_hits

    # -- allocation ----------------------------------------------------------------------
    def num_blocks_to_allocate(self, held: Sequence[Block], hit: Sequence[Block], num_tokens: int) -> int:
        """Free blocks an allocation takes: new blocks plus hit blocks now sitting in the queue."""
        required = -(-num_tokens // self.block_size)
        new = max(required - len(held) - len(hit), 0)
        return new + sum(1 for b in hit if b.ref_cnt == 0)

    def _take_free(self, count: int) -> list[Block]:
        """The ``count`` blocks at the front of the free queue, out of it, front first."""
        taken: list[Block] = []
        front = self._front
        while front and len(taken) < count:
            taken.append(front.popitem(last=False)[1])
        fresh = min(count - len(taken), self.num_gpu_blocks - self._fresh)
        if fresh > 0:
            ids = range(self._fresh, self._fresh + fresh)
            made = list(map(Block, ids))
            self.blocks.update(zip(ids, made))
            self._fresh += fresh
            taken += made
        back = self._back
        taken += [back.popitem(last=False)[1] for _ in range(count - len(taken))]
        return taken

    def allocate(self, held: list[Block], hit: Sequence[Block], num_tokens: int) -> bool:
        """Give a request slots for its first ``num_tokens`` tokens, appending to ``held``.

        ``hit`` are prefix-cache blocks found for a request that holds none yet. Returns False,
        changing nothing, when the free queue is too short (the scheduler then waits or preempts).
        """
        if self.num_blocks_to_allocate(held, hit, num_tokens) > self.num_free_blocks:
            return False
        for block in hit:
            if block.ref_cnt == 0:  # a cached block freed: at the back (only uncached ones go first)
                del self._back[block.block_id]
            block.ref_cnt += 1
            held.append(block)
        required = -(-num_tokens // self.block_size)
        for block in self._take_free(required - len(held)):
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            held.append(block)
        return True

    def cache_full_blocks(self, held: Sequence[Block], block_hashes: Sequence[BlockHash], first: int, num_full: int,
                          token_ids: Sequence[int] = (), lora_name: str | None = None,
                          cache_salt: str | None = None) -> None:
        """Register ``held[first:num_full]`` under their hashes once their tokens are scheduled.

        With ``record_events``, queue one ``BlockStored`` for them as vLLM does: their token ids
        (from ``token_ids``, the request's), their parent's hash (None from the first block),
        and the cache salt in the first block's extra keys."""
        if self.record_events and num_full > first:
            size = self.block_size
            extra = [(cache_salt,) if i == 0 and cache_salt else None for i in range(first, num_full)]
            self.events.append(BlockStored(
                block_hashes=list(block_hashes[first:num_full]),
                parent_block_hash=block_hashes[first - 1] if first else None,
                token_ids=list(token_ids[first * size : num_full * size]), block_size=size, lora_id=None,
                medium="GPU", lora_name=lora_name, extra_keys=extra if any(extra) else None, group_idx=0))
        if self.cpu is not None and num_full > first:
            self.cpu.events = self.events if self.record_events else None
            self.cpu.store(block_hashes, first, num_full, token_ids, lora_name, cache_salt)
        cached = self.cached
        for i in range(first, num_full):
            block = held[i]
            block_hash = block_hashes[i]
            if block.block_hash == block_hash:
                continue  # a hit block, already cached
            block.block_hash = block_hash
            entry = cached.get(block_hash)
            if entry is None:
                cached[block_hash] = block
            elif isinstance(entry, Block):
                cached[block_hash] = {entry.block_id: entry, block.block_id: block}
            else:
                entry[block.block_id] = block

    def free(self, held: Sequence[Block]) -> None:
        """Release a request's blocks, tail first, keeping their cached contents."""
        evict_first: list[Block] = []
        back, front = self._back, self._front
        for block in reversed(held):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    evict_first.append(block)
                else:
                    back[block.block_id] = block
        for block in reversed(evict_first):
            front[block.block_id] = block
            front.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's ``BlockPool.reset_prefix_cache`` does: refused
        (False) while any block is held by a request, else True and an ``AllBlocksCleared``
        event. The query and hit counters are cumulative and keep counting."""
        if self.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        self.cached.clear()
        for block in self.blocks.values():
            block.block_hash = None
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list:
        """The events queued since the last call (``BlockPool.take_events``)."""
        events, self.events = self.events, []
        return events

    def _evict(self, block: Block) -> None:
        block_hash = block.block_hash
        block.block_hash = None
        if self.record_events:
            self.events.append(BlockRemoved(block_hashes=[block_hash], medium="GPU", group_idx=0))
        entry = self.cached.get(block_hash)
        if entry is block:
            del self.cached[block_hash]
        elif isinstance(entry, dict):
            entry.pop(block.block_id, None)
            if len(entry) == 1:
                self.cached[block_hash] = next(iter(entry.values()))
