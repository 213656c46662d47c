"""Resuming a training keeps the settings its checkpoint was trained with: a changed setting (learning rate, seed,
reward, static config, depth range, size actions, PPO hyper-parameters, ...) is refused in one line naming each
option with its saved and given value, before anything is loaded or written; the budget, the validation cadence,
wandb and threads may change, and a resumed stage says where it resumes from. `train all` names only its own
options when a resumed stage 1 is unfinished or already past its budget."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from test_cli_errors import assert_one_line, run_cli
from test_grid import synthetic_profile
from test_train_resume import CountingEnv, counting_env, tiny  # noqa: F401 (counting_env: autouse fixture)
from tiny import tiny_pair

from specpilot.drafting import TreeConfig
from specpilot.envs.record import record_trace
from specpilot.train.rl.ppo import CheckpointError, ResumeSettingsError, _StageCallback, read_progress, train_policy

TREE = TreeConfig(width=3, max_depth=4, max_size=8)
TINY_PPO = ["--n-steps", "64", "--batch-size", "32", "--n-epochs", "1", "--pi-arch", "8", "--vf-arch", "8",
            "--wandb", "disabled", "--static", "2,4"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """traces/{train,validation} recorded on a tiny pair (W=3, depth 4, max_size 8) with a latency profile."""
    pair = tiny_pair(noise=0.2, eos=None)
    rng = np.random.default_rng(2)
    root = tmp_path_factory.mktemp("resume_settings") / "traces"
    for split in ("train", "validation"):
        prompts = [rng.integers(0, 95, size=5).tolist() for _ in range(2)]
        record_trace(pair, TREE, prompts, max_new_tokens=12).save(root / split)
        synthetic_profile(TREE).save(root / split / "profile.json")
    return root


def _interrupted(argv: list[str], stage: str, at: int) -> int:
    """`specpilot ARGV` in this process, Ctrl-C'd at the first update boundary of `stage` at or after `at` steps."""
    from specpilot.cli import main

    original = _StageCallback._on_rollout_start

    def interrupt(self):
        original(self)
        if self.stage == stage and self.num_timesteps >= at:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_StageCallback, "_on_rollout_start", interrupt)
        return main(argv)


def _size(run, traces, *extra) -> list[str]:
    return ["--threads", "1", "train", "size", "--run", str(run), "--traces", str(traces), "--steps", "256",
            *TINY_PPO, *extra]


