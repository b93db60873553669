"""The compiled chat template (``prefix_router/prompts/chat_template.py``) renders what
transformers' ``apply_chat_template`` renders: the tiny model's template, one reading what the
tiny one does not, and two real model families' (``tests/data/templates``), under random
messages, tool calls, tools and template kwargs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..helpers import TEMPLATES, with_template
from .test_tokenizer import reference_ids, texts, tokenizer, tokenizer_dir, tool_lists  # noqa: F401 (fixtures)


# a template reading what the tiny one does not: a special token, a message's name, a kwarg,
# reasoning, tool call ids, a dict's own methods, a loop variable and a filter
OTHER_TEMPLATE = (
    "{{ bos_token or '' }}{%- for m in messages %}[{{ loop.index }}:{{ m.role }}"
    "{%- if m.name is defined %}({{ m.name }}){%- endif %}{{ m.keys() | list | length }}{{ m.get('nope', '') }}]"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{%- endif %}"
    "{{ m.content | trim }}{%- for c in m.tool_calls or [] %}{{ c.id }}={{ c.function | tojson }}{%- endfor %}"
    "{%- if m.tool_call_id is defined %}#{{ m.tool_call_id }}{%- endif %}<|im_end|>{%- endfor %}"
    "{%- if tools %}{{ tools | length }} tools{%- endif %}"
    "{%- if style is defined %}style={{ style }}{%- endif %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{%- endif %}"
)


@pytest.fixture(scope="module")
def other_tokenizers(tokenizer_dir, tmp_path_factory):
    """The tiny tokenizer with ``OTHER_TEMPLATE``, then with each of ``TEMPLATES``."""
    assert len(TEMPLATES) >= 2
    toks = [with_template(tokenizer_dir, tmp_path_factory.mktemp("other-template"), OTHER_TEMPLATE)]
    for path in TEMPLATES:
        toks.append(with_template(tokenizer_dir, tmp_path_factory.mktemp(path.stem), path.read_text()))
    return toks


names = st.none() | st.from_regex(r"[a-z]{1,6}", fullmatch=True)


calls = st.lists(st.builds(lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}},
                           st.from_regex(r"call_[0-9]{1,3}", fullmatch=True), st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
                           st.sampled_from(['{"x": 1}', "", '{"q": "a\\"b", "n": [1, 2]}', '{"e": null}'])), max_size=2)


messages_st = st.lists(
    st.one_of(st.builds(lambda r, c, n: {"role": r, "content": c, "name": n}, st.sampled_from(["system", "user"]), texts, names),
              st.builds(lambda c, k: {"role": "assistant", "content": c, "tool_calls": k}, st.none() | texts, calls),
              st.builds(lambda c, i: {"role": "tool", "content": c, "tool_call_id": i}, texts, st.none() | st.just("call_1"))),
    min_size=1, max_size=6)


kwargs_st = st.none() | st.fixed_dictionaries({"style": st.sampled_from(["terse", "long"])})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=messages_st, tools=tool_lists, kwargs=kwargs_st, generation=st.booleans())
def test_the_compiled_template_renders_what_apply_chat_template_renders(tokenizer, other_tokenizers, messages, tools,
                                                                         kwargs, generation):
    from prefix_router.prompts.tokenizer import normalize_messages, normalize_tools

    for tok in (tokenizer, *other_tokenizers):
        assert tok._template is not None  # the fast path is the one under test
        conversation = normalize_messages(messages)
        expected = tok._tok.apply_chat_template(conversation, tools=normalize_tools(tools), tokenize=False,
                                                add_generation_prompt=generation, **(kwargs or {}))
        assert tok._render(conversation, normalize_tools(tools), generation, dict(kwargs or {})) == expected
        assert tok.render_chat(messages, tools=tools, add_generation_prompt=generation,
                               chat_template_kwargs=kwargs) == reference_ids(tok, expected)
