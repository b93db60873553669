"""The OpenAI Responses API read as the chat request vLLM renders, and the answers of both agent
APIs (Responses here, Anthropic Messages in ``anthropic.py``) read as a chat's.

vLLM serves both by turning the request into chat messages and tools and rendering them with the
model's chat template, exactly as for ``/v1/chat/completions``; their prompts are therefore as
cacheable, and as routable, as a chat's. ``responses_prompt`` (and ``anthropic.messages_prompt``)
build the chat body vLLM 0.32 builds: the gateway hashes its blocks, names its conversation and
explains its changes from it; the request itself is forwarded as the client sent it.

Responses (``vllm/entrypoints/openai/responses/utils.py``: ``construct_input_messages``,
``construct_chat_messages_with_tool_call``, ``construct_tool_dicts``; ``protocol.py``:
``input_item_parsing``, ``build_chat_params``): ``instructions`` a system message; then, for a
``previous_response_id``, the stored messages of that response less their system messages and
its output messages as assistant turns (reasoning and tool calls of the output are not carried,
as in vLLM); then ``input``, a string (one user message) or items: messages as they are,
``function_call`` / ``custom_tool_call`` items as assistant tool calls (merged into the
assistant message before them), ``reasoning`` items as the assistant's reasoning,
``function_call_output`` items as tool messages. Function tools (namespaced ones flattened to
``namespace__name``, custom tools as a one-string function) become chat tools. A last input
message that is ``in_progress`` or ``incomplete`` is continued, not answered.

Answers: the usage of each API in the chat's shape (``chat_usage``), and a stream's usage, first
token and (Responses) output through ``Events``, which passes every byte as it came.
"""

from __future__ import annotations

import json

import orjson

from prefix_router.prompts.analysis import check_fields, kind
from prefix_router.fleet.response_homes import response_id_of_stream

__all__ = ["FIELDS", "MESSAGES", "RESPONSES", "Events", "chat_body", "chat_usage", "check_responses_body", "count",
           "output_messages", "responses_prompt"]

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
_CUSTOM_INPUT = "input"  # vllm/tool_parsers/utils.py: CUSTOM_TOOL_INPUT_KEY
_CUSTOM_PARAMETERS = {"type": "object", "properties": {_CUSTOM_INPUT: {
    "type": "string", "description": "The freeform text payload for this tool."}},
    "required": [_CUSTOM_INPUT], "additionalProperties": False}  # custom_tool_parameters()


# the fields both agent APIs share that the gateway reads, with the types vLLM requires
FIELDS = (("model", str, "a string"), ("cache_salt", str, "a string"), ("user", str, "a string"),
           ("stream", bool, "a boolean"), ("tools", list, "a list"))


def check_responses_body(body: dict) -> tuple[str, str] | None:
    """(message, param) for a Responses body whose fields the gateway reads have the wrong shape
    (``input`` a string or a list of objects, ``instructions`` and ``previous_response_id``
    strings, as ``ResponsesRequest`` requires), else None."""
    problem = check_fields(body, FIELDS)
    if problem is not None:
        return problem
    items = body.get("input")
    if not isinstance(items, str) and not (isinstance(items, list) and all(isinstance(i, dict) for i in items)):
        return f"'input' must be a string or a list of input items, got {kind(items)}", "input"
    return check_fields(body, (("instructions", str, "a string"), ("previous_response_id", str, "a string")))


def chat_body(body: dict, messages: list[dict], tools: list[dict] | None, kwargs: dict,
              continue_final: bool = False) -> dict:
    """A chat completion body with ``body``'s model and cache salt, these messages and tools,
    ``chat_template_kwargs`` and, for a last message to continue, the flags that say so."""
    chat = {"model": body.get("model"), "messages": messages}
    if tools:
        chat["tools"] = tools
    if isinstance(body.get("cache_salt"), str):
        chat["cache_salt"] = body["cache_salt"]
    if continue_final:
        chat["add_generation_prompt"], chat["continue_final_message"] = False, True
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    return chat


# -- Responses --------------------------------------------------------------------------------

