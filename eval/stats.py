"""Paired bootstrap intervals and verdicts: the statistics behind every interval and "faster / slower" in a report.

A *unit* is one (prompt, round) of an evaluation: every method ran that prompt in that round, back to back, so the
methods' times on a unit share the machine's state. A comparison of method A with method B uses the units both
ran and computes the *pooled ratio*

    ratio = (sum_u tokens_A(u) / sum_u time_A(u)) / (sum_u tokens_B(u) / sum_u time_B(u))

(A's throughput over B's: what a user of A instead of B sees). Its 95% interval is a paired percentile bootstrap:
resample the units with replacement (the *same* resampled units for A and B, so what the two share, such as the
prompt's length and the machine's load in that round, cancels), recompute the pooled ratio, and take the 2.5% and
97.5% percentiles of the resampled ratios. The interval is conditional on the prompts evaluated: it covers timing
noise and how the ratio varies over the units, not prompts the suite does not contain.

The *prompt-level* (cluster) interval resamples prompts instead: a *cluster* is one prompt with all its rounds,
which repeat the same text and (at T=0) the same decisions, so they are not independent draws. The statistic is
the same pooled ratio; each resample draws prompts with replacement and brings every round of a drawn prompt
along (`cluster_ratio_interval`). Its interval covers the choice of prompts as well as timing noise: "faster"
then means faster on prompts like these, not just on these. With prompt-level effects (some prompts suit a method
better than others) the unit interval is too narrow, because R rounds of one prompt count as R independent
units; the cluster interval is not (tests/test_stats_cluster.py measures both coverages on synthetic data). The
report's method comparisons use the cluster interval; the unit interval's half-width (timing noise only, which
more rounds shrink) is what the rounds' stopping rule watches.

Verdicts of a comparison: "same decisions" when the two methods made the same (depth, size) choice on every cycle
of every unit (their difference is then timing noise by construction: no percentage is printed), else "faster"
(the interval lies above 1), "slower" (below 1) or "indistinguishable" (it contains 1).

Everything here is pure numpy on arrays; `specpilot.eval.runner` and `specpilot.eval.report` feed it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 4000           # bootstrap resamples (>= 2000 keeps the 2.5% percentile's Monte-Carlo error small)
LEVEL = 0.95               # two-sided interval level
MIN_UNITS = 2              # fewer units: no interval (a bootstrap of one unit has zero width, and means nothing)
MIN_PROMPTS_TO_CONCLUDE = 5  # a group with fewer distinct prompts is reported as too small to conclude
VERDICTS = ("faster", "slower", "indistinguishable", "same decisions")


@dataclass(frozen=True)
class Interval:
    """A pooled ratio with its bootstrap interval over `n_units` units (low/high NaN below MIN_UNITS units)."""

    ratio: float
    low: float
    high: float
    n_units: int

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to the ratio (0.015 reads "+-1.5%"); inf when there is no interval."""
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or not self.ratio > 0:
            return math.inf
        return (self.high - self.low) / (2.0 * self.ratio)

    def ci(self) -> list[float]:
        return [self.low, self.high]


def resample_weights(n_units: int, *, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """[resamples, n_units] counts: how often each unit appears in each bootstrap resample (rows sum to n_units).

    Multinomial counts are the same as drawing n_units indices with replacement, and turn every resampled sum
    into one matrix-vector product."""
    if n_units < 1:
        raise ValueError("resample_weights needs at least one unit")
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=resamples).astype(np.float64)


def pooled_ratio(tokens_a, time_a, tokens_b, time_b, weights: np.ndarray | None = None):
    """(sum tokens_a / sum time_a) / (sum tokens_b / sum time_b); with `weights` [R, n] one ratio per row."""
    arrays = [np.asarray(x, dtype=np.float64) for x in (tokens_a, time_a, tokens_b, time_b)]
    if weights is None:
        ta, sa, tb, sb = (float(x.sum()) for x in arrays)
    else:
        ta, sa, tb, sb = (weights @ x for x in arrays)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (ta / sa) / (tb / sb)


