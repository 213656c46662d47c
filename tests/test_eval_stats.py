"""The statistics behind every interval and verdict: coverage on synthetic data with a known ratio, degenerate
cases, verdicts, decision comparison and the adaptive stopping rule."""
import math
from collections import Counter

import numpy as np
import pytest

from specpilot.eval.compare import comparison_pairs, compare, decision_stats, group_comparisons, unit_records
from specpilot.eval.metrics import RunRecord
from specpilot.eval.rounds import RoundPlan, method_order
from specpilot.eval.stats import (Interval, paired_ratio_interval, pooled_ratio, resample_weights, same_decisions,
                                  verdict)
from specpilot.eval.suites import Prompt


def _synthetic(rng, n: int, ratio: float, noise: float):
    """Units with prompt-dependent base times; A is `ratio` times faster than B in expectation: time_a = time_b /
    ratio * e with E[e] = 1 and e independent of the base, so the population pooled ratio is exactly `ratio`."""
    tokens = rng.integers(20, 120, size=n).astype(float)
    base = tokens * rng.uniform(0.005, 0.03, size=n)              # seconds: prompts differ a lot
    time_b = base * rng.lognormal(-noise ** 2 / 2, noise, size=n)
    time_a = base / ratio * rng.lognormal(-noise ** 2 / 2, noise, size=n)
    return tokens, time_a, tokens, time_b


def test_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    true = 1.03
    covered = 0
    for k in range(200):
        iv = paired_ratio_interval(*_synthetic(rng, 60, true, 0.08), resamples=2000, seed=k)
        covered += iv.low <= true <= iv.high
    assert 0.90 <= covered / 200 <= 0.99, covered


def test_constant_ratio_gives_a_zero_width_interval():
    tokens = np.array([30.0, 50.0, 70.0, 90.0])
    time_b = np.array([0.3, 0.7, 0.2, 1.1])
    iv = paired_ratio_interval(tokens, time_b / 1.25, tokens, time_b)
    assert iv.ratio == pytest.approx(1.25) and iv.low == iv.high == iv.ratio
    assert iv.half_width == 0.0


def test_interval_is_seeded_and_contains_the_point_estimate():
    data = _synthetic(np.random.default_rng(0), 40, 1.1, 0.1)
    a, b = paired_ratio_interval(*data, seed=3), paired_ratio_interval(*data, seed=3)
    assert a == b and a.low <= a.ratio <= a.high and a.n_units == 40


def test_pairing_cancels_what_units_share():
    """Both methods slow down together on some units (load): the paired interval stays narrow."""
    rng = np.random.default_rng(2)
    tokens = np.full(30, 64.0)
    load = rng.choice([1.0, 3.0], size=30)                      # a shared, large per-unit factor
    time_b = load * rng.lognormal(0, 0.01, 30)
    time_a = load / 1.05 * rng.lognormal(0, 0.01, 30)
    paired = paired_ratio_interval(tokens, time_a, tokens, time_b)
    assert paired.low > 1.02 and paired.high < 1.08


@pytest.mark.parametrize("ratio, expected", [(1.3, "faster"), (0.7, "slower"), (1.0, "indistinguishable")])
def test_clear_cases_get_their_verdict(ratio, expected):
    rng = np.random.default_rng(4)
    iv = paired_ratio_interval(*_synthetic(rng, 80, ratio, 0.05))
    assert verdict(iv) == expected


def test_the_verdict_comes_from_the_interval_alone():
    assert verdict(Interval(1.2, 1.1, 1.3, 10)) == "faster"
    assert verdict(Interval(1.0, math.nan, math.nan, 1)) == "indistinguishable"


def test_one_unit_has_no_interval():
    iv = paired_ratio_interval([10], [1.0], [10], [2.0])
    assert iv.ratio == 2.0 and math.isnan(iv.low) and iv.half_width == math.inf
    assert math.isnan(paired_ratio_interval([], [], [], []).ratio)


