"""Dynamic-depth heuristics the LTD paper compares against, as Controllers.

Each heuristic decides *depth* only (when to stop drafting); the verification size is a constructor argument
(`size`, default: the CPU default of `default_static_config()`), which the decoder clips to the candidates drafted.

    DDDController         Brown et al. 2024: at check depths, stop if log(sum of beam path probabilities) < threshold
    SVIPController        Zhang et al. 2024: stop when sqrt(coef * H) > threshold, H the last level's draft entropy
    ConfidenceController  DISCO (unsupervised) / HF assistant_confidence_threshold: stop when p(top child) < threshold
    HFHeuristicController transformers' "heuristic" schedule: a depth target, +2 after a fully accepted draft, else -1
    GammaTuneController   acceptance-rate EMA switching between a short and a long depth

Decisions under load (batched decoding, `SpeculativeDecoder.generate_batch`: `state.batch_size` is the live rows):
    BatchTableController  a static (depth, size) per batch size: the entry of the largest batch size <= the current
                          one (the grid's per-batch-size answer; depth 0 = plain target steps, no drafting)
    SpeculateBelowBatch   another controller below batch size b, plain target steps at b and above
    BatchGuardController  a learned controller guarded by a BatchTableController: at the batch sizes where the
                          learned one lost to the table on validation, the table's entry decides

`HEURISTICS` maps short names to classes; `make_heuristic(name, **kw)` builds one.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from specpilot.drafting.checks import check_float, check_int
from specpilot.drafting.types import CycleRecord, DraftState
from specpilot.drafting.control import Controller, default_static_config, fits_tree


def _default_size(size: int | None, device: str | None) -> int:
    if size is None:
        return int(default_static_config(device)[1])
    return check_int("verification size", size, minimum=1)


class _SizedController(Controller):
    """Shared size handling: a constant verification size (a given one the tree cannot hold is refused)."""

    def __init__(self, size: int | None = None, *, device: str | None = None) -> None:
        self.size = _default_size(size, device)
        self._size_given = size is not None

    def check_tree(self, tree) -> None:
        if self._size_given and self.size > tree.max_size:
            raise ValueError(f"{type(self).__name__} size {self.size} is larger than the tree's max_size "
                             f"{tree.max_size}: use a size in 1..{tree.max_size}, or a larger TreeConfig")

    def choose_size(self, state: DraftState) -> int:
        return self.size


DDD_CHECK_DEPTHS = (5, 7, 9)  # the paper's checkpoints (a shallower tree drafts to its max_depth)


class DDDController(_SizedController):
    """Dynamic Depth Decoding: after each check depth, confidence = logsumexp of the beam's cumulative scores.

    The beam is the top-W frontier (`state.frontier_scores[:state.width]`, already sorted descending), so the
    confidence is log of the summed path probabilities of the W paths kept. Stop if confidence < threshold.
    """

    name = "ddd"

    def __init__(
        self,
        check_depths: tuple[int, ...] | None = None,
        threshold: float = -0.3,
        size: int | None = None,
        *,
        device: str | None = None,
    ) -> None:
        super().__init__(size, device=device)
        self._depths_given = check_depths is not None
        check_depths = DDD_CHECK_DEPTHS if check_depths is None else check_depths
        if isinstance(check_depths, (int, np.integer)) or not hasattr(check_depths, "__iter__"):
            raise TypeError(f"DDD check_depths must be a sequence of depths such as (5, 7, 9), got {check_depths!r}")
        self.check_depths = frozenset(check_int("DDD check depth", d, minimum=1) for d in check_depths)
        if not self.check_depths:  # nothing would ever be checked: refused here, not by min() mid-decoding
            raise ValueError("DDD check_depths is empty: give at least one depth, e.g. (5, 7, 9)")
        self.threshold = check_float("DDD threshold (a log-probability)", threshold)

    def check_tree(self, tree) -> None:
        super().check_tree(tree)
        if self._depths_given and min(self.check_depths) > tree.max_depth:  # never checked: always max_depth
            raise ValueError(f"DDD check depths {sorted(self.check_depths)} all lie past the tree's max_depth "
                             f"{tree.max_depth}: give check depths within 1..{tree.max_depth}")

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
        self.coef = check_float("SVIP coef", coef, minimum=0.0)
        self.threshold = check_float("SVIP threshold", threshold, minimum=0.0)

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
        self.threshold = check_float("confidence threshold (a probability)", threshold, minimum=0.0, maximum=1.0)

    def should_stop(self, state: DraftState) -> bool:
        return float(state.last_top_prob) < self.threshold

    def describe(self) -> dict:
        return {"name": self.name, "threshold": self.threshold, "size": self.size}


HF_INITIAL_DEPTH = 5  # transformers' num_assistant_tokens default


class HFHeuristicController(_SizedController):
    """transformers' `num_assistant_tokens_schedule="heuristic"`: draft `target` levels; after each cycle the
    target grows by 2 if every drafted token was accepted, else shrinks by 1 (never below 1, never above
    `max_depth` when given). `reset()` restores `initial_depth` (HF keeps it across calls: "heuristic_transient"
    resets, which is what per-generation evaluation wants)."""

    name = "hf_heuristic"

    def __init__(self, initial_depth: int | None = None, max_depth: int | None = None, size: int | None = None, *,
                 device: str | None = None) -> None:
        super().__init__(size, device=device)
        self._initial_given = initial_depth is not None  # the default may exceed a shallow tree: the schedule caps it
        self.initial_depth = check_int("initial_depth", HF_INITIAL_DEPTH if initial_depth is None else initial_depth,
                                       minimum=1)
        self.max_depth = None if max_depth is None else check_int("max_depth (or None)", max_depth, minimum=1)
        if self.max_depth is not None and self.initial_depth > self.max_depth:
            raise ValueError(f"hf_heuristic initial_depth {self.initial_depth} is above its max_depth "
                             f"{self.max_depth}: give an initial_depth in 1..{self.max_depth}")
        self.target = self._clip(self.initial_depth)

    def check_tree(self, tree) -> None:
        """A given initial or maximum depth past the tree's max_depth would be capped at it without a word (the
        schedule's growth beyond it is capped by design: it reaches the tree's depth and stays)."""
        super().check_tree(tree)
        for label, value, given in (("initial_depth", self.initial_depth, self._initial_given),
                                    ("max_depth", self.max_depth, self.max_depth is not None)):
            if given and value > tree.max_depth:
                raise ValueError(f"hf_heuristic {label} {value} is deeper than the tree's max_depth {tree.max_depth}: "
                                 f"use a depth in 1..{tree.max_depth}, or a deeper TreeConfig")

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
        self._given = {"gamma_min": gamma_min is not None, "gamma_max": gamma_max is not None}
        gamma_min = check_int("gamma_min", gamma_min, minimum=1) if gamma_min is not None else None
        gamma_max = check_int("gamma_max", gamma_max, minimum=1) if gamma_max is not None else None
        if gamma_min is not None and gamma_max is not None and gamma_min > gamma_max:
            raise ValueError(f"gammatune gamma_min {gamma_min} is above gamma_max {gamma_max}: the short depth must "
                             "not exceed the long one")
        self.gamma_min = gamma_min if gamma_min is not None else max(1, min(base // 2, gamma_max or base))
        self.gamma_max = gamma_max if gamma_max is not None else max(self.gamma_min, math.ceil(1.5 * base))
        self.rate = check_float("gammatune rate (an EMA weight)", rate, minimum=0.0, maximum=1.0, open_low=True)
        self.switch_at = check_float("switch_at (an acceptance rate)", switch_at, minimum=0.0, maximum=1.0)
        self.ema = self.switch_at

    def check_tree(self, tree) -> None:
        """A given gamma past the tree's max_depth would be capped at it without a word (the defaults, fitted to the
        device's default depth, may be: a shallower tree drafts to its max_depth)."""
        super().check_tree(tree)
        for label in ("gamma_min", "gamma_max"):
            if self._given[label] and getattr(self, label) > tree.max_depth:
                raise ValueError(f"gammatune {label} {getattr(self, label)} is deeper than the tree's max_depth "
                                 f"{tree.max_depth}: use a depth in 1..{tree.max_depth}, or a deeper TreeConfig")

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
        low, high = check_int("low", low, minimum=0), check_int("high", high, minimum=0)
        if low > high:
            raise ValueError(f"RandomDepthController needs 0 <= low <= high, got low={low}, high={high}")
        self.low, self.high = low, high
        self.size = _default_size(size, device)
        self._size_given = size is not None
        self.rng = np.random.default_rng(seed)
        self._target = self.low

    def seed(self, seed: int | None) -> None:
        self.rng = np.random.default_rng(seed)

    def check_tree(self, tree) -> None:
        """Depths past the tree's max_depth (or a given size past its max_size) would be capped without a word."""
        if self.high > tree.max_depth:
            raise ValueError(f"random depths up to {self.high} but the tree's max_depth is {tree.max_depth}: use a "
                             f"range within 0..{tree.max_depth}")
        if self._size_given and self.size > tree.max_size:
            raise ValueError(f"RandomDepthController size {self.size} is larger than the tree's max_size "
                             f"{tree.max_size}")

    def skip_drafting(self, state: DraftState) -> bool:
        self._target = int(self.rng.integers(self.low, self.high + 1))
        return self._target == 0

    def should_stop(self, state: DraftState) -> bool:
        return state.depth >= max(self._target, 1)

    def choose_size(self, state: DraftState) -> int:
        return self.size

    def describe(self) -> dict:
        return {"name": self.name, "low": self.low, "high": self.high, "size": self.size}


