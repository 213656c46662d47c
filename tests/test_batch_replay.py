"""Replay for batches: a batch of identical traces decides and accepts as single replay does; each cycle is timed by
the batch-size-B profile (interpolated between measured sizes); replayed batches match the live batched decoder's
cycles; batched profiles are measured with drafting/batch.py, saved and loaded (version-1 files still load)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specpilot.drafting.control import FixedController
from specpilot.drafting.cycle import run_cycle, run_generation
from specpilot.drafting.decoder import SpeculativeDecoder
from specpilot.drafting.types import TreeConfig
from specpilot.envs.batch_replay import (BatchReplaySession, batch_static_sweep, best_per_batch_size,
                                         replay_batch)
from specpilot.envs.profile import LatencyProfile, collect_batch_samples, measure_batch_profile
from specpilot.envs.record import record_trace
from specpilot.envs.replay import ReplayModel, ReplaySession
from tiny import tiny_pair

TREE = TreeConfig(width=2, max_depth=3, max_size=6)
BATCH_SIZES = [1, 2, 4]


def known_profile(tree: TreeConfig, batch: int = 1) -> LatencyProfile:
    """Distinct costs per key; a batch of B verifies B * (V + 1) tokens, so verification grows with B."""
    first = {n: [(1.0e-3 + 3e-4 * n) * (1 + 0.1 * (batch - 1))] for n in range(1, tree.max_depth + 2)}
    levels = {level: [(0.8e-3 + 1e-4 * level) * (1 + 0.1 * (batch - 1))] for level in range(2, tree.max_depth + 1)}
    verify = [(v, c, 3e-3 + 4e-4 * batch * (v + 1) + 2e-6 * c) for v in range(0, tree.max_size + 1) for c in (4, 30)]
    return LatencyProfile.from_samples(first, levels, verify, max_depth=tree.max_depth, width=tree.width)


def batched_profile(tree: TreeConfig = TREE) -> LatencyProfile:
    return known_profile(tree).with_batch({b: known_profile(tree, b) for b in BATCH_SIZES})


@pytest.fixture(scope="module")
def recorded():
    torch.set_num_threads(1)
    pair = tiny_pair(noise=0.4, eos=None)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 95, size=int(rng.integers(3, 7))).tolist() for _ in range(4)]
    budgets = 10
    return pair, prompts, record_trace(pair, TREE, prompts, max_new_tokens=budgets)


class _Alternating(FixedController):
    """A state-dependent controller: depth from the previous acceptance (exercises the lead's DraftState)."""

    def __init__(self):
        super().__init__(3, 4)

    def should_stop(self, state):
        return state.depth >= (3 if state.prev_accepted >= 1 else 1)

    def choose_size(self, state):
        return 2 + state.prev_accepted


@pytest.mark.parametrize("controller", [FixedController(0, 0), FixedController(1, 1), FixedController(3, 4),
                                        _Alternating()], ids=["ar", "d1v1", "d3v4", "adaptive"])
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_a_batch_of_identical_traces_decides_and_accepts_as_single_replay(recorded, controller, batch):
    _, _, trace = recorded
    model = ReplayModel(trace, batched_profile())
    for index in range(trace.num_prompts):
        single = run_generation(ReplaySession(model, index), controller)
        session = BatchReplaySession(model, [index] * batch)
        records = run_generation(session, controller)
        fields = [(r.depth, r.size, r.accepted, r.emitted) for r in single]
        assert [(r.depth, r.size, r.accepted, r.emitted) for r in records] == fields
        for row in session.rows:  # every row accepted exactly its own recorded lengths
            assert [(r.depth, r.size, r.accepted, r.emitted) for r in row.cycles] == fields
        assert session.emitted_total == batch * sum(r.emitted for r in single)


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_batch_1_profile_gives_single_replay_times(recorded, batch):
    """With every batch size priced like the single profile, a batch of identical rows costs single replay's time."""
    _, _, trace = recorded
    single = known_profile(TREE)
    model = ReplayModel(trace, single.with_batch({b: single for b in BATCH_SIZES}))
    for index in range(trace.num_prompts):
        one = run_generation(ReplaySession(model, index), FixedController(2, 3))
        many = run_generation(BatchReplaySession(model, [index] * batch), FixedController(2, 3))
        assert [r.cycle_s for r in many] == pytest.approx([r.cycle_s for r in one])


@pytest.mark.parametrize("controller", [FixedController(0, 0), FixedController(2, 3), _Alternating()],
                         ids=["ar", "d2v3", "adaptive"])
def test_each_cycle_is_timed_by_the_batch_profile_of_the_rows_still_running(recorded, controller):
    """Rows of different lengths: a cycle with k unfinished rows costs the batch-k profile at (largest fed, longest
    context); as rows finish the batch shrinks (B = 3 is interpolated between the measured 2 and 4)."""
    _, _, trace = recorded
    profile = batched_profile()
    model = ReplayModel(trace, profile, max_new_tokens=10)
    indices = [0, 1, 2, 3]
    session = BatchReplaySession(model, indices)
    expected = []
    while not session.done:
        rows = session.active
        b, fed = len(rows), max(r.n_new for r in rows)
        context = max(r.prompt_len + r.tokens_emitted for r in rows)
        record = run_cycle(session, controller)
        lo, hi = max(s for s in BATCH_SIZES if s <= b), min(s for s in BATCH_SIZES if s >= b)
        w = 0.0 if hi == lo else (b - lo) / (hi - lo)

        def cost(s):
            part = profile.for_batch(s)
            draft = part.draft_table()[min(fed, TREE.max_depth + 1), record.depth] if record.depth else 0.0
            return draft + part.verify_time(record.size, context)

        expected.append((1 - w) * cost(lo) + w * cost(hi))
        assert record.cycle_s == pytest.approx(expected[-1])
    assert session.batch_sizes == sorted(session.batch_sizes, reverse=True) and session.batch_sizes[0] == 4
    res = replay_batch(model, controller, batch_size=4)
    assert res["time_s"] == pytest.approx(sum(expected)) and res["batch_size"] == 4


def test_batch_larger_than_measured_is_refused(recorded):
    _, _, trace = recorded
    model = ReplayModel(trace, batched_profile())
    with pytest.raises(ValueError, match="above the profile's largest measured batch size 4"):
        replay_batch(model, FixedController(1, 1), batch_size=8)
    with pytest.raises(ValueError, match="batch size 1 only"):
        replay_batch(ReplayModel(trace, known_profile(TREE)), FixedController(1, 1), batch_size=2)


def test_static_sweep_per_batch_size_prefers_less_speculation_under_load(recorded):
    """Verification cost grows with B * (V + 1): the best static size per batch size never grows with B, and
    the speedup over batched AR is computed against AR at the same batch size."""
    _, _, trace = recorded
    model = ReplayModel(trace, batched_profile())
    rows = batch_static_sweep(model, [(d, v) for d in (1, 2, 3) for v in (1, 2, 4, 6)], BATCH_SIZES)
    best = best_per_batch_size(rows)
    assert [r["batch_size"] for r in best] == BATCH_SIZES
    for b in BATCH_SIZES:
        ar = next(r for r in rows if r["batch_size"] == b and r["depth"] == 0)
        assert ar["speedup_vs_ar"] == 1.0
        cell = next(r for r in rows if r["batch_size"] == b and (r["depth"], r["size"]) == (2, 4))
        direct = replay_batch(model, FixedController(2, 4), batch_size=b)
        assert cell["tokens_per_s"] == pytest.approx(direct["tokens_per_s"])
        assert cell["speedup_vs_ar"] == pytest.approx(direct["tokens_per_s"] / ar["tokens_per_s"])
    verified = [r["size"] if r["depth"] else 0 for r in best]  # candidates per row of the best cell
    assert verified[-1] <= verified[0]


def test_replayed_batch_matches_the_live_batched_decoders_cycles(recorded):
    """The live batched decoder (drafting/batch.py) and batch replay of the recorded traces take the same decisions
    and each row accepts the same lengths."""
    pair, prompts, trace = recorded
    assert_batch_replay_is_live(pair, prompts, trace)


def assert_batch_replay_is_live(pair, prompts, trace) -> None:
    """generate_batch and a BatchReplaySession of `trace` (recorded from `prompts`, 10 tokens) take the same decisions
    and accept the same lengths per row, for a fixed and an alternating controller."""
    model = ReplayModel(trace, batched_profile())
    decoder = SpeculativeDecoder(pair, TREE)
    for controller in (FixedController(2, 3), _Alternating()):
        live = decoder.generate_batch(prompts, controller=controller, max_new_tokens=10)
        session = BatchReplaySession(model, list(range(len(prompts))))
        run_generation(session, controller)
        for out, row in zip(live, session.rows):
            assert [(r.depth, r.size, r.accepted, r.emitted) for r in out.cycles] == \
                [(r.depth, r.size, r.accepted, r.emitted) for r in row.cycles]


def test_measured_batch_profile_keys_saves_and_loads(recorded, tmp_path):
    pair, prompts, _ = recorded
    samples = collect_batch_samples(pair, TREE, prompts, [1, 2], max_new_tokens=12, rng=0, warmup_cycles=2)
    assert set(samples) == {1, 2} and all(s.verify for s in samples.values())
    profile = measure_batch_profile(pair, TREE, prompts, [1, 2], max_new_tokens=12, warmup_cycles=2)
    assert profile.batch_sizes == [1, 2]
    path = profile.save(tmp_path / "profile.json")
    loaded = LatencyProfile.load(path)
    assert loaded.batch_sizes == [1, 2] and loaded.version == 2
    for b in (1, 2):
        np.testing.assert_allclose(loaded.batch_tables(b, TREE.max_size, np.arange(5, 30))[1],
                                   profile.batch_tables(b, TREE.max_size, np.arange(5, 30))[1])
    old = json.loads(path.read_text())  # a version-1 file (batch size 1 only) still loads
    old.pop("batch")
    old["version"] = 1
    path.write_text(json.dumps(old))
    legacy = LatencyProfile.load(path)
    assert legacy.batch_sizes == [] and legacy.verify_time(2, 10) == pytest.approx(profile.verify_time(2, 10))