def test_misaligned_units_are_rejected():
    with pytest.raises(ValueError, match="paired units must align"):
        paired_ratio_interval([1, 2], [1.0, 1.0], [1], [1.0])


def test_resample_weights_are_multinomial_counts():
    w = resample_weights(7, resamples=500, seed=0)
    assert w.shape == (500, 7) and np.all(w.sum(axis=1) == 7)
    assert pooled_ratio([1, 1], [1.0, 3.0], [1, 1], [2.0, 2.0]) == pytest.approx(1.0)


@pytest.mark.parametrize("a, b, same", [
    ([[(2, 8, 3), (2, 8, 1)]], [[(2, 8, 2), (2, 8, 1)]], True),   # emitted may differ, decisions the same
    ([[(2, 8, 3)]], [[(3, 8, 3)]], False),
    ([[(2, 8, 3)], [(1, 4, 2)]], [[(2, 8, 3)], [(1, 5, 2)]], False),
    ([[(2, 8, 3)]], [[(2, 8, 3), (2, 8, 1)]], False),
    ([[]], [[]], False),                                          # no cycles (ar): never "the same decisions"
])
def test_same_decisions_compares_depth_and_size_per_unit(a, b, same):
    assert same_decisions(a, b) is same


# ---- comparisons over records ----------------------------------------------------------------------------------
def _rec(method, prompt, rnd, wall, cycles, tokens=12):
    return RunRecord(prompt_id=prompt, method=method, tokens=list(range(tokens)), wall_s=wall, cycles=cycles,
                     repeat=rnd)


def _records(ltd_cycles, grid_cycles, n_prompts=6, rounds=2, ltd_speed=1.0):
    rng = np.random.default_rng(0)
    out = []
    for p in range(n_prompts):
        for r in range(rounds):
            base = rng.uniform(0.5, 1.5)
            out += [_rec("ar", f"p{p}", r, base * 2, []),
                    _rec("grid", f"p{p}", r, base * rng.uniform(0.9, 1.1), grid_cycles),
                    _rec("ltd", f"p{p}", r, base / ltd_speed * rng.uniform(0.9, 1.1), ltd_cycles)]
    return out


def test_identical_decision_logs_are_a_flag_beside_the_interval_verdict():
    cycles = [(2, 8, 3), (2, 8, 4), (2, 8, 1)]
    by = unit_records(_records(cycles, list(cycles)), temperature=0.0)
    c = compare(by, "ltd", "grid", temperature=0.0)
    assert c["same_decisions"] is True and c["flags"] == ["same decisions"] and c["n_units"] == 12
    assert c["verdict"] == verdict(Interval(c["ratio"], *c["ci"], c["n_units"]))


def test_different_decisions_get_a_numeric_verdict():
    by = unit_records(_records([(3, 8, 3)], [(2, 8, 3)], ltd_speed=1.5), temperature=0.0)
    c = compare(by, "ltd", "grid", temperature=0.0)
    assert c["same_decisions"] is False and c["verdict"] == "faster" and c["ci"][0] > 1.0


def test_groups_flag_too_small_groups():
    prompts = [Prompt(f"p{i}", "qa" if i < 5 else "math", "en", "heldout", "x") for i in range(6)]
    groups = group_comparisons(_records([(3, 8, 3)], [(2, 8, 3)]), prompts, temperature=0.0)
    flags = {(g["task"], g["language"]): g["too_small"] for g in groups}
    assert flags == {("qa", "en"): False, ("math", "en"): True}


def test_decision_stats_against_the_grid_config():
    stats = decision_stats(_records([(3, 8, 3), (2, 8, 2)], [(2, 8, 3), (2, 8, 2)]), temperature=0.0)
    assert stats["ltd"]["depth_hist"] == {"2": 12, "3": 12} and stats["ltd"]["differs_from_reference"] == 0.5
    assert stats["grid"]["differs_from_reference"] == 0.0 and stats["grid"]["mean_abs_tau_diff"] == 0.0
    assert stats["ltd"]["units_same_as_reference"] == 0.0 and "ar" not in stats


