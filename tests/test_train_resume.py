"""Checkpoint / resume / run-directory contracts of the PPO training machinery, and loading a run's controllers."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from stable_baselines3 import PPO

from specpilot.drafting.types import DraftState
from specpilot.envs.spaces import observation_space
from specpilot.policies.observation import ObservationSpec
from specpilot.policies.ppo import PolicyLoadError, PPOController, load_run_controllers
from specpilot.policies.exported import file_sha256
from specpilot.train.rl.logging import CycleMetricsCallback, RunLogger, resolve_wandb_mode
from specpilot.train.rl.ppo import (
    CheckpointError,
    read_progress,
    settings_for,
    train_policy,
    update_manifest,
    write_policies_index,
)


class CountingEnv(gym.Env):
    """Two-step episodes; counts every step across instances and can raise KeyboardInterrupt at a given count."""

    observation_space = gym.spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)
    steps = 0
    interrupt_at: int | None = None

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        CountingEnv.steps += 1
        if CountingEnv.interrupt_at is not None and CountingEnv.steps >= CountingEnv.interrupt_at:
            raise KeyboardInterrupt
        self.t += 1
        info = {"accepted": 1, "emitted": 2, "depth": 1 + self.t, "size": 4, "draft_s": 0.01, "verify_s": 0.02}
        return np.array([self.t / 2, float(action)], dtype=np.float32), float(action), self.t >= 2, False, info


@pytest.fixture(autouse=True)
def counting_env():
    CountingEnv.steps, CountingEnv.interrupt_at = 0, None
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    CountingEnv.steps, CountingEnv.interrupt_at = 0, None
    torch.set_num_threads(old)


def tiny(**kw):
    base = dict(total_timesteps=1024, n_steps=128, batch_size=64, n_epochs=2, pi_arch=[8], vf_arch=[8], seed=0,
                checkpoint_every=128, eval_every=256)
    return settings_for("depth", **{**base, **kw})


def val_fn(model) -> float:
    return float(model.num_timesteps)  # later is better: best.zip must track the newest validation


def test_interrupted_training_resumes_without_repeating_steps(tmp_path):
    CountingEnv.interrupt_at = 600  # inside the 5th rollout: 4 * 128 = 512 steps trained
    with pytest.raises(KeyboardInterrupt):
        train_policy(CountingEnv, val_fn, tiny(), tmp_path, "stage")
    progress = read_progress(tmp_path / "stage")
    assert progress["timesteps_done"] == 512
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["stages"]["stage"]["status"] == "interrupted" and "torch" in manifest["versions"]

    CountingEnv.steps, CountingEnv.interrupt_at = 0, None
    best = train_policy(CountingEnv, val_fn, tiny(), tmp_path, "stage", resume=True)
    assert CountingEnv.steps == 1024 - 512  # only the remaining budget ran
    assert read_progress(tmp_path / "stage")["timesteps_done"] == 1024
    assert PPO.load(best, device="cpu").num_timesteps == 1024
    assert json.loads((tmp_path / "stage" / "best.json").read_text())["timesteps"] == 1024
    assert len(list((tmp_path / "stage" / "checkpoints").glob("step_*.zip"))) == 3  # pruned to keep_checkpoints

    CountingEnv.steps = 0
    train_policy(CountingEnv, val_fn, tiny(), tmp_path, "stage", resume=True)  # finished stage: nothing to do
    assert CountingEnv.steps == 0


def test_ctrl_c_inside_the_gradient_update_checkpoints_the_boundary_weights(tmp_path, monkeypatch):
    """A Ctrl-C during PPO's update (after some gradient steps) must not save those half-trained weights under the
    previous boundary's step: the checkpoint holds the weights and optimiser state the boundary had."""
    updates, boundary = [], {}
    real_train = PPO.train

    def train_then_interrupt(self):
        if len(updates) == 2:  # the third update: take one real gradient step, then Ctrl-C
            boundary["weights"] = {k: v.clone() for k, v in self.policy.state_dict().items()}
            boundary["steps"] = self.policy.optimizer.state_dict()["state"][0]["step"].item()
            loss = sum(p.pow(2).sum() for p in self.policy.parameters())
            self.policy.optimizer.zero_grad()
            loss.backward()
            self.policy.optimizer.step()
            raise KeyboardInterrupt
        updates.append(self.num_timesteps)
        return real_train(self)

    monkeypatch.setattr(PPO, "train", train_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        train_policy(CountingEnv, None, tiny(), tmp_path, "stage")
    progress = read_progress(tmp_path / "stage")
    assert progress["timesteps_done"] == updates[-1] == 256  # two updates trained; the third rollout is redone
    saved = PPO.load(tmp_path / "stage" / "checkpoints" / progress["checkpoint"], device="cpu")
    for name, value in saved.policy.state_dict().items():
        assert torch.equal(value, boundary["weights"][name]), name
    assert saved.policy.optimizer.state_dict()["state"][0]["step"].item() == boundary["steps"]

    monkeypatch.setattr(PPO, "train", real_train)
    CountingEnv.steps = 0
    train_policy(CountingEnv, None, tiny(), tmp_path, "stage", resume=True)
    assert CountingEnv.steps == 1024 - 256 and read_progress(tmp_path / "stage")["timesteps_done"] == 1024


def test_existing_stage_is_never_overwritten(tmp_path):
    train_policy(CountingEnv, None, tiny(total_timesteps=256), tmp_path, "stage")
    assert (tmp_path / "stage" / "best.zip").is_file()
    with pytest.raises(FileExistsError, match="resume=True"):
        train_policy(CountingEnv, None, tiny(total_timesteps=256), tmp_path, "stage")


def test_resume_extends_budget(tmp_path):
    train_policy(CountingEnv, None, tiny(total_timesteps=256), tmp_path, "stage")
    CountingEnv.steps = 0
    train_policy(CountingEnv, None, tiny(total_timesteps=512), tmp_path, "stage", resume=True)
    assert CountingEnv.steps == 256 and read_progress(tmp_path / "stage")["timesteps_done"] == 512


def test_corrupted_checkpoint_gives_clear_error(tmp_path):
    train_policy(CountingEnv, None, tiny(total_timesteps=256), tmp_path, "stage")
    progress = read_progress(tmp_path / "stage")
    ckpt = tmp_path / "stage" / "checkpoints" / progress["checkpoint"]
    ckpt.write_bytes(b"not a zip at all")
    with pytest.raises(CheckpointError, match=ckpt.name) as err:
        train_policy(CountingEnv, None, tiny(total_timesteps=512), tmp_path, "stage", resume=True)
    assert "delete" in str(err.value)


def test_mismatched_settings_refuse_to_resume(tmp_path):
    train_policy(CountingEnv, None, tiny(total_timesteps=256), tmp_path, "stage")
    with pytest.raises(CheckpointError, match="pi_arch"):
        train_policy(CountingEnv, None, tiny(total_timesteps=512, pi_arch=[16]), tmp_path, "stage", resume=True)


def test_corrupted_progress_file_gives_clear_error(tmp_path):
    train_policy(CountingEnv, None, tiny(total_timesteps=256), tmp_path, "stage")
    (tmp_path / "stage" / "checkpoints" / "progress.json").write_text("{trunc")
    with pytest.raises(CheckpointError, match="progress.json"):
        train_policy(CountingEnv, None, tiny(total_timesteps=512), tmp_path, "stage", resume=True)


def test_manifest_merges_sections(tmp_path):
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"abc")
    update_manifest(tmp_path, config={"a": 1}, models={"target": {"sha256": file_sha256(weights)}})
    manifest = update_manifest(tmp_path, config={"b": 2}, seeds={"train": 0})
    assert manifest["config"] == {"a": 1, "b": 2} and manifest["seeds"] == {"train": 0}
    assert manifest["models"]["target"]["sha256"].startswith("ba7816bf")
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest


