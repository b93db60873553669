"""``match_all``: the one walk of a prompt for every replica, whatever structure holds them.

Matching a prompt against each replica's index on its own costs replicas x matched blocks: a
shared 32k-token prompt in front of 256 replicas is half a million lookups a request. SGLang's
gateway (one radix tree whose nodes carry the workers holding them), NVIDIA Dynamo's KV router
and llm-d's KV-block index keep one index for the fleet instead. Here the gateway's guesses live
in one ``BlockTree`` (``cache/tree.py``) and the engines' views, whose blocks come and go by the
engine's events in any order, in one ``EngineMap`` (``cache/engine_map.py``). Each answers
``drops``: one walk of a prompt's blocks with one bit a replica, stopping at the first block no
candidate holds; chained hashes make a held block's prefix held too, so a replica's depth is
where its bit first drops out (``tests/cache/test_holders.py``, ``tests/cache/test_engine_map.py``
hold the walk equal to every index's own ``match`` under random operations).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Protocol

from prefix_router.cache.blocks import BlockHash

__all__ = ["Index", "Fleet", "match_all", "offload_depths"]

_HOLDERS, _BIT = attrgetter("holders"), attrgetter("bit")


class Fleet(Protocol):
    """A structure holding many replicas' indexes, one bit a replica (``BlockTree``, ``EngineMap``)."""

    def drops(self, hashes: Sequence[BlockHash], mask: int, cap: int | None = None) -> list[tuple[int, int]]: ...


class Index(Protocol):
    """A replica's index as ``match_all`` reads it (a ``ShadowIndex`` in a ``BlockTree``, an
    ``EngineView`` in an ``EngineMap``)."""

    holders: Fleet | None
    bit: int

    def match(self, hashes: Sequence[BlockHash]) -> int: ...


def match_all(hashes: Sequence[BlockHash], indexes: Mapping[str, Index], cap: int) -> dict[str, int]:
    """Replica name -> the leading blocks of ``hashes`` its index holds, at most ``cap``: one walk
    of the prompt for all the indexes that report into one ``Fleet`` (at most two: the
    gateway's guesses and the engines' views), an index's own ``match`` for any that does not.
    Apart from the walk, a pass over the indexes is a few ``map`` and ``zip`` calls in C."""
    out = dict.fromkeys(indexes, 0)
    maps = list(map(_HOLDERS, indexes.values()))
    distinct = set(maps)
    for holders in distinct:
        if len(distinct) == 1:
            group = indexes
        else:
            group = {name: index for (name, index), h in zip(indexes.items(), maps) if h is holders}
        if holders is None:
            for name, index in group.items():
                out[name] = min(index.match(hashes), cap)
            continue
        names = dict(zip(map(_BIT, group.values()), group))
        everyone = sum(names)
        for bits, depth in holders.drops(hashes, everyone, cap):
            if bits == everyone:  # the whole group at one depth (a prompt every replica holds)
                out.update(dict.fromkeys(group, depth))
            elif bits.bit_count() < 8:
                while bits:
                    low = bits & -bits
                    out[names[low]] = depth
                    bits ^= low
            else:  # many replicas at one depth (a prompt every replica holds): one pass, in C
                out.update(dict.fromkeys([name for bit, name in names.items() if bit & bits], depth))
    return out


def offload_depths(hashes: Sequence[BlockHash], indexes: Mapping[str, Index], matches: Mapping[str, int],
                   cap: int, media: Sequence[str]) -> dict[str, list[int]]:
    """Replica name -> blocks of ``hashes`` past its match (``matches``, its GPU's) that it holds
    in each offload medium of ``media`` (``cache/offload.py``), in order: a run in the first
    medium from the match on, then a run in the next from there, to ``cap`` in all. vLLM's
    offloading connector loads a prompt's continuation past its GPU hit from the tiers
    (``OffloadingConnectorScheduler.get_num_new_matched_tokens``). Only replicas whose index
    has offload tiers (``EngineView.offload``) appear. Replicas starting a medium's run at one
    depth share one walk of the fleet's map of that medium (``EngineMap.tiers``)."""
    if not any(getattr(fleet, "tiers", None) for fleet in set(map(_HOLDERS, indexes.values()))):
        return {}  # no replica ever announced an offloaded block: one pass in C
    tiered = {n: i for n, i in indexes.items() if getattr(i, "offload", None)}
    if not tiered:
        return {}
    out = {n: [0] * len(media) for n in tiered}
    start = {n: matches.get(n, 0) for n in tiered}
    for k, medium in enumerate(media):
        groups: dict[tuple[int, int], dict[int, str]] = {}  # (its map, start) -> bit -> name
        maps = {}
        for name, index in tiered.items():
            if medium not in index.offload or start[name] >= cap:
                continue
            fleet = index.holders.tier(medium)
            maps[id(fleet)] = fleet
            groups.setdefault((id(fleet), start[name]), {})[index.bit] = name
        for (fleet_id, depth), names in groups.items():
            for bits, run in maps[fleet_id].drops(hashes[depth:cap], sum(names)):
                while bits:
                    low = bits & -bits
                    out[names[low]][k] = run
                    start[names[low]] += run
                    bits ^= low
    return out
