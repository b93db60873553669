"""OpenAI chat messages and tools as vLLM 0.32 hands them to a chat template, and the template
compiled once.

``normalize_messages`` and ``normalize_tools`` follow ``vllm/renderers/chat_utils.py`` (content
as one string, assistant ``tool_calls`` arguments parsed from JSON) and
``ChatCompletionToolsParam.model_dump`` (tool field order, nulls kept); ``compiled_template`` and
``template_messages`` give transformers' own compiled Jinja template and the messages as its
``render_jinja_template`` passes them, so that ``tokenizer.HFTokenizer`` renders without
``apply_chat_template``'s per-call work (``tests/prompts/test_chat_template.py`` holds the two equal).

Errors: ``ChatFormatError`` (a ValueError) for messages or tools that cannot be rendered.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["TEMPLATE_ARGS", "ChatFormatError", "compiled_template", "normalize_messages", "normalize_tools",
           "template_messages"]


class ChatFormatError(ValueError):
    """Messages or tools that cannot be rendered; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# content parts read as text (vllm/renderers/chat_utils.py: TEXT_PART_TYPES less refusal and
# thinking, whose text is not under "text"); the Responses API sends input_text and output_text
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None  # a list or object type is not hashable
            if not isinstance(kind, str) or kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{where}.content[{i}] must be a text part "
                                      '({"type": "text", "text": "..."})', f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatFormatError(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def normalize_messages(messages: Any) -> list[dict]:
    """OpenAI chat messages as vLLM hands them to the chat template.

    Raises ChatFormatError for a non-list, an empty list, or a malformed message.
    """
    if not isinstance(messages, list):
        raise ChatFormatError("messages must be a list", "messages")
    if not messages:
        raise ChatFormatError("Cannot apply chat template to an empty conversation. "
                              "Provide at least one message.", "messages")
    out: list[dict] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatFormatError(f"{where} must be an object with a string role", where)
        role = message["role"]
        item: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"), where)}
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise ChatFormatError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            parsed = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise ChatFormatError("assistant tool_calls entries must be objects with a "
                                          "function name", "tool_calls")
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments) if arguments else {}
                    except json.JSONDecodeError:
                        raise ChatFormatError(f"{where}.tool_calls: arguments are not valid JSON",
                                              "tool_calls") from None
                parsed.append({**call, "function": {**function, "arguments": arguments}})
            item["tool_calls"] = parsed
        if role == "tool" and "tool_call_id" in message:
            item["tool_call_id"] = message["tool_call_id"]
        if "name" in message:
            item["name"] = message["name"]
        out.append(item)
    return out


def normalize_tools(tools: Any) -> list[dict] | None:
    """OpenAI tools as vLLM passes them to the template (``model_dump`` field order, nulls kept)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatFormatError("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatFormatError(f"tools[{i}] must have a function with a string name", "tools")
        fn: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        for key in ("strict", "defer_loading"):  # FunctionDefinition drops them when None
            if function.get(key) is not None:
                fn[key] = function[key]
        out.append({"type": "function", "function": fn})
    return out


# render_jinja_template's own arguments: kwargs naming one of them take apply_chat_template's path
TEMPLATE_ARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "chat_template",
                           "continue_final_message", "return_assistant_tokens_mask", "conversations"})

# transformers' chat_template_utils: a message's reasoning under any of these names is given to
# the template under the first two
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_messages(conversation: list[dict]) -> list[dict]:
    """``normalize_messages``' output as ``render_jinja_template`` hands it to the template:
    null fields dropped, reasoning aliased as ``thinking`` and ``reasoning_content``."""
    chat = []
    for message in conversation:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def compiled_template(tok: Any) -> tuple[Any, dict]:
    """(transformers' compiled Jinja template of ``tok``, the special tokens it renders with), or
    (None, {}) where the fast path does not apply: no single template string (a dict of named
    templates picks one per call), or a transformers without ``_compile_jinja_template``."""
    template = getattr(tok, "chat_template", None)
    if not isinstance(template, str):
        return None, {}
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None, {}
    env = _compile_jinja_template(template).environment  # transformers' sandbox, filters, globals
    fast = object.__new__(_dict_first(type(env)))
    fast.__dict__.update(env.__dict__)  # as jinja2's Environment.overlay copies one
    return fast.from_string(template), dict(tok.special_tokens_map)


_DICT_ATTRIBUTES = frozenset(dir(dict))


def _dict_first(sandbox: type) -> type:
    """``sandbox`` (jinja2's sandboxed environment class that transformers renders in) with
    ``message.role`` on a plain dict read as the item at once. The sandbox first asks the dict
    for an attribute of that name and catches the AttributeError, for every field a template
    reads (a third of the rendering time, measured with py-spy); a plain dict has no attributes
    but its class's, so the result is the same: a name of ``dict``'s own still goes through
    the sandbox."""

    class DictFirst(sandbox):
        def getattr(self, obj, attribute):
            if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
                try:
                    return obj[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
            return super().getattr(obj, attribute)

    return DictFirst
