"""``prefix-router audit FILE``: why did my cache miss? Read a log of requests, find every place
a client rewrote text it had sent before, and say what each cost and how to fix it.

Input: a request log (``replay/workloads.load_request_log``): OpenAI request bodies one a line,
optionally with a ``session`` field, or the gateway's request log written with
``request_log_bodies: true``. Requests are taken in the order they were answered (their lines'
``t``), else in file order, and grouped into conversations, each named in the report
(``_Conversations``), by the first of:

- the line's ``session`` (or ``session_id``) field, or the gateway log's ``conversation`` (the
  gateway's session key, from ``X-Session-ID`` or the like, kept out of its log as a 16-hex-digit
  tag, so named by that tag): named by it;
- the body's OpenAI ``user`` (else Anthropic's ``metadata.user_id``), which the gateway keys a
  session by when no header names one (``serve/inbound._session_key``), also where the gateway
  log's tag is of that key: named ``user:<user>``, and split by first user message
  (``user:<user> #2`` for the second), because ``user`` names an end user, not a conversation
  (OpenAI: "a unique identifier representing your end-user"), and a user's new chat is no break
  of the last one (the gateway keeps one user on one replica, which is right for routing);
- nothing: model, cache salt and first user message, as the gateway groups them
  (``analysis.conversation_id``), named by that hash (``u:`` and a 64-bit number); a completion
  without a session or ``user`` is a conversation of its own, named ``#<line>``.

No prompt text is printed: names are what the client sent as ids, or hashes.

For each request, with one prefix cache of unbounded size in front of everything before it
(the best APC could do; a real KV cache evicts and a router may split conversations, so real
figures are lower):

- reused now: the longest prefix, in whole blocks, that an earlier request already computed;
- a break: the request departs from its conversation's previous request inside what that one
  sent (``diagnosis.diagnose``: cause, message index, role, token position and the fix);
- reused if fixed: for a break, what the request would reuse had it appended to the previous
  request instead (the previous request's blocks, at most this one's reusable blocks).

Tokens are exact with ``--tokenizer`` (the served model's folder: chat templates rendered as
vLLM renders them); otherwise estimated as 4 characters a token (OpenAI's rule of thumb for
English text) from 64-character blocks. Output: a text report, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

from prefix_router.cache.blocks import BlockHash
from prefix_router.misses.diagnosis import FIXES, Cause, RequestPrint, explain, fingerprint
from prefix_router.constants import CHAR_BLOCK_SIZE, VLLM_BLOCK_SIZE
from prefix_router.misses.classify import TAIL_BLOCKS
from prefix_router.misses.request_log import conversation_tag
from prefix_router.prompts.analysis import analyze, conversation_id
from prefix_router.tools.replay.workloads import CHAT, ReplayRequest, load_request_log

__all__ = ["Break", "ConversationReport", "audit", "add_parser"]

CHARS_PER_TOKEN = 4  # without a tokenizer: OpenAI's rule of thumb for English text


@dataclass(slots=True)
class Break:
    """One request that rewrote its conversation's prefix."""

    line: int  # in the input file, 1-based
    turn: int  # the request's place in its conversation, from 0
    cause: Cause
    message_index: int  # -1: the tool list
    role: str
    token_position: int  # tokens before the first changed block
    detail: str
    lost_tokens: int  # reused if fixed minus reused now

    def as_dict(self) -> dict:
        return {"line": self.line, "turn": self.turn, "cause": self.cause.value,
                "message_index": self.message_index, "role": self.role, "token_position": self.token_position,
                "detail": self.detail, "lost_tokens": self.lost_tokens, "fix": FIXES[self.cause]}


@dataclass(slots=True)
class ConversationReport:
    """One conversation's requests and breaks; token counts summed over its requests."""

    id: str  # the name: a session id, ``user:<user>``, or a hash where the client sent neither
    grouped_by: str  # "session", "user", or "prompt" (model, salt and first user message)
    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    reused_if_fixed: int = 0
    breaks: list[Break] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"id": self.id, "grouped_by": self.grouped_by, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "reused_tokens": self.reused_tokens, "reused_if_fixed": self.reused_if_fixed,
                "breaks": [b.as_dict() for b in self.breaks]}


def _leading(hashes: list[BlockHash], known) -> int:
    n = 0
    for h in hashes:
        if h not in known:
            break
        n += 1
    return n


