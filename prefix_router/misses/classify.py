"""Why did a request miss? Conversation memory and the miss classification.

A conversation is identified by the client's session key or, without one, by the prompt up to
the end of its first user message (chat). A completion without a session key has none: in
token ids a client rewriting its prompt and two requests sharing a document then branching
look alike (the Mooncake traces are full of the latter), so it is never called changed. For each
conversation the gateway remembers the previous request's block hashes and a hash per message
(``max_conversations`` entries, LRU; about 4 KB for an 8k-token prompt in 16-token blocks).

``classify`` decides, once the engine reported ``cached_tokens``, in this order:

- ``miss_changed``: the conversation's previous request diverged from this one inside text it
  had already sent (not an append), and the engine's hit stopped at or before that point.
  The client rewrote its own prefix: a timestamp in the system prompt, reordered tools,
  history trimmed in place. Reported with the block where it diverged and the message index.
- ``miss_routed``: another replica was believed to hold more of the prompt than the engine
  served (the gateway sent it elsewhere: spill, fallback, no affinity, or balance: a new
  conversation whose small shared prefix was held elsewhere, placed for the load).
- ``miss_evicted``: the chosen replica held more than it served: believed cached, or evicted
  lately from the shadow index's LRU (its ghost list). The KV cache is short for the traffic.
- ``miss_cold``: nothing of the prompt was known anywhere.
- ``hit``: the engine served at least the longest prefix known anywhere.
Lost tokens are what the better outcome would have reused, in tokens.
"""

from __future__ import annotations

import enum
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from prefix_router.cache.blocks import BlockHash
from prefix_router.misses.diagnosis import RequestPrint

__all__ = ["CacheResult", "Conversation", "Conversations", "Verdict", "classify", "TAIL_BLOCKS"]

# A departure in the previous prompt's last block is not a change: the tokens at a prompt's end
# (the generation prompt, "<|im_start|>assistant\n") may tokenize differently once the answer
# follows them (BPE merges across the boundary; measured with the byte tokenizer's 4-byte
# tokens on the SWE-agent sessions), so that block can differ though the client appended.
TAIL_BLOCKS = 1


class CacheResult(str, enum.Enum):
    HIT = "hit"
    MISS_COLD = "miss_cold"
    MISS_CHANGED = "miss_changed"
    MISS_ROUTED = "miss_routed"
    MISS_EVICTED = "miss_evicted"


@dataclass(slots=True)
class Conversation:
    """The previous request of one conversation: 8 bytes a block and a message (``array``),
    so an 8k-token prompt in 16-token blocks costs about 4 KB."""

    hashes: array  # "Q": the block hashes
    message_hashes: array  # "Q": the tool list's hash, then one per message
    print: RequestPrint | None = None  # for diagnosis.diagnose: about 32 bytes a message more

    @classmethod
    def of(cls, hashes: Sequence[BlockHash], message_hashes: Sequence[int],
           print_: RequestPrint | None = None) -> Conversation:
        return cls(array("Q", hashes), array("Q", message_hashes), print_)


@dataclass(slots=True)
class Verdict:
    result: CacheResult
    lost_tokens: int = 0
    diverged_block: int | None = None  # first block that differs from the previous request
    diverged_message: int | None = None  # index of the first message that differs (-1: tools)


class Conversations:
    """LRU map of conversation id -> previous request, at most ``max_conversations``."""

    def __init__(self, max_conversations: int = 100_000) -> None:
        self.max_conversations = max_conversations
        self._items: OrderedDict[str, Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, conversation_id: str) -> Conversation | None:
        return self._items.get(conversation_id)

    def put(self, conversation_id: str, conversation: Conversation) -> None:
        self._items[conversation_id] = conversation
        self._items.move_to_end(conversation_id)
        while len(self._items) > self.max_conversations:
            self._items.popitem(last=False)


def _common(a: Sequence, b: Sequence) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def classify(*, hashes: Sequence[BlockHash], message_hashes: Sequence[int], previous: Conversation | None,
             cached_blocks: int, predicted_blocks: int, best_blocks: int, max_hit_blocks: int,
             block_size: int, held_blocks: int = 0) -> Verdict:
    """Classify one request's cache outcome (see the module docstring). Counts in blocks.

    ``predicted_blocks``: what the chosen replica was believed to hold; ``held_blocks``: what it
    held now or until lately (the shadow index's ghost list); ``best_blocks``: the most any
    replica was believed to hold.
    """
    if previous is not None:
        reusable = min(len(previous.hashes), max_hit_blocks)
        shared = _common(hashes, previous.hashes)
        if shared < reusable - TAIL_BLOCKS and cached_blocks <= shared:
            message = _common(message_hashes, previous.message_hashes) - 1  # -1: the tools
            return Verdict(CacheResult.MISS_CHANGED, (reusable - shared) * block_size, shared, message)
    if best_blocks > cached_blocks and best_blocks > predicted_blocks:
        return Verdict(CacheResult.MISS_ROUTED, (best_blocks - cached_blocks) * block_size)
    held = max(predicted_blocks, held_blocks)
    if held > cached_blocks:
        return Verdict(CacheResult.MISS_EVICTED, (held - cached_blocks) * block_size)
    if cached_blocks == 0 and best_blocks == 0:
        return Verdict(CacheResult.MISS_COLD)
    return Verdict(CacheResult.HIT)
