"""The learned batch-aware policy: the optional batch features of the observation, replay envs over batches (one
episode = a BatchReplaySession, rewarded on batch throughput, equal to batch replay's cycles), PPO training over a
batch-size distribution, and the learned policy's own per-batch-size table in the engines' configs."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specpilot.drafting.control import FixedController
from specpilot.drafting.cycle import run_generation
from specpilot.drafting.types import DraftState, TreeConfig
from specpilot.envs.batch_replay import BatchReplaySession, replay_batch
from specpilot.envs.environments import DepthEnv, ReplaySource, SizeEnv
from specpilot.envs.record import record_trace
from specpilot.envs.replay import ReplayModel
from specpilot.policies.observation import BATCH_FEATURES, DEFAULT_SIZE_FEATURES, ObservationSpec, depth_observation
from specpilot.policies.ppo import BATCH_GUARD_FILE
from specpilot.train.rl import pipeline as P
from specpilot.train.rl.ppo import PPOOverrides

from test_batch_replay import known_profile
from tiny import tiny_pair

TREE = TreeConfig(width=2, max_depth=3, max_size=6)
BATCH_SIZES = (1, 2, 4)
SMALL = PPOOverrides(pi_arch=[16], vf_arch=[16], n_steps=64, batch_size=32, n_epochs=2)


def batched(tree: TreeConfig = TREE):
    return known_profile(tree).with_batch({b: known_profile(tree, b) for b in BATCH_SIZES})


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """train (4 prompts) / validation (3) traces of a tiny pair, each with a batched profile."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("batchlearn")
    pair = tiny_pair(noise=0.4, eos=None)
    rng = np.random.default_rng(3)
    for split, n in (("train", 4), ("validation", 3)):
        prompts = [rng.integers(0, 95, size=int(rng.integers(3, 7))).tolist() for _ in range(n)]
        record_trace(pair, TREE, prompts, max_new_tokens=12).save(root / split)
        batched().save(root / split / "profile.json")
    return P.TaskTraces.resolve(root)


@pytest.mark.parametrize("batch_size,expected", [(1, 0.0), (2, 1 / 6), (8, 0.5), (64, 1.0), (256, 1.0)])
def test_batch_feature_is_log2_batch_size_saturating(batch_size, expected):
    spec = ObservationSpec.for_depth(2, 3, max_context=100, features=BATCH_FEATURES)
    state = DraftState(depth=1, max_depth=3, width=2, context_len=10, scores=np.array([-0.5, -1.0], np.float32),
                       batch_size=batch_size, context_max=150)
    obs = depth_observation(state, spec)
    assert obs.shape == (spec.dim,) and spec.dim == 2 * 4 + 6 + 2
    assert obs[-2] == pytest.approx(expected) and obs[-1] == 1.0   # context_max saturates at max_context


def test_batch_features_are_off_by_default_and_round_trip():
    plain = ObservationSpec.for_depth(2, 3)
    assert plain.features == () and plain.dim == 2 * 4 + 6
    spec = ObservationSpec.for_size(2, 3, size_actions=[2, 4], features=("context_max", "batch", "entropy"))
    assert spec.features == ("entropy", "batch", "context_max")   # FEATURES order
    assert ObservationSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    # a spec without batch features observes exactly what it did (the batch size does not leak in)
    state = DraftState(depth=1, max_depth=3, width=2, context_len=10, scores=np.array([-0.5], np.float32))
    state8 = DraftState(depth=1, max_depth=3, width=2, context_len=10, scores=np.array([-0.5], np.float32),
                        batch_size=8, context_max=40)
    assert np.array_equal(depth_observation(state, plain), depth_observation(state8, plain))


def test_batch_replay_states_carry_the_load(task):
    model = ReplayModel(task.train)
    session = BatchReplaySession(model, [0, 1, 2])
    state = session.cycle_state()
    lengths = [r.prompt_len for r in session.rows]
    assert (state.batch_size, state.context_max, state.context_mean) == (3, max(lengths), pytest.approx(np.mean(lengths)))
    assert session.draft_level().batch_size == 3


