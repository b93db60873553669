"""What the replayer sends: ``ReplayRequest``, which every workload loader returns
(``workloads.py``) and the built-in generator makes (``generate.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CHAT", "COMPLETIONS", "ReplayRequest"]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(slots=True)
class ReplayRequest:
    """One request to send: ``path`` and the body without ``model`` and ``stream``."""

    path: str
    body: dict
    at_s: float = 0.0  # send time (or session start), modelled seconds from the replay's start
    session: str | None = None  # turns of one session go out one after another
    turn: int = 0
    think_s: float = 0.0  # wait after the previous turn's response, modelled seconds
    meta: dict = field(default_factory=dict)  # e.g. the Mooncake hash_ids, for offline checks
