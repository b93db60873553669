"""The admission queue (prefix_router/fleet/admission.py): first come first served while every
replica is saturated, bounded in length (429) and in wait (503).

``saturated`` is a flag the test flips; the proxy's answers (Retry-After, the rejection metric)
are tested in tests/serve/test_proxy.py.
"""

from __future__ import annotations

import asyncio

import pytest

from prefix_router.config import AdmissionConfig
from prefix_router.fleet.admission import Admission, QueueFull, QueueTimeout


class Fleet:
    """Whether every replica is saturated: what ``Gateway.saturated`` says, set by the test."""

    def __init__(self, saturated: bool) -> None:
        self.saturated = saturated

    def __call__(self) -> bool:
        return self.saturated


def gate(saturated: bool = True, **config) -> tuple[Admission, Fleet]:
    fleet = Fleet(saturated)
    return Admission(AdmissionConfig(**{"saturated_depth": 1, "timeout_s": 5.0, **config}), fleet), fleet


async def queued(admission: Admission, n: int) -> list[asyncio.Task]:
    """``n`` requests waiting in order (each has joined the queue when this returns)."""
    tasks = []
    for _ in range(n):
        tasks.append(asyncio.create_task(admission.admit()))
        while len(admission) < len(tasks):
            await asyncio.sleep(0)
    return tasks


async def test_a_request_goes_at_once_while_some_replica_is_not_saturated():
    admission, _ = gate(saturated=False)
    assert await admission.admit() == 0.0
    assert len(admission) == 0


async def test_a_saturated_depth_of_zero_turns_the_queue_off():
    admission, _ = gate(saturated=True, saturated_depth=0)
    assert await admission.admit() == 0.0


async def test_waiters_are_admitted_in_arrival_order_one_per_notify():
    admission, fleet = gate()
    tasks = await queued(admission, 3)
    fleet.saturated = False
    for i, task in enumerate(tasks):
        admission.notify()
        assert await asyncio.wait_for(task, 1.0) >= 0.0
        assert not any(t.done() for t in tasks[i + 1:])


async def test_notify_admits_nobody_while_every_replica_is_still_saturated():
    admission, _ = gate()
    [task] = await queued(admission, 1)
    admission.notify()
    await asyncio.sleep(0.01)
    assert not task.done() and len(admission) == 1
    task.cancel()


async def test_a_newcomer_queues_behind_waiters_even_when_capacity_freed():
    """Capacity freed before the first waiter was woken belongs to that waiter: no overtaking."""
    admission, fleet = gate()
    [first] = await queued(admission, 1)
    fleet.saturated = False
    newcomer = asyncio.create_task(admission.admit())
    await asyncio.sleep(0.01)
    assert not newcomer.done() and len(admission) == 2
    admission.notify()
    await asyncio.wait_for(first, 1.0)
    assert not newcomer.done()
    admission.notify()
    await asyncio.wait_for(newcomer, 1.0)


async def test_a_full_queue_refuses_at_once():
    admission, _ = gate(max_queue=2)
    tasks = await queued(admission, 2)
    with pytest.raises(QueueFull):
        await admission.admit()
    assert len(admission) == 2
    for task in tasks:
        task.cancel()


async def test_a_max_queue_of_zero_refuses_every_request_while_saturated():
    admission, _ = gate(max_queue=0)
    with pytest.raises(QueueFull):
        await admission.admit()


async def test_a_wait_past_the_timeout_raises_and_gives_up_its_place():
    admission, _ = gate(timeout_s=0.05)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(QueueTimeout):
        await admission.admit()
    assert loop.time() - started >= 0.05
    assert len(admission) == 0


async def test_a_waiter_cancelled_before_its_turn_gives_its_place_to_the_next():
    admission, fleet = gate()
    first, second = await queued(admission, 2)
    first.cancel()
    await asyncio.sleep(0)
    fleet.saturated = False
    admission.notify()
    assert await second >= 0.0
    assert first.cancelled()


async def test_a_waiter_cancelled_as_its_turn_comes_passes_the_turn_on():
    """Its client left in the instant it was admitted: the capacity it was given goes to the
    next waiter, not to nobody until the next notify."""
    admission, fleet = gate()
    first, second = await queued(admission, 2)
    fleet.saturated = False
    first.cancel()  # cancelled...
    admission.notify()  # ...and given its turn before it could run
    await asyncio.wait_for(second, 1.0)
    assert first.cancelled() and len(admission) == 0
