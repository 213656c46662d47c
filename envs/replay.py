"""Replay: exact counterfactual decoding from a recorded trace, timed by a latency profile.

Under greedy decoding the output does not depend on (depth, size), so a trace (`specpilot.envs.record`) gives the
exact accepted length of any choice at any position, and a latency profile (`specpilot.envs.profile`) its time.
`ReplaySession` implements the decoder's step protocol (`specpilot.drafting.cycle`) over those tables: the
DraftStates it returns carry the numbers the live `DecodingSession` computes, so the same `run_cycle`, controllers
and environments run on it unchanged (`specpilot.envs.environments`, `specpilot.envs.oracle`).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from specpilot.artifacts.contract import check_profile_belongs
from specpilot.artifacts.profile import profile_path
from specpilot.artifacts.trace import ARRAYS_FILE
from specpilot.drafting.cycle_math import (FED_AT_START, clip_size, emitted_count, level_bounds, next_fed,
                                           num_candidates, update_acceptance)
from specpilot.drafting.types import CycleRecord, DraftState
from specpilot.envs.profile import LatencyProfile
from specpilot.envs.record import Trace

_TRACES: dict[tuple[str, float], Trace] = {}


def load_trace(trace: str | Path | Trace) -> Trace:
    """A Trace from a directory / trace.npz path (cached per file: many envs share one copy) or a Trace."""
    if isinstance(trace, Trace):
        return trace
    path = Path(trace)
    npz = path if path.suffix == ".npz" else path / ARRAYS_FILE
    key = (str(npz.resolve()), npz.stat().st_mtime if npz.exists() else 0.0)
    if key not in _TRACES:
        _TRACES[key] = Trace.load(path)
    return _TRACES[key]


def load_profile(profile: str | Path | LatencyProfile | None, trace: Trace) -> LatencyProfile:
    if isinstance(profile, LatencyProfile):
        return profile
    if profile is None:
        if trace.path is None or not profile_path(trace.path).is_file():
            raise FileNotFoundError("no latency profile: pass profile= (a LatencyProfile or profile.json path) or "
                                    "keep profile.json next to trace.npz (`specpilot record` writes both)")
        profile = profile_path(trace.path)
    # a profile measured with another pair, dtype or tree would time these decisions with another model's latencies
    # (a profile.json copied next to a trace, or profile= from another run): refused, as training refuses it
    check_profile_belongs(trace, profile, given=f"the latency profile {profile}",
                          fix="replay a trace with the profile recorded beside it (`specpilot record` writes both), "
                              "or measure one with the trace's pair")
    return LatencyProfile.load(profile)


class PromptTables:
    """Everything replay needs about one prompt, precomputed with numpy (the env steps only index into it).

    n: tokens the generation emits; eos: whether it ends with EOS; acc[t, d-1, V]: accepted draft tokens;
    verify[t, V]: predicted verify time (V = 0: a plain target step).
    """

    def __init__(self, model: "ReplayModel", index: int) -> None:
        trace = model.trace
        self.model = model
        self.index = index
        self.rows = trace.positions(index)
        self.n, self.eos = trace.budget(index, model.max_new_tokens)
        self.prompt_len = len(trace.prompt(index))
        ranks = trace.arrays["onpath_rank"][self.rows][: self.n]                        # [n, D, D]
        sizes = np.arange(trace.max_size + 1)
        self.acc = (ranks[:, :, :, None] < sizes).sum(axis=2, dtype=np.int8)            # [n, D, max_size+1]
        self.context = self.prompt_len + np.arange(self.n)
        self.verify = model.profile.verify_table(trace.max_size, self.context)           # [n, max_size+1]

    def scores(self, t: int) -> np.ndarray:
        return self.model.trace.arrays["scores"][self.rows.start + t]

    def state(self, t: int, depth: int, prev_accepted: int = 0, prev_depth: int = 0,
              acceptance: float = 1.0) -> DraftState:
        """The DraftState the live decoder's session returns at position t after `depth` levels (0: before
        drafting), the previous cycle having accepted `prev_accepted` of `prev_depth` levels."""
        trace, row = self.model.trace, self.rows.start + t
        fields = dict(max_depth=trace.max_depth, width=trace.width, context_len=self.prompt_len + t, new_tokens=t,
                      max_new_tokens=self.model.max_new_tokens, prev_accepted=prev_accepted,
                      prev_depth=prev_depth, acceptance=acceptance)
        if depth == 0:
            return DraftState(depth=0, **fields)
        return DraftState(depth=depth, scores=trace.arrays["scores"][row, : trace.num_candidates(depth)],
                          level_start=level_bounds(trace.width, depth)[0],
                          last_top_prob=float(trace.arrays["top_prob"][row, depth - 1]),
                          last_entropy=float(trace.arrays["entropy"][row, depth - 1]), **fields)

    def emitted(self, t: int, depth: int, size: int) -> tuple[int, int]:
        """(accepted, emitted) of a cycle at position t drafting `depth` levels and verifying `size` (clipped)."""
        accepted = int(self.acc[t, depth - 1, size]) if depth > 0 else 0
        return accepted, emitted_count(accepted, self.n - t)


class ReplayModel:
    """A trace + a latency profile under a generation budget: per-prompt tables (cached) and cycle costs."""

    def __init__(self, trace: str | Path | Trace, profile: str | Path | LatencyProfile | None = None, *,
                 max_new_tokens: int | None = None) -> None:
        self.trace = load_trace(trace)
        self.profile = load_profile(profile, self.trace)
        if self.profile.max_depth < self.trace.max_depth:
            raise ValueError(f"the latency profile covers depth {self.profile.max_depth} but the trace "
                             f"{self.trace.max_depth}: measure the profile with the trace's tree")
        self.max_new_tokens = self.trace.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        self.trace.budget(0, self.max_new_tokens)  # validates the budget
        self.draft = self.profile.draft_table()[: self.trace.max_depth + 2, : self.trace.max_depth + 1]
        self._tables: dict[int, PromptTables] = {}

    @property
    def num_prompts(self) -> int:
        return self.trace.num_prompts

    def tables(self, index: int) -> PromptTables:
        tab = self._tables.get(index)
        if tab is None:
            tab = self._tables[index] = PromptTables(self, index)
        return tab

    def clip_size(self, depth: int, size: int) -> int:
        """The size the decoder actually verifies (`cycle_math.clip_size`): int or, elementwise, arrays."""
        return clip_size(size, num_candidates(self.trace.width, depth), self.trace.max_size)

    def draft_time(self, n_new: int, depth):
        """Modelled time of `depth` draft levels (an int, or an array of depths) whose first forward feeds
        `n_new` tokens (counts past max_depth + 1 cost like max_depth + 1)."""
        times = self.draft[min(n_new, self.trace.max_depth + 1), depth]
        return float(times) if np.ndim(times) == 0 else times


class _NoClock:
    """Replay does not time decisions: it charges the profile's measured decision time instead (`charges`)."""

    @staticmethod
    def now() -> float:
        return 0.0