def test_comparison_pairs_cover_decide_and_learned_vs_best_heuristic():
    pairs = comparison_pairs(["ar", "grid", "ltd", "size_only", "svip"], "svip")
    assert pairs == [("ltd", "grid"), ("ltd", "svip"), ("size_only", "grid"), ("size_only", "svip")]


# ---- adaptive stopping -----------------------------------------------------------------------------------------
def _decided(half_width, same=False):
    return {"half_width": half_width, "same_decisions": same}


@pytest.mark.parametrize("done, decided, remaining, reason", [
    (1, _decided(0.001), 0.0, None),                 # never before min_rounds
    (2, _decided(0.001), 100.0, "target reached"),
    (2, _decided(0.05, same=True), 100.0, None),    # same decisions: rounds go on (decision time still differs)
    (2, _decided(0.05), 0.0, "time budget"),
    (3, _decided(0.05), 100.0, None),
    (5, _decided(0.05), 100.0, "max rounds"),
    (2, None, 100.0, "no deciding comparison"),
    (1, None, 100.0, None),
])
def test_auto_plan_stop_reasons(done, decided, remaining, reason):
    plan = RoundPlan.make("auto", min_rounds=2, max_rounds=5)
    assert plan.stop_reason(done, decided, remaining, next_round_s=10.0) == reason


@pytest.mark.parametrize("temperature, done, decided, remaining, reason", [
    (1.0, 1, _decided(0.05), 0.0, "time budget"),        # the sampled floor is one round
    (1.0, 1, _decided(0.05), 100.0, None),               # time left: rounds go on as at T=0
    (1.0, 1, None, 100.0, "no deciding comparison"),
    (0.0, 1, _decided(0.05), 0.0, None),                 # the greedy floor stays min_rounds
])
def test_sampled_min_rounds(temperature, done, decided, remaining, reason):
    plan = RoundPlan.make("auto", min_rounds=2, max_rounds=5, sampled_min_rounds=1)
    assert plan.stop_reason(done, decided, remaining, next_round_s=10.0, temperature=temperature) == reason
    assert plan.describe()["sampled_min_rounds"] == 1


def test_auto_plan_without_a_deciding_pair_stops_after_the_full_rounds():
    plan = RoundPlan.make("auto", min_rounds=2, full_rounds=1)
    assert plan.stop_reason(1, None, 100.0, next_round_s=1.0) == "no deciding comparison"


def test_fixed_plan_and_round_methods():
    plan = RoundPlan.make(3, full_rounds=1)
    assert [plan.stop_reason(k, None, 0.0, 1.0) for k in (1, 2, 3)] == [None, None, "fixed"]
    assert plan.methods(0, ["ar", "grid", "ddd", "ltd"]) == ["ar", "grid", "ddd", "ltd"]
    assert plan.methods(1, ["ar", "grid", "ddd", "ltd"]) == ["ar", "grid", "ltd"]


@pytest.mark.parametrize("rounds, message", [(0, "positive int"), ("many", "positive int"), (True, "positive int")])
def test_bad_rounds_rejected(rounds, message):
    with pytest.raises(ValueError, match=message):
        RoundPlan.make(rounds)


# ---- method order -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9])
def test_method_order_is_a_williams_design(m):
    """Over one block of rows every method takes every position, and follows every other method, equally often."""
    names = [f"m{i}" for i in range(m)]
    block = 2 * m if m % 2 else m
    rows = [method_order(names, k) for k in range(block)]
    assert all(sorted(row) == names for row in rows)
    positions = Counter((name, i) for row in rows for i, name in enumerate(row))
    assert set(positions.values()) == {block // m}
    if m > 1:
        follows = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
        assert len(follows) == m * (m - 1) and len(set(follows.values())) == 1
    assert [method_order(names, k + block) for k in range(block)] == rows  # cyclic over units
