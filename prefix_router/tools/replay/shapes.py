"""Other projects' traffic shapes as request lists, for the replayer and the fleet simulator.

- ``generated_shared_prefix``: SGLang's ``bench_serving --dataset-name generated-shared-prefix``
  (``GeneratedSharedPrefixLoader``): ``groups`` system prompts of ``system_len`` random tokens,
  each followed by ``per_group`` questions of ``question_len`` random tokens, ``output_len``
  tokens out. Defaults are SGLang's (64 x 16, 2,048, 128, 256). The requests are shuffled, so a
  group's prompts arrive spread over the run.
- ``prefix_repetition`` and ``random_shared_prefix``: ``vllm bench serve``'s datasets as vLLM
  makes them (``vllm/benchmarks/datasets``: ``PrefixRepetitionRandomDataset.sample``, prefixes of
  random tokens each followed by ``num_prompts // prefixes`` suffixes of their own, shuffled;
  ``RandomDataset`` with ``--random-prefix-len``, one prefix before every prompt, range ratio 0).
- ``one_system_prompt``: many short chat sessions that share one long system prompt (a
  product's assistant): the shape where prefix affinity must not send everything to one replica.
- ``coding_agents``: agent sessions sharing one system prompt whose context grows by a tool's
  output a turn, to the size of a production coding agent's requests.

Prompts are ``token_text`` strings (4 characters a token id), so the byte tokenizer reads exactly
the token counts given, and every router, text-only ones included, sees the same text. Arrivals
are Poisson at ``rate`` requests (or sessions) a modelled second, as ``vllm bench serve
--request-rate`` with burstiness 1; everything is seeded.
"""

from __future__ import annotations

import random

from prefix_router.tools.replay.request import CHAT, COMPLETIONS, ReplayRequest

__all__ = ["SHAPES", "coding_agents", "generated_shared_prefix", "one_system_prompt", "prefix_repetition",
           "random_shared_prefix", "shape", "token_text"]

_VOCAB = 32_000  # token ids drawn below this, as the Mooncake loader's
_TEXT_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"  # 64 symbols, 6 bits


def token_text(token_ids) -> str:
    """``token_ids`` (each < 2**24) as text, 4 characters from a 64-symbol ASCII alphabet per id.

    Equal ids give equal 4-character groups and different ids different ones, so the byte
    tokenizer of ``prefix_router/prompts/tokenizer.py`` (4 bytes a token) reads the text back as one token per
    id with the same equalities: prefix sharing, and so cache hits, are those of the ids.
    Raises ValueError for an id outside [0, 2**24).
    """
    a = _TEXT_ALPHABET
    out = []
    for t in token_ids:
        t = int(t)
        if not 0 <= t < 1 << 24:
            raise ValueError(f"token id {t} does not fit 4 characters of 6 bits")
        out.append(a[t >> 18] + a[(t >> 12) & 63] + a[(t >> 6) & 63] + a[t & 63])
    return "".join(out)


def _tokens(rng: random.Random, n: int) -> str:
    return token_text(rng.randrange(100, _VOCAB) for _ in range(n))


def _completions(rng: random.Random, prompts: list[str], rate: float, output_len: int) -> list[ReplayRequest]:
    t, out = 0.0, []
    for prompt in prompts:
        t += rng.expovariate(rate)
        out.append(ReplayRequest(COMPLETIONS, {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True}, at_s=t))
    return out


def generated_shared_prefix(*, groups: int = 64, per_group: int = 16, system_len: int = 2048,
                            question_len: int = 128, output_len: int = 256, rate: float = 16.0,
                            seed: int = 0) -> list[ReplayRequest]:
    """SGLang's generated-shared-prefix workload: ``groups x per_group`` completions, each
    request's ``meta["group"]`` its system prompt's number."""
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        system = _tokens(rng, system_len)
        prompts += [(g, system + _tokens(rng, question_len)) for _ in range(per_group)]
    rng.shuffle(prompts)
    out = _completions(rng, [p for _, p in prompts], rate, output_len)
    for request, (g, _) in zip(out, prompts):
        request.meta["group"] = g
    return out


