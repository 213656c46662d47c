"""Behaviour cloning from the replay oracle: the oracle's per-question labels replay to the oracle's own time, the
SB3 policy networks learn those labels, the DAgger loop aggregates the policy's own states, and the pipeline
fine-tunes the cloned policies with PPO."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specpilot.drafting.types import TreeConfig
from specpilot.envs.oracle import replay_oracle
from specpilot.envs.replay import ReplayModel
from specpilot.policies.observation import ObservationSpec
from specpilot.policies.ppo import load_run_controllers
from specpilot.train.rl import pipeline as P
from specpilot.train.rl.imitation import (ImitationSettings, LabellingController, OracleLabels, OracleTables, imitate,
                                       rollout)
from specpilot.train.rl.ppo import PPOOverrides

from test_pipeline import tiny_task_traces

TREE = TreeConfig(width=3, max_depth=4, max_size=8)
SIZES = [2, 4, 8]
STATIC = (2, 4)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return tiny_task_traces(tmp_path_factory.mktemp("traces"), TREE, noise=0.3, seed=3)


def _options(**kw):
    return P.TrainOptions(static=STATIC, ppo=PPOOverrides(pi_arch=[64], vf_arch=[16], n_steps=64, batch_size=32,
                                                          n_epochs=2), **kw)


@pytest.mark.parametrize("allow_skip", [True, False])
def test_cost_to_go_matches_the_oracle(traces, allow_skip):
    model = ReplayModel(traces.train)
    depths = np.arange(0 if allow_skip else 1, TREE.max_depth + 1)
    oracle = replay_oracle(model, depths=depths.tolist(), sizes=SIZES)["oracle"]
    total = sum(OracleTables(model, i, depths, np.array(SIZES)).cost[0, 1] for i in range(model.num_prompts))
    assert total == pytest.approx(oracle["time_s"])


@pytest.mark.parametrize("allow_skip", [True, False])
def test_oracle_labels_replay_to_the_oracle_time(traces, allow_skip):
    """Answering every question with its label, through run_cycle, reaches the hindsight optimum exactly."""
    model = ReplayModel(traces.train)
    labels = OracleLabels(model, SIZES, allow_skip=allow_skip)
    depth_spec = ObservationSpec.for_depth(TREE.width, TREE.max_depth)
    size_spec = ObservationSpec.for_size(TREE.width, TREE.max_depth, size_actions=SIZES)
    expert = LabellingController(labels, depth_spec, size_spec, SIZES, None)
    if not allow_skip:
        expert.skip_drafting = lambda state: False
    got = rollout(model, expert)
    depths = list(range(0 if allow_skip else 1, TREE.max_depth + 1))
    oracle = replay_oracle(model, depths=depths, sizes=SIZES)["oracle"]
    assert got["time_s"] == pytest.approx(oracle["time_s"]) and got["tokens"] == oracle["tokens"]
    # the expert agrees with itself, and both datasets hold one labelled observation per question
    assert expert.depth_data.agreed == expert.depth_data.asked > 0
    obs, y = expert.size_data.arrays()
    assert obs.shape == (expert.size_data.asked, size_spec.dim) and set(y) <= set(range(len(SIZES)))


def test_behaviour_cloning_reproduces_the_oracle_labels(traces, tmp_path):
    """The cloned SB3 networks answer as the oracle: every size label, and the depth labels well beyond the majority
    answer (hindsight labels depend on the future, so identical-looking states can carry different labels)."""
    out = imitate(tmp_path / "run", traces, size_actions=SIZES, options=_options(),
                  settings=ImitationSettings(iters=1, epochs=300, lr=1e-2, loss="set"))
    model = ReplayModel(traces.train)
    labels = OracleLabels(model, SIZES)
    spec_d = ObservationSpec.for_depth(TREE.width, TREE.max_depth)
    spec_s = ObservationSpec.for_size(TREE.width, TREE.max_depth, size_actions=SIZES)
    expert = LabellingController(labels, spec_d, spec_s, SIZES, None)
    rollout(model, expert)
    majority = np.bincount(expert.depth_data.arrays()[1]).max() / expert.depth_data.asked
    fit = out["iterations"][0]["fit"]
    assert fit["size"]["accuracy"] >= 0.95 and fit["depth"]["accuracy"] >= majority + 0.05
    # the cloned controller, loaded from RUN/bc like any run (the inference path), makes those decisions
    ltd = load_run_controllers(tmp_path / "run" / "bc")["ltd"]
    for actor, data, kind in ((ltd.depth_actor, expert.depth_data, "depth"), (ltd.size_actor, expert.size_data, "size")):
        obs, best = data.arrays()[0], data.best_mask()
        right = [best[i, actor.act(o)] for i, o in enumerate(obs)]
        assert np.mean(right) == pytest.approx(fit[kind]["accuracy"])


def test_dagger_aggregates_and_pipeline_fine_tunes(traces, tmp_path):
    run = tmp_path / "run"
    out = P.run_pipeline(run, traces, size_steps=64, depth_steps=64, coadapt_steps=128, rounds=2,
                         size_actions=SIZES, options=_options(bc_iters=3, bc_epochs=5), wandb="disabled")
    history = json.loads((run / "bc" / "imitation.json").read_text())["iterations"]
    assert [h["rollout"] for h in history] == ["oracle", "policy", "policy"]
    assert history[0]["samples"]["depth"] < history[1]["samples"]["depth"] < history[2]["samples"]["depth"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["coadapt"]["rounds"][0]["stage"] == "co1_size"
    # co-adaptation started from the cloned policies and never handed on a worse one
    assert manifest["stage_setup"]["co1_size"]["init_from"].endswith("bc_size/best.zip")
    rnd = out["coadapt"]["rounds"][0]
    assert rnd["score"] >= rnd["validation"]["init_score"] - 1e-9
    assert {"ltd", "depth_only", "size_only"} <= set(load_run_controllers(run))
    ev = P.evaluate_run(run, traces, static=STATIC)
    assert {"bc_ltd", "ltd", "oracle"} <= set(ev)


@pytest.mark.parametrize("mode", ["regret", "cost", "soft"])
def test_regret_loss_picks_the_cheaper_answer_on_average_where_labels_conflict(mode):
    """Two identical observations, hindsight labels 0 and 1; answering 0 wrongly costs little, answering 1 wrongly
    costs much: plain cross-entropy cannot choose, every cost-sensitive loss chooses 0 (the cheaper answer on
    average)."""
    from stable_baselines3 import PPO

    from specpilot.train.rl.imitation import fit_policy
    from test_ppo_learning import ToyStopEnv

    policy = PPO("MlpPolicy", ToyStopEnv(), policy_kwargs=dict(net_arch=[16]), seed=0, device="cpu").policy
    obs = np.array([[0.5, 0.5], [0.5, 0.5]], dtype=np.float32)
    labels = np.array([1, 0])
    best = np.array([[False, True], [True, False]])
    regret = np.array([[0.2, 0.0], [0.0, 5.0]])
    fit_policy(policy, obs, labels, best=best, regret=regret, epochs=200, batch_size=2, lr=1e-2, mode=mode)
    with torch.no_grad():
        logits = policy.action_net(policy.mlp_extractor.forward_actor(torch.as_tensor(obs[:1])))
    assert int(logits.argmax()) == 0


class _StopAt:
    """A causal stand-in for a policy: stops after `depth` levels."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def should_stop(self, state) -> bool:
        return state.depth >= self.depth


