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


def test_a_step_admits_only_the_requests_that_arrived_by_its_start():
    # the engine, running behind the wall clock, computes steps of the modelled past: a request
    # that arrived later (its modelled arrival_s) waits for a step that starts after it
    s = sched()
    early, late = req(range(100, 100 + 2 * BS), max_tokens=1, rid="early"), req(range(300, 300 + BS), max_tokens=1, rid="late")
    early.arrival_s, late.arrival_s = 1.0, 2.5
    s.add(early)
    s.add(late)
    first = s.schedule(2.0)
    assert [r.request_id for r, _ in first.scheduled] == ["early"]
    assert s.finish_step(first, 2.1) == [early] and early.finish_reason == "length"
    assert [r.request_id for r, _ in s.schedule(2.5).scheduled] == ["late"]


def _drive(s, arrivals, stretch: bool):
    """Step ``s`` through ``arrivals`` ((step index, request)), decode-only runs at once when
    ``stretch``; what it did: each request's tokens and cached prompt, the engine's KV events,
    its counters, and the step index each request finished at."""
    s.kv.record_events = True
    pending = sorted(arrivals, key=lambda a: a[0])
    events, finished_at, t = [], {}, 0
    while pending or s.has_work:
        while pending and pending[0][0] <= t:
            s.add(pending.pop(0)[1])
        if not s.has_work:
            t = pending[0][0]
            continue
        horizon = pending[0][0] - t if pending else 1 << 30  # arrivals come between steps, as here one at a time
        steps = s.decode_run(horizon) if stretch else 0
        if steps >= 1:
            t += steps
            done = s.decode(steps, float(t))
        else:
            step = s.schedule()
            assert step.scheduled, "engine stalled"
            t += 1
            done = [r for r in s.finish_step(step, float(t)) if r.finish_reason is not None]
        for r in done:
            finished_at[r.request_id] = t
        events += [repr(e) for e in s.kv.take_events()]
    requests = [r for _, r in sorted(arrivals, key=lambda a: a[1].request_id)]
    return ([(r.request_id, r.token_ids, r.num_cached_tokens, r.num_preemptions) for r in requests], events,
            finished_at, s.num_generation_tokens, s.num_preemptions, sorted(s.kv.cached))


def test_decode_only_steps_applied_at_once_do_what_the_steps_one_at_a_time_do():
    """The fleet simulator applies runs of decode-only steps at once (``decode_run``, ``decode``):
    the same tokens, blocks taken and cached in the same order (the KV events say which),
    finishing at the same step, under shared prefixes, eviction and preemption elsewhere."""
    import random

    for seed in range(12):
        rng = random.Random(seed)
        docs = [[rng.randrange(300, 900) for _ in range(BS * rng.randrange(1, 5))] for _ in range(3)]
        outs = []
        for stretch in (False, True):
            rng2 = random.Random(seed)
            arrivals = []
            for i in range(rng2.randrange(3, 12)):
                prompt = rng2.choice(docs) + [rng2.randrange(300, 900) for _ in range(rng2.randrange(1, 3 * BS))]
                arrivals.append((rng2.randrange(0, 60), req(prompt, max_tokens=rng2.randrange(1, 5 * BS), rid=f"r{i:02d}")))
            s = sched(num_blocks=rng2.choice([12, 24, 200]), max_num_batched_tokens=rng2.choice([8, 64]))
            outs.append(_drive(s, arrivals, stretch))
        assert outs[0] == outs[1], seed