@pytest.mark.parametrize("batch_size", [2, 4])
@pytest.mark.parametrize("depth,size", [(1, 2), (3, 4)])
def test_size_env_episode_at_batch_size_equals_batch_replay(task, batch_size, depth, size):
    """A constant agent in the batch env = FixedController in BatchReplaySession over the same rows: the same
    cycles, the same times, and rewards summing every row's tokens per batch cycle."""
    source = ReplaySource(task.train, batch_sizes=BATCH_SIZES)
    env = SizeEnv(source, reward="throughput", size_actions=[2, 4], depth_controller=depth)
    assert env.spec_obs.features == BATCH_FEATURES + DEFAULT_SIZE_FEATURES  # (kept in this order)
    obs, info = env.reset(seed=7, options={"batch_size": batch_size})
    assert info["batch_size"] == batch_size and env.observation_space.contains(obs)
    rows = [r.index for r in env.session.rows]
    steps, done = [], False
    while not done:
        obs, reward, term, trunc, info = env.step([2, 4].index(size))
        steps.append((reward, info))
        done = term or trunc
        assert env.observation_space.contains(obs)
    ref = BatchReplaySession(ReplayModel(task.train), rows)
    records = run_generation(ref, FixedController(depth, size))
    assert [(i["depth"], i["size"], i["accepted"], i["draft_s"], i["verify_s"]) for _, i in steps] == \
        [(r.depth, r.size, r.accepted, r.draft_s, r.verify_s) for r in records]
    assert sum(i["batch_emitted"] for _, i in steps) == ref.emitted_total
    assert [i["batch_size"] for _, i in steps] == ref.batch_sizes
    for (reward, i), r in zip(steps, records):
        assert reward == pytest.approx(i["batch_emitted"] / r.cycle_s)


def test_depth_env_draws_batch_sizes_and_a_profile_without_them_is_refused(task):
    env = DepthEnv(ReplaySource(task.train, batch_sizes=BATCH_SIZES), size_controller=4)
    seen = {env.reset(seed=s)[1]["batch_size"] for s in range(30)}
    assert seen == set(BATCH_SIZES)
    single = known_profile(TREE)
    with pytest.raises(ValueError, match="batch sizes"):
        ReplaySource(task.train, single, batch_sizes=BATCH_SIZES)
    with pytest.raises(ValueError, match="measured batch sizes"):
        ReplaySource(task.train, batch_sizes=(1, 8))
    with pytest.raises(ValueError, match="time_noise"):
        ReplaySource(task.train, batch_sizes=BATCH_SIZES, time_noise=0.5)


@pytest.fixture(scope="module")
def trained(task, tmp_path_factory):
    """A few PPO steps of both stage-1 policies over batch sizes 1, 2, 4 (the traces' batched profiles)."""
    run = tmp_path_factory.mktemp("batchrun") / "run"
    options = P.TrainOptions(static=(2, 4), ppo=SMALL, batch_sizes=BATCH_SIZES)
    out = P.run_pipeline(run, task, size_steps=128, depth_steps=128, rounds=0, options=options, wandb="disabled")
    return run, out


def test_training_over_batch_sizes_writes_batch_aware_policies(task, trained):
    run, out = trained
    assert out["depth_s1"]["spec"]["features"] == list(BATCH_FEATURES)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stage_setup"]["size_s1"]["batch_sizes"] == list(BATCH_SIZES)
    from specpilot.policies.ppo import load_run_controllers
    from specpilot.train.rl.validation import evaluate_batches

    ltd = load_run_controllers(run)["ltd"]
    model = ReplayModel(task.validation)
    res = evaluate_batches(ltd, model, BATCH_SIZES)
    assert set(res["per_batch_size"]) == set(BATCH_SIZES) and res["score"] > 0
    # the depth stage's kept score is the batch validation of its policy
    score = json.loads((run / "depth_s1" / "best.json").read_text())["score"]
    assert 0 < score < 10
    for b in BATCH_SIZES:
        assert res["per_batch_size"][b]["tokens_per_s"] == pytest.approx(
            replay_batch(model, ltd, batch_size=b)["tokens_per_s"])


def test_batch_training_refuses_live():
    P.TrainOptions(batch_sizes=(1, 2), bc_iters=2)  # behaviour cloning over batches: the per-batch oracle's labels
    with pytest.raises(ValueError, match="batch replay"):
        P.TrainOptions(batch_sizes=(1, 2), backend="live", pair=object())


