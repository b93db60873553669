"""Token blocks and their chained identity, shared by the gateway and the simulator.

A prompt of token ids is cut into blocks of ``block_size`` tokens; only full blocks count, as
in vLLM's prefix cache. Block i's hash covers block i's tokens and block i-1's hash, so equal
hashes mean equal prefixes up to and including that block (vLLM:
``vllm/v1/core/kv_cache_utils.py``, ``hash_block_tokens``). The first block's parent is a seed
made of the model (or LoRA adapter) name and the ``cache_salt``: different salts never share a
block, as in vLLM, where the salt enters the first block's extra keys.

Digests are xxh3-64 over the token ids as little-endian 64-bit integers, seeded with the
parent hash. They are stable across processes and machines (never Python's ``hash()``), so
several gateway instances agree. They are not vLLM's digests (sha256 there): the gateway
compares token ids, not engine hashes.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from typing import NewType

import xxhash

__all__ = ["BlockHash", "seed_hash", "extend_block_hashes", "block_hashes", "text_block_hashes",
           "packed_hashes", "common_blocks"]

BlockHash = NewType("BlockHash", int)


def seed_hash(model: str, cache_salt: str | None = None, lora: str | None = None) -> BlockHash:
    """The parent hash of a prompt's first block: separates models, adapters and cache salts."""
    key = f"{model}\x00{lora or ''}\x00{cache_salt or ''}".encode("utf-8", "surrogatepass")  # JSON allows lone surrogates
    return BlockHash(xxhash.xxh3_64_intdigest(key))


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        seed: BlockHash) -> None:
    """Append the chained hashes of every full block of ``token_ids`` not yet in ``hashes``.

    ``hashes[i]`` identifies ``token_ids[: (i + 1) * block_size]``. Call again as the sequence
    grows (generated tokens, a longer next turn) to hash only the new blocks. Token ids must be
    ints in [-2**63, 2**63) (else ``struct.error``).
    """
    num_full = len(token_ids) // block_size
    start = len(hashes)
    if start >= num_full:
        return
    parent = hashes[-1] if hashes else seed
    window = token_ids[start * block_size : num_full * block_size]
    # an array("q") is already the bytes to hash (a tokenizer's ``Tokens``); a list is packed by
    # ``struct``, which converts a list of ints about three times faster than ``array`` does
    if isinstance(window, array) and window.typecode == "q":
        data = window.tobytes()
    else:
        data = struct.pack(f"={len(window)}q", *window)  # native order, as ``array.tobytes``
    width = block_size * 8
    digest = xxhash.xxh3_64_intdigest
    for offset in range(0, len(data), width):
        parent = BlockHash(digest(data[offset : offset + width], parent))
        hashes.append(parent)


def text_block_hashes(text: str, block_size: int, seed: BlockHash) -> list[BlockHash]:
    """Chained hashes of the full ``block_size``-character blocks of ``text`` (the gateway's
    approximate blocks without a tokenizer). Hashes UTF-32 windows of the text, never a list of
    code points: a 30 MB prompt costs tens of MB here, not a gigabyte."""
    out: list[BlockHash] = []
    parent = seed
    digest = xxhash.xxh3_64_intdigest
    width = 4 * block_size
    window = block_size * 4096  # characters encoded at a time
    end = len(text) - len(text) % block_size
    for start in range(0, end, window):
        data = text[start : min(start + window, end)].encode("utf-32-le", "surrogatepass")
        for offset in range(0, len(data), width):
            parent = BlockHash(digest(data[offset : offset + width], parent))
            out.append(parent)
    return out


def block_hashes(token_ids: Sequence[int], block_size: int, seed: BlockHash) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` (see ``extend_block_hashes``)."""
    out: list[BlockHash] = []
    extend_block_hashes(out, token_ids, block_size, seed)
    return out


_last_packed: tuple[Sequence[int] | None, int, bytes] = (None, 0, b"")


def packed_hashes(hashes: Sequence[BlockHash], n: int) -> bytes:
    """The first ``n`` (at least) of ``hashes`` as 8 bytes each (native order): a run of blocks
    compared in C (``cache/tree.py``); callers read no further than ``n`` (a huge prompt is
    matched and held only up to a replica's capacity). The last list's bytes are kept, with the
    list itself (so its identity cannot pass to another list): one request's hashes are matched,
    inserted and touched by several calls."""
    global _last_packed
    last = _last_packed
    if last[0] is hashes and last[1] >= n:
        return last[2]
    n = min(n, len(hashes))
    packed = struct.pack(f"={n}Q", *(hashes[:n] if n < len(hashes) else hashes))
    _last_packed = (hashes, n, packed)
    return packed


def common_blocks(run: bytes, packed: bytes, pos: int, limit: int) -> int:
    """How many leading blocks of ``run`` (packed hashes whose first block equals the prompt's
    block ``pos``) equal the prompt's (``packed``) from block ``pos``, at most ``limit`` (>= 1):
    one comparison of the whole run, else a binary search of ``startswith`` over its prefixes."""
    start = pos << 3
    view = memoryview(run)
    if packed.startswith(view[: limit << 3], start):
        return limit
    lo, hi = 1, limit - 1  # block 0 is equal; block ``limit`` is not
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if packed.startswith(view[: mid << 3], start):
            lo = mid
        else:
            hi = mid - 1
    return lo