class BatchTableController(Controller):
    """A static (depth, size) per batch size. `table` maps a batch size to (depth, size); a cycle at batch size B
    uses the entry of the largest key <= B (below the smallest key: the smallest key's entry), as vLLM's
    `num_speculative_tokens_per_batch_size` ranges and SGLang's batch-size-keyed parameters look K up. Depth 0
    (size 0) never drafts: the target takes one plain step per cycle. At batch size 1 (`generate`) it is the
    static config of key 1."""

    name = "batch_table"

    def __init__(self, table: Mapping[int, tuple[int, int]]) -> None:
        if not isinstance(table, Mapping) or not table:
            raise ValueError("BatchTableController needs a non-empty {batch_size: (depth, size)} table")
        entries, keys = {}, {}
        for key, value in table.items():
            batch, depth, size = _table_entry(key, value)
            if batch in entries:  # {1: ..., "1": ...}: which one decides would depend on the dict's order
                raise ValueError(f"batch table names batch size {batch} twice: keys {keys[batch]!r} and {key!r}")
            entries[batch], keys[batch] = (batch, depth, size), key
        self.entries = sorted(entries.values())

    def entry(self, batch_size: int) -> tuple[int, int, int]:
        """(key, depth, size) deciding at `batch_size`: the entry of the largest key <= it (the smallest key below
        all), as the engines look their tables up."""
        chosen = self.entries[0]
        for entry in self.entries:
            if entry[0] <= batch_size:
                chosen = entry
        return chosen

    def lookup(self, batch_size: int) -> tuple[int, int]:
        """(depth, size) for `batch_size` (`entry`)."""
        _, depth, size = self.entry(batch_size)
        return depth, size

    def check_tree(self, tree) -> None:
        # a depth-0 entry never drafts, so it never verifies: its size does not have to fit
        deepest, largest = max(e[1] for e in self.entries), max(e[2] if e[1] else 0 for e in self.entries)
        if deepest > tree.max_depth or largest > tree.max_size:
            raise ValueError(f"batch table needs depth {deepest} and size {largest}; the tree holds max_depth "
                             f"{tree.max_depth}, max_size {tree.max_size}: use a larger TreeConfig")

    # stateless: every answer looks the batch size up in the state it is given (it cannot change within a cycle)
    def skip_drafting(self, state: DraftState) -> bool:
        return self.lookup(int(state.batch_size))[0] == 0

    def should_stop(self, state: DraftState) -> bool:
        return state.depth >= self.lookup(int(state.batch_size))[0]

    def choose_size(self, state: DraftState) -> int:
        return self.lookup(int(state.batch_size))[1]

    def describe(self) -> dict:
        return {"name": self.name, "table": {str(b): [d, s] for b, d, s in self.entries}}


