"""The latency profile prices a plain (depth-0) step from plain steps: fitted on a known model, not pulled towards
the block-verification line, used by replay of FixedController(0), collected in streaks, saved and loaded, and
checked against live `ar` by the cost-model check."""
import json

import numpy as np
import pytest
import torch

from specpilot.drafting import TreeConfig
from specpilot.envs.profile import LatencyProfile, collect_samples

TREE = TreeConfig(width=2, max_depth=3, max_size=6)
FIRST = {n: [1e-3 + 2e-4 * n] for n in range(1, 6)}
LEVELS = {level: [1e-3] for level in (2, 3)}


def plain_true(context):
    """A plain step: cheaper than any block verification (no tree block, mask or cache compaction)."""
    return 2e-3 + 1e-5 * np.asarray(context, dtype=float)


def block_true(size, context):
    return 5e-3 + 2e-4 * size + 1e-6 * context


PLAIN = [(0, c, float(plain_true(c))) for c in range(20, 200, 3)]
BLOCKS = [(v, c, block_true(v, c)) for v in (1, 2, 4, 6) for c in (20, 100, 190) for _ in range(3)]


def _profile(verify) -> LatencyProfile:
    return LatencyProfile.from_samples(FIRST, LEVELS, verify, max_depth=TREE.max_depth, width=TREE.width)


@pytest.mark.parametrize("context", [20, 57, 101, 150, 197])
def test_plain_step_is_fitted_on_plain_steps_only(context):
    profile = _profile(PLAIN + BLOCKS)
    assert profile.verify_time(0, context) == pytest.approx(float(plain_true(context)), rel=1e-9)


def test_plain_step_is_not_extrapolated_past_the_measured_contexts():
    profile = _profile(PLAIN + BLOCKS)
    assert profile.verify_time(0, 3) == pytest.approx(float(plain_true(20)))
    assert profile.verify_time(0, 5000) == pytest.approx(float(plain_true(197)))


def test_plain_steps_stay_out_of_block_verification():
    with_plain, without = _profile(PLAIN + BLOCKS), _profile(BLOCKS)
    contexts = np.array([20, 60, 100, 190])
    assert np.allclose(with_plain.verify_table(6, contexts)[:, 1:], without.verify_table(6, contexts)[:, 1:])
    # the old model put the plain step on the block line: its intercept, far above what a plain step costs
    assert without.verify_time(0, 100) > 1.5 * float(plain_true(100)) and not without.plain


@pytest.mark.parametrize("plain_model", [True, False])
def test_without_plain_steps_a_plain_step_costs_the_ar_reference(plain_model):
    """A profile without plain steps (--profile-cycles 0) but with its AR reference prices a plain step at it: a
    plain step is one AR step (the block line's intercept could make depth 0 look faster than AR)."""
    profile = LatencyProfile.from_samples(FIRST, LEVELS, (PLAIN if plain_model else []) + BLOCKS,
                                          max_depth=TREE.max_depth, width=TREE.width,
                                          meta={"ar_seconds_per_token": 7e-3})
    contexts = np.array([20, 100, 190])
    expected = plain_true(contexts) if plain_model else np.full(3, 7e-3)
    assert np.allclose(profile.verify_table(6, contexts)[:, 0], expected)
    assert profile.verify_time(0, 57) == pytest.approx(float(plain_true(57)) if plain_model else 7e-3)


def test_replay_of_depth_0_is_the_sum_of_plain_steps():
    from tiny import tiny_pair

    from specpilot.envs.oracle import replay_static
    from specpilot.envs.record import record_trace

    torch.set_num_threads(1)
    trace = record_trace(tiny_pair(noise=0.2, eos=None), TREE, [[5, 6, 7, 8], [9, 10, 11]], max_new_tokens=8)
    out = replay_static(trace, _profile(PLAIN + BLOCKS), 0, 0)
    contexts = [len(trace.prompt(i)) + t for i in range(2) for t in range(8)]
    assert out["tokens"] == 16 and out["cycles"] == 16
    assert out["time_s"] == pytest.approx(float(plain_true(np.clip(contexts, 20, 197)).sum()))


