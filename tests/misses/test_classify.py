"""Miss classification with small hand-worked block lists, and the conversation memory bound."""

from __future__ import annotations

from prefix_router.misses.classify import CacheResult, Conversation, Conversations, classify

BLOCK = 16
TOOLS, SYSTEM, USER1, ASSISTANT1, USER2 = 900, 901, 902, 903, 904  # stand-in message hashes


def chain(*blocks: int) -> tuple[int, ...]:
    return tuple(blocks)


def verdict(hashes, *, previous=None, message_hashes=(), cached=0, predicted=0, best=0, max_hit=None, held=0):
    return classify(hashes=hashes, message_hashes=message_hashes, previous=previous, cached_blocks=cached,
                    predicted_blocks=predicted, best_blocks=best,
                    max_hit_blocks=len(hashes) if max_hit is None else max_hit, block_size=BLOCK,
                    held_blocks=held)


# --- changed ------------------------------------------------------------------------------

PREVIOUS = Conversation.of(chain(1, 2, 3, 4, 5), (TOOLS, SYSTEM, USER1))


def rewritten(shared: int, extra: int = 3) -> tuple[int, ...]:
    """The previous chain with everything from block ``shared`` on replaced."""
    return tuple(PREVIOUS.hashes[:shared]) + tuple(100 + i for i in range(extra + len(PREVIOUS.hashes) - shared))


def test_a_request_diverging_inside_what_was_sent_before_with_the_hit_stopping_there_is_changed():
    shared = 2
    hashes = rewritten(shared)
    v = verdict(hashes, previous=PREVIOUS, message_hashes=(TOOLS, SYSTEM, 777, ASSISTANT1, USER2),
                cached=shared, predicted=len(PREVIOUS.hashes), best=len(PREVIOUS.hashes))
    assert v.result is CacheResult.MISS_CHANGED
    reusable = min(len(PREVIOUS.hashes), len(hashes))
    assert v.lost_tokens == (reusable - shared) * BLOCK
    assert v.diverged_block == shared
    assert v.diverged_message == 1  # tools (-1) and the system message (0) are equal; message 1 differs


def test_a_hit_that_stopped_before_the_divergence_is_still_changed():
    shared = 3
    v = verdict(rewritten(shared), previous=PREVIOUS, cached=shared - 2)
    assert v.result is CacheResult.MISS_CHANGED
    assert v.lost_tokens == (len(PREVIOUS.hashes) - shared) * BLOCK


def test_a_hit_reaching_past_the_divergence_is_not_blamed_on_the_client():
    shared = 2
    hashes = rewritten(shared)
    v = verdict(hashes, previous=PREVIOUS, cached=shared + 1, predicted=shared + 1, best=shared + 1)
    assert v.result is not CacheResult.MISS_CHANGED


def test_lost_tokens_of_a_change_count_only_what_the_engine_could_have_hit():
    shared = 1
    hashes = rewritten(shared, extra=0)
    max_hit = 3  # the engine never hits the last token: fewer blocks than the previous chain
    v = verdict(hashes, previous=PREVIOUS, cached=0, max_hit=max_hit)
    assert v.result is CacheResult.MISS_CHANGED
    assert v.lost_tokens == (min(len(PREVIOUS.hashes), max_hit) - shared) * BLOCK


def test_a_changed_tool_list_reports_message_index_minus_one():
    shared = 0
    v = verdict(rewritten(shared), previous=PREVIOUS, message_hashes=(12345, SYSTEM, USER1, ASSISTANT1, USER2))
    assert v.result is CacheResult.MISS_CHANGED
    assert v.diverged_block == 0 and v.diverged_message == -1
    assert v.lost_tokens == len(PREVIOUS.hashes) * BLOCK


def test_a_changed_system_prompt_reports_message_index_zero():
    v = verdict(rewritten(1), previous=PREVIOUS, message_hashes=(TOOLS, 4242, USER1))
    assert v.result is CacheResult.MISS_CHANGED and v.diverged_message == 0


