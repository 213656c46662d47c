"""The replay ceilings against brute force, the latency profile's fit on known data, and replay vs live."""
from __future__ import annotations

import numpy as np
import pytest

from specpilot.drafting.types import TreeConfig
from specpilot.envs.oracle import replay_controller, replay_oracle, replay_static
from specpilot.envs.profile import LatencyProfile
from specpilot.envs.record import record_trace
from specpilot.envs.replay import ReplayModel
from specpilot.policies import FixedController
from tiny import tiny_pair

TREE = TreeConfig(width=2, max_depth=3, max_size=6)
DEPTHS, SIZES = [0, 1, 3], [2, 6]


def known_profile(tree: TreeConfig) -> LatencyProfile:
    """Distinct costs per key, so that a wrong index anywhere changes the optimum."""
    first = {n: [1.0e-3 + 3e-4 * n] for n in range(1, tree.max_depth + 2)}
    levels = {level: [0.8e-3 + 1e-4 * level] for level in range(2, tree.max_depth + 1)}
    verify = [(v, c, 3e-3 + 4e-4 * v + 2e-6 * c) for v in range(0, tree.max_size + 1) for c in (4, 30)]
    return LatencyProfile.from_samples(first, levels, verify, max_depth=tree.max_depth, width=tree.width)


@pytest.fixture(scope="module")
def model():
    pair = tiny_pair(noise=0.4, eos=None)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 95, size=4).tolist() for _ in range(3)]
    return ReplayModel(record_trace(pair, TREE, prompts, max_new_tokens=6), known_profile(TREE))


def brute_force_time(model: ReplayModel, index: int) -> float:
    """Least total time over EVERY sequence of (depth, size) choices, by plain recursion over the trace's own
    accepted-length lookup (no tables shared with the oracle)."""
    trace, profile = model.trace, model.profile
    n = model.tables(index).n
    context = len(trace.prompt(index))
    k_max = trace.max_depth + 1
    draft = profile.draft_table()  # the profile's own lookups, read per choice

    def best(t: int, fed: int) -> float:
        if t >= n:
            return 0.0
        options = []
        for d in DEPTHS:
            for v in (SIZES if d else [0]):
                accepted = trace.accepted(index, t, d, v) if d else 0
                emitted = min(accepted + 1, n - t)
                size = min(v, trace.num_candidates(d), trace.max_size) if d else 0
                cost = (draft[min(fed, k_max), d] if d else 0.0) + profile.verify_time(size, context + t)
                options.append(cost + best(t + emitted, emitted if d else min(fed + emitted, k_max)))
        return min(options)

    return best(0, 1)


def test_hindsight_oracle_equals_brute_force(model):
    for i in range(model.num_prompts):
        oracle = replay_oracle(model, depths=DEPTHS, sizes=SIZES, prompts=[i])["oracle"]
        assert oracle["time_s"] == pytest.approx(brute_force_time(model, i), rel=1e-9)


def test_every_static_cell_equals_its_replay_through_run_cycle(model):
    result = replay_oracle(model, depths=DEPTHS, sizes=SIZES)
    for row in result["static"]:
        via_cycle = replay_static(model, depth=row["depth"], size=row["size"])
        assert (row["tokens"], row["cycles"]) == (via_cycle["tokens"], via_cycle["cycles"])
        assert row["time_s"] == pytest.approx(via_cycle["time_s"], rel=1e-12)
    times = [r["time_s"] for r in result["static"]]
    assert len(set(np.round(times, 12))) > 3  # the cells really differ
    assert result["oracle"]["time_s"] <= min(times) + 1e-12
    assert result["oracle"]["time_s"] <= result["greedy_oracle"]["time_s"] + 1e-12


def test_each_prompt_at_its_own_best_static_cell(model):
    """per_prompt_static: the best replay_static cell of every prompt, summed; between the best single cell and
    the oracle."""
    result = replay_oracle(model, depths=DEPTHS, sizes=SIZES)
    tokens = time_s = 0.0
    for i in range(model.num_prompts):
        cells = [replay_static(model, depth=d, size=v, prompts=[i]) for d in DEPTHS for v in SIZES]
        best = max(cells, key=lambda r: r["tokens_per_s"])
        tokens, time_s = tokens + best["tokens"], time_s + best["time_s"]
    own = result["per_prompt_static"]
    assert own["tokens"] == tokens and own["time_s"] == pytest.approx(time_s, rel=1e-12)
    assert result["best_static"]["tokens_per_s"] <= own["tokens_per_s"] + 1e-9
    assert own["tokens_per_s"] <= result["oracle"]["tokens_per_s"] + 1e-9


def test_plain_steps_cost_one_target_step_per_token(model):
    plain = replay_controller(model, controller=FixedController(0))
    tables = [model.tables(i) for i in range(model.num_prompts)]
    assert plain["cycles"] == plain["tokens"] == sum(t.n for t in tables)
    assert plain["time_s"] == pytest.approx(sum(t.verify[:, 0].sum() for t in tables))