def test_collected_profile_has_plain_streaks_and_survives_save_and_load(tmp_path):
    from tiny import tiny_pair

    torch.set_num_threads(1)
    samples = collect_samples(tiny_pair(noise=0.2, eos=None), TREE, [[5, 6, 7, 8], [9, 10, 11, 12, 13]],
                              max_new_tokens=40, rng=1, warmup_cycles=2)
    plain = sorted(c for v, c, _ in samples.verify if v == 0)
    assert len(plain) >= 8 and any(b == a + 1 for a, b in zip(plain, plain[1:]))  # streaks: consecutive contexts
    assert max(samples.first) > TREE.max_depth + 1  # a streak's tokens are caught up by the next drafting cycle
    profile = samples.profile()
    assert sum(profile.plain["count"]) == len(plain)
    assert sum(profile.verify_size["count"]) == len(samples.verify) - len(plain)
    path = profile.save(tmp_path / "profile.json")
    loaded = LatencyProfile.load(path)
    assert loaded.verify_time(0, plain[0]) == pytest.approx(profile.verify_time(0, plain[0]))
    old = json.loads(path.read_text())
    del old["plain"]  # a profile saved before the plain model: V = 0 priced on the block line, as it was
    path.write_text(json.dumps(old))
    legacy = LatencyProfile.load(path)
    assert not legacy.plain and legacy.verify_time(0, 10) > 0


def test_cost_check_measures_depth_0_against_live_ar():
    from specpilot.eval.costcheck import PLAIN_NAME, compare_rates
    from specpilot.eval.metrics import RunRecord

    runs = [RunRecord(prompt_id=str(p), method=m, tokens=[0] * 40, wall_s=40 / tps + 0.01, prefill_s=0.01, repeat=r)
            for r in range(2) for p in range(2) for m, tps in (("ar", 100.0), ("d2_s4", 150.0))]
    out = compare_rates({PLAIN_NAME: 104.0, "d2_s4": 150.0}, runs)
    rows = {c["config"]: c for c in out["configs"]}
    assert rows[PLAIN_NAME]["method"] == "ar" and rows[PLAIN_NAME]["error"] == pytest.approx(0.04)
    assert "method" not in rows["d2_s4"] and rows["d2_s4"]["error"] == pytest.approx(0.0)


def test_a_profile_of_plain_steps_alone_still_prices_every_size():
    profile = _profile(PLAIN)
    assert profile.verify_time(0, 100) == pytest.approx(float(plain_true(100)))
    assert profile.verify_time(4, 100) > 0  # m(V) falls back to the plain steps' mean rather than failing


@pytest.mark.parametrize("min_cycles", [0, 60, 150])
def test_collect_samples_decodes_the_prompts_again_until_min_cycles(min_cycles):
    from tiny import tiny_pair

    torch.set_num_threads(1)
    pair, prompts = tiny_pair(noise=0.2, eos=None), [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    one_pass = collect_samples(pair, TREE, prompts, max_new_tokens=12, rng=1, warmup_cycles=2)
    samples = collect_samples(pair, TREE, prompts, max_new_tokens=12, rng=1, warmup_cycles=2, min_cycles=min_cycles)
    assert len(samples.verify) >= max(min_cycles, len(one_pass.verify))
    assert len(samples.verify) < max(min_cycles, len(one_pass.verify)) + 12  # stops after the pass that got there
    if min_cycles == 0:
        assert samples.verify[0][:2] == one_pass.verify[0][:2]  # one pass, as before
    before = len(samples.verify)  # accumulating into earlier samples: min_cycles counts this call's own cycles
    collect_samples(pair, TREE, prompts, max_new_tokens=12, rng=1, warmup_cycles=0, min_cycles=40, samples=samples)
    assert len(samples.verify) - before >= 40
