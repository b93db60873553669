"""The gateway's guess of every replica's cache in one radix tree of block-hash runs.

A per-replica LRU set of block hashes took 813 MiB at 256 replicas of 30,000 blocks, half a
prompt they all hold, and a 32k-token prompt touched 2,048 entries of it one by one
(``bench/results/choice``). Chained hashes make a replica's blocks a set of paths from the root,
so this tree keeps each distinct run of blocks once, packed 8 bytes a block, and each replica's
hold on a node as a count: the leading blocks of the node's run it holds. A prompt every
replica holds is one node; a conversation is a node a turn. A lookup starts at a prompt's first
block (a chained hash names its whole prefix).

- ``drops`` walks a prompt once for every replica (``match_all``'s contract), comparing a
  node's run with the prompt by ``bytes.startswith`` in C: a comparison a node, not a lookup a block.
- LRU, exact per block: vLLM frees a request's blocks tail first and evicts the least recently
  freed (``vllm/v1/core/block_pool.py``), so a touch gives a chain one stamp, its tail oldest,
  and a prefix is touched at least as late as what it prefixes. A replica's least recent block
  is then the last of one of its leaves (a node it holds no child of): a heap of its leaves by
  (stamp, -depth) finds it, and eviction trims that leaf. A touch ending inside a replica's
  hold splits the node there, so a hold's blocks share a stamp.
- Generated tokens' blocks take capacity and are never matched: a FIFO of counts per replica.
"""

from __future__ import annotations

import heapq
import sys
from collections import deque
from collections.abc import Sequence

from prefix_router.cache.blocks import BlockHash, common_blocks, packed_hashes

__all__ = ["BlockTree"]


class _Node:
    __slots__ = ("run", "size", "depth", "parent", "children", "holds", "mask", "full")

    def __init__(self, run: bytes, depth: int, parent: _Node | None) -> None:
        self.run = run  # the blocks' hashes, packed 8 bytes each (native order)
        self.size = len(run) >> 3
        self.depth = depth  # blocks above this node
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first block's hash -> child
        self.holds: dict[int, _Hold] = {}  # replica bit -> its hold on this node
        self.mask = 0  # bits holding any of it
        self.full = 0  # bits holding the whole run


class _Hold:
    """A replica's hold on one node: the node's leading ``n`` blocks, touched at ``stamp``."""

    __slots__ = ("n", "stamp", "kids")

    def __init__(self, n: int, stamp: int) -> None:
        self.n, self.stamp, self.kids = n, stamp, 0  # kids: children of the node it holds blocks of


class _Holder:
    __slots__ = ("bit", "capacity", "blocks", "opaque", "opaque_n", "heap", "nodes")

    def __init__(self, bit: int, capacity: int) -> None:
        self.bit = bit
        self.capacity = capacity
        self.blocks, self.opaque_n = 0, 0  # blocks held in the tree; generated blocks held
        self.opaque: deque[list[int]] = deque()  # [stamp, count] of generated blocks, oldest first
        self.heap: list[tuple[int, int, int, _Node]] = []  # (stamp, -end depth, id, node) of its leaves, lazily
        self.nodes: set[_Node] = set()  # nodes it holds blocks of