def _table_entry(key, value) -> tuple[int, int, int]:
    """(batch size, depth, size) of one table entry: integer keys (or their decimal strings, as JSON stores them)
    and a (depth, size) pair of integers; else ValueError naming the entry (no truncation of 2.5 or "24")."""
    def bad(why: str) -> ValueError:
        return ValueError(f"batch table entry {key!r}: {value!r} is not batch_size: (depth, size) ({why})")

    if isinstance(key, str):
        if not key.strip().isdigit():
            raise bad("a batch size is a whole number")
        batch = int(key)
    else:
        try:
            batch = check_int("batch size", key)
        except (TypeError, ValueError):
            raise bad("a batch size is a whole number") from None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise bad("give two integers")
    try:
        depth, size = check_int("depth", value[0]), check_int("size", value[1])
    except (TypeError, ValueError):
        raise bad("depth and size are whole numbers") from None
    if batch < 1 or depth < 0 or size < (0 if depth == 0 else 1):
        raise ValueError(f"batch table entry {batch}: ({depth}, {size}) needs batch size >= 1, depth >= 0 "
                         "and size >= 1 when drafting (0 with depth 0)")
    return batch, depth, size


class SpeculateBelowBatch(Controller):
    """Speculation only under light load: `inner` decides while the batch holds fewer than `max_batch` sequences;
    at `max_batch` and above every cycle is a plain target step (batched autoregressive decoding). The plain steps
    it forces are not reported to `inner` (its adaptive state tracks its own cycles only)."""

    name = "speculate_below_batch"

    def __init__(self, inner: Controller, max_batch: int) -> None:
        if not isinstance(inner, Controller):
            raise TypeError(f"inner must be a Controller, got {type(inner).__name__}")
        self.inner, self.max_batch = inner, check_int("max_batch", max_batch, minimum=1)
        self._forced = False

    def reset(self) -> None:
        self._forced = False
        self.inner.reset()

    def check_tree(self, tree) -> None:
        fits_tree(self.inner, tree)

    def skip_drafting(self, state: DraftState) -> bool:
        self._forced = int(state.batch_size) >= self.max_batch
        return self._forced or self.inner.skip_drafting(state)

    def should_stop(self, state: DraftState) -> bool:
        return self.inner.should_stop(state)

    def choose_size(self, state: DraftState) -> int:
        return self.inner.choose_size(state)

    def observe(self, record: CycleRecord) -> None:
        # forgotten after each cycle: a cycle that asks no skip question (nothing to draft from yet) was not forced
        forced, self._forced = self._forced, False
        if not forced:
            self.inner.observe(record)

    def actor_questions(self) -> frozenset[str]:
        return self.inner.actor_questions()

    def describe(self) -> dict:
        return {"name": self.name, "max_batch": self.max_batch, "inner": self.inner.describe()}



