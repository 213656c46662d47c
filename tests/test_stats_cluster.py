"""The prompt-level (cluster) bootstrap: coverage on synthetic data with prompt-level effects, where the (prompt,
round) unit bootstrap under-covers, and its agreement with the unit bootstrap when every prompt ran once."""
import numpy as np
import pytest

from specpilot.eval.stats import cluster_ratio_interval, paired_ratio_interval, pooled_ratio

PROMPTS, ROUNDS, TRUE = 20, 5, 1.05


def _with_prompt_effects(rng, prompts: int = PROMPTS, rounds: int = ROUNDS, ratio: float = TRUE):
    """Each prompt has its own base time and its own effect on A (some prompts suit A better: mean-1 lognormal,
    independent of the base), and every round repeats the prompt with small timing noise. The population pooled
    ratio over prompts like these is exactly `ratio`."""
    base = rng.uniform(0.5, 2.0, size=prompts)
    effect = rng.lognormal(-0.15 ** 2 / 2, 0.15, size=prompts)
    p = np.repeat(np.arange(prompts), rounds)
    noise = lambda: rng.lognormal(-0.02 ** 2 / 2, 0.02, size=p.size)  # noqa: E731
    tokens = np.full(p.size, 64.0)
    time_a = base[p] * effect[p] / ratio * noise()
    time_b = base[p] * noise()
    return tokens, time_a, tokens, time_b, [f"prompt-{i}" for i in p]


def _coverage(interval, sims: int = 300) -> float:
    rng = np.random.default_rng(7)
    covered = 0
    for k in range(sims):
        iv = interval(*_with_prompt_effects(rng), seed=k)
        covered += iv.low <= TRUE <= iv.high
    return covered / sims


def test_cluster_interval_covers_about_95_percent_with_prompt_level_effects():
    coverage = _coverage(lambda ta, sa, tb, sb, c, seed: cluster_ratio_interval(ta, sa, tb, sb, c, resamples=1000,
                                                                                 seed=seed))
    assert 0.88 <= coverage <= 0.99, coverage


def test_unit_interval_under_covers_the_same_data():
    """R rounds of one prompt counted as R independent units: the interval is about sqrt(R) too narrow."""
    coverage = _coverage(lambda ta, sa, tb, sb, c, seed: paired_ratio_interval(ta, sa, tb, sb, resamples=1000,
                                                                                seed=seed))
    assert coverage <= 0.80, coverage


def test_cluster_interval_counts_prompts_and_keeps_the_pooled_ratio():
    ta, sa, tb, sb, clusters = _with_prompt_effects(np.random.default_rng(0))
    iv = cluster_ratio_interval(ta, sa, tb, sb, clusters)
    assert iv.n_units == PROMPTS
    assert iv.ratio == pytest.approx(float(pooled_ratio(ta, sa, tb, sb)))
    assert iv.low <= iv.ratio <= iv.high
    assert iv == cluster_ratio_interval(ta, sa, tb, sb, clusters)  # seeded


def test_one_round_per_prompt_is_the_unit_bootstrap():
    ta, sa, tb, sb, _ = _with_prompt_effects(np.random.default_rng(1), rounds=1)
    ids = [f"p{i}" for i in range(len(ta))]
    assert cluster_ratio_interval(ta, sa, tb, sb, ids, seed=3) == paired_ratio_interval(ta, sa, tb, sb, seed=3)


def test_one_prompt_has_no_interval_and_misaligned_labels_are_rejected():
    iv = cluster_ratio_interval([64.0, 64.0], [1.0, 1.1], [64.0, 64.0], [1.2, 1.3], ["a", "a"])
    assert iv.n_units == 1 and np.isnan(iv.low)
    with pytest.raises(ValueError, match="cluster labels"):
        cluster_ratio_interval([1.0, 2.0], [1.0, 1.0], [1.0, 2.0], [1.0, 1.0], ["a"])
