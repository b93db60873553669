"""Anthropic Messages read as the chat request vLLM renders for them
(``prefix_router/prompts/anthropic.py``): system blocks, tool use and tool results, and inline
system messages merged only where the model's template refuses them. Through the gateway:
``tests/e2e/test_dialects.py``; against vLLM's own render endpoint:
``tests/vllm_tier/test_apis_and_adapters_vllm.py``."""

from __future__ import annotations

import json

from prefix_router.prompts.anthropic import merges_inline_system, messages_prompt
from prefix_router.tools.tiny_model import CHAT_TEMPLATE


def test_messages_system_blocks_tool_use_and_tool_results_become_chat_messages():
    body = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cch=0f3a"},
                       {"type": "text", "text": "You are an agent."}],
            "messages": [{"role": "user", "content": "fix it"},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"},
                                                           {"type": "tool_use", "id": "t1", "name": "bash",
                                                            "input": {"cmd": "ls"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"},
                                                      {"type": "text", "text": "go on"}]}],
            "tools": [{"name": "bash", "description": "run", "input_schema": {"type": "object"}}]}
    chat = messages_prompt(body)
    assert chat["messages"][0] == {"role": "system", "content": "You are an agent."}  # the billing block left out
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "user"]
    call = chat["messages"][2]["tool_calls"][0]
    assert call["id"] == "t1" and json.loads(call["function"]["arguments"]) == {"cmd": "ls"}
    assert chat["messages"][2]["reasoning"] == "hm"
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "a.py"}
    assert chat["tools"] == [{"type": "function", "function": {"name": "bash", "description": "run",
                                                               "parameters": {"type": "object"}}}]


def test_inline_system_messages_are_merged_only_where_the_template_refuses_them():
    body = {"system": "S.", "messages": [{"role": "user", "content": "q"}, {"role": "system", "content": " R."},
                                         {"role": "user", "content": "q2"}]}
    assert [m["role"] for m in messages_prompt(body)["messages"]] == ["system", "user", "system", "user"]
    merged = messages_prompt(body, merge_inline_system=True)["messages"]
    assert merged[0] == {"role": "system", "content": "S. R."} and len(merged) == 3
    first_only = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                  "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
                  "{{ m.content }}{% endfor %}")
    assert merges_inline_system(first_only) is True
    assert merges_inline_system(CHAT_TEMPLATE) is False  # the tiny model's takes a system message anywhere
    assert merges_inline_system(None) is True
