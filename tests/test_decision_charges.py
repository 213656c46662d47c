"""Decision time in replay: the latency profile times a probe policy's answers to every question, and replay
charges them to the questions a controller answers with a policy network (as the live clock does)."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from specpilot.drafting.control import DecisionLog, FixedController
from specpilot.drafting.cycle import run_generation
from specpilot.drafting.errors import InputFileError
from specpilot.drafting.types import TreeConfig
from specpilot.envs.oracle import replay_controller
from specpilot.envs.profile import LatencyProfile, ProfileSamples, collect_samples
from specpilot.envs.record import record_trace
from specpilot.envs.replay import ReplayModel, ReplaySession
from specpilot.envs.shards import merge_samples, samples_from_dict, samples_to_dict
from specpilot.policies.heuristics import BatchGuardController, SpeculateBelowBatch
from specpilot.policies.learned import LearnedController, probe_controller
from tiny import tiny_pair

TREE = TreeConfig(width=2, max_depth=4, max_size=8)
SIZES = [1, 2, 4, 8]
CHARGES = {"skip": 5e-5, "stop": 3e-5, "size": 4e-5}


@pytest.fixture(scope="module")
def pair_prompts():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    yield tiny_pair(vocab=64, layers=1, eos=63, sharpness=1.0), [rng.integers(0, 63, size=5).tolist() for _ in range(2)]
    torch.set_num_threads(threads)


def _synthetic_profile(decision: dict | None = None) -> LatencyProfile:
    first = {n: [1e-3] for n in range(1, TREE.max_depth + 2)}
    levels = {level: [1.2e-3] for level in range(2, TREE.max_depth + 1)}
    verify = [(v, c, 4e-3 + 1e-4 * v) for v in range(0, TREE.max_size + 1) for c in (5, 40)]
    return LatencyProfile.from_samples(first, levels, verify, max_depth=TREE.max_depth, width=TREE.width,
                                       decisions={q: [s] for q, s in (decision or {}).items()})


def _questions(records, max_depth: int) -> dict[str, int]:
    """What run_cycle asks in these cycles: skip every cycle, stop after each level below max_depth, size when
    drafted (the prompts have more than one token: every cycle can draft)."""
    drafted = [r.depth for r in records if r.depth]
    return {"skip": len(records), "stop": sum(min(d, max_depth - 1) for d in drafted), "size": len(drafted)}


def _probe() -> LearnedController:
    return probe_controller(TREE.width, TREE.max_depth, SIZES)


def test_the_profile_times_the_probe_on_every_question(pair_prompts):
    pair, prompts = pair_prompts
    samples = collect_samples(pair, TREE, prompts, max_new_tokens=12, sizes=SIZES, warmup_cycles=2)
    counts = {q: len(v) for q, v in samples.decisions.items()}
    drafted = sum(len(v) for v in samples.first.values())
    assert counts == {"skip": len(samples.verify), "size": drafted,
                      "stop": drafted + sum(len(samples.levels[l]) for l in range(2, TREE.max_depth))}
    profile = samples.profile()
    assert profile.decision["keys"] == ["size", "skip", "stop"] and all(t > 0 for t in profile.decision["mean"])
    assert profile.decision_time("stop") == pytest.approx(np.mean(samples.decisions["stop"]))
    plain = collect_samples(pair, TREE, prompts[:1], max_new_tokens=6, sizes=SIZES, probe_decisions=False)
    assert not plain.decisions and plain.profile().decision == {} and plain.profile().decision_time("skip") == 0.0


@pytest.fixture(scope="module")
def model(pair_prompts):
    pair, prompts = pair_prompts
    return ReplayModel(record_trace(pair, TREE, prompts, max_new_tokens=16), _synthetic_profile(CHARGES))


def test_replay_charges_each_question_an_actor_answers(model):
    probe = _probe()
    records = [r for i in range(model.num_prompts)
               for r in run_generation(ReplaySession(model, i, charges=CHARGES), probe)]
    asked = _questions(records, TREE.max_depth)
    expected = sum(CHARGES[q] * n for q, n in asked.items())
    assert sum(r.policy_s for r in records) == pytest.approx(expected)
    out = replay_controller(model, controller=probe)
    assert out["decision_s"] == pytest.approx(expected)
    assert out["time_s"] == pytest.approx(sum(r.cycle_s for r in records) + expected)
    # the same decisions for free where the profile did not time them
    free = replay_controller(ReplayModel(model.trace, _synthetic_profile()), controller=probe)
    assert free["decision_s"] == 0.0 and free["time_s"] == pytest.approx(out["time_s"] - expected)


@pytest.mark.parametrize("controller, charged", [
    (FixedController(3, 4), set()),
    (_probe(), {"skip", "stop", "size"}),
    (LearnedController(depth_actor=_probe().depth_actor, depth_spec=_probe().depth_spec,
                       fallback=FixedController(3, 4)), {"skip", "stop"}),
    (LearnedController(size_actor=_probe().size_actor, size_spec=_probe().size_spec, size_actions=SIZES,
                       fallback=FixedController(3, 4)), {"size"}),
    (DecisionLog(_probe()), {"skip", "stop", "size"}),
    (SpeculateBelowBatch(_probe(), 4), {"skip", "stop", "size"}),
    (BatchGuardController(_probe(), {1: (3, 4), 8: (0, 0)}, []), {"skip", "stop", "size"}),
    (BatchGuardController(_probe(), {1: (3, 4), 8: (0, 0)}, [1]), set()),  # the table answers at batch size 1
])
def test_only_questions_answered_by_a_network_are_charged(model, controller, charged):
    assert controller.actor_questions() == charged
    records = [r for i in range(model.num_prompts)
               for r in run_generation(ReplaySession(model, i, charges=model.profile.decision_charges(charged)),
                                       copy.deepcopy(controller))]
    asked = _questions(records, TREE.max_depth)
    expected = sum(CHARGES[q] * asked[q] for q in charged)
    assert replay_controller(model, controller=copy.deepcopy(controller))["decision_s"] == pytest.approx(expected)


def test_profile_decision_times_survive_save_load_and_a_malformed_entry_is_refused(tmp_path):
    profile = _synthetic_profile(CHARGES)
    loaded = LatencyProfile.load(profile.save(tmp_path / "profile.json"))
    assert loaded.decision_charges({"skip", "stop", "size"}) == pytest.approx(CHARGES)
    bad = dataclasses.replace(profile, decision={"keys": ["skip"]})
    bad.save(tmp_path / "bad.json")
    with pytest.raises(InputFileError, match="decision"):
        LatencyProfile.load(tmp_path / "bad.json")


def test_shards_carry_and_pool_their_decision_times():
    a, b = (ProfileSamples(max_depth=3, width=2, meta={"device": "cpu", "measured_s": 1.0}) for _ in range(2))
    a.decisions["stop"].extend([1e-5, 2e-5])
    b.decisions["stop"].append(3e-5)
    b.decisions["skip"].append(4e-5)
    assert samples_from_dict(samples_to_dict(a)).decisions == a.decisions
    merged = merge_samples([("cpu", a), ("cpu", b)])
    assert merged.decisions == {"stop": [1e-5, 2e-5, 3e-5], "skip": [4e-5]}
