"""Heuristic controllers: each stopping rule on hand-made DraftStates, the HF +2/-1 schedule, the registry."""
from __future__ import annotations

import math

import pytest
import torch

from specpilot.drafting.types import CycleRecord, DraftState
from specpilot.policies import Controller, default_static_config
from specpilot.policies.heuristics import (
    HEURISTICS,
    ConfidenceController,
    DDDController,
    GammaTuneController,
    HFHeuristicController,
    RandomDepthController,
    SVIPController,
    make_heuristic,
)


def make_state(depth: int = 1, frontier=(-0.1,), width: int = 2, top_prob: float = 0.9, entropy: float = 0.1,
               max_depth: int = 12) -> DraftState:
    state = DraftState.from_levels([list(frontier)], max_depth=max_depth, width=width, context_len=10,
                                   last_top_prob=top_prob, last_entropy=entropy, new_tokens=0, max_new_tokens=64)
    state.depth = depth
    return state


def record(depth: int, accepted: int) -> CycleRecord:
    return CycleRecord(depth=depth, size=8, accepted=accepted, emitted=accepted + 1, draft_s=0.01, verify_s=0.02,
                       policy_s=0.0, context_len=10)


# Beam of width 2: logsumexp(log .5, log .3) = log .8 = -0.22 (continue); logsumexp(log .4, log .2) = log .6 = -0.51
@pytest.mark.parametrize(
    "depth, beam, expected",
    [
        (5, [math.log(0.5), math.log(0.3), -9.0], False),  # confident beam at a check depth
        (5, [math.log(0.4), math.log(0.2), -9.0], True),  # unconfident beam at a check depth
        (7, [math.log(0.4), math.log(0.2)], True),
        (9, [math.log(0.4), math.log(0.2)], True),
        (6, [math.log(0.4), math.log(0.2)], False),  # not a check depth
        (1, [-5.0, -6.0], False),
        (5, [math.log(0.5), math.log(0.3), math.log(0.15)], False),  # scores beyond the beam W do not count
    ],
)
def test_ddd_stops_on_beam_confidence(depth, beam, expected):
    assert DDDController().should_stop(make_state(depth=depth, frontier=beam, width=2)) is expected


def test_ddd_confidence_is_logsumexp_of_beam():
    state = make_state(frontier=[math.log(0.5), math.log(0.3), math.log(0.1)], width=2)
    assert DDDController.confidence(state) == pytest.approx(math.log(0.8), abs=1e-6)


# sqrt(0.15 * H) > 0.3  <=>  H > 0.6
@pytest.mark.parametrize("entropy, expected", [(0.0, False), (0.5, False), (0.59, False), (0.61, True), (3.0, True),
                                               (-1e-9, False)])
def test_svip_entropy_rule(entropy, expected):
    assert SVIPController().should_stop(make_state(entropy=entropy)) is expected


@pytest.mark.parametrize("top_prob, expected", [(0.99, False), (0.41, False), (0.4, False), (0.39, True), (0.0, True)])
def test_confidence_threshold(top_prob, expected):
    assert ConfidenceController().should_stop(make_state(top_prob=top_prob)) is expected


def test_hf_heuristic_schedule_plus_two_minus_one():
    ctrl = HFHeuristicController(initial_depth=5)
    assert not ctrl.should_stop(make_state(depth=4)) and ctrl.should_stop(make_state(depth=5))
    ctrl.observe(record(depth=5, accepted=5))  # fully accepted: +2
    assert ctrl.target == 7
    ctrl.observe(record(depth=7, accepted=3))  # partially accepted: -1
    assert ctrl.target == 6
    for _ in range(10):
        ctrl.observe(record(depth=ctrl.target, accepted=0))
    assert ctrl.target == 1  # never below 1
    ctrl.reset()
    assert ctrl.target == 5


def test_hf_heuristic_respects_max_depth():
    ctrl = HFHeuristicController(initial_depth=5, max_depth=6)
    ctrl.observe(record(depth=5, accepted=5))
    assert ctrl.target == 6


def test_gammatune_switches_on_acceptance_rate():
    ctrl = GammaTuneController(gamma_min=2, gamma_max=6, rate=0.5)
    assert ctrl.target == 6
    ctrl.observe(record(depth=6, accepted=0))
    assert ctrl.target == 2
    ctrl.observe(record(depth=2, accepted=2))
    ctrl.observe(record(depth=2, accepted=2))
    assert ctrl.target == 6
    ctrl.observe(record(depth=6, accepted=0))
    ctrl.reset()
    assert ctrl.target == 6


