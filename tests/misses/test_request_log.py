"""The request log (prefix_router/misses/request_log.py): one JSON line per request, on disk as
each request ends, and conversation ids reduced to a tag."""

from __future__ import annotations

import json
import time

import pytest
import xxhash

from prefix_router.misses.request_log import RequestLog, conversation_tag


def test_a_conversation_is_tagged_by_its_xxh3_64_digest_in_16_hex_digits():
    tag = conversation_tag("session-42")
    assert tag == xxhash.xxh3_64_hexdigest(b"session-42")
    assert len(tag) == 16 and int(tag, 16) >= 0
    assert conversation_tag("session-42") == tag  # stable: the same in every process
    assert conversation_tag("session-43") != tag


def test_no_conversation_has_no_tag():
    assert conversation_tag("") is None


def test_a_session_key_with_a_lone_surrogate_is_still_tagged():
    # a header or JSON string may carry one; tagging must not raise
    assert len(conversation_tag("session-\udc80")) == 16


def test_each_write_is_one_compact_json_line_with_the_time_added(tmp_path):
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path))
    before = time.time()
    log.write(replica="a:8000", route="affinity", status=200, cached_tokens=64, result="hit")
    log.write(replica="b:8000", route="retry", status=502, cause=None)
    after = time.time()
    lines = path.read_text().splitlines()  # read before close: line buffered
    log.close()
    assert len(lines) == 2
    first, second = map(json.loads, lines)
    assert {k: v for k, v in first.items() if k != "t"} == {"replica": "a:8000", "route": "affinity", "status": 200,
                                                            "cached_tokens": 64, "result": "hit"}
    assert second["cause"] is None
    assert before - 1e-6 <= first["t"] <= second["t"] <= after + 1e-6
    assert round(first["t"], 6) == first["t"]
    assert ", " not in lines[0] and '": ' not in lines[0]  # compact separators


def test_the_time_is_the_first_key_of_a_line(tmp_path):
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path))
    log.write(replica="a")
    log.close()
    assert next(iter(json.loads(path.read_text()))) == "t"


def test_a_log_that_exists_is_appended_to_not_replaced(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"t":1.0,"replica":"earlier"}\n')
    log = RequestLog(str(path))
    log.write(replica="later")
    log.close()
    assert [json.loads(line)["replica"] for line in path.read_text().splitlines()] == ["earlier", "later"]


def test_a_log_that_cannot_be_opened_raises_os_error(tmp_path):
    with pytest.raises(OSError):
        RequestLog(str(tmp_path / "no-such-folder" / "requests.jsonl"))
    with pytest.raises(OSError):
        RequestLog(str(tmp_path))  # a folder


def test_keyed_blocks_keep_equal_prefixes_equal_and_change_with_the_key():
    from prefix_router.misses.request_log import keyed_blocks

    a, b = [11, 22, 33], [11, 22, 44]
    ka, kb = keyed_blocks(a, b"k" * 16), keyed_blocks(b, b"k" * 16)
    assert ka[:2] == kb[:2] and ka[2] != kb[2] and all(len(k) == 16 for k in ka)
    assert keyed_blocks(a, b"j" * 16) != ka and ka != [f"{h:016x}" for h in a]


def test_the_key_comes_from_the_environment_else_at_random(monkeypatch):
    from prefix_router.misses.request_log import KEY_ENV, log_key

    monkeypatch.setenv(KEY_ENV, "a secret of some length")
    assert log_key() == b"a secret of some length"
    monkeypatch.setenv(KEY_ENV, "x" * 100)
    assert len(log_key()) == 64  # BLAKE2b's longest key
    monkeypatch.delenv(KEY_ENV)
    assert log_key() != log_key()
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(ValueError, match=KEY_ENV):
        log_key()
