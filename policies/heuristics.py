"""Dynamic-depth heuristics the LTD paper compares against, as Controllers.

Each heuristic decides *depth* only (when to stop drafting); the verification size is a constructor argument
(`size`, default: the CPU default of `default_static_config()`), which the decoder clips to the candidates drafted.

    DDDController         Brown et al. 2024: at check depths, stop if log(sum of beam path probabilities) < threshold
    SVIPController        Zhang et al. 2024: stop when sqrt(coef * H) > threshold, H the last level's draft entropy
    ConfidenceController  DISCO (unsupervised) / HF assistant_confidence_threshold: stop when p(top child) < threshold
    HFHeuristicController transformers' "heuristic" schedule: a depth target, +2 after a fully accepted draft, else -1
    GammaTuneController   acceptance-rate EMA switching between a short and a long depth

`HEURISTICS` maps short names to classes; `make_heuristic(name, **kw)` builds one.
"""
from __future__ import annotations

import math

import numpy as np

from specpilot.drafting.types import CycleRecord, DraftState
from specpilot.drafting.control import Controller, default_static_config


def _default_size(size: int | None, device: str | None) -> int:
    value = int(default_static_config(device)[1] if size is None else size)
    if value < 1:
        raise ValueError(f"verification size must be >= 1, got {value}")
    return value


class _SizedController(Controller):
    """Shared size handling: a constant verification size."""

    def __init__(self, size: int | None = None, *, device: str | None = None) -> None:
        self.size = _default_size(size, device)

    def choose_size(self, state: DraftState) -> int:
        return self.size


class DDDController(_SizedController):
    """Dynamic Depth Decoding: after each check depth, confidence = logsumexp of the beam's cumulative scores.

    The beam is the top-W frontier (`state.frontier_scores[:state.width]`, already sorted descending), so the
    confidence is log of the summed path probabilities of the W paths kept. Stop if confidence < threshold.
    """

    name = "ddd"

    def __init__(
        self,
        check_depths: tuple[int, ...] = (5, 7, 9),
        threshold: float = -0.3,
        size: int | None = None,
        *,
        device: str | None = None,
    ) -> None:
        super().__init__(size, device=device)
        if any(int(d) < 1 for d in check_depths):
            raise ValueError(f"DDD check depths must be >= 1, got {tuple(check_depths)}")
        self.check_depths = frozenset(int(d) for d in check_depths)
        self.threshold = float(threshold)

    @staticmethod
    def confidence(state: DraftState) -> float:
        beam = state.frontier_scores[: state.width].astype(np.float64)
        if not beam.size:
            return -math.inf
        top = beam.max()
        return float(top + np.log(np.exp(beam - top).sum()))

    def should_stop(self, state: DraftState) -> bool:
        if state.depth < 1 or state.depth not in self.check_depths:
            return False
        return self.confidence(state) < self.threshold

    def describe(self) -> dict:
        return {"name": self.name, "check_depths": sorted(self.check_depths), "threshold": self.threshold,
                "size": self.size}


class SVIPController(_SizedController):
    """SVIP: stop when sqrt(coef * H) > threshold, H the entropy (nats) behind the level just drafted."""

    name = "svip"

    def __init__(self, coef: float = 0.15, threshold: float = 0.3, size: int | None = None, *,
                 device: str | None = None) -> None:
        super().__init__(size, device=device)
        self.coef = float(coef)
        self.threshold = float(threshold)

    def should_stop(self, state: DraftState) -> bool:
        # max(0, .) guards against a tiny negative entropy from float round-off.
        return math.sqrt(self.coef * max(0.0, float(state.last_entropy))) > self.threshold

    def describe(self) -> dict:
        return {"name": self.name, "coef": self.coef, "threshold": self.threshold, "size": self.size}


class ConfidenceController(_SizedController):
    """Confidence threshold: stop once the best child's conditional draft probability falls under `threshold`."""

    name = "confidence"

    def __init__(self, threshold: float = 0.4, size: int | None = None, *, device: str | None = None) -> None:
        super().__init__(size, device=device)
        self.threshold = float(threshold)

    def should_stop(self, state: DraftState) -> bool:
        return float(state.last_top_prob) < self.threshold

    def describe(self) -> dict:
        return {"name": self.name, "threshold": self.threshold, "size": self.size}


