"""The cycle's arithmetic (drafting/cycle_math.py) and the step protocol: the live and replayed sessions count the
same way, scalars and the oracle's arrays agree, cycle time excludes decision time."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from specpilot.drafting.cycle import Session, run_generation
from specpilot.drafting.cycle_math import (ACCEPTANCE_RATE, clip_size, emitted_count, level_bounds, next_fed,
                                           num_candidates, update_acceptance)
from specpilot.drafting.decoder import SpeculativeDecoder
from specpilot.drafting.types import CycleRecord, TreeConfig
from specpilot.envs.record import record_trace
from specpilot.envs.replay import ReplayModel, ReplaySession
from specpilot.envs.rewards import make_reward
from specpilot.policies import FixedController
from test_replay_oracle import known_profile
from tiny import tiny_pair

ROOT = Path(__file__).resolve().parents[1]
TREE = TreeConfig(width=2, max_depth=3, max_size=6)


@pytest.mark.parametrize("width", [1, 2, 8])
def test_levels_partition_the_tree(width):
    depth = 5
    ends = [level_bounds(width, d) for d in range(1, depth + 1)]
    assert ends[0] == (0, width)
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    assert ends[-1][1] == num_candidates(width, depth) == width + (depth - 1) * width * width
    assert num_candidates(width, 0) == 0 and type(num_candidates(width, 3)) is int


def test_array_forms_equal_the_scalar_forms():
    depths, sizes = np.array([0, 1, 2, 3])[:, None], np.array([1, 3, 7, 40])[None, :]
    clipped = clip_size(sizes, num_candidates(2, depths), 6)
    assert clipped.tolist() == [[clip_size(int(v), num_candidates(2, int(d)), 6) for v in sizes[0]]
                                for d in depths[:, 0]]
    assert clipped[0].tolist() == [0, 0, 0, 0]  # a plain step verifies nothing
    assert type(clip_size(5, 4, 6)) is int and clip_size(5, 4, 6) == 4
    accepted, left = np.array([0, 2, 5]), np.array([9, 2, 1])
    assert emitted_count(accepted, left).tolist() == [emitted_count(int(a), int(n)) for a, n in zip(accepted, left)]
    assert emitted_count(2, 9) == 3 and emitted_count(2, 2) == 2
    depth, fed, emitted = np.array([0, 0, 2]), np.array([1, 3, 3]), np.array([1, 1, 4])
    assert next_fed(depth, fed, emitted).tolist() == [2, 4, 4]
    assert next_fed(0, 3, 1) == 4 and next_fed(1, 3, 2) == 2


def test_acceptance_ema():
    assert update_acceptance(0.6, 5, 0) == 0.6  # plain steps leave it unchanged
    assert update_acceptance(1.0, 1, 2) == pytest.approx(1.0 + ACCEPTANCE_RATE * (0.5 - 1.0))


def test_cycle_time_excludes_decision_time():
    record = CycleRecord(depth=2, size=3, accepted=1, emitted=2, draft_s=0.25, verify_s=0.5, policy_s=10.0,
                         context_len=9)
    assert record.cycle_s == 0.75
    assert make_reward("throughput")(record) == pytest.approx(2 / 0.75)


@pytest.fixture(scope="module")
def pair_and_model():
    pair = tiny_pair(noise=0.4, eos=None)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 95, size=4).tolist() for _ in range(2)]
    return pair, prompts, ReplayModel(record_trace(pair, TREE, prompts, max_new_tokens=8), known_profile(TREE))


def test_live_tree_has_the_counted_shape(pair_and_model):
    pair, prompts, _ = pair_and_model
    session = SpeculativeDecoder(pair, TREE).start(prompts[0], max_new_tokens=8)
    assert session.drafter.capacity == num_candidates(TREE.width, TREE.max_depth)
    for depth in range(1, TREE.max_depth + 1):
        state = session.draft_level()
        assert state.num_candidates == num_candidates(TREE.width, depth) == TREE.num_candidates(depth)
        start, end = level_bounds(TREE.width, depth)
        assert state.level_scores.shape[0] == end - start
    assert session.verify(100).size == clip_size(100, num_candidates(2, 3), TREE.max_size) == 6


class Alternating(FixedController):
    """Plain steps between speculative cycles: the drafter's pending tokens accumulate (next_fed's other case)."""

    def reset(self) -> None:
        self.cycle = 0

    def skip_drafting(self, state) -> bool:
        self.cycle += 1
        return self.cycle % 3 != 0


@pytest.mark.parametrize("make", [lambda: FixedController(0), lambda: FixedController(1, 1),
                                  lambda: FixedController(2, 3), lambda: FixedController(3, 6),
                                  lambda: Alternating(2, 4)])
def test_live_and_replayed_sessions_count_alike(pair_and_model, make):
    """Same protocol (no attribute probes), same emitted counts, acceptance EMA, fed tokens and finish."""
    pair, prompts, model = pair_and_model
    decoder = SpeculativeDecoder(pair, TREE)
    for i, prompt in enumerate(prompts):
        live, replay = decoder.start(prompt, max_new_tokens=8), ReplaySession(model, i)
        assert isinstance(live, Session) and isinstance(replay, Session)
        live_records = run_generation(live, make())
        replay_records = run_generation(replay, make())
        fields = lambda r: (r.depth, r.size, r.accepted, r.emitted, r.fed, r.context_len)  # noqa: E731
        assert [fields(r) for r in live_records] == [fields(r) for r in replay_records]
        assert (live.tokens_emitted, live.finished_by, live.prompt_len, live.acceptance) == \
            (replay.tokens_emitted, replay.finished_by, replay.prompt_len, replay.acceptance)


def test_replay_does_not_import_the_decoder():
    """Replay counts with cycle_math; it must not pull the live decoder in for a constant."""
    tree = ast.parse((ROOT / "envs" / "replay.py").read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "specpilot.drafting.decoder" not in modules