def _user(body: dict) -> str | None:
    """The body's OpenAI ``user``, else Anthropic's ``metadata.user_id``, as the gateway reads it
    for a session key (``serve/inbound._session_key``): a non-empty string, at most 256 characters."""
    user = body.get("user")
    metadata = body.get("metadata")
    if user is None and isinstance(metadata, dict):
        user = metadata.get("user_id")
    return user[:256] if isinstance(user, str) and user else None


class _Conversations:
    """Which conversation a request belongs to, and its name (the module docstring's rules)."""

    def __init__(self) -> None:
        self.names: dict[tuple, str] = {}  # grouping key -> name, in order of first request
        self.per_user: dict[str, int] = {}  # conversations named so far for each ``user``

    def of(self, request: ReplayRequest) -> tuple[tuple, str]:
        """(grouping key, name) of ``request``; its ``session`` is the line's, else the loader's
        hash (``load_request_log``), which counts as none here."""
        body, line = request.body, request.meta["line"]
        hashed = conversation_id(body, None)  # "" for a completion
        session = request.session if request.session not in (hashed, f"#{line}") else None
        user = _user(body)
        # a gateway log's tag of the ``user`` key or of the hash: the client sent no session id
        tags = {conversation_tag(hashed)}  # the tags the gateway logs for a client that sent no session id
        if user:  # the ``user`` key: whole (earlier releases), or with the chat's opening
            tags |= {conversation_tag(f"user:{user}"), conversation_tag(conversation_id(body, f"user:{user}", True))}
        if session is not None and session not in tags:
            key, name = ("session", session), session
        elif user is not None:
            key = ("user", user, hashed)  # a completion has no first user message: one per user
            if key not in self.names:
                count = self.per_user[user] = self.per_user.get(user, 0) + 1
                self.names[key] = f"user:{user}" + (f" #{count}" if count > 1 else "")
            return key, self.names[key]
        else:
            name = hashed or f"#{line}"
            key = ("prompt", name)
        return key, self.names.setdefault(key, name)


