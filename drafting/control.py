"""The one interface that steers the decoder: fixed configs, heuristics, PPO policies and exported policies.

It lives beside the cycle that calls it (`specpilot.drafting.cycle`); `specpilot.policies` re-exports it with every
controller built on it. The decoder calls, in each cycle:
    skip_drafting(state) before drafting (state.depth == 0; default False): True skips drafting and the target
        takes one plain step (one token): speculation switched off for this cycle,
    should_stop(state) after every draft forward (never at max_depth: the decoder stops there by itself),
    choose_size(state) once drafting stopped, returning how many drafted candidates to verify (>= 1),
    observe(record) after verification (feedback for adaptive heuristics).
reset() is called at the start of every generation, and may_draft() (default True) before its prefill. The decoder
times every call; controllers need not.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from specpilot.drafting.checks import check_int
from specpilot.drafting.types import CycleRecord, DraftState


class Controller(ABC):
    """Decides draft depth (CONTINUE/STOP after each level) and verification size for each cycle."""

    name: str = "controller"

    def reset(self) -> None:
        """Start of a new generation: forget per-generation state."""

    def skip_drafting(self, state: DraftState) -> bool:
        """True to skip drafting this cycle (state.depth == 0): the target takes one plain step."""
        return False

    @abstractmethod
    def should_stop(self, state: DraftState) -> bool:
        """True to stop drafting after the level just drafted."""

    @abstractmethod
    def choose_size(self, state: DraftState) -> int:
        """Number of drafted candidates to verify (1..state.num_candidates; larger values are clipped)."""

    def observe(self, record: CycleRecord) -> None:
        """Feedback after verification."""

    def may_draft(self) -> bool:
        """False when this controller skips drafting on every cycle (a depth-0 config): `generate` then starts a
        target-only session (no drafter prefill, no EAGLE features; every cycle a plain step), so speculation
        switched off costs what autoregressive decoding costs."""
        return True

    def check_tree(self, tree) -> None:
        """Raise ValueError when this controller cannot steer `tree` as configured (its depths or sizes would be
        capped, or its policies observe another tree's shape); the decoder asks before every generation."""

    def actor_questions(self) -> frozenset[str]:
        """The questions ("skip", "stop", "size") this controller answers with a policy network: replay charges
        each of them the decision time measured with the latency profile (`LatencyProfile.decision`), as the live
        decoder's clock charges it (a rule or a fixed config answers in a few microseconds: not charged)."""
        return frozenset()

    def describe(self) -> dict:
        """JSON-able description for reports and manifests."""
        return {"name": self.name}


def default_static_config(device: str | None = None) -> tuple[int, int]:
    """(depth, size) used when nothing better is known: small trees on CPU, EAGLE-3's (8, 60) on GPU."""
    if device is not None and str(device).startswith("cuda"):
        return 8, 60
    return 4, 12


class FixedController(Controller):
    """A static (depth, size) configuration: draft exactly `depth` levels, verify the top `size` candidates.
    depth 0 never drafts: every cycle is a plain target step (autoregressive decoding through the decoder).

    With no arguments it uses `default_static_config()` for the CPU (a GPU default when device="cuda"); those
    defaults are fitted to the decoder's tree (a shallower tree stops drafting at its max_depth), while values given
    here that the tree cannot hold are refused by `check_tree` (SpeculativeDecoder.generate calls it).
    """

    name = "fixed"

    def __init__(self, depth: int | None = None, size: int | None = None, *, device: str | None = None) -> None:
        default_depth, default_size = default_static_config(device)
        self.depth = check_int("FixedController depth (0 = never draft)", default_depth if depth is None else depth,
                               minimum=0)
        # a controller that never drafts verifies nothing
        self.size = check_int("FixedController size", default_size if size is None else size,
                              minimum=0 if self.depth == 0 else 1)
        self._given = (depth is not None, size is not None)

    def check_tree(self, tree, *, parts: tuple[str, ...] = ("depth", "size")) -> None:
        """Refuse a tree this config does not fit: a depth beyond tree.max_depth would be capped at it, a size beyond
        tree.max_size clipped to it, both without a word. `parts`: the ones this config decides (a learned
        controller's fallback decides only what its actors do not)."""
        if "depth" in parts and self._given[0] and self.depth > tree.max_depth:
            raise ValueError(f"FixedController depth {self.depth} is deeper than the tree's max_depth "
                             f"{tree.max_depth}: use a depth in 0..{tree.max_depth}, or a deeper TreeConfig")
        if "size" in parts and self._given[1] and self.size > tree.max_size:
            raise ValueError(f"FixedController size {self.size} is larger than the tree's max_size {tree.max_size}: "
                             f"use a size in 1..{tree.max_size}, or a larger TreeConfig")

    def skip_drafting(self, state: DraftState) -> bool:
        return self.depth == 0

    def may_draft(self) -> bool:
        return self.depth > 0

    def should_stop(self, state: DraftState) -> bool:
        return state.depth >= self.depth

    def choose_size(self, state: DraftState) -> int:
        return self.size

    def describe(self) -> dict:
        return {"name": self.name, "depth": self.depth, "size": self.size}


def fits_tree(controller, tree) -> None:
    """Ask `controller` whether it can steer `tree` (`Controller.check_tree` raises when it cannot); a duck-typed
    controller without the method passes. The decoder, the environments (of their partners) and every wrapping
    controller ask through this."""
    check = getattr(controller, "check_tree", None)
    if check is not None:
        check(tree)


class DuckController(Controller):
    """A duck-typed controller (an object with should_stop and choose_size, not a Controller subclass) with the
    optional methods it lacks filled in as the Controller base defines them (never skip, no feedback, nothing to
    reset), so such an object steers the decoder as the README says it may."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, getattr(inner, "name", type(inner).__name__)

    def reset(self) -> None:
        if callable(getattr(self.inner, "reset", None)):
            self.inner.reset()

    def skip_drafting(self, state: DraftState) -> bool:
        skip = getattr(self.inner, "skip_drafting", None)
        return bool(skip(state)) if callable(skip) else False

    def should_stop(self, state: DraftState) -> bool:
        return self.inner.should_stop(state)

    def choose_size(self, state: DraftState) -> int:
        return self.inner.choose_size(state)

    def observe(self, record: CycleRecord) -> None:
        if callable(getattr(self.inner, "observe", None)):
            self.inner.observe(record)

    def may_draft(self) -> bool:
        may = getattr(self.inner, "may_draft", None)
        return bool(may()) if callable(may) else True

    def check_tree(self, tree) -> None:
        fits_tree(self.inner, tree)

    def actor_questions(self) -> frozenset[str]:
        questions = getattr(self.inner, "actor_questions", None)
        return questions() if callable(questions) else frozenset()

    def describe(self) -> dict:
        describe = getattr(self.inner, "describe", None)
        return describe() if callable(describe) else {"name": self.name}


def as_controller(obj) -> Controller:
    """`obj` as a Controller: a Controller as it is, a duck-typed one (should_stop and choose_size) wrapped in
    DuckController; a class instead of an instance, or an object without those two methods, is a TypeError."""
    if isinstance(obj, Controller):
        return obj
    if isinstance(obj, type):
        raise TypeError(f"controller must be an instance, got the class {obj.__name__}: pass {obj.__name__}(...)")
    if not all(callable(getattr(obj, name, None)) for name in ("should_stop", "choose_size")):
        raise TypeError(f"controller must be a specpilot Controller (FixedController, a heuristic, a learned or "
                        f"exported policy) or an object with should_stop(state) and choose_size(state), got "
                        f"{type(obj).__name__}")
    return DuckController(obj)


class DecisionLog(Controller):
    """Delegates every decision to `inner` and logs the (depth, size) of each cycle it observes (for reports,
    validation statistics and the evaluation's decision comparisons)."""

    def __init__(self, inner: Controller) -> None:
        self.inner, self.name = inner, getattr(inner, "name", "controller")
        self.log: list[tuple[int, int]] = []

    def reset(self) -> None:
        self.inner.reset()

    def skip_drafting(self, state: DraftState) -> bool:
        return self.inner.skip_drafting(state)

    def may_draft(self) -> bool:
        return self.inner.may_draft()

    def should_stop(self, state: DraftState) -> bool:
        return self.inner.should_stop(state)

    def choose_size(self, state: DraftState) -> int:
        return self.inner.choose_size(state)

    def observe(self, record: CycleRecord) -> None:
        self.log.append((record.depth, record.size))
        self.inner.observe(record)

    def actor_questions(self) -> frozenset[str]:
        return self.inner.actor_questions()

    def check_tree(self, tree) -> None:
        fits_tree(self.inner, tree)

    def describe(self) -> dict:
        return self.inner.describe()
