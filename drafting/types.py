"""Plain data the decoder exchanges with controllers, environments and evaluation.

TreeConfig fixes the shape of the draft tree; DraftState is what a controller sees after each draft forward;
CycleRecord is what one draft-and-verify cycle did and cost; GenerationOutput is a whole generation.
Nothing here runs a model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree (EAGLE-2/3 style dynamic tree).

    width: beam width W. Each draft forward expands the W frontier nodes; their W*W children are all candidates and
        the global top-W (by cumulative draft log-probability) become the next frontier. W=1 drafts a chain.
    max_depth: most draft forwards in one cycle; a controller may stop earlier, never later.
    max_size: most drafted candidates verified in one target forward (the root is verified in addition).
    """

    width: int = 8
    max_depth: int = 12
    max_size: int = 64

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"TreeConfig.width must be >= 1, got {self.width}")
        if self.max_depth < 1:
            raise ValueError(f"TreeConfig.max_depth must be >= 1, got {self.max_depth}")
        if self.max_size < 1:
            raise ValueError(f"TreeConfig.max_size must be >= 1, got {self.max_size}")

    def num_candidates(self, depth: int) -> int:
        """Candidates in a tree of `depth` levels: W at level 1, W*W at each later level."""
        return self.width + (depth - 1) * self.width * self.width if depth > 0 else 0


@dataclass
class DraftState:
    """What a controller sees after a draft forward (all scores are cumulative draft log-probabilities, <= 0).

    depth: draft forwards done in this cycle (1..max_depth).
    context_len: committed tokens (prompt + emitted so far) at the start of the cycle.
    frontier_scores: scores of the W*W (W at depth 1) children produced by the last forward, sorted descending.
    candidate_scores: scores of every candidate drafted this cycle, sorted descending (the pool V is taken from).
    last_top_prob: draft probability of the best child at the last level, conditional on its parent.
    last_entropy: entropy (nats) of the draft distribution at the best frontier node of the previous level, i.e. the
        distribution the last level's best child was taken from.
    new_tokens: tokens emitted so far in this generation; max_new_tokens: its budget.
    prev_accepted / prev_depth: drafted tokens accepted by / levels drafted in the previous cycle of this generation
        (0 / 0 before the first verification). Acceptance is persistent (repetitive spans stay easy), so the last
        outcome is the cheapest predictor of the next one.
    level_scores: the last level's scores in drafting order (the parents best-first, each parent's children
        best-first: the order the drafter produces them in, so reading them costs no sort). None (hand-built
        states): the sorted frontier_scores stand in.
    """

    depth: int
    max_depth: int
    width: int
    context_len: int
    frontier_scores: torch.Tensor
    candidate_scores: torch.Tensor
    last_top_prob: float
    last_entropy: float
    new_tokens: int
    max_new_tokens: int
    prev_accepted: int = 0
    prev_depth: int = 0
    level_scores: torch.Tensor | None = None

    @property
    def num_candidates(self) -> int:
        return int(self.candidate_scores.numel())


@dataclass
class CycleRecord:
    """One draft-and-verify cycle.

    depth: draft forwards; size: drafted candidates verified (the root is verified in addition);
    accepted: drafted tokens accepted; emitted: tokens appended to the output (accepted + 1 bonus/correction token,
    fewer only when EOS or max_new_tokens cut the cycle short). Acceptance length tau counts the bonus: emitted.
    Times in seconds, measured with perf_counter after device synchronisation:
    draft_s: draft forwards and tree bookkeeping; verify_s: target forward, acceptance and cache compaction;
    policy_s: time spent inside the controller's decisions.
    """

    depth: int
    size: int
    accepted: int
    emitted: int
    draft_s: float
    verify_s: float
    policy_s: float
    context_len: int

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s + self.policy_s


@dataclass
class GenerationOutput:
    """A finished generation. `tokens` are the new tokens only; `token_times` the perf_counter offsets (seconds,
    from the first timed step) at which each new token became available, for TTFT and inter-token latency."""

    tokens: list[int]
    prompt_len: int
    cycles: list[CycleRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    total_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finished_by: str = "length"  # "eos" | "length"
    text: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.total_s if self.total_s > 0 else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens emitted per cycle, bonus token included."""
        return sum(c.emitted for c in self.cycles) / len(self.cycles) if self.cycles else float("nan")

    @property
    def policy_s(self) -> float:
        return sum(c.policy_s for c in self.cycles)

    @property
    def draft_s(self) -> float:
        return sum(c.draft_s for c in self.cycles)

    @property
    def verify_s(self) -> float:
        return sum(c.verify_s for c in self.cycles)


class LazyDraftState(DraftState):
    """A DraftState whose score vectors are sorted (and moved to the CPU) only when a controller reads them, so
    controllers that ignore scores (fixed configs, schedules) add no sorting or device syncs to the hot loop."""

    def __init__(self, *, scores: torch.Tensor, level_start: int, ranking=None, scores_view=None, size: int = 0,
                 **fields) -> None:
        self._scores, self._level_start = scores, level_start  # scores: [num_candidates] on the model's device
        # a CPU tree's whole score buffer as a numpy view (None elsewhere) and the candidates drafted so far
        self._scores_view, self._size = scores_view, size
        self._ranking = ranking  # DraftTree.ranking: the sort verification uses (so the two share it)
        self._frontier = self._candidates = None
        super().__init__(frontier_scores=None, candidate_scores=None, level_scores=None, **fields)

    @property
    def level_scores(self) -> torch.Tensor | np.ndarray:
        if self._scores_view is not None:  # a numpy slice: no torch op on the depth policy's path
            return self._scores_view[self._level_start: self._size]
        return self._scores[self._level_start:].cpu()

    @level_scores.setter
    def level_scores(self, value) -> None:
        pass  # always read from the tree

    @property
    def frontier_scores(self) -> torch.Tensor:
        if self._frontier is None:
            self._frontier = torch.sort(self._scores[self._level_start:], descending=True).values.cpu()
        return self._frontier

    @frontier_scores.setter
    def frontier_scores(self, value) -> None:
        if value is not None:
            self._frontier = value

    @property
    def candidate_scores(self) -> torch.Tensor:
        if self._candidates is None:
            values = self._ranking()[0] if self._ranking is not None else None
            if values is None or values.numel() != self._scores.numel():  # the tree grew since this state
                values = torch.sort(self._scores, descending=True).values
            self._candidates = values.cpu()
        return self._candidates

    @candidate_scores.setter
    def candidate_scores(self, value) -> None:
        if value is not None:
            self._candidates = value

    @property
    def num_candidates(self) -> int:
        return int(self._scores.numel())