@pytest.fixture(scope="module")
def interrupted_size(traces, tmp_path_factory):
    """A `train size` run interrupted with its checkpoint at step 128 of 256."""
    run = tmp_path_factory.mktemp("interrupted_size") / "run"
    assert _interrupted(_size(run, traces), "size_s1", 128) == 130
    assert read_progress(run / "size_s1")["timesteps_done"] == 128
    return run


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _snapshot(run) -> dict:
    """Every file of the run and its bytes (TensorBoard's folder aside: the command's logger opens a new, empty
    events file before the stages are checked)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.relative_to(run).parts[0] != "tb"}


# ---- train size --resume with a changed setting: refused, nothing changed ----------------------------------------

@pytest.mark.parametrize("extra, fragments", [
    (["--lr", "0.5"], ["--lr saved 0.001, given 0.5"]),
    (["--seed", "4"], ["--seed saved 0, given 4"]),
    (["--reward", "throughput"], ["--reward saved dinkelbach, given throughput"]),
    (["--static", "3,4"], ["--static saved 2,4, given 3,4"]),
    (["--depth-range", "1,2"], ["--depth-range saved 1,4, given 1,2"]),
    (["--size-actions", "2,4"], ["--size-actions saved 3,4,5,7,8, given 2,4"]),
    (["--gamma", "0.5"], ["--gamma saved 0.9, given 0.5"]),
    (["--n-steps", "128"], ["--n-steps saved 64, given 128"]),
    (["--batch-size", "64"], ["--batch-size saved 32, given 64"]),
    (["--n-epochs", "2"], ["--n-epochs saved 1, given 2"]),
    (["--pi-arch", "16"], ["--pi-arch saved 8, given 16"]),
    (["--vf-arch", "8,8"], ["--vf-arch saved 8, given 8,8"]),
    (["--ent-coef", "0.1"], ["--ent-coef saved 0.01, given 0.1"]),
    (["--lr", "0.5", "--seed", "4", "--depth-range", "1,2"],
     ["--lr saved 0.001, given 0.5", "--seed saved 0, given 4", "--depth-range saved 1,4, given 1,2"]),
])
def test_resume_with_a_changed_setting_is_refused(interrupted_size, traces, tmp_path, capsys, extra, fragments):
    run = _copy(interrupted_size, tmp_path)
    before = _snapshot(run)
    code, err = run_cli(_size(run, traces, "--resume", *extra), capsys)
    assert_one_line(code, err, "cannot resume stage", "size_s1", *fragments, "resume with those", "new --run")
    assert "VecNormalize" not in err and "delete" not in err
    assert _snapshot(run) == before


@pytest.mark.parametrize("damage,fragment", [
    (lambda p: p.pop("settings"), "settings missing"),
    (lambda p: p.update(settings="x"), "settings is a str"),
    (lambda p: p.update(timesteps_done="128"), "timesteps_done is a str"),
    (lambda p: p.update(setup=[1]), "setup is a list"),
])
def test_a_damaged_progress_record_is_refused_not_resumed_unchecked(interrupted_size, traces, tmp_path, capsys,
                                                                     damage, fragment):
    """A record whose settings are gone would skip the resume check: refused in one line, nothing changed."""
    run = _copy(interrupted_size, tmp_path)
    path = run / "size_s1" / "checkpoints" / "progress.json"
    progress = json.loads(path.read_text())
    damage(progress)
    path.write_text(json.dumps(progress))
    before = _snapshot(run)
    code, err = run_cli(_size(run, traces, "--resume", "--lr", "0.5"), capsys)
    assert_one_line(code, err, str(path), "is damaged", fragment, "restore it")
    assert _snapshot(run) == before


@pytest.mark.parametrize("extra, done", [([], 256), (["--eval-every", "128"], 256), (["--steps", "320"], 320)])
def test_resume_with_the_same_settings_continues_and_says_so(interrupted_size, traces, tmp_path, capsys, extra,
                                                             done):
    run = _copy(interrupted_size, tmp_path)
    code, err = run_cli(_size(run, traces, "--resume", *extra), capsys)
    assert code == 0, err
    assert f"size_s1: resuming size seed 0 from {run / 'size_s1' / 'checkpoints' / 'step_0000000128.zip'} at " \
           "step 128" in err
    assert read_progress(run / "size_s1")["timesteps_done"] == done


def test_a_larger_budget_keeps_the_checkpoints_budget_scaled_ppo_settings(traces, tmp_path, capsys):
    """--n-steps / --batch-size / --n-epochs not given scale with --steps: a resume with a larger --steps keeps the
    checkpoint's instead of refusing settings the user never gave."""
    run = tmp_path / "run"
    base = ["--threads", "1", "train", "size", "--run", str(run), "--traces", str(traces), "--pi-arch", "8",
            "--vf-arch", "8", "--wandb", "disabled", "--static", "2,4"]
    assert run_cli([*base, "--steps", "128"], capsys)[0] == 0
    saved = read_progress(run / "size_s1")["settings"]
    code, err = run_cli([*base, "--steps", "1024", "--resume"], capsys)  # scaled: n_steps 128, not 64
    assert code == 0, err
    progress = read_progress(run / "size_s1")
    assert progress["timesteps_done"] == 1024
    assert {k: progress["settings"][k] for k in ("n_steps", "batch_size", "n_epochs")} == \
        {k: saved[k] for k in ("n_steps", "batch_size", "n_epochs")}


# ---- the library: train_policy compares every defining setting -------------------------------------------------

@pytest.mark.parametrize("change", [dict(learning_rate=0.5), dict(seed=3), dict(ent_coef=0.1), dict(gamma=0.5),
                                    dict(clip_range=0.1), dict(gae_lambda=0.9), dict(warmup_fraction=0.2),
                                    dict(n_steps=64), dict(vf_arch=[16])])
def test_train_policy_refuses_each_changed_setting(tmp_path, change):
    train_policy(CountingEnv, None, tiny(total_timesteps=256), tmp_path, "stage")
    (key, value), = change.items()
    with pytest.raises(ResumeSettingsError, match=f"{key} saved .*, given {str(value).strip('[]')}"):
        train_policy(CountingEnv, None, tiny(total_timesteps=512, **change), tmp_path, "stage", resume=True)
    assert read_progress(tmp_path / "stage")["timesteps_done"] == 256