def test_profile_fit_recovers_a_known_linear_model():
    rng = np.random.default_rng(0)
    first = {n: list(2e-3 + 5e-4 * n + rng.normal(0, 1e-6, 200)) for n in range(1, 6)}
    levels = {level: list(1e-3 + rng.normal(0, 1e-6, 200)) for level in range(2, 5)}
    verify = [(v, c, 4e-3 + 1e-4 * v + float(rng.normal(0, 1e-6))) for v in range(0, 9) for c in (10, 300)
              for _ in range(50)]
    profile = LatencyProfile.from_samples(first, levels, verify, max_depth=4, width=2)
    table = profile.draft_table()
    assert table[3, 1] == pytest.approx(2e-3 + 5e-4 * 3, rel=1e-3)
    assert table[2, 4] == pytest.approx(2e-3 + 5e-4 * 2 + 3 * 1e-3, rel=1e-3)
    np.testing.assert_allclose(profile.verify_table(8, np.array([10, 300]))[:, [0, 4, 8]],
                               [[4e-3, 4.4e-3, 4.8e-3]] * 2, rtol=2e-3)
    # beyond the measured keys the line extrapolates
    assert profile.first_time(9)[()] == pytest.approx(2e-3 + 5e-4 * 9, rel=1e-2)


def test_profile_shrinks_a_rarely_seen_key_towards_the_line():
    first = {1: [1e-3] * 100, 2: [2e-3] * 100, 3: [3e-3] * 100, 4: [10e-3]}  # one wild sample at n = 4
    profile = LatencyProfile.from_samples(first, {}, [(1, 5, 1e-3)], max_depth=1, width=1, shrink=10.0)
    value = float(profile.first_time(4))
    assert 4e-3 < value < 5e-3  # pulled most of the way to the line (~4 ms), not the lone 10 ms sample
    assert float(profile.first_time(2)) == pytest.approx(2e-3, rel=0.02)


def _verify_samples(rng, n: int, sigma: float, step: float = 0.0) -> list:
    """n samples per size 1..8 of 4 ms + 0.1 ms per size (+ `step` from size 5 on), with Gaussian noise sigma."""
    return [(v, 10, 4e-3 + 1e-4 * v + (step if v >= 5 else 0.0) + float(rng.normal(0, sigma)))
            for v in range(1, 9) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_profile_bumps_within_the_noise_follow_the_line(seed):
    """20 noisy samples per size (a 600-cycle profile's share): the key means scatter around their line by sampling
    noise alone; the curve keeps (almost) none of that scatter, where the count share alone would keep 2/3."""
    samples = _verify_samples(np.random.default_rng(seed), 20, 1e-3)
    profile = LatencyProfile.from_samples({1: [1e-3]}, {}, samples, max_depth=1, width=1)
    sizes = np.arange(1, 9)
    means = np.array([np.mean([t for v, _, t in samples if v == k]) for k in sizes])
    line = np.polyval(np.polyfit(sizes, means, 1), sizes)
    got = profile.verify_table(8, np.array([10]))[0, 1:] - profile.context_offset[profile.bucket(10)]
    assert np.abs(got - line).max() < 0.2 * np.abs(means - line).max()


def test_profile_keeps_a_real_step():
    """A 1 ms step from size 5 on, measured well (200 samples per size, noise 0.1 ms): far beyond the noise, kept."""
    profile = LatencyProfile.from_samples({1: [1e-3]}, {}, _verify_samples(np.random.default_rng(0), 200, 1e-4, 1e-3),
                                          max_depth=1, width=1)
    got = profile.verify_table(8, np.array([10]))[0] - profile.context_offset[profile.bucket(10)]
    assert got[5] - got[4] == pytest.approx(1e-3 + 1e-4, rel=0.1)  # the step survives, not smeared into the line
    assert got[4] - got[3] == pytest.approx(1e-4, abs=1e-4)


def test_default_ceiling_covers_plain_steps_when_drafting_never_pays():
    """A drafter that never agrees: plain target steps (depth 0) beat every drafting cell, and the default ceiling
    (every depth from 0) must be at least their throughput, as the controllers that skip drafting reach it."""
    pair = tiny_pair(noise=3.0, eos=None)
    prompts = [[3, 1, 4, 1], [5, 9, 2, 6]]
    model = ReplayModel(record_trace(pair, TREE, prompts, max_new_tokens=6), known_profile(TREE))
    plain = replay_controller(model, controller=FixedController(0))
    result = replay_oracle(model)
    assert result["oracle"]["tokens_per_s"] >= plain["tokens_per_s"] * (1 - 1e-12)
    assert result["best_static"]["tokens_per_s"] >= plain["tokens_per_s"] * (1 - 1e-12)
    assert 0 in {row["depth"] for row in result["static"]}
