"""The Anthropic Messages API (``POST /v1/messages``) read as the chat request vLLM renders.

vLLM 0.32 serves it by converting the request to a chat completion
(``vllm/entrypoints/anthropic/serving.py``: ``to_chat_completion_request``), and so does
``messages_prompt``: ``system`` (a string or text blocks, Claude Code's
``x-anthropic-billing-header`` block left out, as vLLM strips it) one leading system message;
text blocks the content, ``thinking`` blocks the reasoning, ``tool_use`` blocks tool calls
(arguments as ``json.dumps`` writes them), a user's ``tool_result`` blocks tool messages placed
before that user's message; inline system messages merged into the leading one when the chat
template refuses a system message after the first (``merges_inline_system``); tools with their
``input_schema`` as parameters. Usage and streams: ``prompts/responses.py``.
"""

from __future__ import annotations

import json
import time

from prefix_router.prompts.responses import FIELDS, chat_body
from prefix_router.prompts.analysis import check_fields, check_messages, kind

__all__ = ["check_messages_body", "merges_inline_system", "messages_prompt"]

_BILLING = "x-anthropic-billing-header"  # Claude Code's per-request header block, skipped by vLLM


def check_messages_body(body: dict) -> tuple[str, str] | None:
    """(message, param) for a Messages body whose fields the gateway reads have the wrong shape
    (``messages`` a non-empty list of objects with a string ``role``, ``system`` a string or a
    list, as ``AnthropicMessagesRequest`` requires), else None."""
    problem = check_fields(body, FIELDS) or check_messages(body.get("messages"))
    if problem is not None:
        return problem
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        return f"'system' must be a string or a list of text blocks, got {kind(system)}", "system"
    return None


def merges_inline_system(template: str | None) -> bool:
    """Whether vLLM merges a Messages request's inline system messages into the leading one for
    this chat template: it does when the template fails to render [system, user, system, user]
    (Qwen's ``loop.first`` guard) or there is none (``_detect_merge_inline_system``)."""
    if not template:
        return True
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    turns = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    try:
        env.from_string(template).render(messages=turns, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def _system_text(content) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(_BILLING) else content
    if not isinstance(content, list):  # vLLM refuses it; the gateway only routes it
        return None
    parts = [b["text"] for b in content if isinstance(b, dict) and b.get("type") == "text"
             and isinstance(b.get("text"), str) and b["text"] and not b["text"].startswith(_BILLING)]
    return "".join(parts) if parts else None


def messages_prompt(body: dict, merge_inline_system: bool = False) -> dict:
    """The chat body vLLM renders for an Anthropic Messages request (module docstring).
    ``merge_inline_system``: the chat template refuses a system message after the first, so
    vLLM merges every one into the leading system message."""
    messages: list[dict] = []
    system = body.get("system")
    parts: list[str] = []
    if isinstance(system, str) and system:
        parts.append(system)
    elif isinstance(system, list):
        parts += [b["text"] for b in system if isinstance(b, dict) and b.get("type") == "text"
                  and isinstance(b.get("text"), str) and b["text"] and not b["text"].startswith(_BILLING)]
    source = body.get("messages") if isinstance(body.get("messages"), list) else []
    if merge_inline_system:
        parts += [t for m in source if isinstance(m, dict) and m.get("role") == "system"
                  and (t := _system_text(m.get("content")))]
    if parts:
        messages.append({"role": "system", "content": "".join(parts)})
    for m in source:
        if not isinstance(m, dict):
            continue
        role, content = m.get("role"), m.get("content")
        if role == "system":
            text = None if merge_inline_system else _system_text(content)
            if text:
                messages.append({"role": "system", "content": text})
            continue
        message: dict = {"role": role}
        if isinstance(content, str):
            message["content"] = content
        elif isinstance(content, list):
            _blocks(content, role, message, messages)
        if not (role == "user" and "content" not in message):
            messages.append(message)
    kwargs = dict(body["chat_template_kwargs"]) if isinstance(body.get("chat_template_kwargs"), dict) else {}
    return chat_body(body, messages, _anthropic_tools(body), kwargs)


def _blocks(blocks: list, role, message: dict, messages: list[dict]) -> None:
    """``_convert_message_content``: one Anthropic message's content blocks into ``message``
    (a user's tool results go to ``messages`` as tool messages first)."""
    parts: list[dict] = []
    calls: list[dict] = []
    reasoning: list[str] = []
    for block in blocks:
        if not isinstance(block, dict):
            continue
        block_type = block.get("type")
        if block_type == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif block_type == "image" and isinstance(block.get("source"), dict):
            source = block["source"]
            url = source.get("url", "") if source.get("type") == "url" else \
                f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif block_type == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif block_type == "tool_use":
            calls.append({"id": block.get("id") or f"call_{int(time.time())}", "type": "function",
                          "function": {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}})
        elif block_type == "tool_result":
            result = block.get("content")
            if role != "user":
                parts.append({"type": "text", "text": f"Tool result: {str(result) if result else ''}"})
                continue
            if isinstance(result, list):
                result = "\n".join(i["text"] for i in result if isinstance(i, dict) and i.get("type") == "text"
                                   and isinstance(i.get("text"), str))
            messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                             "content": result if isinstance(result, str) else ""})
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    if parts:
        message["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts


def _anthropic_tools(body: dict) -> list[dict] | None:
    """``_convert_tools``: each tool with its ``input_schema`` as the function's parameters."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        function = {"name": tool.get("name"), "description": tool.get("description"),
                    "parameters": tool.get("input_schema")}
        for key in ("strict", "defer_loading"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out