def responses_prompt(body: dict, history: list[dict] | None = None) -> dict:
    """The chat body vLLM renders for a Responses request (module docstring). ``history``: the
    messages remembered for its ``previous_response_id`` (``output_messages``), or None."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if history:
        messages.extend(m for m in history if m.get("role") != "system")
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        continue_final = False
    else:
        items = items if isinstance(items, list) else []
        messages.extend(_items_as_messages(items))
        last = items[-1] if items else None
        continue_final = (isinstance(last, dict) and last.get("type", "message") in ("message", "reasoning")
                          and last.get("status") in ("in_progress", "incomplete"))
    kwargs = dict(body["chat_template_kwargs"]) if isinstance(body.get("chat_template_kwargs"), dict) else {}
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    return chat_body(body, messages, _responses_tools(body.get("tools")), kwargs, continue_final)


def _items_as_messages(items: list) -> list[dict]:
    """``construct_chat_messages_with_tool_call`` on items as ``input_item_parsing`` leaves them."""
    messages: list[dict] = []
    for item in items:
        if not isinstance(item, dict):
            continue
        item_type = item.get("type")
        prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        call = None
        if item_type == "function_call":
            name = item.get("name")
            if item.get("namespace"):
                name = f"{item['namespace']}__{name}"
            call = {"id": item.get("call_id"), "function": {"name": name, "arguments": item.get("arguments")},
                    "type": "function"}
        elif item_type == "custom_tool_call":
            arguments = json.dumps({_CUSTOM_INPUT: item.get("input") or ""}, ensure_ascii=False)
            call = {"id": item.get("call_id"), "function": {"name": item.get("name"), "arguments": arguments},
                    "type": "function"}
        if call is not None:
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
            continue
        if item_type == "reasoning":
            content, summary = item.get("content"), item.get("summary")
            source = content if content else summary
            text = source[0].get("text", "") if isinstance(source, list) and source and isinstance(source[0], dict) else ""
            if prev is not None and prev.get("reasoning") is None:
                prev["reasoning"] = text
            else:
                messages.append({"role": "assistant", "reasoning": text})
        elif item_type in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
        elif item.get("role") == "assistant":
            content = item.get("content")
            text = content if isinstance(content, str) else (
                content[0].get("text") if isinstance(content, list) and content and isinstance(content[0], dict) else None)
            if text is None:
                messages.append(dict(item))  # a copy: a later tool call may be merged into it
            elif prev is not None and prev.get("content") is None:
                prev["content"] = text
            else:
                messages.append({"role": "assistant", "content": text})
        elif "role" in item:
            messages.append(item)
    return messages


def _responses_tools(tools) -> list[dict] | None:
    """``construct_tool_dicts``: the function tools the model is shown, as chat tools."""
    if not isinstance(tools, list):
        return None
    out = []

    def add(tool: dict, name) -> None:
        function = {"name": name, "description": tool.get("description"), "parameters": tool.get("parameters")}
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        if tool.get("defer_loading") is not None:
            function["defer_loading"] = tool["defer_loading"]
        out.append({"type": "function", "function": function})

    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            continue
        if tool.get("type") == "function":
            add(tool, tool.get("name"))
        elif tool.get("type") == "custom":
            add({"description": tool.get("description"), "parameters": _CUSTOM_PARAMETERS}, tool.get("name"))
        elif tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            for inner in tool["tools"]:
                if isinstance(inner, dict) and inner.get("type") == "function" and isinstance(inner.get("name"), str):
                    add(inner, f"{tool.get('name')}__{inner.get('name')}")
    return out or None


def output_messages(response: dict) -> list[dict]:
    """A stored response's output as the next request sees it: each output message's text parts
    as assistant messages (``construct_input_messages``: reasoning and tool calls skipped)."""
    out = []
    output = response.get("output")
    for item in output if isinstance(output, list) else []:
        content = item.get("content") if isinstance(item, dict) and item.get("type") == "message" else None
        out += [{"role": "assistant", "content": part.get("text")} for part in content if isinstance(part, dict)
                and isinstance(part.get("text"), str)] if isinstance(content, list) else []
    return out


# -- answers ------------------------------------------------------------------------------------

def chat_usage(path: str, usage) -> dict | None:
    """An answer's usage in the chat's shape (``prompt_tokens``, ``completion_tokens``,
    ``prompt_tokens_details.cached_tokens``), or None. Responses: ``input_tokens``,
    ``input_tokens_details.cached_tokens``, ``output_tokens``. Messages (``_build_anthropic_usage``):
    the prompt is ``input_tokens + cache_read_input_tokens + cache_creation_input_tokens``."""
    if not isinstance(usage, dict):
        return None
    if path == RESPONSES:
        details = usage.get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return {"prompt_tokens": count(usage.get("input_tokens")), "completion_tokens": count(usage.get("output_tokens")),
                "prompt_tokens_details": {"cached_tokens": count(cached)}}
    if path == MESSAGES:
        cached = count(usage.get("cache_read_input_tokens"))
        prompt = count(usage.get("input_tokens")) + cached + count(usage.get("cache_creation_input_tokens"))
        return {"prompt_tokens": prompt, "completion_tokens": count(usage.get("output_tokens")),
                "prompt_tokens_details": {"cached_tokens": cached}}
    return usage


def count(value) -> int:
    """A token count from an engine's usage: a non-negative number, else 0 (an odd replica's
    answer must not break the gateway's accounting)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        return 0
    return int(min(value, 1 << 62))


