"""The proxy's stream filter, pure: a replica's SSE bytes cut anywhere come out whole."""

from __future__ import annotations

import json

import pytest

from router.proxy import _UsageFilter

USAGE = {"prompt_tokens": 12, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}
EVENTS = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
          b'data: {"choices":[{"delta":{"content":"b\\n"}}]}\r\n\r\n',
          b'data: {"choices":[],"usage":' + json.dumps(USAGE, separators=(",", ":")).encode() + b"}\n\n",
          b"data: [DONE]\n\n"]
STREAM = b"".join(EVENTS)


def relay(chunks, keep_usage):
    f = _UsageFilter(keep_usage=keep_usage)
    out = b"".join(f.feed(c) for c in chunks) + f.flush()
    return out, f


@pytest.mark.parametrize("keep_usage", [True, False], ids=["client-asked-for-usage", "client-did-not"])
def test_a_stream_cut_at_every_byte_comes_out_whole_and_the_usage_is_read(keep_usage):
    expected = STREAM if keep_usage else STREAM.replace(EVENTS[2], b"")
    for cut in range(1, len(STREAM)):
        out, f = relay([STREAM[:cut], STREAM[cut:]], keep_usage)
        assert out == expected, cut
        assert f.usage == USAGE and f.saw_data


def test_a_stream_fed_one_byte_at_a_time_comes_out_whole():
    out, f = relay([STREAM[i:i + 1] for i in range(len(STREAM))], keep_usage=False)
    assert out == STREAM.replace(EVENTS[2], b"") and f.usage == USAGE


def test_events_that_arrive_together_go_out_in_one_piece():
    f = _UsageFilter(keep_usage=False)
    burst = EVENTS[0] * 20
    assert f.feed(burst) is burst  # not copied, not split


def test_a_last_line_without_its_newline_is_sent_at_the_end():
    out, _ = relay([b"data: [DONE]"], keep_usage=False)
    assert out == b"data: [DONE]"
