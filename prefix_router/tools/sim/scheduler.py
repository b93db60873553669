"""Continuous-batching scheduler, modelled on vLLM's v1 ``Scheduler.schedule`` (FCFS policy).

One engine step (``vllm/v1/core/sched/scheduler.py``):

1. Running requests first, in order, each given the tokens it still needs (a decode needs one,
   an unfinished chunked prefill the rest of its prompt) within the step's token budget
   (``max_num_batched_tokens``). When the KV cache cannot hold them, the last running request
   is preempted: its blocks are freed (their contents stay cached) and it goes back to the
   front of the waiting queue, to be recomputed from scratch.
2. Then, only if nothing was preempted in this step, waiting requests in arrival order while
   fewer than ``max_num_seqs`` run and budget is left: look up the prefix cache, allocate blocks
   for the hit plus the tokens scheduled (chunked prefill: as many as the budget allows), and
   stop at the first request that does not fit.
3. Blocks become hittable as soon as their tokens are scheduled, so a later request in the
   same step can already hit them (``KVCacheManager.allocate_slots`` caches them at once).

When the step's model pass is done (``finish_step``), every request whose computed tokens
reached its length samples one token; it finishes at ``max_tokens`` or at ``max_model_len``
and frees its blocks tail first. The scheduler is synchronous and does no I/O: ``engine``
drives it in time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.kv_cache import Block, BlockHash, KVCache, extend_block_hashes, seed_hash
from prefix_router.tools.sim.offload import CpuTier

__all__ = ["SimRequest", "Step", "Scheduler"]


class SimRequest:
    """One generation request inside the simulated engine.

    Args:
        request_id: unique id, used in responses.
        prompt_token_ids: the prompt, already tokenized.
        max_tokens: output tokens to generate (the engine never samples EOS).
        model: requested model name; with ``cache_salt`` it seeds the first block's hash.
        cache_salt: optional tenant salt (vLLM: only requests with the same salt share blocks).
        arrival_s: modelled time the request entered the engine, in seconds.

    A KV connector (``kv_transfer.py``) sets two more: ``num_external_tokens``, prompt tokens a
    decode replica pulled from a prefill replica (computed without prefill work, as vLLM's
    ``get_num_new_matched_tokens`` reports them), and ``hold_blocks``, a prefill leg whose
    blocks stay held when it finishes, for a decode replica to pull (``Scheduler.held``).
    """

    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "max_tokens", "block_hashes",
        "blocks", "num_computed_tokens", "num_cached_blocks", "num_cached_tokens",
        "num_preemptions", "arrival_s", "first_token_s", "finish_s", "finish_reason",
        "seed", "on_update", "model", "cache_salt", "num_external_tokens", "hold_blocks",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        model: str,
        cache_salt: str | None = None,
        arrival_s: float = 0.0,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.seed = seed_hash(model, cache_salt)
        self.model = model
        self.cache_salt = cache_salt
        self.block_hashes: list[BlockHash] = []  # one per full block of token_ids
        self.blocks: list[Block] = []  # KV blocks held while scheduled
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0  # blocks of self.blocks registered in the prefix cache
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.num_preemptions = 0
        self.arrival_s = arrival_s
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.finish_reason: str | None = None  # "length" or "abort"
        self.on_update = None  # callable(), set by whoever streams the output; the engine calls it
        self.num_external_tokens = 0
        self.hold_blocks = False

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(slots=True)
class Step:
    """What one engine step computes: requests with their token counts, and its cost drivers."""

    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)
    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens, cache hits excluded
    num_decode_context_tokens: int = 0  # context length summed over decoding requests
    num_preempted: int = 0
    admitted: list[SimRequest] = field(default_factory=list)  # first admissions (not resumptions)
    num_loaded_tokens: int = 0  # prompt tokens loaded from the CPU offload tier


class Scheduler:
    """Waiting queue, running set and KV cache of one simulated replica.

    ``vocab_size`` bounds the generated token ids (drawn from a seeded generator, so runs
    repeat exactly).
    """

    def __init__(self, config: SimConfig, *, vocab_size: int = 32_000) -> None:
        self.config = config
        self.kv = KVCache(config.num_gpu_blocks, config.block_size)
        if config.cpu_offload_blocks:
            self.kv.cpu = CpuTier(config.cpu_offload_blocks, config.block_size)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.vocab_size = vocab_size
        self._rng_state = (config.seed * 2654435761 + 1) & 0xFFFFFFFF
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # computed prompt tokens (prefill work, hits excluded)
        self.num_generation_tokens = 0
        # finished prefill legs' blocks, by request id, until a decode pulls them or the lease ends
        self.held: dict[str, list[Block]] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: SimRequest) -> None:
        """Queue a new request; its prompt block hashes are computed here, as vLLM does."""
        extend_block_hashes(request.block_hashes, request.token_ids, self.config.block_size, request.seed)
        self.waiting.append(request)

    def abort(self, request: SimRequest, now_s: float) -> None:
        """Drop a request (client gone) and free its blocks, as ``finish_requests`` does."""
        if request.finish_reason is not None:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, "abort", now_s)

    # -- one step ------------------------------------------------------------------------
    def schedule(self, start_s: float = math.inf) -> Step:
        """Choose the requests and token counts of the next step (may be empty), which starts at
        modelled time ``start_s``: requests that arrive after it wait (see ``engine.py``)."""
        cfg = self.config
        kv = self.kv
        step = Step()
        budget = cfg.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(
                request.num_tokens - request.num_computed_tokens,
                budget,
                cfg.max_model_len - 1 - request.num_computed_tokens,
            )
            if num_new <= 0:
                index += 1
                continue
            scheduled = True
            while not kv.allocate(request.blocks, (), request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                step.num_preempted += 1
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                break
            self._commit(request, num_new, step)
            budget -= num_new
            index += 1

        while self.waiting and budget > 0 and not step.num_preempted and self.waiting[0].arrival_s <= start_s:
            if len(self.running) >= cfg.max_num_seqs:
                break
            request = self.waiting[0]
            hit = kv.find_longest_cache_hit(request.block_hashes, request.num_tokens)
            num_hit = len(hit) * cfg.block_size
            # pulled tokens past the local hit; the last prompt token is always computed (vLLM
            # recomputes it for its logits: ``_update_waiting_for_remote_kv``)
            external = max(min(request.num_external_tokens, request.num_tokens - 1) - num_hit, 0)
            loaded = 0
            if kv.cpu is not None and not external:  # the continuation past the GPU hit, from the CPU tier
                loaded = kv.cpu.hit(request.block_hashes, len(hit), (request.num_tokens - 1) // cfg.block_size)
                external = loaded * cfg.block_size
            num_new = min(request.num_tokens - num_hit - external, budget)
            if not kv.allocate(request.blocks, hit, num_hit + external + num_new):
                break
            self.waiting.popleft()
            if loaded:
                step.num_loaded_tokens += external
                kv.cpu.num_loaded_tokens += external
            if request.num_preemptions == 0:
                kv.record_query(request.num_tokens, num_hit)
                request.num_cached_tokens = num_hit + external  # the engine's count; a decode's answer reports its prefill's
                step.admitted.append(request)
            request.num_external_tokens = 0  # a preempted request recomputes everything
            num_hit += external
            request.num_computed_tokens = num_hit
            request.num_cached_blocks = len(hit)
            self.running.append(request)
            self._commit(request, num_new, step)
            budget -= num_new
        return step

    def finish_step(self, step: Step, now_s: float) -> list[SimRequest]:
        """Apply a computed step at modelled time ``now_s``; return the requests that changed.

        A request whose computed tokens reach its length samples one token; it finishes at
        ``max_tokens`` or ``max_model_len`` and frees its blocks.
        """
        updated: list[SimRequest] = []
        block_size = self.config.block_size
        for request, num_new in step.scheduled:
            if request.finish_reason is not None:
                continue  # aborted while the step ran
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                continue  # a chunk of a longer prefill
            request.token_ids.append(self._next_token())
            self.num_generation_tokens += 1
            extend_block_hashes(request.block_hashes, request.token_ids, block_size, request.seed)
            if request.first_token_s is None:
                request.first_token_s = now_s
            if (
                request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.config.max_model_len
            ):
                self.running.remove(request)
                self._finish(request, "length", now_s)
            updated.append(request)
        return updated

    # -- decode-only steps at once (the fleet simulator) ----------------------------------
    def decode_run(self, limit: int) -> int:
        """How many of the next steps, at most ``limit``, are decode-only steps that ``decode``
        can apply at once: nothing waiting, every running request decoding (one token a step,
        within the token budget), none finishing before the last of them, and the free blocks
        enough for every block they fill, so that no step preempts. 0 when the next is not one."""
        running, cfg = self.running, self.config
        if self.waiting or not running or len(running) > cfg.max_num_batched_tokens:
            return 0
        steps = limit
        for r in running:
            if not r.num_output_tokens or r.num_computed_tokens != r.num_tokens - 1:
                return 0
            steps = min(steps, r.max_tokens - r.num_output_tokens, cfg.max_model_len - r.num_tokens)
        free, size = self.kv.num_free_blocks, cfg.block_size
        while steps > 0 and sum(max(-(-(r.num_tokens + steps - 1) // size) - len(r.blocks), 0)
                                for r in running) > free:
            steps //= 2
        return max(steps, 0)

    def decode(self, steps: int, now_s: float) -> list[SimRequest]:
        """Apply ``steps`` decode-only steps (at most ``decode_run``'s) as ``schedule`` and
        ``finish_step`` would one at a time: the same tokens drawn in the same order, the same
        blocks taken from the free queue and cached in the same order (only where a step fills
        or starts a block: a token a step costs no Python step here), the last step ending at
        ``now_s``. Returns the requests that finished, in running order."""
        running, kv, size = list(self.running), self.kv, self.config.block_size
        n = len(running)
        drawn = [self._next_token() for _ in range(steps * n)]
        start = [r.num_tokens for r in running]  # tokens at the first step; each step computes the last
        ops = []  # (step, request, 0: take a block / 1: cache the blocks it fills)
        for i, (r, t) in enumerate(zip(running, start)):
            held = len(r.blocks) * size
            first_alloc = max(held + 1 - t, 0)  # the step whose token count first passes the blocks held
            ops += [(s, i, 0) for s in range(first_alloc, steps, size)]
            first_full = (-t) % size  # the step at which its token count is a whole number of blocks
            ops += [(s, i, 1) for s in range(first_full, steps, size)]
            r.token_ids.extend(drawn[i::n])
            extend_block_hashes(r.block_hashes, r.token_ids, size, r.seed)
        ops.sort()
        for s, i, kind in ops:
            r, t = running[i], start[i] + s
            if kind == 0:
                kv.allocate(r.blocks, (), t)
            elif t // size > r.num_cached_blocks:
                lora = r.model if r.model != self.config.model else None
                kv.cache_full_blocks(r.blocks, r.block_hashes, r.num_cached_blocks, t // size, r.token_ids, lora,
                                     r.cache_salt)
                r.num_cached_blocks = t // size
        finished = []
        for r in running:
            r.num_computed_tokens += steps
            if r.num_output_tokens >= r.max_tokens or r.num_tokens >= self.config.max_model_len:
                self.running.remove(r)
                self._finish(r, "length", now_s)
                finished.append(r)
        self.num_generation_tokens += steps * n
        return finished

    # -- helpers -------------------------------------------------------------------------
    def _commit(self, request: SimRequest, num_new: int, step: Step) -> None:
        """Record a scheduled request and cache the full blocks its tokens now fill."""
        if request.num_output_tokens and request.num_computed_tokens == request.num_tokens - 1:
            step.num_decode_context_tokens += request.num_computed_tokens
        else:
            step.num_prefill_tokens += num_new
            self.num_prompt_tokens += num_new
        step.scheduled.append((request, num_new))
        num_full = min(request.num_computed_tokens + num_new, request.num_tokens) // self.config.block_size
        if num_full > request.num_cached_blocks:
            lora = request.model if request.model != self.config.model else None
            self.kv.cache_full_blocks(request.blocks, request.block_hashes, request.num_cached_blocks, num_full,
                                      request.token_ids, lora, request.cache_salt)
            request.num_cached_blocks = num_full

    def _preempt(self, request: SimRequest) -> None:
        self.kv.free(request.blocks)
        request.blocks = []
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def release_held(self, request_id: str) -> list[BlockHash] | None:
        """Free a finished prefill leg's held blocks (pulled, or its lease ended): their hashes
        (None for a block not full), or None when none are held under ``request_id``."""
        blocks = self.held.pop(request_id, None)
        if blocks is None:
            return None
        self.kv.free(blocks)
        return [b.block_hash for b in blocks]

    def _finish(self, request: SimRequest, reason: str, now_s: float) -> None:
        if request.hold_blocks and reason == "length":
            self.held[request.request_id] = request.blocks
        else:
            self.kv.free(request.blocks)
        request.blocks = []
        request.finish_reason = reason
        request.finish_s = now_s

    def _next_token(self) -> int:
        # xorshift32: cheap, seeded, repeatable; ids stay clear of the first 256 (specials).
        x = self._rng_state
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        self._rng_state = x
        return 256 + x % max(self.vocab_size - 256, 1)
