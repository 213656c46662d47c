"""A stage records the number of environments its VecEnv really runs (Ray: one per worker), and a resume that builds
another number is refused before anything loads, naming --ray / --workers."""
from __future__ import annotations

import json

import pytest
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv

from specpilot.train.rl.ppo import ResumeSettingsError, read_progress, train_policy

from tests.test_train_resume import CountingEnv, counting_env, tiny  # noqa: F401  (counting_env: autouse fixture)


def two_envs():
    """Stands in for RayVecEnv over 2 workers: a VecEnv whose size the PPO settings (n_envs=1) do not know."""
    return DummyVecEnv([lambda: Monitor(CountingEnv()) for _ in range(2)])


def train_interrupted(run, venv_factory):
    CountingEnv.interrupt_at = 300  # past the first 128-step rollout (and its checkpoint) in either layout
    with pytest.raises(KeyboardInterrupt):
        train_policy(CountingEnv, None, tiny(n_steps=64, batch_size=32), run, "stage", venv_factory=venv_factory)
    CountingEnv.steps, CountingEnv.interrupt_at = 0, None


def resume(run, venv_factory):
    return train_policy(CountingEnv, None, tiny(n_steps=64, batch_size=32, total_timesteps=512), run, "stage",
                        resume=True, venv_factory=venv_factory)


def test_progress_records_the_envs_the_vecenv_runs(tmp_path):
    train_interrupted(tmp_path, two_envs)
    assert read_progress(tmp_path / "stage")["settings"]["n_envs"] == 2


def _as_older_runs_recorded_it(stage):
    path = stage / "checkpoints" / "progress.json"
    progress = json.loads(path.read_text())
    progress["settings"]["n_envs"] = 1
    path.write_text(json.dumps(progress))


@pytest.mark.parametrize("trained, resumed, advice, older_record", [
    (two_envs, None, "--ray and --workers 2", False),
    (two_envs, None, "--ray and --workers 2", True),  # its zip says 2: the resume believes the zip
    (None, two_envs, "no --ray", False),
], ids=["ray-then-local", "ray-then-local-older-record", "local-then-ray"])
def test_resume_with_another_number_of_envs_is_refused_before_training(tmp_path, trained, resumed, advice,
                                                                       older_record):
    train_interrupted(tmp_path, trained)
    if older_record:
        _as_older_runs_recorded_it(tmp_path / "stage")
    before = read_progress(tmp_path / "stage")
    with pytest.raises(ResumeSettingsError, match=advice):
        resume(tmp_path, resumed)
    assert CountingEnv.steps == 0 and read_progress(tmp_path / "stage") == before


def test_resume_with_the_same_envs_continues(tmp_path):
    train_interrupted(tmp_path, two_envs)
    resume(tmp_path, two_envs)
    assert read_progress(tmp_path / "stage")["timesteps_done"] == 512


def test_a_resume_is_checked_against_a_worker_count_before_any_env_is_built(tmp_path):
    from specpilot.train.rl.ppo import check_stages_envs

    train_interrupted(tmp_path, None)  # one environment
    with pytest.raises(ResumeSettingsError, match="no --ray"):
        check_stages_envs(tmp_path, ["stage"], 2)
    check_stages_envs(tmp_path, ["stage"], 1)  # the same count: nothing to say
    check_stages_envs(tmp_path, ["not_started"], 2)  # no checkpoint: a new stage takes any count
    assert CountingEnv.steps == 0


def test_a_finished_stage_resumed_past_its_budget_is_checked_too(tmp_path):
    from specpilot.artifacts.run import FINISHED, RunManifest
    from specpilot.train.rl.ppo import check_stages_envs

    train_interrupted(tmp_path, None)  # one environment
    done = read_progress(tmp_path / "stage")["timesteps_done"]
    RunManifest.update(tmp_path, stages={"stage": {"status": FINISHED, "timesteps_done": done}})
    check_stages_envs(tmp_path, ["stage"], 2, steps=done)  # its budget met: the resume skips it
    check_stages_envs(tmp_path, ["stage"], 2)
    with pytest.raises(ResumeSettingsError, match="no --ray"):  # a raised budget continues it: checked
        check_stages_envs(tmp_path, ["stage"], 2, steps=done + 256)


def test_the_cli_refuses_a_ray_resume_with_another_worker_count_before_starting_the_pool(tmp_path, monkeypatch,
                                                                                          capsys):
    import specpilot.train.cli as train_cli
    import specpilot.train.scale.cluster_cli as cluster_cli
    from specpilot.cli import main

    train_interrupted(tmp_path, None)
    (tmp_path / "stage").rename(tmp_path / "size_s1")
    monkeypatch.setattr(train_cli, "_check", lambda cmd, args, run_dir: (None, None))  # no traces needed here

    def no_pool(*args, **kwargs):
        raise AssertionError("the Ray pool was started")
    monkeypatch.setattr(cluster_cli, "open_pool", no_pool)
    monkeypatch.setattr(train_cli, "open_pool", no_pool, raising=False)
    code = main(["train", "size", "--run", str(tmp_path), "--backend", "live", "--ray", "local", "--workers", "2",
                 "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "was trained on 1 environment, this resume runs 2" in err and "no --ray" in err