# ---------------------------------------------------------------------------------------------------------------
# logging


@pytest.mark.parametrize("arg, env, expected", [(None, None, "offline"), (None, "disabled", "disabled"),
                                                ("online", "offline", "online"), (None, "dryrun", "offline")])
def test_wandb_mode_resolution(monkeypatch, arg, env, expected):
    if env is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env)
    assert resolve_wandb_mode(arg) == expected


def test_logger_records_cycle_metrics_to_tensorboard(tmp_path):
    with RunLogger(tmp_path, {"x": 1}, mode="disabled") as run_logger:
        train_policy(CountingEnv, None, tiny(total_timesteps=256), tmp_path, "stage", logger=run_logger)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert list((tmp_path / "tb" / "stage").glob("events.out.tfevents.*"))  # SB3's train/* metrics


def test_cycle_metrics_definitions():
    cb = CycleMetricsCallback(None, "s")
    cb._cycles.update(emitted=[2.0, 4.0], draft_s=[0.1, 0.1], verify_s=[0.2, 0.2], depth=[1, 3], size=[4, 8],
                      accepted=[1, 3])
    metrics = cb.rollout_metrics()
    assert metrics["s/cycle/mean_accepted_length"] == 3.0
    assert metrics["s/cycle/tokens_per_s"] == pytest.approx(6.0 / 0.6)  # renewal-reward: sum / sum
    assert metrics["s/cycle/depth_mean"] == 2.0


