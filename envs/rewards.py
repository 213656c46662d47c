"""Per-cycle rewards for the depth and size environments (live and replay share them).

Each reward is a small object: `reward(record) -> float` scores one finished draft-and-verify cycle (a
`CycleRecord`), `reset()` is called at the start of every episode. Cycle time is `record.cycle_s` = draft_s +
verify_s (decision time, `record.policy_s`, excluded, as in the paper). Tokens are `record.emitted`: what the
cycle appended to the output, bonus token included (the paper's L_A counts accepted tokens; the bonus is output
too and is what throughput counts).

    throughput   emitted / time                         the paper's reward (tokens per second of this cycle)
    dinkelbach   (emitted - lambda * time) / scale      lambda = running throughput estimate; optimises the
                                                        long-run tokens/second E[tokens]/E[time] (renewal reward)
    acceptance   emitted                                paper ablation: over-verifies
    time         -time / running mean cycle time        paper ablation: under-drafts

`make_reward("dinkelbach", rate=0.01)` builds one by name; an object with `__call__` and `reset` is passed through.
"""
from __future__ import annotations

from typing import Protocol

from specpilot.drafting.types import CycleRecord


class Reward(Protocol):
    name: str

    def __call__(self, record: CycleRecord) -> float: ...

    def reset(self) -> None: ...


def _cycle_time(record: CycleRecord) -> float:
    # a clock can read 0 for a very fast cycle on a coarse timer: keep the ratio finite
    return max(record.cycle_s, 1e-9)


class ThroughputReward:
    """emitted / (draft_s + verify_s): the cycle's tokens per second (the LTD paper's reward)."""

    name = "throughput"

    def __call__(self, record: CycleRecord) -> float:
        return record.emitted / _cycle_time(record)

    def reset(self) -> None:
        pass


class AcceptanceReward:
    """emitted: tokens of the cycle, time ignored (the paper's acceptance-only ablation)."""

    name = "acceptance"

    def __call__(self, record: CycleRecord) -> float:
        return float(record.emitted)

    def reset(self) -> None:
        pass


class _RunningMean:
    """Exponential moving average initialised with its first value (so it is never biased towards 0)."""

    __slots__ = ("rate", "value")

    def __init__(self, rate: float) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        self.rate = rate
        self.value: float | None = None

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.value + self.rate * (x - self.value)
        return self.value


class TimeReward:
    """-(draft_s + verify_s) / running mean cycle time: O(1) and time-only (the paper's time ablation).

    The running mean (EMA with `rate`) persists across episodes; `reset_statistics()` forgets it (the envs call it
    on a seeded reset).
    """

    name = "time"

    def __init__(self, rate: float = 0.01) -> None:
        self._scale = _RunningMean(rate)

    def __call__(self, record: CycleRecord) -> float:
        t = _cycle_time(record)
        scale = self._scale.value if self._scale.value is not None else t
        self._scale.update(t)
        return -t / scale

    def reset(self) -> None:
        pass

    def reset_statistics(self) -> None:
        self._scale.value = None


class DinkelbachReward:
    """(emitted - lambda * time) / token_scale, lambda the running throughput estimate.

    Maximising E[tokens]/E[time] (the long-run tokens per second of a policy, by renewal-reward) is equivalent to
    maximising E[tokens - lambda* time] at lambda* = the optimal throughput (Dinkelbach). lambda is estimated as
    EMA(emitted) / EMA(time), both EMAs with `rate`, updated *after* scoring each cycle (the first cycle scores 0).
    Dividing by token_scale = EMA(emitted) keeps rewards O(1) whatever the hardware's tokens/second.
    The statistics persist across episodes (lambda is a long-run quantity); `reset_statistics()` forgets them (the
    envs call it on a seeded reset).
    """

    name = "dinkelbach"

    def __init__(self, rate: float = 0.01) -> None:
        self._tokens = _RunningMean(rate)
        self._time = _RunningMean(rate)

    @property
    def lam(self) -> float | None:
        """Current throughput estimate (tokens/s), None before the first cycle."""
        if self._tokens.value is None:
            return None
        return self._tokens.value / max(self._time.value, 1e-12)

    def __call__(self, record: CycleRecord) -> float:
        emitted, t = float(record.emitted), _cycle_time(record)
        if self._tokens.value is None:
            self._tokens.update(emitted)
            self._time.update(t)
            return 0.0
        lam = self._tokens.value / max(self._time.value, 1e-12)
        reward = (emitted - lam * t) / max(self._tokens.value, 1e-12)
        self._tokens.update(emitted)
        self._time.update(t)
        return reward

    def reset(self) -> None:
        pass

    def reset_statistics(self) -> None:
        self._tokens.value = self._time.value = None


REWARDS: dict[str, type] = {
    "throughput": ThroughputReward,
    "dinkelbach": DinkelbachReward,
    "acceptance": AcceptanceReward,
    "time": TimeReward,
}


def make_reward(reward: str | Reward = "throughput", **kwargs) -> Reward:
    """A reward by name (see REWARDS), or `reward` itself when it already is a reward object."""
    if not isinstance(reward, str):
        if not callable(reward) or not hasattr(reward, "reset"):
            raise TypeError(f"reward must be a name in {sorted(REWARDS)} or an object with __call__(record) and "
                            f"reset(); got {reward!r}")
        return reward
    try:
        cls = REWARDS[reward]
    except KeyError:
        raise ValueError(f"unknown reward {reward!r}; choose one of {sorted(REWARDS)}") from None
    return cls(**kwargs)
