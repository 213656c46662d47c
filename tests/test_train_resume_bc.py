"""A resumed pipeline keeps stage 1 as it was trained: a finished behaviour cloning resumed with other cloning
settings, a cloned run resumed without --bc, and a PPO run resumed with --bc are refused before any work, naming
each option with its saved and given value."""
from __future__ import annotations

import shutil

import pytest

import specpilot.train.rl.imitation as imitation
import specpilot.train.rl.ppo as ppo
from specpilot.artifacts.run import RunManifest
from specpilot.train.rl import pipeline as P
from specpilot.train.rl.ppo import ResumeSettingsError

from test_pipeline import SMALL, STATIC, TREE, tiny_task_traces


def _options(**kw):
    return P.TrainOptions(static=STATIC, ppo=SMALL, **kw)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return tiny_task_traces(tmp_path_factory.mktemp("traces"), TREE, noise=0.2, seed=1)


@pytest.fixture(scope="module")
def cloned(traces, tmp_path_factory):
    """A finished run whose stage 1 is behaviour cloning (1 iteration of 1 epoch), no co-adaptation."""
    run = tmp_path_factory.mktemp("cloned") / "run"
    P.run_pipeline(run, traces, rounds=0, options=_options(bc_iters=1, bc_epochs=1), wandb="disabled")
    return run


def _snapshot(run) -> dict:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.relative_to(run).parts[0] != "tb"}


@pytest.fixture
def no_work(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("work started before the refusal")

    monkeypatch.setattr(ppo, "train_policy", boom)
    monkeypatch.setattr(imitation, "fit_policy", boom)


@pytest.mark.parametrize("given, named", [
    ({"bc_iters": 2, "bc_epochs": 1}, "--bc-iters saved 1, given 2"),
    ({"bc_iters": 1, "bc_epochs": 3}, "--bc-epochs saved 1, given 3"),
    ({"bc_iters": 1, "bc_epochs": 1, "seed": 5}, "--seed saved 0, given 5"),
    ({"bc_iters": 0}, "without --bc"),
])
def test_a_cloned_run_resumed_with_other_cloning_settings_is_refused_before_any_work(cloned, traces, tmp_path,
                                                                                     no_work, given, named):
    run = shutil.copytree(cloned, tmp_path / "run")
    before = _snapshot(run)
    with pytest.raises(ResumeSettingsError, match=named):
        P.run_pipeline(run, traces, rounds=1, options=_options(resume=True, **given), wandb="disabled")
    assert _snapshot(run) == before


def test_a_cloned_run_resumed_with_its_settings_keeps_its_cloning(cloned, traces, tmp_path, no_work):
    run = shutil.copytree(cloned, tmp_path / "run")
    out = P.run_pipeline(run, traces, rounds=0, options=_options(resume=True, bc_iters=1, bc_epochs=1),
                         wandb="disabled")
    assert out["size_s1"]["stage"] == "bc_size"


def test_a_ppo_run_resumed_with_bc_is_refused(tmp_path, traces, no_work):
    run = tmp_path / "run"
    RunManifest.update(run, stages={"size_s1": {"status": "done"}})  # stage 1 trained with PPO
    with pytest.raises(ResumeSettingsError, match="with --bc: its stage 1 was trained with PPO"):
        P.run_pipeline(run, traces, rounds=1, options=_options(resume=True, bc_iters=1), wandb="disabled")