@pytest.mark.slow
def test_wandb_offline_writes_locally(tmp_path):
    with RunLogger(tmp_path, {"x": 1}, mode="offline") as run_logger:
        run_logger.log({"s/val/score": 1.0, "s/cycle/depth": [1, 2, 3]}, step=1)
    assert list((tmp_path / "wandb").glob("offline-run-*"))


# ---------------------------------------------------------------------------------------------------------------
# run directory -> controllers

W, DMAX, SIZE_ACTIONS = 2, 5, [2, 4, 8]
DEPTH_SPEC = ObservationSpec.for_depth(W, DMAX)
SIZE_SPEC = ObservationSpec.for_size(W, DMAX, size_actions=SIZE_ACTIONS)


class SpaceOnlyEnv(gym.Env):
    def __init__(self, spec, n):
        self.observation_space, self.action_space = observation_space(spec), gym.spaces.Discrete(n)

    def reset(self, *, seed=None, options=None):
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, True, False, {}


def make_run(tmp_path):
    depth_zip, size_zip = tmp_path / "depth_s2" / "best.zip", tmp_path / "size_s3" / "best.zip"
    depth_zip.parent.mkdir()
    size_zip.parent.mkdir()
    PPO("MlpPolicy", SpaceOnlyEnv(DEPTH_SPEC, 2), policy_kwargs={"net_arch": [8]}).save(depth_zip)
    PPO("MlpPolicy", SpaceOnlyEnv(SIZE_SPEC, 3), policy_kwargs={"net_arch": [8]}).save(size_zip)
    write_policies_index(tmp_path, depth=depth_zip, size=size_zip, depth_spec=DEPTH_SPEC, size_spec=SIZE_SPEC,
                         size_actions=SIZE_ACTIONS, fallback_depth=3, fallback_size=5)
    return depth_zip, size_zip


