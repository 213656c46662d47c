"""The latency profile prices a verify block the way the target's CPU linears run it: where the row plan pads V + 1
rows to `width`, V costs what width - 1 candidates cost (a measured size), not a point interpolated between the
measured sizes around it; without a plan (GPU, one thread, older profiles) V is priced as V. Profiles record the
target's plan, and keep it through save and load."""
import numpy as np
import pytest
import torch

from specpilot.drafting import TreeConfig
from specpilot.drafting import linear_kernels
from specpilot.drafting.linear_kernels import target_row_plan
from specpilot.envs.profile import LatencyProfile, collect_samples

TREE = TreeConfig(width=4, max_depth=3, max_size=16)
FIRST = {n: [1e-3] for n in range(1, 4)}
LEVELS = {level: [1e-3] for level in (2, 3)}
MEASURED = (3, 4, 7, 8, 15, 16)
PLAN = [[r, 4] for r in (3, 4)] + [[r, 8] for r in (5, 6, 7, 8)] + [[r, 16] for r in range(10, 17)]


def step_cost(size):
    """A step function of the padded block: 4, 8, 9 or 16 rows."""
    rows = size + 1
    return {4: 5e-3, 8: 7e-3, 9: 7.5e-3, 16: 9e-3}.get(rows, 5e-3 + 2.5e-4 * rows)


def _profile(plan) -> LatencyProfile:
    verify = [(v, c, step_cost(v)) for v in MEASURED for c in (20, 40) for _ in range(30)]
    meta = {"row_plan": plan} if plan is not None else {}
    return LatencyProfile.from_samples(FIRST, LEVELS, verify, max_depth=TREE.max_depth, width=TREE.width, meta=meta)


@pytest.mark.parametrize("size, priced_as", [(1, 1), (2, 3), (3, 3), (5, 7), (6, 7), (9, 15), (12, 15), (16, 16)])
def test_a_padded_block_costs_what_the_padded_size_costs(size, priced_as):
    profile = _profile(PLAN)
    assert profile.priced_sizes(16)[size] == priced_as
    assert profile.verify_time(size, 30) == pytest.approx(profile.verify_time(priced_as, 30))


def test_without_a_plan_sizes_are_priced_as_themselves_between_measured_points():
    for plan in (None, []):
        profile = _profile(plan)
        assert list(profile.priced_sizes(16)) == list(range(17))
        t8, t12, t15 = (profile.verify_time(v, 30) for v in (8, 12, 15))
        assert t8 < t12 < t15  # interpolated: V = 12 between the measured 8 and 15


def test_the_plan_survives_save_and_load(tmp_path):
    profile = _profile(PLAN)
    loaded = LatencyProfile.load(profile.save(tmp_path / "profile.json"))
    assert np.allclose(loaded.verify_table(16, np.array([30])), profile.verify_table(16, np.array([30])))
    assert loaded.priced_sizes(16)[12] == 15


def test_collected_profiles_record_the_target_plan(monkeypatch):
    from tiny import tiny_pair

    pair = tiny_pair(noise=0.2, eos=None)
    assert target_row_plan(pair.target) == [] and target_row_plan(None) == []  # tiny layers are not turned
    samples = collect_samples(pair, TREE, [[5, 6, 7, 8]], max_new_tokens=8, rng=1, warmup_cycles=1, min_cycles=1)
    assert samples.meta["row_plan"] == []
    monkeypatch.setattr(linear_kernels, "MIN_WEIGHT_ELEMENTS", 0)
    monkeypatch.setattr(linear_kernels, "measure", lambda *a, **k: {"plan": PLAN, "widths": dict(map(tuple, PLAN))})
    linear_kernels.enable_small_row_linears(pair.target)
    try:
        assert target_row_plan(pair.target) == PLAN
        samples = collect_samples(pair, TREE, [[5, 6, 7, 8]], max_new_tokens=8, rng=1, warmup_cycles=1,
                                  min_cycles=1)
        assert samples.meta["row_plan"] == PLAN and samples.profile().priced_sizes(16)[12] == 15
    finally:
        linear_kernels.disable_small_row_linears(pair.target)
