"""The relay's stream filter, pure: a replica's SSE bytes cut anywhere come out whole."""

from __future__ import annotations

import json

import pytest

from prefix_router.serve.relay import UsageFilter

USAGE = {"prompt_tokens": 12, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}
EVENTS = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
          b'data: {"choices":[{"delta":{"content":"b\\n"}}]}\r\n\r\n',
          b'data: {"choices":[],"usage":' + json.dumps(USAGE, separators=(",", ":")).encode() + b"}\n\n",
          b"data: [DONE]\n\n"]
STREAM = b"".join(EVENTS)


def relay(chunks, keep_usage):
    f = UsageFilter(keep_usage=keep_usage)
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
    f = UsageFilter(keep_usage=False)
    burst = EVENTS[0] * 20
    assert f.feed(burst) is burst  # not copied, not split


def test_a_last_line_without_its_newline_is_sent_at_the_end():
    out, _ = relay([b"data: [DONE]"], keep_usage=False)
    assert out == b"data: [DONE]"


# vLLM 0.32 with include_usage: the terminal chunk goes without system_fingerprint, the usage
# event carries it (chat_completion/serving.py); without include_usage the terminal chunk has it
FINGERPRINT = "vllm-0.32.0-b40948de"
TERMINAL = b'data: {"choices":[{"index":0,"delta":{"content":"c"},"finish_reason":"length"}]}\n\n'
WITH_USAGE = [EVENTS[0], TERMINAL, b'data: {"choices":[],"usage":' + json.dumps(USAGE).encode()
              + b',"system_fingerprint":"' + FINGERPRINT.encode() + b'"}\n\n', b"data: [DONE]\n\n"]


def test_a_dropped_usage_event_gives_its_fingerprint_back_to_the_terminal_chunk_wherever_cut():
    stream = b"".join(WITH_USAGE)
    stamped = TERMINAL.replace(b"]}\n", b'],"system_fingerprint":"' + FINGERPRINT.encode() + b'"}\n')
    for cut in range(1, len(stream)):
        out, f = relay([stream[:cut], stream[cut:]], keep_usage=False)
        assert out == EVENTS[0] + stamped + b"data: [DONE]\n\n", cut
        assert f.usage == USAGE
    out, _ = relay([stream], keep_usage=True)  # the client asked for usage: as vLLM sent it
    assert out == stream


def test_a_terminal_chunk_followed_by_other_events_is_sent_as_it_came():
    # n > 1: one choice ends while another goes on; the held chunk goes out before the next event
    other = b'data: {"choices":[{"index":1,"delta":{"content":"d"},"finish_reason":null}]}\n\n'
    out, _ = relay([EVENTS[0], TERMINAL, other, b"data: [DONE]\n\n"], keep_usage=False)
    assert out == EVENTS[0] + TERMINAL + other + b"data: [DONE]\n\n"
    out, _ = relay([TERMINAL], keep_usage=False)  # a stream cut after it: flushed at the end
    assert out == TERMINAL