class HFHeuristicController(_SizedController):
    """transformers' `num_assistant_tokens_schedule="heuristic"`: draft `target` levels; after each cycle the
    target grows by 2 if every drafted token was accepted, else shrinks by 1 (never below 1, never above
    `max_depth` when given). `reset()` restores `initial_depth` (HF keeps it across calls: "heuristic_transient"
    resets, which is what per-generation evaluation wants)."""

    name = "hf_heuristic"

    def __init__(self, initial_depth: int = 5, max_depth: int | None = None, size: int | None = None, *,
                 device: str | None = None) -> None:
        super().__init__(size, device=device)
        if initial_depth < 1:
            raise ValueError(f"initial_depth must be >= 1, got {initial_depth}")
        if max_depth is not None and max_depth < 1:
            raise ValueError(f"max_depth must be >= 1 or None, got {max_depth}")
        self.initial_depth = int(initial_depth)
        self.max_depth = None if max_depth is None else int(max_depth)
        self.target = self._clip(self.initial_depth)

    def _clip(self, depth: int) -> int:
        depth = max(1, depth)
        return min(depth, self.max_depth) if self.max_depth is not None else depth

    def reset(self) -> None:
        self.target = self._clip(self.initial_depth)

    def should_stop(self, state: DraftState) -> bool:
        return state.depth >= self.target

    def observe(self, record: CycleRecord) -> None:
        fully_accepted = record.accepted >= record.depth
        self.target = self._clip(self.target + 2 if fully_accepted else self.target - 1)

    def describe(self) -> dict:
        return {"name": self.name, "initial_depth": self.initial_depth, "max_depth": self.max_depth,
                "size": self.size}


class GammaTuneController(_SizedController):
    """GammaTune-style switching (the exact published rule is unavailable; this follows LTD's settings).

    An EMA (rate `rate`) of the per-cycle acceptance ratio accepted/depth selects the depth: `gamma_max` while the
    EMA is at least `switch_at`, `gamma_min` otherwise. Defaults: gamma_min = half the default depth, gamma_max =
    1.5x it, rate 0.2. The EMA starts at `switch_at` (optimistic: start long) and is reset per generation.
    """

    name = "gammatune"

    def __init__(self, gamma_min: int | None = None, gamma_max: int | None = None, rate: float = 0.2,
                 switch_at: float = 0.5, size: int | None = None, *, device: str | None = None) -> None:
        super().__init__(size, device=device)
        base = default_static_config(device)[0]
        self.gamma_min = max(1, int(gamma_min if gamma_min is not None else base // 2))
        self.gamma_max = max(self.gamma_min, int(gamma_max if gamma_max is not None else math.ceil(1.5 * base)))
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        self.rate = float(rate)
        self.switch_at = float(switch_at)
        self.ema = self.switch_at

    @property
    def target(self) -> int:
        return self.gamma_max if self.ema >= self.switch_at else self.gamma_min

    def reset(self) -> None:
        self.ema = self.switch_at

    def should_stop(self, state: DraftState) -> bool:
        return state.depth >= self.target

    def observe(self, record: CycleRecord) -> None:
        ratio = min(1.0, record.accepted / record.depth) if record.depth > 0 else 0.0
        self.ema = (1.0 - self.rate) * self.ema + self.rate * ratio

    def describe(self) -> dict:
        return {"name": self.name, "gamma_min": self.gamma_min, "gamma_max": self.gamma_max, "rate": self.rate,
                "switch_at": self.switch_at, "size": self.size}


class RandomDepthController(Controller):
    """A training partner, not a heuristic: draft a depth drawn uniformly from [low, high] each cycle (drawn before
    drafting; depth 0 is a plain target step, where the env lets the partner skip), verify `size`. The paper trains
    the size policy against depths drawn from [1, 12].

    `seed(seed)` reseeds its generator; the environments call it at every reset with a seed drawn from their own
    seeded generator, so an environment seed reproduces the partner's depths too.
    """

    name = "random_depth"

    def __init__(self, low: int = 1, high: int = 12, size: int | None = None, *, seed: int | None = None,
                 device: str | None = None) -> None:
        if not 0 <= int(low) <= int(high):
            raise ValueError(f"RandomDepthController needs 0 <= low <= high, got low={low}, high={high}")
        self.low, self.high = int(low), int(high)
        self.size = _default_size(size, device)
        self.rng = np.random.default_rng(seed)
        self._target = self.low

    def seed(self, seed: int | None) -> None:
        self.rng = np.random.default_rng(seed)

    def skip_drafting(self, state: DraftState) -> bool:
        self._target = int(self.rng.integers(self.low, self.high + 1))
        return self._target == 0

    def should_stop(self, state: DraftState) -> bool:
        return state.depth >= max(self._target, 1)

    def choose_size(self, state: DraftState) -> int:
        return self.size

    def describe(self) -> dict:
        return {"name": self.name, "low": self.low, "high": self.high, "size": self.size}


HEURISTICS: dict[str, type[Controller]] = {
    "ddd": DDDController,
    "svip": SVIPController,
    "confidence": ConfidenceController,
    "hf_heuristic": HFHeuristicController,
    "gammatune": GammaTuneController,
}


def make_heuristic(name: str, **kwargs) -> Controller:
    """Build a heuristic by registry name, e.g. `make_heuristic("ddd", threshold=-0.5, size=12)`."""
    try:
        cls = HEURISTICS[name]
    except KeyError:
        raise ValueError(f"unknown heuristic {name!r}; choose one of {sorted(HEURISTICS)}") from None
    return cls(**kwargs)
