"""The built-in workloads (``prefix_router/tools/replay/generate.py``): repeatable for a seed,
append-only sessions, and cache breakers that really break the prefix."""

from __future__ import annotations

import json

import pytest

from prefix_router.tools.replay.generate import builtin_workload

from .test_workloads import by_session, is_prefix


def test_the_builtin_workload_repeats_for_a_seed_and_changes_with_it():
    first = builtin_workload("mixed", seed=3, sessions=10)
    again = builtin_workload("mixed", seed=3, sessions=10)
    other = builtin_workload("mixed", seed=4, sessions=10)
    assert [r.body for r in first] == [r.body for r in again]
    assert [(r.at_s, r.session, r.think_s) for r in first] == [(r.at_s, r.session, r.think_s) for r in again]
    assert [r.body for r in first] != [r.body for r in other]


def test_an_unknown_builtin_workload_name_raises_value_error():
    with pytest.raises(ValueError, match="unknown workload"):
        builtin_workload("nope")


def test_mixed_sessions_without_a_breaker_are_append_only():
    sessions = by_session(builtin_workload("mixed"))
    clean = [turns for turns in sessions.values() if turns[0].meta["breaker"] is None]
    assert clean
    for turns in clean:
        for prev, nxt in zip(turns, turns[1:]):
            assert is_prefix(prev.body["messages"], nxt.body["messages"])
            assert prev.body.get("tools") == nxt.body.get("tools")


@pytest.mark.parametrize("name, seed", [("mixed", 0), ("mixed", 1), ("breakers", 0)])
def test_every_cache_breaker_really_breaks_the_prefix(name, seed):
    sessions = by_session(builtin_workload(name, seed=seed))
    broken = {}
    for turns in sessions.values():
        breaker = turns[0].meta["breaker"]
        if breaker is None:
            continue
        pairs = list(zip(turns, turns[1:]))
        if breaker == "timestamp":
            ok = all(p.body["messages"][0]["content"] != n.body["messages"][0]["content"] for p, n in pairs)
        elif breaker == "tools_reordered":
            ok = any([t["function"]["name"] for t in p.body["tools"]] != [t["function"]["name"] for t in n.body["tools"]]
                     for p, n in pairs)
            assert all(sorted(map(json.dumps, p.body["tools"])) == sorted(map(json.dumps, n.body["tools"]))
                       for p, n in pairs)  # same tools, other order
        else:
            assert breaker == "trimmed"
            ok = any(not is_prefix(p.body["messages"], n.body["messages"]) for p, n in pairs)
        assert ok, (breaker, turns[0].session)
        broken[breaker] = broken.get(breaker, 0) + 1
    assert set(broken) == {"timestamp", "tools_reordered", "trimmed"}