class ReplaySession:
    """One recorded prompt's generation replayed step by step (the `specpilot.drafting.cycle` protocol).

    rng / time_noise: optional seeded Gaussian noise on the modelled times, in units of the profile's measured
    standard deviations (draft noise scaled by sqrt(depth)).
    charges: {question: seconds} charged to CycleRecord.policy_s each time that question is asked ("skip": the
    cycle state before drafting, "stop": after a level below max_depth, "size": the ranked tree), as the live clock
    charges a policy's answers (`LatencyProfile.decision_charges`); None: decisions are free (the training
    environments: the paper's reward leaves decision time out)."""

    clock = _NoClock()

    def __init__(self, model: ReplayModel, index: int, *, rng: np.random.Generator | None = None,
                 time_noise: float = 0.0, charges: dict[str, float] | None = None) -> None:
        self.model, self.tables, self.index = model, model.tables(index), index
        charges = charges or {}
        self._charge_skip, self._charge_stop, self._charge_size = (float(charges.get(q, 0.0))
                                                                   for q in ("skip", "stop", "size"))
        self._policy_s = 0.0
        self.max_depth = model.trace.max_depth
        self.rng, self.time_noise = rng, float(time_noise)
        self.t, self.n_new, self.depth = 0, FED_AT_START, 0
        self.prev, self.acceptance = (0, 0), 1.0
        self.cycles: list[CycleRecord] = []

    @property
    def done(self) -> bool:
        return self.t >= self.tables.n

    @property
    def can_draft(self) -> bool:
        """As DecodingSession.can_draft: an EAGLE head cannot draft while the whole context is one token."""
        return self.t > 0 or self.prompt_len > 1 or self.model.trace.header.get("pair", {}).get("drafter") != "eagle3"

    @property
    def finished_by(self) -> str | None:
        if not self.done:
            return None
        return "eos" if self.tables.eos else "length"

    @property
    def tokens_emitted(self) -> int:
        return self.t

    @property
    def prompt_len(self) -> int:
        return self.tables.prompt_len

    def draft_time(self, depth):
        """Modelled time of drafting `depth` levels (an int or an array of depths) in the cycle starting now."""
        return self.model.draft_time(self.n_new, depth)

    def _state(self) -> DraftState:
        return self.tables.state(self.t, self.depth, *self.prev, acceptance=self.acceptance)

    def cycle_state(self) -> DraftState:
        self._policy_s += self._charge_skip  # (asked only as the skip question)
        return self._state()

    def draft_level(self) -> DraftState:
        if self.depth >= self.max_depth:
            raise RuntimeError(f"cannot draft past max_depth={self.max_depth}; call verify()")
        self.depth += 1
        if self.depth < self.max_depth:  # the stop question follows every level below max_depth
            self._policy_s += self._charge_stop
        return self._state()

    def rank_candidates(self) -> None:
        self._policy_s += self._charge_size  # the size question follows

    def add_policy_time(self, seconds: float) -> None:
        pass

    def _times(self, depth: int, size: int) -> tuple[float, float]:
        draft_s = self.draft_time(depth) if depth else 0.0
        verify_s = float(self.tables.verify[self.t, size])
        if self.time_noise and self.rng is not None:
            noise = self.rng.normal(size=2) * self.time_noise
            draft_s = max(draft_s + noise[0] * self.model.profile.draft_std() * math.sqrt(depth), 1e-9) \
                if depth else 0.0
            verify_s = max(verify_s + noise[1] * self.model.profile.verify_std(), 1e-9)
        return draft_s, verify_s

    def verify(self, size: int) -> CycleRecord:
        depth = self.depth
        size = self.model.clip_size(depth, size)
        accepted, emitted = self.tables.emitted(self.t, depth, size)
        draft_s, verify_s = self._times(depth, size)
        record = CycleRecord(depth, size, accepted, emitted, draft_s, verify_s, self._policy_s,
                             self.prompt_len + self.t, fed=self.n_new if depth else 0)
        self._policy_s = 0.0
        self.t += emitted
        self.n_new = next_fed(depth, self.n_new, emitted)
        self.acceptance = update_acceptance(self.acceptance, accepted, depth)
        self.prev, self.depth = (accepted, depth), 0
        self.cycles.append(record)
        return record