@pytest.mark.parametrize("stop_at", [1, 2, TREE.max_depth])
def test_continuing_as_the_policy_values_continue_at_the_depth_it_would_reach(traces, stop_at):
    """CONTINUE costs what the cycle costs when the controller drafts on to where IT stops (best size there, the
    oracle after); the oracle's own continuation (stopping exactly where acceptance ends) is never more."""
    from specpilot.envs.replay import ReplaySession
    from specpilot.policies.learned import CONTINUE, STOP

    model = ReplayModel(traces.train)
    labels = OracleLabels(model, SIZES)
    session = ReplaySession(model, 0)
    q = labels.tables(0).q(session.t, session.n_new)                                      # [depths 0..D, sizes]
    stop = _StopAt(stop_at)
    for depth in range(0, TREE.max_depth):
        got = labels.depth_costs_continuing(session, depth, stop.should_stop)
        reach = max(stop_at, depth + 1)
        assert got[CONTINUE] == pytest.approx(q[reach].min())
        assert got[STOP] == labels.depth_costs(session, depth)[STOP]
        assert labels.depth_costs(session, depth)[CONTINUE] <= got[CONTINUE] + 1e-12


def test_regret_decomposition_sums_to_the_gap_to_the_oracle(traces):
    """Performance difference: the hindsight regrets of a controller's own answers add up to its replay time minus
    the oracle's, exactly."""
    from specpilot.drafting.control import FixedController
    from specpilot.train.rl.gap import decompose

    out = decompose(ReplayModel(traces.train), FixedController(*STATIC), SIZES)
    assert out["gap_s"] > 0
    assert sum(out["parts"].values()) == pytest.approx(out["gap_s"], rel=1e-9, abs=1e-12)
    assert set(out["parts"]) <= {"skip", "stop_too_early", "draft_not_skip", "too_deep", "size_too_small",
                                 "size_too_large"}