def test_export_writes_the_learned_policys_table_beside_the_grids(task, trained, tmp_path):
    from specpilot.envs.batch_replay import learned_batch_table
    from specpilot.policies.exported import load_exported
    from specpilot.train.export.writer import export_run

    run, _ = trained
    pair = tiny_pair(noise=0.4, eos=None)
    meta = export_run(run, tmp_path / "export", pair=pair, num_prompts=1, max_new_tokens=8, num_random=100,
                      log=lambda *a: None)
    learned = meta["engine_configs"]["per_batch_size_learned"]
    assert learned["source"] == "learned" and [r["batch_size"] for r in learned["table"]] == list(BATCH_SIZES)
    assert meta["policies"]["depth"]["spec"]["features"] == list(BATCH_FEATURES)
    # the table is the exported controller's modal choice per batch size in batch replay of the validation trace
    exported, _, _ = load_exported(tmp_path / "export", load_pair=False)
    rows = learned_batch_table(ReplayModel(task.validation), exported, list(BATCH_SIZES))
    assert [(r["depth"], r["size"]) for r in rows] == [(r["depth"], r["size"]) for r in learned["table"]]
    # vLLM's learned file: written where the policy drafts at some batch size, else left out and the README says
    # why (what a few PPO steps learn depends on the random stream, so both are possible here)
    engines = tmp_path / "export" / "engines"
    if any(r["depth"] > 0 for r in learned["table"]):
        _check_vllm_learned(engines, learned)
    else:
        assert not (engines / "vllm" / "speculative_config.learned.json").exists()
        assert "Not written: vllm/speculative_config.learned.json" in (engines / "README.md").read_text()
    # a table that drafts, for certain: a copy of the run whose batch guard hands every size to a table
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / BATCH_GUARD_FILE).write_text(json.dumps({"table": {"1": [2, 4], "2": [1, 2], "4": [0, 0]},
                                                     "fallback": [1, 2, 4]}))
    meta = export_run(copy, tmp_path / "export2", pair=pair, num_prompts=1, max_new_tokens=8, num_random=100,
                      log=lambda *a: None)
    _check_vllm_learned(tmp_path / "export2" / "engines", meta["engine_configs"]["per_batch_size_learned"])


def _check_vllm_learned(engines, learned: dict) -> None:
    vllm = json.loads((engines / "vllm" / "speculative_config.learned.json").read_text())
    table = vllm.get("num_speculative_tokens_per_batch_size")
    assert table == learned["vllm_num_speculative_tokens_per_batch_size"]
    assert table[0][0] == 1 and vllm["num_speculative_tokens"] >= max(k for _, _, k in table)


def test_learned_table_is_the_modal_choice_per_batch_size(task):
    from specpilot.envs.batch_replay import learned_batch_table

    rows = learned_batch_table(ReplayModel(task.validation), FixedController(2, 3), list(BATCH_SIZES))
    assert [(r["batch_size"], r["depth"], r["size"], r["depth_share"]) for r in rows] == \
        [(b, 2, 3, 1.0) for b in BATCH_SIZES]


def test_cli_trains_over_batch_sizes_with_ppo_and_with_bc(task, tmp_path, capsys):
    from specpilot.cli import main

    base = ["--threads", "1", "train", "depth", "--run", str(tmp_path / "r"), "--traces", str(task.train.parent),
            "--static", "2,4", "--steps", "64", "--n-steps", "64", "--batch-size", "32", "--n-epochs", "1",
            "--pi-arch", "8", "--vf-arch", "8", "--wandb", "disabled", "--batch-sizes", "1,2,4"]
    assert main(base) == 0
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["stage_setup"]["depth_s1"]["spec"]["features"] == list(BATCH_FEATURES)
    bc = ["--threads", "1", "train", "all", "--run", str(tmp_path / "r2"), "--traces", str(task.train.parent),
          "--static", "2,4", "--bc", "--bc-iters", "1", "--bc-epochs", "1", "--rounds", "1", "--coadapt-steps", "64",
          "--n-steps", "64", "--batch-size", "32", "--n-epochs", "1", "--pi-arch", "8", "--vf-arch", "8",
          "--wandb", "disabled", "--batch-sizes", "1,2"]
    assert main(bc) == 0
    manifest = json.loads((tmp_path / "r2" / "manifest.json").read_text())
    assert manifest["stage_setup"]["bc_depth"]["batch_sizes"] == [1, 2]
    assert manifest["stage_setup"]["bc_depth"]["spec"]["features"][-len(BATCH_FEATURES):] == list(BATCH_FEATURES)