@pytest.mark.parametrize("name", sorted(HEURISTICS))
def test_registry_builds_controllers_with_default_size(name):
    ctrl = make_heuristic(name)
    assert isinstance(ctrl, Controller)
    assert ctrl.choose_size(make_state()) == default_static_config()[1]
    assert ctrl.describe()["name"] == name
    assert make_heuristic(name, size=7).choose_size(make_state()) == 7


def test_registry_unknown_name_lists_choices():
    with pytest.raises(ValueError, match="ddd"):
        make_heuristic("nope")


@pytest.mark.parametrize("make,error,fragment", [
    (lambda: DDDController(size=2.5), TypeError, "verification size must be an integer >= 1"),
    (lambda: DDDController(threshold=float("nan")), ValueError, "DDD threshold .* must be a finite number"),
    (lambda: DDDController(check_depths=5), TypeError, "check_depths must be a sequence of depths"),
    (lambda: ConfidenceController(threshold=5), ValueError, "confidence threshold .* <= 1"),
    (lambda: SVIPController(coef=-1), ValueError, "SVIP coef must be a finite number >= 0"),
    (lambda: HFHeuristicController(initial_depth=2.5), TypeError, "initial_depth must be an integer >= 1"),
    (lambda: HFHeuristicController(size="12"), TypeError, "verification size must be an integer"),
    (lambda: RandomDepthController(1.5, 3), TypeError, "low must be an integer >= 0"),
    (lambda: GammaTuneController(switch_at=float("nan")), ValueError, "switch_at .* must be a finite number"),
    (lambda: DDDController(check_depths=()), ValueError, "check_depths is empty"),
    (lambda: HFHeuristicController(initial_depth=10, max_depth=3), ValueError, "initial_depth 10 is above its max"),
    (lambda: GammaTuneController(gamma_min=5, gamma_max=2), ValueError, "gamma_min 5 is above gamma_max 2"),
])
def test_heuristic_arguments_are_checked_not_truncated(make, error, fragment):
    with pytest.raises(error, match=fragment):
        make()


def test_a_given_size_past_the_tree_is_refused_by_the_decoder():
    from tiny import tiny_pair

    from specpilot.drafting import SpeculativeDecoder, TreeConfig

    decoder = SpeculativeDecoder(tiny_pair(), TreeConfig(width=2, max_depth=4, max_size=8))
    with pytest.raises(ValueError, match="DDDController size 9 is larger than the tree's max_size 8"):
        decoder.generate([1, 2, 3], controller=DDDController(size=9), max_new_tokens=4)
    assert decoder.generate([1, 2, 3], controller=DDDController(size=8), max_new_tokens=4).tokens
    with pytest.raises(ValueError, match=r"DDD check depths \[5, 7\] all lie past the tree's max_depth 4"):
        decoder.generate([1, 2, 3], controller=DDDController(check_depths=(5, 7)), max_new_tokens=4)


@pytest.mark.parametrize("make, fragment", [
    (lambda: HFHeuristicController(initial_depth=10), "hf_heuristic initial_depth 10 is deeper than the tree's"),
    (lambda: HFHeuristicController(max_depth=9), "hf_heuristic max_depth 9 is deeper than the tree's"),
    (lambda: GammaTuneController(gamma_max=10), "gammatune gamma_max 10 is deeper than the tree's"),
    (lambda: GammaTuneController(gamma_min=5, gamma_max=5), "gammatune gamma_min 5 is deeper than the tree's"),
])
def test_given_depths_the_tree_cannot_draft_are_refused_not_capped(make, fragment):
    from specpilot.drafting import TreeConfig
    from specpilot.drafting.control import fits_tree

    with pytest.raises(ValueError, match=fragment):
        fits_tree(make(), TreeConfig(width=2, max_depth=4, max_size=8))


@pytest.mark.parametrize("make", [HFHeuristicController, GammaTuneController,
                                  lambda: HFHeuristicController(initial_depth=4, max_depth=4)])
def test_default_depths_fit_a_shallow_tree_by_the_schedules_cap(make):
    from specpilot.drafting import TreeConfig
    from specpilot.drafting.control import fits_tree

    fits_tree(make(), TreeConfig(width=2, max_depth=4, max_size=8))  # defaults past max_depth: capped by design
