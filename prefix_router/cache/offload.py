"""A replica's KV blocks offloaded beyond the GPU: its CPU memory and storage tiers, from KV events.

vLLM's ``OffloadingConnector`` copies computed blocks to CPU memory (and, tiered, to storage) and
loads them back when a request's prefix continues past its GPU hit (the connector's
``get_num_new_matched_tokens``): such a prefix is far cheaper than recomputing it and dearer than
one in GPU memory. With ``"self_describing_kv_events": true`` in ``kv_connector_extra_config`` it
publishes each tier's changes as ``BlockStored`` / ``BlockRemoved`` with ``medium`` ``CPU`` or
``STORAGE`` (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py``,
``OffloadingEventsTracker``): an offloaded chunk's stored event lists the hashes of the GPU-sized
blocks it holds with their tokens and the chunk's parent, and its removal fans out to the same
hashes. A chunk overlapping a shared prefix not aligned to chunks announces the shared hashes
once more per chunk, and consumers "are expected to deduplicate (reference-count)": an engine
hash is held here from its first store to the removal of its last announcement.

``OffloadTier`` keeps one medium of one replica in the gateway's block hashes, each block a bit
(the replica's ``EngineView`` slot) in the fleet's ``EngineMap`` of that medium
(``EngineMap.tier``), so that ``holders.offload_depths`` matches a prompt's continuation on every
replica in one walk. Without the option vLLM publishes placeholders (no tokens, block size 0),
which name no block the gateway can hash: they are counted (``opaque``) and left out.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefix_router.cache.blocks import BlockHash
from prefix_router.cache.engine_map import EngineMap
from prefix_router.cache.u64map import U64Map

__all__ = ["MEDIA", "OffloadTier"]

MEDIA = ("CPU", "STORAGE")
"""The offload media vLLM names in events (``vllm/distributed/kv_events.py``: ``MEDIUM_CPU``,
``MEDIUM_STORAGE``), nearest the GPU first: vLLM loads a prefix's continuation from them in this
order."""


class OffloadTier:
    """One replica's blocks on one offload medium: engine key -> gateway block, each engine key
    counted per announcement, each gateway block set in ``holders`` under ``bit`` while any
    engine key names it."""

    def __init__(self, holders: EngineMap, bit: int) -> None:
        self.holders, self.bit = holders, bit
        self._engine = U64Map()  # engine key -> gateway hash
        self._announced: dict[int, int] = {}  # engine key -> announcements beyond its first
        self._names: dict[BlockHash, int] = {}  # gateway hash -> engine keys naming it beyond one
        self.held = 0  # gateway blocks held
        self.keys = 0  # engine keys held (more than ``held`` where several name one block)
        self.opaque = 0  # stored blocks announced without tokens (no self-describing events)

    def __len__(self) -> int:
        return self.held

    def name_of(self, keys: Sequence[int]) -> tuple[list[bool], list[int]]:
        """(found, gateway hash) of each engine key held here: a stored event's parent."""
        return self._engine.get(keys)

    def store(self, keys: Sequence[int], ours: Sequence[BlockHash]) -> None:
        """The tier stored the blocks ``ours`` (gateway hashes) under engine keys ``keys``."""
        found, _ = self._engine.get(keys)
        new_keys, new_blocks, taken = [], [], set()
        for key, h, f in zip(keys, ours, found):
            if f or key in taken:
                self._announced[key] = self._announced.get(key, 0) + 1
            else:
                taken.add(key)
                new_keys.append(key)
                new_blocks.append(h)
        if not new_keys:
            return
        self._engine.put(new_keys, new_blocks)
        self.keys += len(new_keys)
        before = self.holders.store(new_blocks, self.bit)
        seen: set[BlockHash] = set()
        for h, held in zip(new_blocks, before):
            if held or h in seen:  # another engine key names this block too
                self._names[h] = self._names.get(h, 0) + 1
            else:
                seen.add(h)
        self.held += len(seen)

    def remove(self, keys: Sequence[int]) -> None:
        """The tier removed one announcement of each of ``keys`` (unknown keys are ignored)."""
        found, named = self._engine.get(keys)
        dropped, gone = set(), []
        for key, h, f in zip(keys, named, found):
            if not f or key in dropped:
                continue
            more = self._announced.get(key, 0)
            if more > 1:
                self._announced[key] = more - 1
                continue
            if more:
                del self._announced[key]
                continue
            dropped.add(key)
            if self._names.get(h):
                self._names[h] -= 1
                if not self._names[h]:
                    del self._names[h]
                continue
            gone.append(h)
        if dropped:
            self._engine.delete(list(dropped))
            self.keys -= len(dropped)
        if gone:
            self.held -= len(gone)
            self.holders.unstore(gone, self.bit)

    def clear(self) -> None:
        """Forget every block (the view is reset or dropped)."""
        self.holders.unstore(list(set(self._engine.items()[1])), self.bit)
        self._engine.clear()
        self._announced.clear()
        self._names.clear()
        self.held = self.keys = 0
