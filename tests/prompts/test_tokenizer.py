"""Incremental chat tokenization always equals a full tokenization.

The tokenizer under test is the tiny byte-level BPE the real-engine tier serves (built here
from ``prefix_router/tools/tiny_model.py``, tokenizer only: no torch needed). Hypothesis drives
random multi-turn conversations, tool lists and awkward text (unicode, whitespace, the special
tokens' own text inside content) through one ``HFTokenizer`` whose prefix cache is warm from
earlier turns and earlier conversations; every prompt's ids must equal the ids of encoding the
whole rendered text at once. The compiled template against ``apply_chat_template``:
``test_chat_template.py``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_router.tools.tiny_model import build_tokenizer
from prefix_router.prompts.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(out, None)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return HFTokenizer(str(tokenizer_dir), max_cached_tokens=50_000)


def full(tok: HFTokenizer, messages, tools=None) -> list[int]:
    from prefix_router.prompts.tokenizer import normalize_messages, normalize_tools

    text = tok._tok.apply_chat_template(normalize_messages(messages), tools=normalize_tools(tools),
                                       add_generation_prompt=True, tokenize=False)
    return reference_ids(tok, text)


def reference_ids(tok: HFTokenizer, text: str) -> list[int]:
    """``text``'s ids as transformers encodes them, not through the gateway's ``encode``."""
    return tok._tok(text, add_special_tokens=False)["input_ids"]


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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=texts, conversation=turns, salts=st.lists(st.sampled_from([None, "a", "b"]), min_size=1, max_size=5),
       block_sizes=st.lists(st.sampled_from([1, 4, 16]), min_size=1, max_size=5))
def test_analysis_reusing_the_known_prefixs_block_hashes_equals_hashing_every_block(
        tokenizer, system, conversation, salts, block_sizes):
    # each turn under a salt and a block size of its own: the memo kept with a known prefix
    # must never hand one seed's or one block size's hashes to another
    from prefix_router.cache.blocks import block_hashes, seed_hash
    from prefix_router.prompts.analysis import analyze

    messages = [{"role": "system", "content": system}]
    for i, (user, assistant) in enumerate(conversation):
        messages.append({"role": "user", "content": user})
        salt, size = salts[i % len(salts)], block_sizes[i % len(block_sizes)]
        body = {"model": "m", "messages": messages, **({"cache_salt": salt} if salt else {})}
        for _ in range(2):  # the second time the whole prompt's prefix is known
            info = analyze(body, True, tokenizer, size, 64, None)
            assert info.hashes == block_hashes(full(tokenizer, messages), size, seed_hash("m", salt))
        messages.append({"role": "assistant", "content": assistant})


def test_the_prefix_cache_is_used_and_stays_within_its_bound(tokenizer_dir):
    tok = HFTokenizer(str(tokenizer_dir), max_cached_tokens=2_000)
    messages = [{"role": "system", "content": "shared system prompt " * 50}]
    for i in range(30):
        messages += [{"role": "user", "content": f"question {i} " * 10}, {"role": "assistant", "content": "answer " * 10}]
        assert tok.render_chat(messages) == full(tok, messages)
        assert tok._cached_tokens <= 2_000
    assert tok._prefixes  # something was cached and reused


def test_a_next_turn_reuses_its_prefix_while_the_cache_holds_it_and_encodes_anew_once_it_is_gone(tokenizer_dir):
    # index.tokenizer_cache_tokens: every conversation's first turn keeps its prompt's ids; a
    # bound below what the conversations in flight need evicts them before their next turn
    def first_turns(tok, n):
        history = [[{"role": "system", "content": f"conversation {c}: " + "words of the system prompt " * 20},
                    {"role": "user", "content": "hello"}] for c in range(n)]
        for messages in history:
            tok.render_chat_tokens(messages)
        return [messages + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
                for messages in history]

    roomy = HFTokenizer(str(tokenizer_dir), max_cached_tokens=100_000)
    size = len(roomy.render_chat_tokens(first_turns(roomy, 1)[0][:2]).ids)  # one first turn's ids
    bound = 5 * size  # room for five conversations' first turns, not for twenty
    small = HFTokenizer(str(tokenizer_dir), max_cached_tokens=bound)
    later = first_turns(small, 20)
    assert small._cached_tokens <= bound
    assert small.render_chat_tokens(later[-1]).known is not None  # the latest is still held
    assert small.render_chat_tokens(later[0]).known is None  # the oldest was evicted: a full encode
    assert all(roomy.render_chat_tokens(m).known is not None for m in first_turns(roomy, 20))


@pytest.mark.parametrize("preset", [None, "true"])
def test_loading_a_tokenizer_turns_its_thread_pool_off_unless_the_operator_chose(tokenizer_dir, monkeypatch, preset):
    # one text a call: the pool splits nothing, and waking it costs CPU a request
    if preset is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", preset)
    HFTokenizer(str(tokenizer_dir))
    assert os.environ["TOKENIZERS_PARALLELISM"] == (preset or "false")


def test_the_byte_tokenizer_reads_four_bytes_a_token_the_last_short_one_padded():
    """Its definition, one token at a time, against what it computes at once; chat renders too."""
    import random

    from prefix_router.prompts.tokenizer import ByteTokenizer

    tok, rng = ByteTokenizer(), random.Random(7)
    texts = ["", "a", "abcd", "abcde", "h\u00e9llo \u2713 \U0001F600", "\udcff lone surrogate"]
    texts += ["".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(120))) for _ in range(200)]
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        expected = [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]
        assert tok.encode(text) == expected and all(type(t) is int for t in tok.encode(text))
    messages = [{"role": "system", "content": texts[10]}, {"role": "user", "content": texts[11]}]
    rendered = tok.render_chat(messages)
    assert list(tok.render_chat_tokens(messages).ids) == rendered