def test_load_run_controllers(tmp_path):
    make_run(tmp_path)
    index = json.loads((tmp_path / "policies.json").read_text())
    assert index["depth"]["path"] == "depth_s2/best.zip"  # relative: run dirs can move
    ctrls = load_run_controllers(tmp_path)
    assert set(ctrls) == {"ltd", "depth_only", "size_only"}
    assert all(isinstance(c, PPOController) for c in ctrls.values())
    levels = [[-0.1, -0.2], [-0.5, -1.0, -2.0, -0.7]]
    fields = dict(max_depth=DMAX, width=W, context_len=30, last_top_prob=0.8, last_entropy=0.5, new_tokens=4,
                  max_new_tokens=32)
    state = DraftState.from_levels(levels, **fields)
    assert ctrls["ltd"].choose_size(state) in SIZE_ACTIONS
    assert ctrls["depth_only"].choose_size(state) == 5
    assert ctrls["size_only"].should_stop(state) is False  # the fallback's depth 3
    assert ctrls["size_only"].should_stop(DraftState.from_levels(levels + [[-3.0] * 4], **fields))


def test_corrupted_policy_file_names_the_file(tmp_path):
    _, size_zip = make_run(tmp_path)
    size_zip.write_bytes(b"\x00garbage")
    with pytest.raises(PolicyLoadError, match="size_s3"):
        load_run_controllers(tmp_path)


def test_missing_policy_file_names_the_file(tmp_path):
    depth_zip, _ = make_run(tmp_path)
    depth_zip.unlink()
    with pytest.raises(PolicyLoadError, match="depth_s2"):
        load_run_controllers(tmp_path)
    with pytest.raises(PolicyLoadError, match="policies.json"):
        load_run_controllers(tmp_path / "nowhere")


def _pickle_schedule_from_a_module_that_then_vanishes(zip_path, monkeypatch):
    """Re-save a zip whose learning-rate schedule is a class of a module that no longer exists when it loads (as
    when specpilot.train.ppo moved to specpilot.train.rl.ppo)."""
    import sys
    import types

    gone = types.ModuleType("specpilot_moved_away")
    exec("class Schedule:\n    def __call__(self, progress):\n        return 1e-3\n", gone.__dict__)
    gone.Schedule.__module__ = "specpilot_moved_away"
    monkeypatch.setitem(sys.modules, "specpilot_moved_away", gone)
    model = PPO.load(zip_path, device="cpu")
    model.learning_rate = model.lr_schedule = gone.Schedule()
    model.save(zip_path)
    monkeypatch.delitem(sys.modules, "specpilot_moved_away")
    with pytest.raises(ImportError):
        PPO.load(zip_path, device="cpu")  # the plain load: what the fallback below is for


def test_policy_files_load_after_their_schedule_class_moved(tmp_path, monkeypatch):
    best = train_policy(CountingEnv, None, tiny(total_timesteps=256), tmp_path, "stage")
    _pickle_schedule_from_a_module_that_then_vanishes(best, monkeypatch)
    from specpilot.policies.ppo import load_sb3_policy

    assert load_sb3_policy(best) is not None


def test_checkpoints_resume_after_their_schedule_class_moved(tmp_path, monkeypatch):
    CountingEnv.interrupt_at = 600
    with pytest.raises(KeyboardInterrupt):
        train_policy(CountingEnv, val_fn, tiny(), tmp_path, "stage")
    checkpoint = tmp_path / "stage" / "checkpoints" / read_progress(tmp_path / "stage")["checkpoint"]
    _pickle_schedule_from_a_module_that_then_vanishes(checkpoint, monkeypatch)
    CountingEnv.steps, CountingEnv.interrupt_at = 0, None
    train_policy(CountingEnv, val_fn, tiny(), tmp_path, "stage", resume=True)
    assert read_progress(tmp_path / "stage")["timesteps_done"] == 1024


def test_the_logger_writes_nothing_before_its_first_record(tmp_path):
    """A command refused before it logs leaves no tb/ and no wandb run; a bad mode is refused before any file."""
    run = tmp_path / "run"
    RunLogger(run, {"command": "train size"}, mode="offline").close()
    assert not run.exists()
    with pytest.raises(ValueError, match="wandb mode must be one of"):
        RunLogger(tmp_path / "other", mode="bogus")
    assert not (tmp_path / "other").exists()


