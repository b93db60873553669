"""Which replica holds each stored Response (prefix_router/fleet/response_homes.py): bounded by
ids (least recently used first) and by the characters of the histories kept with them."""

from __future__ import annotations

import pytest

from prefix_router.fleet.response_homes import ResponseHomes, response_id_of_stream


def history(chars: int) -> list[dict]:
    """A one-message history of ``chars`` characters of content."""
    return [{"role": "user", "content": "x" * chars}]


def cost(messages: list[dict]) -> int:
    """What the module charges a history: its text plus 100 characters a message."""
    return sum(len(m.get("content") or "") + len(str(m.get("tool_calls") or "")) + 100 for m in messages)


def test_an_id_is_found_on_the_replica_that_created_it_and_an_unknown_one_nowhere():
    homes = ResponseHomes()
    homes.remember("resp_1", "replica-a")
    assert homes.home("resp_1") == "replica-a"
    assert homes.home("resp_unknown") is None


def test_past_capacity_the_least_recently_used_id_goes_and_a_lookup_counts_as_a_use():
    homes = ResponseHomes(capacity=2)
    homes.remember("resp_1", "a")
    homes.remember("resp_2", "b")
    homes.home("resp_1")  # used: resp_2 is now the oldest
    homes.remember("resp_3", "c")
    assert len(homes) == 2
    assert homes.home("resp_2") is None
    assert homes.home("resp_1") == "a" and homes.home("resp_3") == "c"


def test_a_response_belongs_to_the_tenant_that_created_it_and_a_later_claim_is_ignored():
    homes = ResponseHomes()
    homes.remember("resp_1", "a", owner="tenant-a")
    homes.remember("resp_1", "a", owner="tenant-b")  # relayed again, under another tenant
    assert homes.owned_by("resp_1", "tenant-a")
    assert not homes.owned_by("resp_1", "tenant-b")
    assert not homes.owned_by("resp_never_seen", "tenant-a")  # nobody owns what this process never relayed


def test_an_id_dropped_for_capacity_takes_its_owner_and_history_with_it():
    homes = ResponseHomes(capacity=1)
    homes.remember("resp_1", "a", history(10), owner="tenant-a")
    homes.remember("resp_2", "b")
    assert homes.history("resp_1") is None and not homes.owned_by("resp_1", "tenant-a")
    homes.remember("resp_1", "a", owner="tenant-b")  # seen again after it was forgotten: a new owner
    assert homes.owned_by("resp_1", "tenant-b")


def test_the_history_comes_back_as_remembered_and_a_copy_each_time():
    homes = ResponseHomes()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    homes.remember("resp_1", "a", messages)
    got = homes.history("resp_1")
    assert got == messages
    got.append({"role": "user", "content": "more"})
    assert homes.history("resp_1") == messages


def test_past_the_character_budget_the_least_recently_used_histories_go_but_their_ids_stay():
    one = history(50)
    homes = ResponseHomes(history_chars=2 * cost(one))  # room for two
    for i in range(3):
        homes.remember(f"resp_{i}", "a", one)
        if i == 1:
            homes.history("resp_0")  # read: resp_1 is now the least recently used
    assert homes.history("resp_1") is None
    assert homes.history("resp_0") == one and homes.history("resp_2") == one
    assert homes.home("resp_1") == "a"  # the id, and where it lives, are kept


def test_a_history_larger_than_the_whole_budget_is_not_kept_and_drops_nothing_else():
    small = history(10)
    homes = ResponseHomes(history_chars=cost(small) + 50)
    homes.remember("resp_small", "a", small)
    homes.remember("resp_big", "a", history(1000))
    assert homes.history("resp_big") is None and homes.home("resp_big") == "a"
    assert homes.history("resp_small") == small


def test_remembering_an_id_again_charges_its_history_once():
    one = history(50)
    homes = ResponseHomes(history_chars=2 * cost(one))
    homes.remember("resp_other", "a", one)
    for _ in range(10):  # a leak in the accounting would soon push resp_other out
        homes.remember("resp_1", "a", one)
    assert homes.history("resp_other") == one and homes.history("resp_1") == one


@pytest.mark.parametrize("capacity, budget", [(0, 1), (1, 0)])
def test_a_capacity_or_budget_below_one_is_refused(capacity, budget):
    with pytest.raises(ValueError):
        ResponseHomes(capacity, budget)


@pytest.mark.parametrize("chunk, found", [
    (b'event: response.created\n'
     b'data: {"type":"response.created","response":{"id":"resp_abc123","status":"in_progress"}}\n\n', "resp_abc123"),
    (b'data: {"response" : {  "id" : "resp_spaced"}}\n\n', "resp_spaced"),  # any JSON whitespace
    (b'data: {"type":"response.output_text.delta","delta":"hi"}\n\n', None),
    (b'data: {"response":{"id":"' + b"x" * 201 + b'"}}\n\n', None),  # longer than any id vLLM makes
])
def test_the_response_id_is_read_from_a_streams_created_event(chunk, found):
    assert response_id_of_stream(chunk) == found
