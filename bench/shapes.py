"""Traffic shapes from other projects' benchmarks, generated for the replayer.

- ``generated_shared_prefix``: SGLang's ``bench_serving --dataset-name generated-shared-prefix``
  (``GeneratedSharedPrefixLoader``): ``groups`` system prompts of ``system_len`` random tokens,
  each followed by ``per_group`` questions of ``question_len`` random tokens, ``output_len``
  tokens out. Defaults are SGLang's (64 x 16, 2,048, 128, 256). The requests are shuffled, so a
  group's prompts arrive spread over the run, and sent as ``/v1/completions`` text prompts.
- ``one_system_prompt``: many short chat sessions that share one long system prompt (a
  product's assistant, a coding agent's instructions): the shape where prefix affinity must
  not send everything to one replica.

Prompts are ``token_text`` strings (4 characters a token id), so the simulator's byte
tokenizer reads exactly the token counts given, and every router, text-only ones included,
sees the same text. Arrivals are Poisson at ``rate`` requests (or sessions) per modelled second;
everything is seeded.
"""

from __future__ import annotations

import random

from prefix_router.tools.replay.workloads import CHAT, COMPLETIONS, ReplayRequest, token_text

__all__ = ["generated_shared_prefix", "one_system_prompt"]

_VOCAB = 32_000  # the Mooncake loader's; token_text takes ids below 2**24


def _tokens(rng: random.Random, n: int) -> str:
    return token_text(rng.randrange(100, _VOCAB) for _ in range(n))


def generated_shared_prefix(*, groups: int = 64, per_group: int = 16, system_len: int = 2048,
                            question_len: int = 128, output_len: int = 256, rate: float = 16.0,
                            seed: int = 0) -> list[ReplayRequest]:
    """SGLang's generated-shared-prefix workload: ``groups x per_group`` completion requests."""
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        system = _tokens(rng, system_len)
        prompts += [(g, system + _tokens(rng, question_len)) for _ in range(per_group)]
    rng.shuffle(prompts)
    t = 0.0
    out = []
    for g, prompt in prompts:
        t += rng.expovariate(rate)
        out.append(ReplayRequest(COMPLETIONS, {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True},
                                 at_s=t, meta={"group": g}))
    return out


def one_system_prompt(*, sessions: int = 2000, system_len: int = 2000, turns: tuple[int, int] = (1, 3),
                      user_len: tuple[int, int] = (30, 150), output_len: int = 64, rate: float = 8.0,
                      think_s: float = 2.0, seed: int = 0) -> list[ReplayRequest]:
    """``sessions`` chat sessions of ``turns`` (inclusive range) turns sharing one system prompt."""
    rng = random.Random(seed)
    system = {"role": "system", "content": _tokens(rng, system_len)}
    out = []
    t = 0.0
    for s in range(sessions):
        t += rng.expovariate(rate)
        history = [system]
        for turn in range(rng.randint(*turns)):
            history = history + [{"role": "user", "content": _tokens(rng, rng.randint(*user_len))}]
            think = rng.expovariate(1.0 / think_s) if turn else 0.0
            out.append(ReplayRequest(CHAT, {"messages": history, "max_tokens": output_len, "ignore_eos": True},
                                     at_s=t, session=f"sys-{s}", turn=turn, think_s=think))
            history = history + [{"role": "assistant", "content": _tokens(rng, output_len)}]
    return out