def paired_ratio_interval(tokens_a: Sequence[float], time_a: Sequence[float], tokens_b: Sequence[float],
                          time_b: Sequence[float], *, resamples: int = RESAMPLES, level: float = LEVEL,
                          seed: int = 0) -> Interval:
    """Pooled throughput ratio of A over B and its paired percentile bootstrap interval (module docstring).

    The four sequences are aligned by unit: index u is the same (prompt, round) for A and B. Seeded: the same
    inputs give the same interval."""
    n = len(tokens_a)
    if not (len(time_a) == len(tokens_b) == len(time_b) == n):
        raise ValueError(f"paired units must align: got {n}, {len(time_a)}, {len(tokens_b)}, {len(time_b)} values")
    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"need resamples >= 1 and 0 < level < 1, got {resamples} and {level}")
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    ratio = float(pooled_ratio(tokens_a, time_a, tokens_b, time_b))
    if n < MIN_UNITS:
        return Interval(ratio, math.nan, math.nan, n)
    boot = pooled_ratio(tokens_a, time_a, tokens_b, time_b, resample_weights(n, resamples=resamples, seed=seed))
    boot = boot[np.isfinite(boot)]
    if boot.size == 0:
        return Interval(ratio, math.nan, math.nan, n)
    tail = 100.0 * (1.0 - level) / 2.0
    low, high = np.percentile(boot, [tail, 100.0 - tail])
    # a constant per-unit ratio resamples to the same value up to float rounding: report it as the zero-width
    # interval it is, not as [r - 1e-16, r + 1e-16]
    if high - low <= 1e-12 * abs(ratio):
        low = high = ratio
    return Interval(ratio, float(low), float(high), n)


def cluster_ratio_interval(tokens_a: Sequence[float], time_a: Sequence[float], tokens_b: Sequence[float],
                           time_b: Sequence[float], clusters: Sequence, *, resamples: int = RESAMPLES,
                           level: float = LEVEL, seed: int = 0) -> Interval:
    """Pooled ratio of A over B with a paired percentile bootstrap over clusters (module docstring).

    The four sequences are aligned by unit as in `paired_ratio_interval`; `clusters[u]` names unit u's cluster
    (its prompt id). A resample draws clusters with replacement and keeps every unit of a drawn cluster: the
    pooled ratio is a ratio of sums, so summing each cluster's units first and resampling those sums is exact.
    `n_units` of the result counts clusters (prompts). Below MIN_UNITS clusters there is no interval."""
    n = len(tokens_a)
    if not (len(time_a) == len(tokens_b) == len(time_b) == len(clusters) == n):
        raise ValueError(f"paired units must align: got {n}, {len(time_a)}, {len(tokens_b)}, {len(time_b)} values "
                         f"and {len(clusters)} cluster labels")
    labels: dict = {}
    index = np.array([labels.setdefault(c, len(labels)) for c in clusters], dtype=np.int64)
    sums = [np.bincount(index, weights=np.asarray(x, dtype=np.float64), minlength=len(labels))
            for x in (tokens_a, time_a, tokens_b, time_b)]
    return paired_ratio_interval(*sums, resamples=resamples, level=level, seed=seed)


def same_decisions(logs_a: Sequence[Sequence[tuple[int, int]]], logs_b: Sequence[Sequence[tuple[int, int]]]) -> bool:
    """True when both methods chose the same (depth, size) on every cycle of every unit.

    logs_x[u] is method x's sequence of (depth, size) on unit u (extra fields such as `emitted` are ignored).
    Methods without cycles (autoregressive, transformers' generate) never count as making the same decisions."""
    if len(logs_a) != len(logs_b) or not logs_a:
        return False
    for a, b in zip(logs_a, logs_b):
        if not a or not b or len(a) != len(b):
            return False
        if any(tuple(x[:2]) != tuple(y[:2]) for x, y in zip(a, b)):
            return False
    return True


def verdict(interval: Interval) -> str:
    """"faster" / "slower" when the interval excludes 1, else "indistinguishable" (also when there are too few
    units for an interval). Identical decisions are a flag beside the verdict (`specpilot.eval.compare`), never a
    verdict: two controllers that decide alike still differ by their decision time."""
    if math.isfinite(interval.low) and interval.low > 1.0:
        return "faster"
    if math.isfinite(interval.high) and interval.high < 1.0:
        return "slower"
    return "indistinguishable"


