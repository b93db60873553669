"""The simulated replica's CPU offload tier, rule for rule as vLLM 0.32's ``OffloadingConnector``
with its CPU backend and one block a chunk (``SimConfig.cpu_offload_blocks``).

- Every block the GPU caches is stored to the CPU tier too (the connector's scheduler builds a
  store job for each newly computed full block: ``offloading/scheduler.py``); a block already
  there is only touched.
- The tier holds ``capacity`` blocks and evicts the least recently used to make room
  (``v1/kv_offload/cpu/manager.py``, ``prepare_store`` with the ``lru`` policy), announcing the
  evicted blocks in one ``BlockRemoved``. A request's blocks are used in reverse order, its tail
  first (``cpu/policies/lru.py``: ``touch`` and ``on_request_finished``), so a prefix's first
  blocks outlive its last.
- A request's prompt continuing past its GPU hit loads the blocks the tier holds from there on,
  up to the last prompt token, which is always computed (``get_num_new_matched_tokens``): they
  count as cached tokens (vLLM's ``num_cached_tokens`` is local plus external:
  ``v1/metrics/stats.py``) and take ``cpu_load_tokens_per_s`` to load (``SimConfig``).
- With KV events on, each block stored is announced as vLLM's self-describing offload events do
  (``offloading/events.py``, ``OffloadingEventsTracker``): one ``BlockStored`` a block, medium
  ``CPU``, its tokens and its parent's hash; verified against vLLM 0.32 on CPU with the stock
  manager and event tracker (the copy itself replaced: the CPU build has no CUDA copy worker).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prefix_router.cache.blocks import BlockHash
from prefix_router.tools.sim.kv_events import BlockRemoved, BlockStored

__all__ = ["CpuTier"]


class CpuTier:
    """Block hash -> held, least recently used first; ``events``: the cache's event queue (None:
    no events)."""

    def __init__(self, capacity: int, block_size: int, events: list | None = None) -> None:
        self.capacity, self.block_size = capacity, block_size
        self.blocks: OrderedDict[BlockHash, None] = OrderedDict()
        self.events = events
        self.num_loaded_tokens = 0  # tokens loaded back to the GPU, ever

    def __len__(self) -> int:
        return len(self.blocks)

    def hit(self, block_hashes: Sequence[BlockHash], start: int, end: int) -> int:
        """Blocks ``start``.. of a prompt held here, in a run, up to ``end`` (exclusive); touched."""
        blocks, n = self.blocks, 0
        for block_hash in block_hashes[start:end]:
            if block_hash not in blocks:
                break
            n += 1
        for block_hash in reversed(block_hashes[start:start + n]):
            blocks.move_to_end(block_hash)
        return n

    def store(self, block_hashes: Sequence[BlockHash], first: int, last: int, token_ids: Sequence[int],
              lora_name: str | None, cache_salt: str | None) -> None:
        """The GPU cached blocks ``first``..``last - 1`` of a request: store those not held,
        evicting the least recently used, and announce them."""
        blocks, size = self.blocks, self.block_size
        new = [i for i in range(first, last) if block_hashes[i] not in blocks][:self.capacity]
        adding = set(new)
        evicted = [blocks.popitem(last=False)[0] for _ in range(max(len(blocks) + len(new) - self.capacity, 0))]
        if evicted and self.events is not None:
            self.events.append(BlockRemoved(block_hashes=evicted, medium="CPU", group_idx=0))
        for i in reversed(range(first, last)):  # the tail least recently used
            if block_hashes[i] in blocks:
                blocks.move_to_end(block_hashes[i])
            elif i in adding:
                blocks[block_hashes[i]] = None
        for i in new:
            if self.events is not None:
                self.events.append(BlockStored(
                    block_hashes=[block_hashes[i]], parent_block_hash=block_hashes[i - 1] if i else None,
                    token_ids=list(token_ids[i * size:(i + 1) * size]), block_size=size, lora_id=None, medium="CPU",
                    lora_name=lora_name, extra_keys=[(cache_salt,)] if i == 0 and cache_salt else None, group_idx=0))