class BlockTree:
    """Block-hash runs, and how much of each every replica holds, with each replica's LRU.

    A replica joins with ``join(capacity)`` and gets a bit; ``insert``, ``touch``,
    ``add_opaque``, ``cut`` and ``clear`` change what it holds, and the blocks beyond its
    capacity go, least recently used first. ``drops`` answers for many replicas in one walk."""

    def __init__(self) -> None:
        self._root = _Node(b"", 0, None)
        self._holders: dict[int, _Holder] = {}
        self._next_slot = 0
        self._free: list[int] = []
        self._clock = 0
        self._ids = 0  # heap tie-breaker
        self.blocks = 0  # distinct blocks in the tree

    def __len__(self) -> int:
        return self.blocks

    def join(self, capacity: int) -> int:
        """A new replica's bit (``1 << slot``, freed slots reused lowest first), holding nothing."""
        if self._free:
            self._free.sort()
            slot = self._free.pop(0)
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        bit = 1 << slot
        self._holders[bit] = _Holder(bit, max(capacity, 1))
        return bit

    def leave(self, bit: int) -> None:
        """The replica of ``bit`` holds nothing any more and its slot is free."""
        self.clear(bit)
        del self._holders[bit]
        self._free.append(bit.bit_length() - 1)

    def held(self, bit: int) -> int:
        """Blocks the replica of ``bit`` holds, generated ones included."""
        holder = self._holders[bit]
        return holder.blocks + holder.opaque_n

    def capacity(self, bit: int) -> int:
        return self._holders[bit].capacity

    def set_capacity(self, bit: int, capacity: int) -> None:
        """A new capacity (at least 1); blocks beyond it go at once."""
        holder = self._holders[bit]
        holder.capacity = max(capacity, 1)
        self._evict(holder)

    def clear(self, bit: int) -> None:
        """The replica of ``bit`` holds nothing."""
        holder = self._holders[bit]
        for node in sorted(holder.nodes, key=lambda node: -node.depth):  # leaves first
            self._drop(node, bit)
        holder.opaque.clear()
        holder.opaque_n = 0
        holder.heap.clear()

    def insert(self, bit: int, hashes: Sequence[BlockHash]) -> int:
        """The replica of ``bit`` holds the chain ``hashes``, touched now (its tail least
        recent); blocks beyond its capacity go. Returns the leading blocks it held before."""
        return self._walk(bit, hashes, add=True)

    def touch(self, bit: int, hashes: Sequence[BlockHash]) -> None:
        """The leading blocks of ``hashes`` the replica holds are used now (nothing added)."""
        self._walk(bit, hashes, add=False)

    def add_opaque(self, bit: int, count: int, evict: bool = True) -> None:
        """``count`` blocks that are never matched (generated tokens') take capacity, newest;
        ``evict`` False leaves the blocks beyond capacity to the next change (a ``touch``)."""
        holder = self._holders[bit]
        if count <= 0:
            return
        self._clock += 1
        holder.opaque.append([self._clock, count])
        holder.opaque_n += count
        if evict:
            self._evict(holder)

    def cut(self, bit: int, hashes: Sequence[BlockHash], start: int) -> None:
        """The replica of ``bit`` no longer holds ``hashes[start:]`` (nor what they prefix)."""
        holder = self._holders[bit]
        node, pos, n = self._root, 0, min(len(hashes), holder.capacity)  # it holds no more than that
        packed = packed_hashes(hashes, n)
        while pos < n:
            child = node.children.get(hashes[pos])
            if child is None:
                return
            hold = child.holds.get(bit)
            if hold is None:
                return
            m = common_blocks(child.run, packed, pos, min(child.size, n - pos))
            if start < pos + min(m, hold.n):  # the cut falls in this node
                keep = max(start - pos, 0)
                for grandchild in list(child.children.values()):
                    if grandchild.holds.get(bit) is not None:
                        self._drop_subtree(grandchild, bit)
                if keep:
                    self._set(child, bit, keep)
                    self._shrink(child)
                    self._push(holder, child, child.holds[bit])
                else:
                    self._drop(child, bit)
                return
            if m < child.size:
                return
            node, pos = child, pos + m

    def match(self, bit: int, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` the replica of ``bit`` holds."""
        for bits, depth in self.drops(hashes, bit):
            return depth
        return 0

    def drops(self, hashes: Sequence[BlockHash], mask: int, cap: int | None = None) -> list[tuple[int, int]]:
        """Where the replicas of ``mask`` stop holding the first ``cap`` blocks of ``hashes``:
        ``(bits, depth)`` pairs, ``depth`` > 0 and not decreasing (``EngineMap.drops``' answer).
        One walk down the tree, a comparison of packed bytes a node."""
        n = len(hashes) if cap is None else min(cap, len(hashes))
        out: list[tuple[int, int]] = []
        if not n or not mask:
            return out
        child = self._root.children.get(hashes[0])
        if child is None:
            return out
        packed = packed_hashes(hashes, n)
        alive, pos = mask, 0
        while True:
            m = common_blocks(child.run, packed, pos, min(child.size, n - pos))
            partial = alive & child.mask & ~child.full  # those holding part of the run: looked at one by one
            if partial:
                ends: dict[int, int] = {}
                bits, holds = partial, child.holds
                while bits:
                    bit = bits & -bits
                    bits ^= bit
                    depth = pos + min(holds[bit].n, m)
                    ends[depth] = ends.get(depth, 0) | bit
            gone = alive & ~child.full & ~partial
            if pos and gone:
                out.append((gone, pos))
            if partial:
                out.extend((bits, depth) for depth, bits in sorted(ends.items()))
            alive &= child.full
            if not alive:
                return out
            pos += m
            if m < child.size or pos >= n:
                out.append((alive, pos))
                return out
            nxt = child.children.get(hashes[pos])
            if nxt is None:
                out.append((alive, pos))
                return out
            child = nxt

    def _walk(self, bit: int, hashes: Sequence[BlockHash], add: bool) -> int:
        holder = self._holders[bit]
        n = min(len(hashes), holder.capacity)
        if n == 0:
            self._evict(holder)
            return 0
        packed = packed_hashes(hashes, n)
        self._clock += 1
        stamp = self._clock
        node, pos, before, last = self._root, 0, 0, None
        counting = True  # still inside what the replica held before
        while pos < n:
            child = node.children.get(hashes[pos])
            if child is None:
                if not add:
                    break
                child = _Node(packed[pos << 3 : n << 3], pos, node)
                node.children[hashes[pos]] = child
                self.blocks += child.size
                m = child.size
            else:
                m = common_blocks(child.run, packed, pos, min(child.size, n - pos))
            hold = child.holds.get(bit)
            had = hold.n if hold is not None else 0
            if counting:
                before += min(had, m)
                counting = had >= m and m == child.size
            reach = m if add else min(m, had)
            if reach == 0:
                break
            if reach < had:  # the touch ends inside this replica's hold: split so one stamp covers a hold
                self._split(child, reach)
                had = reach
            if reach < child.size and add and pos + reach < n:  # the prompt leaves the run here
                self._split(child, reach)
            self._set(child, bit, max(had, reach))
            child.holds[bit].stamp = stamp
            last = child
            pos += reach
            if reach < child.size:
                break
            node = child
        if last is not None:
            hold = last.holds[bit]
            if not hold.kids:
                self._push(holder, last, hold)
        self._evict(holder)
        return before

    def _split(self, node: _Node, at: int) -> None:
        """Cut ``node``'s run after ``at`` blocks: ``node`` keeps the head, a new child the tail,
        with the node's children and each replica's hold beyond ``at``."""
        tail = _Node(node.run[at << 3 :], node.depth + at, node)
        tail.children, node.children = node.children, {}
        for grandchild in tail.children.values():
            grandchild.parent = tail
        node.run, node.size = node.run[: at << 3], at
        node.children[int.from_bytes(tail.run[:8], sys.byteorder)] = tail
        full = 0
        for bit, hold in node.holds.items():
            if hold.n > at:
                moved = _Hold(hold.n - at, hold.stamp)
                moved.kids, hold.kids, hold.n = hold.kids, 1, at
                tail.holds[bit] = moved
                tail.mask |= bit
                self._holders[bit].nodes.add(tail)
                if moved.n == tail.size:
                    tail.full |= bit
                if not moved.kids:
                    self._push(self._holders[bit], tail, moved)
            if hold.n == at:
                full |= bit
        node.full = full

    def _set(self, node: _Node, bit: int, n: int) -> None:
        """The replica of ``bit`` holds ``n`` > 0 leading blocks of ``node``."""
        holder = self._holders[bit]
        hold = node.holds.get(bit)
        if hold is None:
            node.holds[bit] = _Hold(n, 0)
            node.mask |= bit
            holder.nodes.add(node)
            holder.blocks += n
            if node.parent is not self._root and node.parent is not None:
                node.parent.holds[bit].kids += 1
        else:
            holder.blocks += n - hold.n
            hold.n = n
        if n == node.size:
            node.full |= bit
        else:
            node.full &= ~bit

    def _drop(self, node: _Node, bit: int) -> None:
        """The replica of ``bit`` holds nothing of ``node`` (nor below it); an empty node goes."""
        hold = node.holds.pop(bit)
        holder = self._holders[bit]
        holder.blocks -= hold.n
        holder.nodes.discard(node)
        node.mask &= ~bit
        node.full &= ~bit
        parent = node.parent
        if parent is not self._root and parent is not None:
            up = parent.holds.get(bit)
            if up is not None:
                up.kids -= 1
                if not up.kids:
                    self._push(holder, parent, up)
        if not node.holds:
            self._remove(node)
        else:
            self._shrink(node)

    def _shrink(self, node: _Node) -> None:
        """Cut the blocks of a node's run that nobody holds (only a leaf's can be)."""
        if node.full or node.children or not node.holds:
            return
        n = max(hold.n for hold in node.holds.values())
        self.blocks -= node.size - n
        node.run, node.size = node.run[: n << 3], n
        node.full = sum(bit for bit, hold in node.holds.items() if hold.n == n)

    def _drop_subtree(self, node: _Node, bit: int) -> None:
        """``_drop`` of ``node`` and all it holds below, deepest first, without recursion (a node a turn)."""
        order, stack = [], [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(child for child in n.children.values() if child.mask & bit)
        for n in reversed(order):
            self._drop(n, bit)

    def _remove(self, node: _Node) -> None:
        """Unlink a node nobody holds, with whatever is left below it."""
        stack = [node]
        while stack:
            n = stack.pop()
            self.blocks -= n.size
            stack.extend(n.children.values())
        parent = node.parent
        if parent is not None:
            key = int.from_bytes(node.run[:8], sys.byteorder)
            if parent.children.get(key) is node:
                del parent.children[key]
        node.parent = None

    def _push(self, holder: _Holder, node: _Node, hold: _Hold) -> None:
        self._ids += 1
        heapq.heappush(holder.heap, (hold.stamp, -(node.depth + hold.n), self._ids, node))
        if len(holder.heap) > 4 * len(holder.nodes) + 64:
            heap = []
            for nd in holder.nodes:
                h = nd.holds[holder.bit]
                if not h.kids:
                    self._ids += 1
                    heap.append((h.stamp, -(nd.depth + h.n), self._ids, nd))
            heapq.heapify(heap)
            holder.heap = heap

    def _leaf(self, holder: _Holder) -> tuple[_Node, _Hold] | None:
        """The replica's least recently used leaf, its stale heap entries dropped on the way."""
        heap = holder.heap
        while heap:
            stamp, end, _, node = heap[0]
            hold = node.holds.get(holder.bit)
            if hold is not None and not hold.kids and hold.stamp == stamp and node.depth + hold.n == -end:
                return node, hold
            heapq.heappop(heap)
        return None

    def _evict(self, holder: _Holder) -> None:
        """Trim the least recently used blocks (a leaf's tail, or generated blocks) to capacity."""
        bit = holder.bit
        while holder.blocks + holder.opaque_n > holder.capacity:
            over = holder.blocks + holder.opaque_n - holder.capacity
            leaf = self._leaf(holder)
            if holder.opaque and (leaf is None or holder.opaque[0][0] < leaf[1].stamp):
                batch = holder.opaque[0]
                k = min(over, batch[1])
                batch[1] -= k
                holder.opaque_n -= k
                if not batch[1]:
                    holder.opaque.popleft()
                continue
            if leaf is None:  # nothing left to evict (cannot happen while blocks are counted)
                return
            node, hold = leaf
            heapq.heappop(holder.heap)
            if hold.n > over:
                self._set(node, bit, hold.n - over)
                self._shrink(node)
                self._push(holder, node, hold)
            else:
                self._drop(node, bit)