def audit(path: str, tokenizer=None, block_size: int = VLLM_BLOCK_SIZE) -> dict:
    """Audit the request log at ``path`` (see the module docstring); returns the JSON report:
    ``unit`` ("tokens" or "estimated tokens"), ``totals``, ``by_cause`` and ``conversations``.

    Raises ``OSError`` when the file cannot be read and ``ValueError`` when it holds no request.
    """
    requests = load_request_log(path)
    exact = tokenizer is not None
    per_unit = 1 if exact else CHARS_PER_TOKEN  # units (tokens or characters) per token
    seen: set[BlockHash] = set()  # every block computed so far: an unbounded prefix cache
    last: dict[tuple, tuple[list[BlockHash], RequestPrint]] = {}
    reports: dict[tuple, ConversationReport] = {}
    conversations = _Conversations()
    for request in requests:
        key, name = conversations.of(request)
        chat = request.path == CHAT
        info = analyze(request.body, chat, tokenizer, block_size, CHAR_BLOCK_SIZE, request.session)
        unit = block_size if info.exact else CHAR_BLOCK_SIZE
        reusable = max((info.num_units - 1) // unit, 0)  # vLLM never serves the last token from cache
        now = min(_leading(info.hashes, seen), reusable)
        fixed = now
        report = reports.setdefault(key, ConversationReport(name, key[0]))
        previous = last.get(key)
        printed = fingerprint(request.body, previous[1] if previous else None)
        if previous is not None:
            shared = _leading(info.hashes, set(previous[0]))
            if shared < min(len(previous[0]), reusable) - TAIL_BLOCKS:  # departs inside what the previous request sent
                fixed = max(now, min(len(previous[0]), reusable))
                change = explain(previous[1], printed, None)
                report.breaks.append(Break(request.meta["line"], report.requests, change.cause, change.message_index,
                                           change.role, shared * unit // per_unit, change.detail,
                                           (fixed - now) * unit // per_unit))
        seen.update(info.hashes)
        last[key] = (info.hashes, printed)
        report.requests += 1
        report.prompt_tokens += info.num_units // per_unit
        report.reused_tokens += now * unit // per_unit
        report.reused_if_fixed += fixed * unit // per_unit
    by_cause = {cause.value: {"breaks": 0, "lost_tokens": 0, "fix": FIXES[cause]} for cause in Cause}
    for report in reports.values():
        for b in report.breaks:
            by_cause[b.cause.value]["breaks"] += 1
            by_cause[b.cause.value]["lost_tokens"] += b.lost_tokens
    totals = {key: sum(getattr(r, key) for r in reports.values())
              for key in ("requests", "prompt_tokens", "reused_tokens", "reused_if_fixed")}
    totals["conversations"] = len(reports)
    totals["breaks"] = sum(len(r.breaks) for r in reports.values())
    return {"file": str(path), "unit": "tokens" if exact else "estimated tokens", "totals": totals,
            "by_cause": {k: v for k, v in by_cause.items() if v["breaks"]},
            "conversations": [r.as_dict() for r in reports.values()]}


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _shown(text: object) -> str:
    """A client's string (session id, user, role, tool name) for a terminal: each character that
    is not printable (a newline that would forge a report line, an ANSI escape that would recolour
    or clear the screen, a bidi override) as its Python escape, ``\\n``, ``\\x1b``, ``\\u202e``."""
    text = str(text)
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def format_report(report: dict) -> str:
    """The JSON report as text: totals, then each conversation with breaks, then causes; the
    clients' strings through ``_shown``."""
    t, unit = report["totals"], report["unit"]
    about = "~" if unit != "tokens" else ""  # estimated: 4 characters a token
    lines = [f"{report['file']}: {t['requests']} requests in {t['conversations']} conversations, "
             f"{about}{t['prompt_tokens']:,} prompt tokens" + (" (estimated at 4 characters a token; --tokenizer DIR "
                                                               "for exact counts)" if about else ""),
             f"reused now:              {t['reused_tokens']:>12,} ({_share(t['reused_tokens'], t['prompt_tokens'])})",
             f"reused if breaks fixed:  {t['reused_if_fixed']:>12,} ({_share(t['reused_if_fixed'], t['prompt_tokens'])})",
             f"breaks: {t['breaks']}", ""]
    for c in report["conversations"]:
        if not c["breaks"]:
            continue
        lines.append(f"conversation {_shown(c['id'])}: {c['requests']} requests, reused {_share(c['reused_tokens'], c['prompt_tokens'])}"
                     f" now, {_share(c['reused_if_fixed'], c['prompt_tokens'])} if fixed")
        for b in c["breaks"]:
            where = "the tool list" if b["message_index"] == -1 else f"message {b['message_index']} ({_shown(b['role'])})"
            lines.append(f"  line {b['line']} (turn {b['turn']}): {b['cause']} at {where}, token {about}{b['token_position']:,}: "
                         f"{_shown(b['detail'])}; {about}{b['lost_tokens']:,} tokens lost")
        lines.append("")
    if report["by_cause"]:
        lines.append("by cause:")
        for cause, v in sorted(report["by_cause"].items(), key=lambda kv: -kv[1]["lost_tokens"]):
            lines.append(f"  {cause:<24} {v['breaks']:>5} breaks {about + format(v['lost_tokens'], ','):>12} tokens lost")
            lines.append(f"    fix: {v['fix']}")
    else:
        lines.append("no breaks: every request appends to its conversation's previous one")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="find where clients rewrote their prompt prefixes, what it cost, and the fix",
                       description="Read a JSONL log of OpenAI request bodies (or the gateway's request log "
                                   "written with request_log_bodies) and report, per conversation and in total, "
                                   "reused tokens now and if every break were fixed, and each break's cause, "
                                   "position and fix.")
    p.add_argument("file", help="JSONL: one request body a line, or a gateway request log; conversations grouped "
                                "and named by a 'session' field, else the body's 'user' (split by first user "
                                "message), else a hash of the first user message")
    p.add_argument("--tokenizer", default=None,
                   help="the served model's tokenizer folder: exact tokens (default: 4 characters a token)")
    p.add_argument("--block-size", type=int, default=VLLM_BLOCK_SIZE, help="tokens per KV block (with --tokenizer)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    tokenizer = None
    if args.tokenizer:
        from prefix_router.prompts.tokenizer import HFTokenizer

        tokenizer = HFTokenizer(args.tokenizer)
    try:
        report = audit(args.file, tokenizer, args.block_size)
    except (OSError, ValueError) as exc:
        print(f"prefix-router audit: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0