def prefix_repetition(*, num_prompts: int = 1000, prefixes: int = 32, prefix_len: int = 2000, suffix_len: int = 200,
                      output_len: int = 128, rate: float = 20.0, seed: int = 0) -> list[ReplayRequest]:
    """``vllm bench serve --dataset-name prefix_repetition``: ``prefixes x (num_prompts //
    prefixes)`` completions (vLLM's ``prompts_per_prefix``; the defaults are this project's
    benchmark matrix's, vLLM's own are 10 prefixes of 256 + 256 tokens).

    Raises ValueError when ``num_prompts`` is below ``prefixes``, as vLLM does."""
    if num_prompts < prefixes:
        raise ValueError(f"num_prompts ({num_prompts}) must be at least prefixes ({prefixes})")
    rng = random.Random(seed)
    prompts = []
    for _ in range(prefixes):
        prefix = _tokens(rng, prefix_len)
        prompts += [prefix + _tokens(rng, suffix_len) for _ in range(num_prompts // prefixes)]
    rng.shuffle(prompts)
    return _completions(rng, prompts, rate, output_len)


def random_shared_prefix(*, num_prompts: int = 1000, prefix_len: int = 2000, input_len: int = 200,
                         output_len: int = 128, rate: float = 20.0, seed: int = 0) -> list[ReplayRequest]:
    """``vllm bench serve --dataset-name random --random-prefix-len P --random-range-ratio 0``:
    ``num_prompts`` completions of one shared prefix and ``input_len`` tokens of their own."""
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len)
    return _completions(rng, [prefix + _tokens(rng, input_len) for _ in range(num_prompts)], rate, output_len)


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


def coding_agents(*, sessions: int = 64, system_len: int = 4000, turns: tuple[int, int] = (6, 12),
                  tool_len: tuple[int, int] = (1000, 4000), output_len: int = 128, rate: float = 1.0,
                  think_s: float = 1.6, seed: int = 0) -> list[ReplayRequest]:
    """``sessions`` coding-agent sessions sharing one system prompt (instructions and tools,
    ``system_len`` tokens): each turn sends the whole context so far, the model answers
    ``output_len`` tokens (a tool call) and the tool's result (``tool_len`` tokens, inclusive
    range) joins the context after an exponential think time of mean ``think_s`` (the tool's run).
    Contexts grow to ~25-45k tokens, the size of a production coding agent's requests (34k input
    tokens on average: 71B over 2.1M requests of a GLM-5.1 coder trace, median tool gap 1.6 s;
    agentic-kvc, gitea.gahow.org/gahow/agentic-kvc), where the built-in agent's stay under 8k.
    Sessions start as a Poisson stream at ``rate`` a second; shape: one request a turn."""
    rng = random.Random(seed)
    system = {"role": "system", "content": _tokens(rng, system_len)}
    out, t = [], 0.0
    for s in range(sessions):
        t += rng.expovariate(rate)
        history = [system, {"role": "user", "content": _tokens(rng, rng.randint(50, 300))}]
        for turn in range(rng.randint(*turns)):
            think = rng.expovariate(1.0 / think_s) if turn else 0.0
            out.append(ReplayRequest(CHAT, {"messages": history, "max_tokens": output_len, "ignore_eos": True},
                                     at_s=t, session=f"agent-{s}", turn=turn, think_s=think))
            history = history + [{"role": "assistant", "content": _tokens(rng, output_len)},
                                 {"role": "tool", "content": _tokens(rng, rng.randint(*tool_len))}]
    return out


# the names ``--workload`` takes for these shapes, each made with its defaults
SHAPES = {"sglang-shared-prefix": generated_shared_prefix, "vllm-prefix-repetition": prefix_repetition,
          "vllm-random-shared-prefix": random_shared_prefix, "one-system-prompt": one_system_prompt,
          "coding-agents": coding_agents}


def shape(name: str, seed: int = 0) -> list[ReplayRequest]:
    """The shape named (one of ``SHAPES``) with its defaults and ``seed``. Raises KeyError otherwise."""
    return SHAPES[name](seed=seed)
