"""The simulated engine's scheduling rules (``prefix_router/tools/sim/scheduler.py``), as vLLM's v1
scheduler applies them: preemption of the last running request, resumed from its cached blocks,
and chunked prefill within the step's token budget. The prefix-caching rules it schedules by:
``test_kv_cache.py``."""

from __future__ import annotations

from .test_kv_cache import BS, req, run, sched


def test_preemption_frees_the_last_running_request_and_it_resumes_from_its_cached_blocks():
    # Four usable blocks; two requests that each grow to three blocks cannot both run.
    s = sched(num_blocks=1 + 4)
    a = req(range(100, 100 + BS + 1), max_tokens=2 * BS, rid="a")
    b = req(range(200, 200 + BS + 1), max_tokens=2 * BS, rid="b")
    run(s, a, b)
    assert s.num_preemptions >= 1
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.num_output_tokens == b.num_output_tokens == 2 * BS
    # The preempted request counted its prefix-cache query once, at first admission.
    assert s.kv.num_queries == a.num_prompt_tokens + b.num_prompt_tokens


def test_chunked_prefill_respects_the_token_budget():
    s = sched(max_num_batched_tokens=3 * BS)
    r = req(range(100, 100 + 7 * BS), max_tokens=1)
    s.add(r)
    sizes = []
    while s.has_work:
        step = s.schedule()
        sizes.append(sum(n for _, n in step.scheduled))
        s.finish_step(step, 0.0)
    assert max(sizes) <= 3 * BS
    assert sum(sizes) == 7 * BS