class BatchGuardController(Controller):
    """A learned batch-aware controller that is never knowingly worse than the per-batch-size table: `fallback`
    lists the batch sizes (keys of `table`) where validation found the learned controller slower than `table`; a
    cycle at batch size B is decided by the table's entry when the largest key <= B (the table's lookup rule) is in
    `fallback`, else by `learned`. The choice is made at the skip question (the batch size cannot change within a
    cycle) and kept for the cycle. `learned` observes every cycle (its history features stay those of the batch).
    `train/rl/validation.batch_guard` picks `fallback` on a validation trace; RUN/batch_guard.json stores it
    (`to_dict` / `from_dict`), and the export's learned per-batch-size table is this controller's."""

    name = "batch_guard"

    def __init__(self, learned: Controller, table: Mapping[int, tuple[int, int]], fallback) -> None:
        if not isinstance(learned, Controller):
            raise TypeError(f"learned must be a Controller, got {type(learned).__name__}")
        self.learned, self.table = learned, BatchTableController(table)
        keys = {e[0] for e in self.table.entries}
        self.fallback = sorted({int(b) for b in fallback})
        if not set(self.fallback) <= keys:
            raise ValueError(f"batch guard: fallback sizes {self.fallback} must be keys of the table {sorted(keys)}")
        self.name = getattr(learned, "name", "learned") + "_guarded"
        self._use_table = False

    def uses_table(self, batch_size: int) -> bool:
        """True where the table decides at `batch_size` (the largest table key <= it is a fallback size)."""
        return self.table.entry(batch_size)[0] in self.fallback

    def reset(self) -> None:
        self._use_table = False
        self.learned.reset()

    def check_tree(self, tree) -> None:
        self.table.check_tree(tree)
        fits_tree(self.learned, tree)

    def skip_drafting(self, state: DraftState) -> bool:
        self._use_table = self.uses_table(int(state.batch_size))
        return (self.table if self._use_table else self.learned).skip_drafting(state)

    def should_stop(self, state: DraftState) -> bool:
        return (self.table if self._use_table else self.learned).should_stop(state)

    def choose_size(self, state: DraftState) -> int:
        return (self.table if self._use_table else self.learned).choose_size(state)

    def observe(self, record: CycleRecord) -> None:
        self.learned.observe(record)

    def actor_questions(self) -> frozenset[str]:
        # replay runs one sequence: at batch size 1 the table or the learned controller answers every question
        return frozenset() if self.uses_table(1) else self.learned.actor_questions()

    def to_dict(self) -> dict:
        return {"table": {str(b): [d, v] for b, d, v in self.table.entries}, "fallback": self.fallback}

    @classmethod
    def from_dict(cls, learned: Controller, data: Mapping) -> "BatchGuardController":
        return cls(learned, {int(b): tuple(c) for b, c in data["table"].items()}, data.get("fallback", []))

    def describe(self) -> dict:
        return {"name": self.name, **self.to_dict(), "learned": self.learned.describe()}

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
