"""Consistent-hash ring of replicas: where a routing key lands, and where it goes next.

A thin, pure wrapper over ``uhashring`` (md5 points, so every gateway instance in every process
builds the same ring from the same replica names and places a key identically). Each replica
gets ``virtual_nodes x weight`` points; a key belongs to the first point clockwise from its
hash. Adding or removing a replica moves only the keys of the arcs it gains or loses. The ring
knows nothing of health or load: the policy walks ``candidates`` and skips what it must.
"""

from __future__ import annotations

from uhashring import HashRing

__all__ = ["Ring"]

_SPACE = 1 << 128  # uhashring's md5 positions


class Ring:
    """Replica names on a consistent-hash ring.

    Args:
        virtual_nodes: points per unit of weight (SGLang's and vLLM's routers use ~150-160).
    """

    def __init__(self, virtual_nodes: int = 160) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be positive, got {virtual_nodes}")
        self.virtual_nodes = virtual_nodes
        self._ring = HashRing(nodes={})
        self._weights: dict[str, int] = {}
        self._cycle: list[str] | None = None  # the points' replicas clockwise, twice round

    @classmethod
    def of(cls, names, virtual_nodes: int = 160) -> "Ring":
        """A ring of ``names`` (weight 1 each), its points placed in one pass: ``add`` re-sorts
        every point a replica, which for a few thousand replicas takes minutes. The same ring as
        ``add`` called for each name (positions depend on names alone)."""
        ring = cls(virtual_nodes)
        names = list(dict.fromkeys(names))
        ring._ring = HashRing(nodes={n: {"weight": 1, "vnodes": virtual_nodes} for n in names})
        ring._weights = dict.fromkeys(names, 1)
        return ring

    def __contains__(self, name: str) -> bool:
        return name in self._weights

    def __len__(self) -> int:
        return len(self._weights)

    @property
    def nodes(self) -> list[str]:
        return sorted(self._weights)

    def add(self, name: str, weight: int = 1) -> None:
        """Put a replica on the ring (no-op when already there with that weight)."""
        if self._weights.get(name) == weight:
            return
        if name in self._weights:
            self._ring.remove_node(name)
        # uhashring places vnodes x weight points: pass the weight once, not in both factors
        self._ring.add_node(name, {"weight": weight, "vnodes": self.virtual_nodes})
        self._weights[name] = weight
        self._cycle = None

    def remove(self, name: str) -> None:
        """Take a replica off the ring (no-op when absent)."""
        if self._weights.pop(name, None) is not None:
            self._ring.remove_node(name)
            self._cycle = None

    def candidates(self, key: str) -> list[str]:
        """Every replica in ring order starting at ``key``'s position: the owner first.

        The order ``uhashring``'s ``range(key, unique=True)`` gives, without walking its points one
        by one: the replicas of the points from the key's position, de-duplicated a slice at a
        time by ``dict.fromkeys`` (first occurrences keep their place), until every replica has
        appeared, which takes about replicas x ln(replicas) points rather than all of them."""
        n = len(self._weights)
        if not n:
            return []
        if self._cycle is None:
            names = [name for _, name in self._ring.get_points()]
            self._cycle = names + names
        cycle, pos = self._cycle, self._ring.get_node_pos(key)
        end = pos + len(cycle) // 2
        seen: dict[str, None] = {}
        step = 4 * n
        while len(seen) < n and pos < end:
            seen.update(dict.fromkeys(cycle[pos:min(pos + step, end)]))
            pos += step
        return list(seen)

    def owner(self, key: str) -> str | None:
        """The replica that owns ``key``, or None on an empty ring."""
        return self._ring.get_node(key) if self._weights else None

    def shares(self) -> dict[str, float]:
        """Fraction of the hash space (so of uniformly spread keys) each replica owns."""
        points = sorted(self._ring.get_points()) if self._weights else []
        shares = dict.fromkeys(self._weights, 0.0)
        for i, (position, name) in enumerate(points):
            previous = points[i - 1][0] - (_SPACE if i == 0 else 0)
            shares[name] += (position - previous) / _SPACE
        return shares
