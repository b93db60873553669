"""Incremental chat tokenization always equals a full tokenization.

The tokenizer under test is the tiny byte-level BPE the real-engine tier serves (built here
from ``router/tiny_model.py``, tokenizer only: no torch needed). Hypothesis drives
random multi-turn conversations, tool lists and awkward text (unicode, whitespace, the special
tokens' own text inside content) through one ``HFTokenizer`` whose prefix cache is warm from
earlier turns and earlier conversations; every prompt's ids must equal the ids of encoding the
whole rendered text at once.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.tokenizer import HFTokenizer

from router.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(out, None)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return HFTokenizer(str(tokenizer_dir), max_cached_tokens=50_000)


def full(tok: HFTokenizer, messages, tools=None) -> list[int]:
    from router.tokenizer import normalize_messages, normalize_tools

    text = tok._tok.apply_chat_template(normalize_messages(messages), tools=normalize_tools(tools),
                                       add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80) | st.sampled_from(
    ["", " ", "\n\n", "  leading", "trailing  ", "<|im_end|>", "a<|im_start|>b", "héllo wörld", "😀 ok", "def f():\n\treturn 1"])
turns = st.lists(st.tuples(texts, texts), min_size=1, max_size=5)
tool_lists = st.none() | st.lists(st.builds(lambda n, d: {"type": "function", "function": {"name": n, "description": d}},
                                            st.from_regex(r"[a-z_]{1,8}", fullmatch=True), texts), max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=texts, conversation=turns, tools=tool_lists)
def test_incremental_ids_equal_a_full_tokenization_on_every_turn(tokenizer, system, conversation, tools):
    messages = [{"role": "system", "content": system}]
    for user, assistant in conversation:
        messages.append({"role": "user", "content": user})
        assert tokenizer.render_chat(messages, tools=tools) == full(tokenizer, messages, tools)
        messages.append({"role": "assistant", "content": assistant})


def test_the_prefix_cache_is_used_and_stays_within_its_bound(tokenizer_dir):
    tok = HFTokenizer(str(tokenizer_dir), max_cached_tokens=2_000)
    messages = [{"role": "system", "content": "shared system prompt " * 50}]
    for i in range(30):
        messages += [{"role": "user", "content": f"question {i} " * 10}, {"role": "assistant", "content": "answer " * 10}]
        assert tok.render_chat(messages) == full(tok, messages)
        assert tok._cached_tokens <= 2_000
    assert tok._prefixes  # something was cached and reused