@pytest.mark.parametrize("change", [dict(eval_every=128), dict(checkpoint_every=256), dict(keep_checkpoints=5)])
def test_train_policy_allows_the_cadence_and_budget_to_change(tmp_path, change):
    train_policy(CountingEnv, None, tiny(total_timesteps=256), tmp_path, "stage")
    train_policy(CountingEnv, None, tiny(total_timesteps=512, **change), tmp_path, "stage", resume=True)
    assert read_progress(tmp_path / "stage")["timesteps_done"] == 512


def test_train_policy_records_and_compares_the_stage_setup(tmp_path):
    setup = {"reward": "dinkelbach", "static": [2, 4]}
    train_policy(CountingEnv, None, tiny(total_timesteps=256), tmp_path, "stage", setup=setup)
    assert read_progress(tmp_path / "stage")["setup"] == setup
    with pytest.raises(ResumeSettingsError, match="static saved 2,4, given 3,4"):
        train_policy(CountingEnv, None, tiny(total_timesteps=512), tmp_path, "stage", resume=True,
                     setup={**setup, "static": [3, 4]})


class WiderEnv(CountingEnv):
    observation_space = CountingEnv.observation_space.__class__(0.0, 1.0, shape=(3,), dtype=np.float32)


def test_other_spaces_are_not_called_corruption(tmp_path):
    train_policy(CountingEnv, None, tiny(total_timesteps=256), tmp_path, "stage")
    with pytest.raises(CheckpointError, match="other observation / action spaces") as err:
        train_policy(WiderEnv, None, tiny(total_timesteps=512), tmp_path, "stage", resume=True)
    assert "delete" not in str(err.value)


# ---- train all: names only its own options ------------------------------------------------------------------------

def _all(run, traces, *extra) -> list[str]:
    return ["--threads", "1", "train", "all", "--run", str(run), "--traces", str(traces), "--size-steps", "128",
            "--rounds", "1", "--coadapt-steps", "64", *TINY_PPO, *extra]


@pytest.fixture(scope="module")
def interrupted_all(traces, tmp_path_factory):
    """A `train all` run interrupted in depth_s1 at step 192 of --depth-steps 256 (validated: best.zip exists)."""
    run = tmp_path_factory.mktemp("interrupted_all") / "run"
    assert _interrupted(_all(run, traces, "--depth-steps", "256"), "depth_s1", 192) == 130
    assert read_progress(run / "depth_s1")["timesteps_done"] == 192 and (run / "depth_s1" / "best.zip").is_file()
    return run


@pytest.mark.parametrize("validated, fragments", [
    (True, ["'depth_s1'", "interrupted (192/256 steps)", "--depth-steps 128", "--resume and --depth-steps 256"]),
    (False, ["depth_s1", "already at 192 steps", "budget of 128", "larger --depth-steps"]),
])
def test_train_all_with_a_smaller_budget_names_its_own_options(interrupted_all, traces, tmp_path, capsys, validated,
                                                               fragments):
    """`--allow-partial` (a `train coadapt` option) and `--steps` (not a budget of `train all`) used to be named."""
    run = _copy(interrupted_all, tmp_path)
    if not validated:  # as when interrupted before its first validation
        for name in ("best.zip", "best.json"):
            (run / "depth_s1" / name).unlink()
    before = _snapshot(run)
    code, err = run_cli(_all(run, traces, "--depth-steps", "128", "--resume"), capsys)
    assert_one_line(code, err, *fragments)
    assert "--allow-partial" not in err and "--steps" not in err
    assert _snapshot(run) == before
    assert not (run / "stage1").exists() and not (run / "co1_size").exists()


def test_train_all_resumes_with_its_budget_and_refuses_a_changed_setting(interrupted_all, traces, tmp_path, capsys):
    run = _copy(interrupted_all, tmp_path)
    code, err = run_cli(_all(run, traces, "--depth-steps", "256", "--resume", "--lr", "0.01"), capsys)
    assert_one_line(code, err, "size_s1", "--lr saved 0.001, given 0.01")
    code, err = run_cli(_all(run, traces, "--depth-steps", "256", "--resume"), capsys)
    assert code == 0, err
    assert "depth_s1: resuming depth seed 0 from" in err and "at step 192" in err
    assert (run / "co1_size" / "best.zip").is_file() and (run / "policies.json").is_file()
    # the starting policy of a co-adaptation stage is recorded relative to the run: a moved run still resumes
    assert read_progress(run / "co1_size")["setup"]["init_from"] == "size_s1/best.zip"
    moved = shutil.copytree(run, tmp_path / "moved")
    code, err = run_cli(_all(moved, traces, "--depth-steps", "256", "--resume"), capsys)
    assert code == 0, err
