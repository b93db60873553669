"""Token blocks and their chained hashes (``prefix_router/cache/blocks.py``): only full blocks
count, equal hashes mean equal prefixes, growing a sequence hashes only its new blocks, and
models, adapters and salts never share a block. The simulator's cache keys its blocks by the
same hashes: ``tests/tools/sim/test_kv_cache.py``."""

from __future__ import annotations

from array import array

import xxhash

from prefix_router.cache.blocks import block_hashes, extend_block_hashes, seed_hash, text_block_hashes

SEED = seed_hash("model")


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(15)), 4, SEED)) == 3
    assert block_hashes(list(range(3)), 4, SEED) == []


def test_prefixes_hash_equal_up_to_the_block_where_they_differ_and_every_block_after_differs():
    a = block_hashes(list(range(16)), 4, SEED)
    b = block_hashes(list(range(9)) + [99] + list(range(10, 16)), 4, SEED)  # token 9, in block 2
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:]))  # block 3's tokens are equal, its parent is not


def test_hashing_a_growing_sequence_equals_hashing_it_at_once_from_a_list_or_an_array():
    tokens = list(range(1000, 1037))
    grown: list = []
    for end in (3, 8, 20, 20, 37):
        extend_block_hashes(grown, tokens[:end], 4, SEED)
    assert grown == block_hashes(tokens, 4, SEED) == block_hashes(array("q", tokens), 4, SEED)


def test_models_adapters_and_salts_never_share_a_block():
    seeds = [seed_hash("m"), seed_hash("m", "tenant"), seed_hash("m", lora="sql"), seed_hash("other"),
             seed_hash("m", "\ud800")]  # JSON allows a lone surrogate in a salt
    assert len(set(seeds)) == len(seeds) and seed_hash("m", "tenant") == seeds[1]
    assert len({block_hashes([1, 2, 3, 4], 4, s)[0] for s in seeds}) == len(seeds)


def test_text_blocks_are_the_chained_hashes_of_their_characters_in_utf_32_across_windows():
    def one_block_at_a_time(text: str, size: int) -> list[int]:
        out, parent = [], SEED
        for start in range(0, len(text) - len(text) % size, size):
            parent = xxhash.xxh3_64_intdigest(text[start:start + size].encode("utf-32-le", "surrogatepass"), parent)
            out.append(parent)
        return out

    text = ("héllo wörld 😀 \ud800 " * 2000)[:20_001]  # longer than one window of 4,096 blocks of 2
    assert text_block_hashes(text, 2, SEED) == one_block_at_a_time(text, 2)
    assert len(text_block_hashes(text, 2, SEED)) == 10_000