class Events:
    """A Responses or Messages SSE stream (``path``), fed in chunks, passed on unchanged in whole
    lines (a line cut between chunks waits for its end), read on the way.

    Same interface as ``relay.UsageFilter``; ``error_event`` is the API's own error event. ``saw_data``: the first generated token's event has
    passed (an ``event:`` line of a Responses ``*.delta`` event or a Messages
    ``content_block_delta``), for the TTFT.
    ``usage``: the last usage seen in the API's own shape (Responses: ``response.completed``'s
    ``response.usage``; Messages: ``message_start``'s, then ``message_delta``'s). ``response``:
    the ``response`` object of ``response.completed``, its output included, and ``response_id``
    the id of ``response.created`` (Responses only: a stream cut short has the id, not the rest).
    """

    __slots__ = ("path", "usage", "saw_data", "response", "response_id", "_tail")

    def __init__(self, path: str) -> None:
        self.path = path
        self.usage: dict | None = None
        self.saw_data = False
        self.response: dict | None = None
        self.response_id: str | None = None
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines of what has come, unchanged; they are read on the way."""
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(b"\n") + 1
        self._tail = data[cut:]
        if cut and not self.saw_data and self.response_id is None:  # the id comes before any token
            self.response_id = response_id_of_stream(data[:cut])
        if cut and (b'"usage"' in data or not self.saw_data):
            self._read(data[:cut])
        return data[:cut]

    def flush(self) -> bytes:
        """The last line, if it had no newline, read and given back."""
        data, self._tail = self._tail, b""
        self._read(data)
        return data

    def error_event(self, message: str) -> bytes:
        """The API's error event for a stream the replica cut (Responses: an ``error`` event;
        Messages: Anthropic's ``error`` event, the one its SDKs raise on)."""
        if self.path == MESSAGES:
            event = {"type": "error", "error": {"type": "api_error", "message": message}}
        else:
            event = {"type": "error", "code": "bad_gateway", "message": message, "param": None}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"

    def _read(self, data: bytes) -> None:
        for line in data.split(b"\n"):
            line = line.rstrip(b"\r")
            if line.startswith(b"event: "):  # both APIs name each event: "event: response.output_text.delta"
                if not self.saw_data and (line.endswith(b".delta") or line == b"event: content_block_delta"):
                    self.saw_data = True
                continue
            if not line.startswith(b"data: {") or (b'"usage":{' not in line and b'"usage": {' not in line):
                continue  # vLLM writes compact JSON; a null usage (response.created) says nothing
            try:
                event = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                continue
            event_type = event.get("type") if isinstance(event, dict) else None
            if event_type == "response.completed" and isinstance(event.get("response"), dict):
                self.response = event["response"]
                self.usage = self.response.get("usage") or self.usage
            elif event_type == "message_start" and isinstance(event.get("message"), dict):
                usage = event["message"].get("usage")
                self.usage = usage if isinstance(usage, dict) else self.usage
            elif event_type == "message_delta" and isinstance(event.get("usage"), dict):
                self.usage = {**(self.usage if isinstance(self.usage, dict) else {}), **event["usage"]}
