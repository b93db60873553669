"""What the simulated replica answers, in the shapes of vLLM 0.32's three generation APIs.

``Answer`` writes one request's answer, whole (``body``) or as SSE (``chunk``, ``end``), for
``/v1/completions``, ``/v1/chat/completions`` (``n`` sequences: one choice each, ``index`` as
vLLM numbers them) and ``/v1/responses`` (one sequence; events as vLLM's
``OpenAIServingResponses.responses_stream_generator`` sends them for plain text: ``created``,
``in_progress``, the output item and content part opened, ``output_text.delta`` per write, then
closed, and ``completed`` with the usage). Chat and completion bodies and events were copied from
a running vLLM CPU replica; a finished prefill leg's ``kv_transfer_params`` go at the top level of
the body, as vLLM puts them.
"""

from __future__ import annotations

import json
import time

from prefix_router.tools.sim.scheduler import SimRequest

__all__ = ["Answer", "usage_of"]

COMPLETION, CHAT, RESPONSES = "completion", "chat", "responses"


def usage_of(children: list[SimRequest], cached: int | None = None) -> dict:
    """The chat and completion APIs' usage of a request's sequences: the prompt counted once,
    the outputs summed, the cache hit of the first (vLLM reports the parent's), or ``cached``
    where given (a decode leg reports its prefill's hit: ``remote_prefill_cached_tokens``, as
    vLLM 0.32's ``OutputProcessor`` does)."""
    first = children[0]
    out = sum(c.num_output_tokens for c in children)
    hit = first.num_cached_tokens or 0 if cached is None else cached
    return {"prompt_tokens": first.num_prompt_tokens, "total_tokens": first.num_prompt_tokens + out,
            "completion_tokens": out, "prompt_tokens_details": {"cached_tokens": hit}}


def _responses_usage(children: list[SimRequest], cached: int | None = None) -> dict:
    u = usage_of(children, cached)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens":
            u["prompt_tokens_details"]["cached_tokens"]}, "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u["total_tokens"]}


class Answer:
    """One request's answer in the API ``kind`` (``completion``, ``chat``, ``responses``), its
    usage reporting ``cached`` prompt tokens as cached where given."""

    def __init__(self, kind: str, rid: str, model: str, include_usage: bool, cached: int | None = None) -> None:
        self.kind, self.rid, self.model, self.include_usage = kind, rid, model, include_usage
        self.cached = cached  # the cache hit to report in place of the engine's (``usage_of``)
        self.created = int(time.time())
        self.item = "msg_" + rid.split("-", 1)[-1]
        self.sequence = 0  # Responses events are numbered
        self.opened: set[int] = set()  # sequences whose first event went out
        self.text = ""  # a Responses stream's text so far, for its closing events

    # -- whole ----------------------------------------------------------------------------
    def body(self, children: list[SimRequest], texts: list[str], transfer: dict | None) -> dict:
        """The answer in one body; ``texts``: each sequence's output text."""
        if self.kind == RESPONSES:
            out = self.response(children, texts[0], "completed")
        else:
            obj = "chat.completion" if self.kind == CHAT else "text_completion"
            choices = [self._choice(i, c, t) for i, (c, t) in enumerate(zip(children, texts))]
            out = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                   "usage": usage_of(children, self.cached)}
        if transfer is not None:
            out["kv_transfer_params"] = transfer
        return out

    def _choice(self, index: int, child: SimRequest, text: str) -> dict:
        if self.kind == CHAT:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": child.finish_reason, "stop_reason": None}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": child.finish_reason,
                "stop_reason": None}

    def response(self, children: list[SimRequest] | None, text: str, status: str) -> dict:
        """A Responses ``response`` object (no usage while in progress)."""
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}]
        output = [{"id": self.item, "type": "message", "role": "assistant", "status": status,
                   "content": content}] if status == "completed" else []
        return {"id": self.rid, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "usage": _responses_usage(children, self.cached) if children else None}

    # -- streamed -------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> str:
        self.sequence += 1
        data = json.dumps({"type": kind, "sequence_number": self.sequence - 1, **fields}, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"

    def chunk(self, index: int, text: str, finish_reason: str | None, own_ttft_s: float | None,
              modelled_ttft_s: float | None = None) -> str:
        """The events for sequence ``index``'s new ``text`` (its ``finish_reason`` when it ended);
        ``own_ttft_s`` and ``modelled_ttft_s``: the replica's own time to the first token, wall and
        modelled seconds, on the first event with tokens (``sim_ttft_s`` and
        ``sim_modelled_ttft_s``, see ``server.py``)."""
        own = _own(own_ttft_s, modelled_ttft_s)
        if self.kind == RESPONSES:
            return self._responses_chunk(text, own)
        head = {"id": self.rid, "object": "chat.completion.chunk" if self.kind == CHAT else "text_completion",
                "created": self.created, "model": self.model}
        out = ""
        reason = finish_reason
        if self.kind == CHAT:
            if index not in self.opened:  # vLLM's role chunk comes with the first output, after the prefill
                out += _data({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]})
            choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
        self.opened.add(index)
        return out + _data({**head, "choices": [choice], **own})

    def _responses_chunk(self, text: str, own: dict) -> str:
        out = ""
        if not self.opened:
            self.opened.add(0)
            out += self._event("response.output_item.added", output_index=0, item={
                "id": self.item, "type": "message", "role": "assistant", "status": "in_progress", "content": []})
            out += self._event("response.content_part.added", item_id=self.item, output_index=0, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        if text:
            self.text += text
            out += self._event("response.output_text.delta", item_id=self.item, output_index=0, content_index=0,
                               delta=text, logprobs=[], **own)
        return out

    def start(self) -> str:
        """What a stream sends before any token: a Responses stream's ``created`` and
        ``in_progress`` events; nothing for the other APIs (their first event has tokens)."""
        if self.kind != RESPONSES:
            return ""
        return (self._event("response.created", response=self.response(None, "", "in_progress"))
                + self._event("response.in_progress", response=self.response(None, "", "in_progress")))

    def end(self, children: list[SimRequest]) -> str:
        """What ends a stream: the usage event when asked (chat, completions), ``[DONE]``; a
        Responses stream's closing events and ``response.completed`` with the usage."""
        if self.kind == RESPONSES:
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            return (self._event("response.output_text.done", item_id=self.item, output_index=0, content_index=0,
                                text=self.text, logprobs=[])
                    + self._event("response.content_part.done", item_id=self.item, output_index=0, content_index=0,
                                  part=part)
                    + self._event("response.output_item.done", output_index=0, item={
                        "id": self.item, "type": "message", "role": "assistant", "status": "completed",
                        "content": [part]})
                    + self._event("response.completed", response=self.response(children, self.text, "completed")))
        out = ""
        if self.include_usage:
            obj = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
            out += _data({"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                          "choices": [], "usage": usage_of(children, self.cached)})
        return out + "data: [DONE]\n\n"


def _own(own_ttft_s: float | None, modelled_ttft_s: float | None) -> dict:
    """The simulator's own fields of a first event with tokens (none on the others)."""
    out = {}
    if own_ttft_s is not None:
        out["sim_ttft_s"] = round(own_ttft_s, 6)
    if modelled_ttft_s is not None:
        out["sim_modelled_ttft_s"] = round(modelled_ttft_s, 6)
    return out


def _data(event: dict) -> str:
    return "data: " + json.dumps(event, separators=(",", ":")) + "\n\n"