def test_wandb_resumes_the_same_run_and_honours_project_and_name(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    monkeypatch.setenv("WANDB_NAME", "named")
    ids = []
    for budget in (64, 128):  # a resume with a larger budget: the same command on the same run folder
        with RunLogger(tmp_path, {"command": "train size", "steps": budget}, mode="offline") as run_logger:
            run_logger.log({"s/val/score": 1.0}, step=budget)
            run = run_logger.wandb_run
            ids.append(run.id)
            assert (run.project, run.name) == ("mine", "named")
    with RunLogger(tmp_path, {"command": "train depth"}, mode="offline") as run_logger:
        run_logger.log({"d/val/score": 1.0}, step=1)
        ids.append(run_logger.wandb_run.id)
    assert ids[0] == ids[1] != ids[2]
    assert json.loads((tmp_path / "wandb" / "run_ids.json").read_text()) == {"train size": ids[0],
                                                                          "train depth": ids[2]}


def test_wandb_online_without_a_server_logs_offline(tmp_path, monkeypatch):
    import wandb

    real = wandb.init

    def unreachable(**kwargs):
        if kwargs["mode"] == "online":
            raise TimeoutError("Timed out while retrying: Post \"https://api.wandb.ai/graphql\"\nmore detail")
        return real(**kwargs)

    monkeypatch.setattr(wandb, "init", unreachable)
    with pytest.warns(UserWarning, match="could not start online \\(Timed out while retrying: .*\\); logging "
                                         "offline to .*`wandb sync` uploads it later"):
        with RunLogger(tmp_path, {"command": "train size"}, mode="online") as run_logger:
            run_logger.log({"s/val/score": 1.0}, step=1)
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_the_wandb_config_records_every_option():
    from specpilot.train.cli import run_config

    args = argparse.Namespace(train_command="size", command="train", steps=64, lr=5e-4, gamma=0.95, static=(2, 4),
                              traces=Path("/r/traces"), pi_arch=[8], _argv=["x"], _handler=print, wandb="offline")
    assert run_config(args) == {"command": "train size", "steps": 64, "lr": 5e-4, "gamma": 0.95, "static": [2, 4],
                                "traces": "/r/traces", "pi_arch": [8], "wandb": "offline"}


def test_a_summary_reaches_wandb_flattened(tmp_path):
    summary = {"methods": {"ltd": {"speedup": 1.8, "speedup_ci": [1.7, 1.9], "tau": float("nan")}},
               "ltd_vs_grid": {"ratio": 1.04, "verdict": "faster"}, "label": None}
    with RunLogger(tmp_path, {"command": "demo"}, mode="offline") as run_logger:
        run_logger.summarize(summary)
        got = dict(run_logger.wandb_run.summary)
    assert {k: got[k] for k in ("methods/ltd/speedup", "ltd_vs_grid/ratio", "ltd_vs_grid/verdict")} == \
        {"methods/ltd/speedup": 1.8, "ltd_vs_grid/ratio": 1.04, "ltd_vs_grid/verdict": "faster"}
    assert "methods/ltd/tau" not in got and "label" not in got and list((tmp_path / "tb").glob("events.*"))


def test_a_batch_validation_prints_as_a_speedup_not_tokens_per_second(tmp_path, capsys):
    from specpilot.train.cli import progress_logger

    with progress_logger(tmp_path, argparse.Namespace(train_command="all", wandb="disabled")) as log:
        log.log({"bc/val/batch_score": 1.234}, step=3)
        log.log({"depth_s1/val/tokens_per_s": 150.0, "depth_s1/val/speedup": 1.5}, step=64)
    err = capsys.readouterr().err
    assert "bc: step 3, validation 1.234x batched AR (geometric mean over batch sizes, batch replay)" in err
    assert "depth_s1: step 64, validation 150.0 tok/s, 1.50x AR (replay)" in err


@pytest.mark.parametrize("where", ["stage", "stage/checkpoints"])
def test_a_file_where_the_stage_folder_goes_is_refused_before_any_work(tmp_path, where):
    from specpilot.drafting.errors import is_user_error, one_line

    (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / where).write_text("x")
    with pytest.raises(NotADirectoryError) as info:
        train_policy(CountingEnv, None, tiny(total_timesteps=64), tmp_path, "stage")
    assert f"{tmp_path / where} is a file, where stage 'stage' keeps its checkpoints" in one_line(info.value)
    assert is_user_error(info.value) and (tmp_path / where).read_text() == "x"


def test_a_file_where_the_tensorboard_logs_go_is_refused_before_any_work(tmp_path):
    (tmp_path / "tb").write_text("x")
    with RunLogger(tmp_path, {"x": 1}, mode="disabled") as run_logger:
        with pytest.raises(NotADirectoryError, match="tb is a file, where the run's TensorBoard logs go"):
            train_policy(CountingEnv, None, tiny(total_timesteps=64), tmp_path, "stage", logger=run_logger)
    assert not (tmp_path / "stage").exists() and (tmp_path / "tb").read_text() == "x"


def test_resume_false_starts_a_new_wandb_run_each_time(tmp_path):
    ids = []
    for _ in range(2):
        with RunLogger(tmp_path, {"command": "eval"}, mode="offline", resume=False) as run_logger:
            run_logger.summarize({"x": 1.0})
            ids.append(run_logger.wandb_run.id)
    assert ids[0] != ids[1]
    assert json.loads((tmp_path / "wandb" / "run_ids.json").read_text()) == {"eval": ids[1]}


def test_an_interrupt_while_wandb_starts_leaves_no_orphan_run(tmp_path, monkeypatch):
    """The run id is kept before wandb starts: Ctrl-C inside wandb.init (its offline folder already made) and the
    rerun continues that id instead of starting a second run beside it."""
    import wandb

    real, seen = wandb.init, []

    def interrupted(**kwargs):
        seen.append(kwargs["id"])
        (tmp_path / "wandb" / f"offline-run-x-{kwargs['id']}").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(wandb, "init", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with RunLogger(tmp_path, {"command": "train size"}, mode="offline") as run_logger:
            run_logger.log({"s/val/score": 1.0}, step=1)
    monkeypatch.setattr(wandb, "init", real)
    with RunLogger(tmp_path, {"command": "train size"}, mode="offline") as run_logger:
        run_logger.log({"s/val/score": 1.0}, step=2)
        rerun = run_logger.wandb_run.id
    assert len(seen[0]) == 8 and rerun == seen[0]
    assert json.loads((tmp_path / "wandb" / "run_ids.json").read_text()) == {"train size": seen[0]}


def test_a_users_wandb_run_id_names_the_command_and_the_other_runs_derive_from_it(tmp_path, monkeypatch):
    from specpilot.train.rl import logging as run_logging

    monkeypatch.setenv("WANDB_RUN_ID", "mine")
    monkeypatch.setenv("WANDB_NAME", "named")
    monkeypatch.setattr(run_logging, "_USER_ID_TAKEN", set())
    got = []
    for folder, config in ((tmp_path / "seed0", {"pipeline": True}), (tmp_path / "run", {"stage": "sampled_T1"}),
                           (tmp_path / "run", {"command": "demo"}), (tmp_path / "run", {"command": "eval"})):
        with RunLogger(folder, config, mode="offline") as run_logger:
            run_logger.log({"s/val/score": 1.0}, step=1)
            got.append((run_logger.wandb_run.id, run_logger.wandb_run.name))
    assert got == [("mine-seed0-run", "named-seed0-run"), ("mine-run-sampled_T1", "named-run-sampled_T1"),
                   ("mine", "named"), ("mine-run-eval", "named-run-eval")]
