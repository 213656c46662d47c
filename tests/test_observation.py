"""Observation features: layout, padding + mask, bounds, JSON round trip, size-action lists."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specpilot.drafting.types import DraftState
from specpilot.envs.spaces import observation_space
from specpilot.policies.observation import (
    NUM_SCALARS,
    ObservationSpec,
    default_size_actions,
    depth_observation,
    size_observation,
)

W, MAX_DEPTH = 3, 6


def make_state(level, earlier=(), depth: int | None = None, context_len: int = 100, new_tokens: int = 8,
               **fields) -> DraftState:
    """A state whose last level drafted `level` (in drafting order) after the `earlier` candidates."""
    levels = [list(earlier), list(level)] if len(earlier) else [list(level)]
    state = DraftState.from_levels(levels, max_depth=MAX_DEPTH, width=W, context_len=context_len,
                                   last_top_prob=0.5, last_entropy=1.0, new_tokens=new_tokens, max_new_tokens=32,
                                   **fields)
    if depth is not None:
        state.depth = depth
    return state


DEPTH_SPEC = ObservationSpec.for_depth(W, MAX_DEPTH, max_context=200)
SIZE_SPEC = ObservationSpec.for_size(W, MAX_DEPTH, size_actions=[2, 4, 6, 8], max_context=200)


def test_spec_sizes():
    assert DEPTH_SPEC.num_scores == W * W and DEPTH_SPEC.dim == 2 * W * W + NUM_SCALARS == 2 * W * W + 6
    assert SIZE_SPEC.num_scores == 8


def test_depth_observation_layout_padding_and_mask():
    state = make_state([-0.5, -1.0, -40.0], depth=1, context_len=50)  # W children at depth 1
    obs = depth_observation(state, DEPTH_SPEC)
    n = DEPTH_SPEC.num_scores
    assert obs.dtype == np.float32 and obs.shape == (DEPTH_SPEC.dim,)
    np.testing.assert_allclose(obs[:3], [-0.025, -0.05, -1.0])  # -40 clipped at the floor -20
    np.testing.assert_array_equal(obs[3:n], -1.0)  # padding is "improbable", never log p = 0
    np.testing.assert_array_equal(obs[n:n + 3], 1.0)
    np.testing.assert_array_equal(obs[n + 3:2 * n], 0.0)
    np.testing.assert_allclose(obs[2 * n:], [1 / MAX_DEPTH, 0.25, 0.25, 0.0, 0.0, 1.0])  # no previous cycle yet


def test_depth_observation_keeps_drafting_order():
    obs = depth_observation(make_state([-2.0, -0.5, -1.0]), DEPTH_SPEC)
    np.testing.assert_allclose(obs[:3], [-0.1, -0.025, -0.05])  # not sorted: the policy reads no sort


def test_observation_before_drafting_has_no_scores_and_depth_zero():
    state = DraftState(depth=0, max_depth=MAX_DEPTH, width=W, context_len=50, new_tokens=8, max_new_tokens=32,
                       prev_accepted=3, prev_depth=4, acceptance=0.25)
    for spec, build in ((DEPTH_SPEC, depth_observation), (SIZE_SPEC, size_observation)):
        obs = build(state, spec)
        n = spec.num_scores
        np.testing.assert_array_equal(obs[:n], -1.0)
        np.testing.assert_array_equal(obs[n:spec.scalar_start], 0.0)  # mask (and candidate depths): all padding
        np.testing.assert_allclose(obs[spec.scalar_start:], [0.0, 0.25, 0.25, 0.5, 4 / 6, 0.25])
        assert observation_space(spec).contains(obs)


@pytest.mark.parametrize("prev_accepted, prev_depth, expected", [(0, 1, [0.0, 1 / 6]), (3, 4, [0.5, 4 / 6]),
                                                                  (9, 9, [1.0, 1.0])])
def test_history_slots_hold_the_previous_cycle(prev_accepted, prev_depth, expected):
    state = make_state([-0.5], prev_accepted=prev_accepted, prev_depth=prev_depth, acceptance=0.75)
    for spec, build in ((DEPTH_SPEC, depth_observation), (SIZE_SPEC, size_observation)):
        obs = build(state, spec)
        np.testing.assert_allclose(obs[-3:], expected + [0.75])
        assert observation_space(spec).contains(obs)


def test_no_fake_zero_logprob_in_padding():
    obs = depth_observation(make_state([-3.0]), DEPTH_SPEC)
    assert not np.any(obs[: DEPTH_SPEC.num_scores] == 0.0)


def test_size_observation_truncates_to_top_scores():
    cands = [-0.1 * i for i in range(1, 20)]
    obs = size_observation(make_state(cands[-9:][::-1], earlier=cands[:-9]), SIZE_SPEC)
    n = SIZE_SPEC.num_scores
    np.testing.assert_allclose(obs[:n], np.array(cands[:n]) / 20.0, rtol=1e-6)
    np.testing.assert_array_equal(obs[n:2 * n], 1.0)


@pytest.mark.parametrize("context_len, new_tokens", [(0, 0), (10_000, 999), (199, 31)])
def test_observation_within_space_bounds(context_len, new_tokens):
    space = observation_space(DEPTH_SPEC)
    rng = np.random.default_rng(0)
    for k in (1, 4, 9, 12):
        scores = -np.abs(rng.normal(0, 10, size=k))
        obs = depth_observation(make_state(scores.tolist(), context_len=context_len, new_tokens=new_tokens),
                                DEPTH_SPEC)
        assert space.contains(obs), obs


def test_observation_space_passes_gymnasium_checks():
    space = observation_space(SIZE_SPEC)
    assert space.shape == (SIZE_SPEC.dim,) and space.dtype == np.float32
    assert space.contains(space.sample())


def test_spec_json_round_trip_and_version_check():
    data = json.loads(json.dumps(SIZE_SPEC.to_dict()))
    assert ObservationSpec.from_dict(data) == SIZE_SPEC
    with pytest.raises(ValueError, match="version"):
        ObservationSpec.from_dict({**data, "version": 999})


@pytest.mark.parametrize("device, expected_len, lo, hi", [("cpu", 8, 3, 31), (None, 8, 3, 31), ("cuda", 12, 20, 240)])
def test_default_size_actions(device, expected_len, lo, hi):
    actions = default_size_actions(device)
    assert len(actions) == expected_len and actions[0] == lo and actions[-1] == hi
    assert actions == sorted(set(actions))



def test_size_observation_carries_each_candidate_depth():
    # W=3: level 1 holds node ids 0-2, level 2 ids 3-11; sorted: -0.1 (d1), -0.2 (d2), -0.3 (d2), -1.0 (d1), ...
    level1, level2 = [-0.1, -1.0, -5.0], [-0.2, -0.3, -1.5, -6.0, -6.5, -7.0, -8.0, -9.0, -9.5]
    state = make_state(level2, earlier=level1)
    spec = ObservationSpec.for_size(W, MAX_DEPTH, size_actions=[2, 4, 6, 8], max_context=200)
    assert spec.candidate_depths and spec.dim == 3 * 8 + NUM_SCALARS
    obs = size_observation(state, spec)
    np.testing.assert_array_equal(state.candidate_depths[:5], [1, 2, 2, 1, 2])
    np.testing.assert_allclose(obs[16:24], np.array([1, 2, 2, 1, 2, 1, 2, 2]) / MAX_DEPTH)
    assert observation_space(spec).contains(obs)
    short = size_observation(make_state([-0.5, -0.1]), spec)  # two candidates: the other depth slots are padding
    np.testing.assert_allclose(short[16:24], [1 / MAX_DEPTH] * 2 + [0.0] * 6)
    plain = ObservationSpec.for_size(W, MAX_DEPTH, size_actions=[2, 4, 6, 8], max_context=200, features=())
    assert plain.dim == 2 * 8 + NUM_SCALARS
    np.testing.assert_array_equal(size_observation(state, plain)[16:], obs[24:])


@pytest.mark.parametrize("width, levels", [(1, 5), (2, 4), (4, 3)])
def test_candidate_depths_follow_the_verification_order(width, levels):
    # the order DraftTree.ranking verifies in: scores descending, ties by node id (a torch stable sort); ties on purpose
    rng = np.random.default_rng(width)
    sizes = [width] + [width * width] * (levels - 1)
    scores = [np.round(rng.normal(-3.0, 1.0, size=n), 1).astype(np.float32) for n in sizes]
    state = DraftState.from_levels(scores, max_depth=levels, width=width, context_len=10)
    _, ids = torch.sort(torch.from_numpy(np.concatenate(scores)), descending=True, stable=True)
    depth_of_id = np.concatenate([np.full(n, d + 1) for d, n in enumerate(sizes)])
    np.testing.assert_array_equal(state.candidate_depths, depth_of_id[ids.numpy()])


def test_candidate_depths_are_a_size_feature():
    with pytest.raises(ValueError, match="size-policy feature"):
        ObservationSpec.for_depth(W, MAX_DEPTH, features=("candidate_depths",))
    spec = ObservationSpec.for_size(W, MAX_DEPTH, size_actions=[2, 4])
    assert ObservationSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