def test_an_append_only_next_turn_is_not_changed_even_when_it_misses():
    hashes = tuple(PREVIOUS.hashes) + chain(6, 7, 8)
    messages = tuple(PREVIOUS.message_hashes) + (ASSISTANT1, USER2)
    for cached, predicted, best, expected in [
        (0, 0, 0, CacheResult.MISS_COLD),
        (0, len(PREVIOUS.hashes), len(PREVIOUS.hashes), CacheResult.MISS_EVICTED),
        (len(PREVIOUS.hashes), len(PREVIOUS.hashes), len(PREVIOUS.hashes), CacheResult.HIT),
    ]:
        v = verdict(hashes, previous=PREVIOUS, message_hashes=messages, cached=cached, predicted=predicted, best=best)
        assert v.result is expected
        assert v.diverged_block is None and v.diverged_message is None


def test_a_shorter_repeat_of_the_previous_prefix_is_not_changed():
    hashes = PREVIOUS.hashes[:3]  # a retry cut short, or a prompt ending inside the old one
    v = verdict(hashes, previous=PREVIOUS, cached=0)
    assert v.result is not CacheResult.MISS_CHANGED


# --- routed, evicted, cold, hit ---------------------------------------------------------------

def test_another_replica_believed_to_hold_more_than_served_and_predicted_is_a_routed_miss():
    hashes = chain(1, 2, 3, 4, 5, 6)
    cached, predicted, best = 1, 2, 5
    v = verdict(hashes, cached=cached, predicted=predicted, best=best)
    assert v.result is CacheResult.MISS_ROUTED
    assert v.lost_tokens == (best - cached) * BLOCK
    assert v.diverged_block is None


def test_the_chosen_replica_believed_to_hold_more_than_it_served_is_an_evicted_miss():
    hashes = chain(1, 2, 3, 4, 5, 6)
    cached, predicted = 1, 4
    v = verdict(hashes, cached=cached, predicted=predicted, best=predicted)  # nobody held more
    assert v.result is CacheResult.MISS_EVICTED
    assert v.lost_tokens == (predicted - cached) * BLOCK


def test_a_prompt_nobody_knew_and_nothing_served_is_a_cold_miss():
    v = verdict(chain(1, 2, 3))
    assert v.result is CacheResult.MISS_COLD and v.lost_tokens == 0


def test_serving_at_least_the_longest_known_prefix_is_a_hit():
    for cached, predicted, best in [(3, 3, 3), (4, 2, 3), (1, 0, 0)]:
        v = verdict(chain(1, 2, 3, 4, 5), cached=cached, predicted=predicted, best=best)
        assert v.result is CacheResult.HIT and v.lost_tokens == 0


def test_a_first_request_without_history_is_never_changed():
    v = verdict(chain(1, 2, 3), previous=None, cached=0, predicted=2, best=2)
    assert v.result is CacheResult.MISS_EVICTED


# --- memory --------------------------------------------------------------------------------

def test_conversations_keep_at_most_max_conversations_dropping_the_least_recently_put():
    limit = 3
    memory = Conversations(limit)
    for i in range(limit + 2):
        memory.put(f"c{i}", Conversation.of(chain(i), ()))
        assert len(memory) <= limit
    assert len(memory) == limit
    assert memory.get("c0") is None and memory.get("c1") is None
    assert all(memory.get(f"c{i}") is not None for i in range(2, limit + 2))


def test_putting_a_conversation_again_refreshes_it_and_replaces_its_previous_request():
    memory = Conversations(2)
    memory.put("a", Conversation.of(chain(1), ()))
    memory.put("b", Conversation.of(chain(2), ()))
    memory.put("a", Conversation.of(chain(1, 3), ()))  # the next turn of "a"
    memory.put("c", Conversation.of(chain(4), ()))
    assert memory.get("b") is None
    assert tuple(memory.get("a").hashes) == chain(1, 3)
    assert len(memory) == 2


def test_a_prefix_evicted_from_the_shadow_index_lately_is_a_miss_evicted_not_a_hit():
    hashes = chain(1, 2, 3, 4)
    v = verdict(hashes, cached=1, predicted=1, best=1, held=3)
    assert v.result is CacheResult.MISS_EVICTED
    assert v.lost_tokens == (3 - 1) * BLOCK
