"""Reward modes: values, O(1) scaling of dinkelbach/time, and that dinkelbach ranks by long-run throughput."""
from __future__ import annotations

import pytest

from specpilot.drafting.types import CycleRecord
from specpilot.envs.rewards import (AcceptanceReward, DinkelbachReward, ThroughputReward, TimeReward,
                                    make_reward)


def rec(emitted: int, draft_s: float, verify_s: float) -> CycleRecord:
    return CycleRecord(depth=3, size=8, accepted=emitted - 1, emitted=emitted, draft_s=draft_s, verify_s=verify_s,
                       policy_s=123.0, context_len=10)


def test_throughput_and_acceptance_and_time():
    r = rec(4, 0.01, 0.03)
    assert ThroughputReward()(r) == pytest.approx(100.0)  # policy time excluded
    assert AcceptanceReward()(r) == 4.0
    time_reward = TimeReward()
    assert time_reward(r) == pytest.approx(-1.0)  # first cycle: its own time is the scale
    assert time_reward(rec(4, 0.02, 0.06)) == pytest.approx(-2.0)


def test_dinkelbach_sign_follows_the_running_throughput():
    reward = DinkelbachReward(rate=0.1)
    assert reward(rec(3, 0.01, 0.02)) == 0.0  # initialises lambda = 100 tokens/s
    assert reward.lam == pytest.approx(100.0)
    assert reward(rec(6, 0.01, 0.02)) > 0  # 200 tokens/s beats the running 100
    assert reward(rec(1, 0.01, 0.02)) < 0
    for _ in range(500):
        value = reward(rec(3, 0.01, 0.02))
    assert abs(value) < 1e-3 and reward.lam == pytest.approx(100.0, rel=1e-3)


def test_dinkelbach_prefers_the_higher_long_run_throughput():
    # A: 1 token in 0.01 s (100/s), B: 10 tokens in 0.05 s (200/s); with lambda = 125/s (between the two)
    # dinkelbach rewards B and penalises A, whatever the cycles' lengths.
    reward = DinkelbachReward(rate=0.5)
    reward(rec(5, 0.02, 0.02))  # lambda = 125/s
    a = reward(rec(1, 0.005, 0.005))
    assert a < 0
    reward.reset_statistics()
    reward(rec(5, 0.02, 0.02))
    b = reward(rec(10, 0.025, 0.025))
    assert b > a


@pytest.mark.parametrize("name,first,second", [("throughput", 100.0, 50.0), ("acceptance", 2.0, 1.0),
                                               ("time", -1.0, -1.0), ("dinkelbach", 0.0, -0.5)])
def test_make_reward_by_name(name, first, second):
    """Each reward's value on two known cycles: 2 tokens in 20 ms, then 1 token in 20 ms."""
    reward = make_reward(name, **({} if name in ("throughput", "acceptance") else {"rate": 1.0}))
    assert reward.name == name
    reward.reset()
    assert reward(rec(2, 0.01, 0.01)) == pytest.approx(first)
    assert reward(rec(1, 0.01, 0.01)) == pytest.approx(second)


def test_make_reward_rejects_unknown():
    with pytest.raises(ValueError, match="unknown reward"):
        make_reward("speed")
    with pytest.raises(TypeError):
        make_reward(42)
