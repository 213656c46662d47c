"""Plain data the decoder exchanges with controllers, environments and evaluation.

TreeConfig fixes the shape of the draft tree; DraftState is what a controller sees after each draft forward;
CycleRecord is what one draft-and-verify cycle did and cost; GenerationOutput is a whole generation.
Nothing here runs a model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specpilot.drafting.checks import check_float, check_int
from specpilot.drafting.cycle_math import num_candidates


NEAR_TIE_ON = 2.0  # the guard's width when switched on (--guard on), in rounding scales
# the guard's default by dtype: off in fp32 (rounding never decides there at the margins that occur); off in half
# precision too, because it did not pay: on 32 held-out prompts the embedded pair's bf16 speculative output equalled
# bf16 AR on all but one (an exact bf16 tie, where it matched fp32 AR instead); the guard fixes that one but buys no
# agreement with fp32 AR and adds target forwards (+12% at 2 scales, +85% at 8 on code; README "Half precision").
# Re-measure with `specpilot agreement --guard on` on a new pair or GPU.
NEAR_TIE_DEFAULT = {torch.float32: 0.0, torch.bfloat16: 0.0, torch.float16: 0.0}


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree (EAGLE-2/3 style dynamic tree).

    width: beam width W. Each draft forward expands the W frontier nodes; their W*W children are all candidates and
        the global top-W (by cumulative draft log-probability) become the next frontier. W=1 drafts a chain.
    max_depth: most draft forwards in one cycle; a controller may stop earlier, never later.
    max_size: most drafted candidates verified in one target forward (the root is verified in addition).
    sampled_children: at temperature > 0, draw each node's children from the draft's sampling distribution without
        replacement and verify them by recursive rejection sampling (True), or take the top-W and verify by drawing
        from the target (False; accepts only when the target happens to sample one of W fixed tokens). Both are
        exact; greedy decoding always takes the top-W.
    near_tie: greedy near-tie guard (drafting/verify.py), in rounding scales of the target's dtype: stop accepting
        where the verify forward's top-1/top-2 margin is below near_tie * eps(dtype) * max(1, |top-1 logit|) and let
        a one-token forward decide that token. 0 = off; None = the dtype's default (`near_tie_units`: off in fp32).
    """

    width: int = 8
    max_depth: int = 12
    max_size: int = 64
    sampled_children: bool = True
    near_tie: float | None = None

    def __post_init__(self) -> None:
        # integers only (a float width would build fractional tree shapes); numpy integers become plain ints
        for name in ("width", "max_depth", "max_size"):
            object.__setattr__(self, name, check_int(f"TreeConfig.{name}", getattr(self, name), minimum=1))
        if self.near_tie is not None:
            object.__setattr__(self, "near_tie", check_float("TreeConfig.near_tie", self.near_tie, minimum=0.0))

    def near_tie_units(self, dtype: torch.dtype) -> float:
        """The guard's width for a target computing in `dtype`: near_tie when set, else NEAR_TIE_DEFAULT[dtype]."""
        if self.near_tie is not None:
            return float(self.near_tie)
        return NEAR_TIE_DEFAULT.get(dtype, 0.0)

    def num_candidates(self, depth: int) -> int:
        """Candidates in a tree of `depth` levels: W at level 1, W*W at each later level."""
        return num_candidates(self.width, depth)


def _to_numpy(scores) -> np.ndarray:
    """A float32 numpy view (CPU tensors, arrays) or copy (accelerator tensors) of a score vector."""
    if isinstance(scores, np.ndarray):
        return scores
    if isinstance(scores, torch.Tensor):
        if scores.device.type == "cpu" and not scores.requires_grad:
            return scores.numpy()
        return scores.detach().cpu().numpy()
    return np.asarray(scores, dtype=np.float32)


_EMPTY = np.zeros(0, dtype=np.float32)


