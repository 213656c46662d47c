"""Observation features for the depth and size policies: the ONE definition shared by the environments, the learned
controllers at inference and the exporter (so training and inference can never drift apart). It imports neither
gymnasium nor SB3: exported decoders load it (`specpilot.envs.spaces.observation_space` gives the matching Box).

Layout of an observation vector (float32, length 2*num_scores + 6, or 3*num_scores + 6 with candidate depths):

    [0, n)        scores: cumulative draft log-probs (depth: drafting order; size: sorted descending), clipped at
                  score_floor, divided by -score_floor, so in [-1, 0]; padding slots hold -1.0 ("improbable")
    [n, 2n)       mask: 1.0 for a real score, 0.0 for padding (padding is explicit: log p = 0 would mean p = 1)
    [2n, 3n)      only with the `candidate_depths` feature (size policies; on by default for them): the tree depth
                  of each sorted candidate / max_depth, in (0, 1]; padding 0. Sorted scores alone do not say
                  whether the 5th best candidate is a sibling at level 1 or a grandchild at level 3, which decides
                  what verifying it is worth (measured: README, "Candidate depths")
    2n (3n)       depth / max_depth                       [0, 1]   (0: before drafting, the skip decision)
    2n + 1        min(context_len / max_context, 1)       [0, 1]
    2n + 2        min(new_tokens / max_new_tokens, 1)     [0, 1]
    2n + 3        min(prev_accepted / max_depth, 1)       [0, 1]   the previous cycle's outcome (history: the
    2n + 4        min(prev_depth / max_depth, 1)          [0, 1]   draft scores alone predict acceptance poorly)
    2n + 5        acceptance                              [0, 1]   running acceptance rate of the speculative
                                                                   cycles: what a policy that stopped drafting sees
    2n + 6 ...    optional drafter features (`ObservationSpec.features`, in FEATURES order):
                  top_prob: last_top_prob, the drafter's conditional probability of its best child at the last
                  level [0, 1]; entropy: min(last_entropy / ENTROPY_SCALE, 1), the entropy of that distribution
                  (both 0 / 1 before drafting, as DraftState gives them);
                  batch: min(log2(batch_size) / BATCH_LOG2_SCALE, 1), the load: sequences decoded together this
                  cycle (0 at batch size 1, 1 at 64 and above); context_max: min(context_max / max_context, 1),
                  the batch's longest context (what the padded verify forward costs)

The depth policy sees the last level's W*W children (W at depth 1) in drafting order (`DraftState.level_scores`:
parents best-first, each parent's children best-first; no sort, which matters because the depth policy decides after
every level); the size policy the top `num_scores` candidates of the whole tree, sorted (default num_scores = the
largest verification size it can choose).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from specpilot.drafting.types import DraftState

SPEC_VERSION = 4  # 2: + previous cycle's accepted length and depth; 3: + depth-0 (skip) states, acceptance rate;
# 4: + optional drafter features (a version-3 spec is a version-4 spec without features: it still loads); the batch
# features were added as optional features too (off by default: a spec without them is unchanged)
READABLE_VERSIONS = (3, 4)
NUM_SCALARS = 6  # depth, context length, generation progress, previous accepted, previous depth, acceptance
FEATURES = ("top_prob", "entropy", "batch", "context_max")  # optional extra scalars, in this order
SLOT_FEATURES = ("candidate_depths",)  # optional per-candidate slots (size policies only)
ENTROPY_SCALE = 5.0  # nats mapped to 1.0 (a near-uniform draft distribution over >= e^5 ~ 150 tokens)
BATCH_LOG2_SCALE = 6.0  # log2(batch size) mapped to 1.0: batch size 64 (larger batches saturate)
BATCH_FEATURES = ("batch", "context_max")  # what a batch-aware policy observes on top of the defaults
DEFAULT_FEATURES: tuple[str, ...] = ()  # what for_depth / for_size (and so the environments) observe by default
DEFAULT_SIZE_FEATURES = ("candidate_depths",)  # what size policies observe on top of DEFAULT_FEATURES by default


@dataclass(frozen=True)
class ObservationSpec:
    """What a policy observes; stored next to every trained policy (policies.json, exports).

    version: layout version; bump when the feature layout changes so stale policies fail loudly.
    kind: "depth" (frontier scores) or "size" (top candidate scores).
    width: beam width W of the tree the policy was trained on.
    max_depth: most draft levels; normalises the depth feature.
    num_scores: score slots (depth: W*W; size: the largest verification size).
    score_floor: log-probs below it are clipped to it (-20: p < 2e-9 is indistinguishable from 0 for a policy).
    max_context: context length mapped to 1.0 (longer contexts saturate).
    features: optional drafter features appended to the scalars (a subset of FEATURES, kept in FEATURES order), and
        "candidate_depths" (size only: each candidate's depth, a block of num_scores slots after the mask).
    """

    kind: str
    width: int
    max_depth: int
    num_scores: int
    score_floor: float = -20.0
    max_context: int = 4096
    version: int = SPEC_VERSION
    features: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        known = FEATURES + SLOT_FEATURES
        unknown = [f for f in self.features if f not in known]
        if unknown:
            raise ValueError(f"ObservationSpec.features: unknown feature(s) {unknown}; known: {list(known)}")
        object.__setattr__(self, "features", tuple(f for f in known if f in self.features))
        if self.kind == "depth" and self.candidate_depths:
            raise ValueError("ObservationSpec.features: candidate_depths is a size-policy feature (a depth policy "
                             "sees one level, whose candidates all have the same depth)")
        if self.kind not in ("depth", "size"):
            raise ValueError(f"ObservationSpec.kind must be 'depth' or 'size', got {self.kind!r}")
        if self.num_scores < 1 or self.width < 1 or self.max_depth < 1 or self.max_context < 1:
            raise ValueError(f"ObservationSpec sizes must be >= 1: {self}")
        if not self.score_floor < 0:
            raise ValueError(f"ObservationSpec.score_floor must be negative, got {self.score_floor}")

    @property
    def candidate_depths(self) -> bool:
        """Whether the observation carries each candidate's depth (a third block of num_scores slots)."""
        return "candidate_depths" in self.features

    @property
    def num_scalars(self) -> int:
        return NUM_SCALARS + sum(f in FEATURES for f in self.features)

    @property
    def scalar_start(self) -> int:
        """Index of the first scalar slot: after the scores, the mask and (with candidate_depths) the depths."""
        return (3 if self.candidate_depths else 2) * self.num_scores

    @property
    def dim(self) -> int:
        return self.scalar_start + self.num_scalars

    def to_dict(self) -> dict:
        d = asdict(self)
        d["features"] = list(self.features)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "ObservationSpec":
        if not isinstance(data, dict):
            raise TypeError(f"an observation spec is a mapping of its fields, got {type(data).__name__} {data!r:.60}")
        version = int(data.get("version", -1))
        if version not in READABLE_VERSIONS:
            raise ValueError(
                f"observation spec version {version} does not match this specpilot's version {SPEC_VERSION} (it "
                f"reads {', '.join(map(str, READABLE_VERSIONS))}): retrain the policy (or use the specpilot version "
                "that trained it)"
            )
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        known["features"] = tuple(known.get("features") or ())
        if version < 4 and known["features"]:
            raise ValueError(f"observation spec version {version} has no drafter features, got {known['features']}")
        return cls(**{**known, "version": SPEC_VERSION})

    @classmethod
    def for_depth(cls, width: int, max_depth: int, **kw) -> "ObservationSpec":
        kw.setdefault("features", DEFAULT_FEATURES)
        return cls(kind="depth", width=width, max_depth=max_depth, num_scores=width * width, **kw)

    @classmethod
    def for_size(cls, width: int, max_depth: int, size_actions: list[int] | None = None,
                 num_scores: int | None = None, **kw) -> "ObservationSpec":
        if num_scores is None:
            if not size_actions:
                raise ValueError("ObservationSpec.for_size needs size_actions or num_scores")
            num_scores = max(size_actions)
        kw.setdefault("features", DEFAULT_FEATURES + DEFAULT_SIZE_FEATURES)
        return cls(kind="size", width=width, max_depth=max_depth, num_scores=int(num_scores), **kw)


def _template(spec: ObservationSpec) -> tuple[np.ndarray, np.float32]:
    """An all-padding observation (scores -1, mask 0, scalars 0) and the score scale, made once per spec and kept
    on it (not a field: equality, hashing and to_dict ignore it; a dict keyed by spec would hash 7 fields a call)."""
    entry = spec.__dict__.get("_template")
    if entry is None:
        n = spec.num_scores
        blank = np.zeros(spec.dim, dtype=np.float32)
        blank[:n] = -1.0
        entry = (blank, np.float32(-1.0 / spec.score_floor))
        object.__setattr__(spec, "_template", entry)  # frozen dataclass: set past the frozen __setattr__
    return entry


def scalars(state: DraftState, spec: ObservationSpec) -> tuple[float, ...]:
    """The observation's scalar slots [2n, dim) in layout order (the base scalars, then `spec.features`)."""
    depth = spec.max_depth
    values = (min(state.depth / depth, 1.0), min(state.context_len / spec.max_context, 1.0),
              min(state.new_tokens / state.max_new_tokens, 1.0) if state.max_new_tokens > 0 else 0.0,
              min(state.prev_accepted / depth, 1.0), min(state.prev_depth / depth, 1.0),
              min(max(float(state.acceptance), 0.0), 1.0))
    # float(): max/min return their first argument on ties, so an int field would make an int slot (the decision
    # kernel is compiled for a tuple of floats)
    if spec.features:
        if "top_prob" in spec.features:
            values += (min(max(float(state.last_top_prob), 0.0), 1.0),)
        if "entropy" in spec.features:
            values += (min(max(float(state.last_entropy), 0.0) / ENTROPY_SCALE, 1.0),)
        if "batch" in spec.features:
            values += (min(math.log2(max(state.batch_size, 1)) / BATCH_LOG2_SCALE, 1.0),)
        if "context_max" in spec.features:
            values += (min(state.context_max / spec.max_context, 1.0),)
    return values


def observed_scores(state: DraftState, spec: ObservationSpec) -> np.ndarray:
    """The raw scores (log-probs) in the observation's score slots: depth: the last level in drafting order; size:
    the top `num_scores` candidates, sorted descending."""
    values = state.level_scores if spec.kind == "depth" else state.candidate_scores
    return values[:spec.num_scores]


def _build(scores: np.ndarray, state: DraftState, spec: ObservationSpec) -> np.ndarray:
    # Few numpy calls on purpose: a decision runs right after a model forward has evicted the CPU caches, where
    # every distinct library call costs tens of microseconds (measured), not the ~1 us it costs in a warm loop.
    n = spec.num_scores
    values = scores[:n]  # size: sorted descending, so the first n are the top n; depth: all W*W
    k = values.shape[0]
    blank, scale = _template(spec)
    out = blank.copy()
    head = out[:k]
    # scale into [-1, 0] and clip there (the floor maps to -1). Scores are log-probs (<= 0) by contract; the
    # minimum only guards round-off above 0.
    np.multiply(values, scale, out=head, casting="unsafe")
    np.maximum(head, -1.0, out=head)  # two ufuncs: np.clip adds a Python-level wrapper
    np.minimum(head, 0.0, out=head)
    out[n:n + k] = 1.0
    if spec.candidate_depths:
        np.multiply(state.candidate_depths[:k], np.float32(1.0 / spec.max_depth), out=out[2 * n:2 * n + k])
    out[spec.scalar_start:] = scalars(state, spec)
    return out


def fold_first_layer(spec: ObservationSpec, weight: np.ndarray, bias: np.ndarray | None) -> list[np.ndarray]:
    """A first Linear layer (weight [out, dim], bias [out] or None) folded with the observation layout, for each
    count k = 0..num_scores of real scores: the float32 matrix A_k of shape (k + num_scalars + 1, out) with

        [max(scores[:k], score_floor), scalars(state, spec), 1] @ A_k == weight @ observation + bias

    up to float round-off (scores are log-probs, <= 0: the observation's clip at 0 only guards round-off). The score
    scale goes into the score rows; the constant slots (k mask ones, n - k padding scores at -1) and the bias into
    the last row, so a decision reads only the k real scores and the scalars. Folded in float64 and rounded once.
    With candidate_depths the input is [scores[:k], depths[:k], scalars, 1] (raw depths: 1 / max_depth is folded
    into their rows; padding depths are 0) and A_k has 2k + num_scalars + 1 rows."""
    n, m = spec.num_scores, spec.num_scalars
    w = np.asarray(weight, dtype=np.float64)
    b = np.zeros(w.shape[0]) if bias is None else np.asarray(bias, dtype=np.float64)
    scale = -1.0 / spec.score_floor
    first = spec.scalar_start
    folded = []
    for k in range(n + 1):
        const = b + w[:, n:n + k].sum(axis=1) - w[:, k:n].sum(axis=1)
        blocks = [w[:, :k].T * scale]
        if spec.candidate_depths:
            blocks.append(w[:, 2 * n:2 * n + k].T / spec.max_depth)
        rows = np.concatenate(blocks + [w[:, first:first + m].T, const[None, :]], axis=0)
        folded.append(np.ascontiguousarray(rows, dtype=np.float32))
    return folded


def depth_observation(state: DraftState, spec: ObservationSpec) -> np.ndarray:
    """Depth policy input: the last level's scores in drafting order (W*W children; W at depth 1; none at depth 0)
    + scalars."""
    return _build(state.level_scores, state, spec)


def size_observation(state: DraftState, spec: ObservationSpec) -> np.ndarray:
    """Size policy input: the top `spec.num_scores` candidate scores of the whole tree + scalars."""
    return _build(state.candidate_scores, state, spec)


def observe(state: DraftState, spec: ObservationSpec) -> np.ndarray:
    """Dispatch on spec.kind."""
    return depth_observation(state, spec) if spec.kind == "depth" else size_observation(state, spec)


CPU_SIZE_ACTIONS = [3, 4, 5, 7, 8, 15, 23, 31]  # with the root, verify blocks of 4, 5, 6, 8, 9, 16, 24, 32 rows


def default_size_actions(device: str | None = None) -> list[int]:
    """Verification sizes the size policy chooses from (and the grid sweeps, with 1): on GPU the paper's 12 linear
    bins over 20..240; on CPU small trees whose verify block (the candidates and the root) is a row count the CPU
    linears run at full width: a CPU product over 13 rows costs what it costs over 16 (`linear_kernels`' row plan
    pads 10-16 rows to 16), so 15 candidates are verified for the price of 12 (CPU_SIZE_ACTIONS)."""
    if device is not None and str(device).startswith("cuda"):
        return [int(v) for v in np.linspace(20, 240, 12)]
    return list(CPU_SIZE_ACTIONS)
