"""The circuit breaker (prefix_router/fleet/breaker.py): closed, open, half-open, on a clock the
test drives (``now`` in seconds)."""

from __future__ import annotations

import pytest

from prefix_router.config import BreakerConfig
from prefix_router.fleet.breaker import BreakerState, CircuitBreaker
from prefix_router.metrics import GatewayMetrics

CONFIG = BreakerConfig(failures=3, cooldown_s=1.0, max_cooldown_s=3.0)


def opened(now: float = 0.0, config: BreakerConfig = CONFIG) -> CircuitBreaker:
    """A breaker that opened at ``now`` after ``config.failures`` failed attempts."""
    breaker = CircuitBreaker(config)
    for _ in range(config.failures):
        breaker.record(False, now)
    assert breaker.state(now) is BreakerState.OPEN
    return breaker


def test_it_opens_at_the_configured_count_of_consecutive_failures_not_one_before():
    breaker = CircuitBreaker(CONFIG)
    for _ in range(CONFIG.failures - 1):
        assert breaker.record(False, 0.0) is None
        assert breaker.allows(0.0)
    assert breaker.record(False, 0.0) is BreakerState.OPEN
    assert not breaker.allows(0.0)


def test_a_success_resets_the_count_of_consecutive_failures():
    breaker = CircuitBreaker(CONFIG)
    for _ in range(CONFIG.failures - 1):
        breaker.record(False, 0.0)
    assert breaker.record(True, 0.0) is None  # closed already: no change to report
    for _ in range(CONFIG.failures - 1):
        assert breaker.record(False, 0.0) is None
    assert breaker.state(0.0) is BreakerState.CLOSED


def test_it_stays_open_for_the_cooldown_and_is_half_open_exactly_when_it_ends():
    breaker = opened(now=10.0)
    assert breaker.state(10.0 + CONFIG.cooldown_s - 1e-6) is BreakerState.OPEN
    assert not breaker.allows(10.0 + CONFIG.cooldown_s - 1e-6)
    assert breaker.state(10.0 + CONFIG.cooldown_s) is BreakerState.HALF_OPEN
    assert breaker.allows(10.0 + CONFIG.cooldown_s)


def test_half_open_lets_one_trial_through_at_a_time():
    breaker = opened()
    now = CONFIG.cooldown_s
    breaker.on_send(now)
    assert not breaker.allows(now)
    assert not breaker.allows(now + 100.0)  # the trial is still in flight, however long


def test_a_trial_that_says_nothing_of_the_replica_frees_the_half_open_slot():
    """The attempt's verdict was None (its client left, every replica refused the request):
    ``release_trial``, and the next request may be the trial."""
    breaker = opened()
    now = CONFIG.cooldown_s
    breaker.on_send(now)
    breaker.release_trial()
    assert breaker.allows(now)
    assert breaker.state(now) is BreakerState.HALF_OPEN  # neither closed nor opened by it


def test_a_failed_trial_reopens_it_for_twice_as_long_up_to_the_maximum():
    breaker = opened()
    now, cooldowns = 0.0, []
    for _ in range(3):
        now += breaker.cooldown_s
        breaker.on_send(now)
        assert breaker.record(False, now) is BreakerState.OPEN
        assert not breaker.allows(now)
        cooldowns.append(breaker.cooldown_s)
    expected, c = [], CONFIG.cooldown_s
    for _ in range(3):
        c = min(2 * c, CONFIG.max_cooldown_s)
        expected.append(c)
    assert cooldowns == expected  # 2 s, then the 3 s cap, then 3 s


def test_a_successful_trial_closes_it_and_restores_the_configured_cooldown():
    breaker = opened()
    now = breaker.cooldown_s
    breaker.on_send(now)
    breaker.record(False, now)  # one failed trial: the cooldown doubled
    now += breaker.cooldown_s
    breaker.on_send(now)
    assert breaker.record(True, now) is BreakerState.CLOSED
    assert breaker.cooldown_s == CONFIG.cooldown_s and breaker.failures == 0
    assert breaker.allows(now)
    assert opened(now, CONFIG).cooldown_s == CONFIG.cooldown_s  # and a later opening starts from it


def test_a_failure_of_a_request_sent_before_it_opened_does_not_extend_the_cooldown():
    breaker = opened(now=0.0)
    assert breaker.record(False, 0.5) is None  # in flight when it opened; it failed too
    assert breaker.state(CONFIG.cooldown_s) is BreakerState.HALF_OPEN  # still from t = 0


def test_sending_while_closed_is_no_trial():
    breaker = CircuitBreaker(CONFIG)
    breaker.on_send(0.0)
    assert not breaker.trial_inflight and breaker.allows(0.0)


@pytest.mark.parametrize("state", list(BreakerState))
def test_each_state_is_exported_as_the_value_the_metric_documents(state):
    help_text = GatewayMetrics().breaker_state._documentation  # "0 closed, 1 open (...), 2 half-open (...)"
    assert f"{int(state)} {state.name.lower().replace('_', '-')}" in help_text