class DraftState:
    """What a controller sees: before drafting (depth 0) and after every draft forward of a cycle.

    All scores are cumulative draft log-probabilities (<= 0), float32 numpy arrays, built lazily: a controller that
    never reads a score vector costs no sort and no device transfer.

    depth: draft forwards done in this cycle (0 = nothing drafted yet: the controller may skip drafting and let the
        target take one plain step; 1..max_depth after each forward).
    context_len: committed tokens (prompt + emitted so far) at the start of the cycle.
    scores: every candidate drafted so far, in node order (level by level; within a level the parents best-first,
        each parent's children best-first: the order the drafter produces them in). Empty at depth 0.
    level_scores: the last level's scores in drafting order (a view of `scores`: no sort).
    frontier_scores: the last level's scores sorted descending.
    candidate_scores: all candidates' scores sorted descending (the pool the verification size is taken from).
    candidate_ids / candidate_depths: the node id (int64) / tree depth (1..depth, float32) of each candidate in
        candidate_scores' order.
    last_top_prob: draft probability of the best child at the last level, conditional on its parent (1.0 at depth 0).
    last_entropy: entropy (nats) of the draft distribution the last level's best child was taken from (0 at depth 0).
    new_tokens: tokens emitted so far in this generation; max_new_tokens: its budget.
    prev_accepted / prev_depth: drafted tokens accepted by / levels drafted in the previous cycle of this generation
        (0 / 0 before the first verification and after a plain step). Acceptance is persistent (repetitive spans
        stay easy), so the last outcome is the cheapest predictor of the next one.
    acceptance: running acceptance rate of this generation's speculative cycles (EMA of accepted / depth, starting
        at 1; plain steps leave it unchanged), so a policy that stopped speculating still sees when to come back.
    batch_size: sequences decoded together in this cycle (1 for `generate`; the live rows of a batched session,
        `specpilot.drafting.batch`): the load, which decides what a verified token costs.
    context_max / context_mean: longest / mean committed length over those sequences (both = context_len at
        batch size 1): the attention cost of the batch's verify pass grows with them.
    """

    __slots__ = ("depth", "max_depth", "width", "context_len", "new_tokens", "max_new_tokens", "prev_accepted",
                 "prev_depth", "acceptance", "last_top_prob", "last_entropy", "batch_size", "context_max",
                 "context_mean", "_scores", "_level_start",
                 "_sorted_source", "_ids_source", "_np", "_frontier", "_candidates", "_ids", "_depths")

    def __init__(self, *, depth: int, max_depth: int, width: int, context_len: int, scores=None,
                 level_start: int = 0, last_top_prob: float = 1.0, last_entropy: float = 0.0, new_tokens: int = 0,
                 max_new_tokens: int = 1, prev_accepted: int = 0, prev_depth: int = 0, acceptance: float = 1.0,
                 sorted_scores=None, batch_size: int = 1, context_max: int | None = None,
                 context_mean: float | None = None, sorted_ids=None) -> None:
        self.depth, self.max_depth, self.width, self.context_len = depth, max_depth, width, context_len
        self.batch_size = batch_size
        self.context_max = context_len if context_max is None else context_max
        self.context_mean = float(context_len if context_mean is None else context_mean)
        self.new_tokens, self.max_new_tokens = new_tokens, max_new_tokens
        self.prev_accepted, self.prev_depth, self.acceptance = prev_accepted, prev_depth, acceptance
        self.last_top_prob, self.last_entropy = last_top_prob, last_entropy
        self._scores = _EMPTY if scores is None else scores   # numpy array or torch tensor, node order
        self._level_start = level_start
        # optional provider of the candidates sorted descending (the decoder passes the sort verification uses)
        self._sorted_source = sorted_scores
        self._ids_source = sorted_ids  # the same for their node ids (DraftTree.sorted_ids)
        self._np = self._frontier = self._candidates = self._ids = self._depths = None

    @classmethod
    def from_levels(cls, levels: list, **fields) -> "DraftState":
        """A state from per-level score lists (tests, synthetic states): depth = len(levels)."""
        arrays = [np.asarray(level, dtype=np.float32) for level in levels]
        scores = np.concatenate(arrays) if arrays else _EMPTY
        start = int(scores.size - (arrays[-1].size if arrays else 0))
        return cls(depth=len(arrays), scores=scores, level_start=start, **fields)

    def detached(self) -> "DraftState":
        """A copy that owns its scores (numpy) and references no tree: safe to keep after the cycle."""
        return DraftState(depth=self.depth, max_depth=self.max_depth, width=self.width, context_len=self.context_len,
                          scores=self._all().copy(), level_start=self._level_start, last_top_prob=self.last_top_prob,
                          last_entropy=self.last_entropy, new_tokens=self.new_tokens,
                          max_new_tokens=self.max_new_tokens, prev_accepted=self.prev_accepted,
                          prev_depth=self.prev_depth, acceptance=self.acceptance, batch_size=self.batch_size,
                          context_max=self.context_max, context_mean=self.context_mean)

    def _all(self) -> np.ndarray:
        if self._np is None:
            self._np = _to_numpy(self._scores)
        return self._np

    @property
    def num_candidates(self) -> int:
        return int(self._scores.shape[0])

    @property
    def scores(self) -> np.ndarray:
        return self._all()

    @property
    def level_scores(self) -> np.ndarray:
        return self._all()[self._level_start:]

    @property
    def frontier_scores(self) -> np.ndarray:
        if self._frontier is None:
            self._frontier = -np.sort(-self.level_scores)
        return self._frontier

    @property
    def candidate_scores(self) -> np.ndarray:
        if self._candidates is None:
            values = self._sorted_source() if callable(self._sorted_source) else self._sorted_source
            if values is None or values.shape[0] != self.num_candidates:  # e.g. the tree grew since this state
                self._candidates = -np.sort(-self._all())
            else:
                self._candidates = _to_numpy(values)
        return self._candidates

    @property
    def candidate_ids(self) -> np.ndarray:
        if self._ids is None:
            ids = self._ids_source() if callable(self._ids_source) else self._ids_source
            if ids is None or ids.shape[0] != self.num_candidates:  # none given, or the tree grew since this state
                # the verification order: scores descending, ties by node id (`DraftTree.ranking`'s stable sort)
                ids = np.argsort(-self._all(), kind="stable")
            self._ids = np.asarray(ids.cpu() if hasattr(ids, "cpu") else ids, dtype=np.int64)
        return self._ids

    @property
    def candidate_depths(self) -> np.ndarray:
        if self._depths is None:
            # node ids are level by level, W at level 1 and W*W at each later one, so an id gives its depth
            ids, w = self.candidate_ids, self.width
            self._depths = np.where(ids < w, 1, 2 + (ids - w) // (w * w)).astype(np.float32)
        return self._depths

    def __repr__(self) -> str:
        return (f"DraftState(depth={self.depth}/{self.max_depth}, width={self.width}, "
                f"candidates={self.num_candidates}, context_len={self.context_len}, batch_size={self.batch_size}, "
                f"new_tokens={self.new_tokens}/{self.max_new_tokens}, prev=({self.prev_accepted}, {self.prev_depth}))")


@dataclass
class CycleRecord:
    """One draft-and-verify cycle.

    depth: draft forwards (0: a plain target step, nothing drafted); size: drafted candidates verified (the root is
    verified in addition; 0 for a plain step); accepted: drafted tokens accepted; emitted: tokens appended to the
    output (accepted + 1 bonus/correction token, fewer only when EOS or max_new_tokens cut the cycle short).
    Acceptance length tau counts the bonus: emitted.
    Times in seconds, measured with perf_counter after device synchronisation:
    draft_s: draft forwards and tree bookkeeping (ranking included); verify_s: target forward, acceptance and cache
    compaction; cycle_s = draft_s + verify_s: the cycle time (what rewards, replay and the oracle count);
    policy_s: decision time, the controller's calls, kept apart from the cycle time (replay charges none).
    level_s: draft time of each level (the first includes catching the drafter up on `fed` committed tokens);
    fed: committed tokens the cycle's first draft forward fed (0 for a plain step).
    """

    depth: int
    size: int
    accepted: int
    emitted: int
    draft_s: float
    verify_s: float
    policy_s: float
    context_len: int
    level_s: tuple[float, ...] = ()
    fed: int = 0

    @property
    def cycle_s(self) -> float:
        """The cycle time: drafting + verification, decision time (policy_s) excluded."""
        return self.draft_s + self.verify_s


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
    finished_by: str = "length"  # "eos" | "length" | "stop" (a stop string); "unfinished" for a session's output()
    # taken before it is done
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
