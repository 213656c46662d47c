"""A co-adaptation stage's choice (its best checkpoint, or its starting policy when that validates better) survives
resuming: a resume that finds the stage finished but its choice unrecorded makes the choice again, and the manifest
records chosen policies relative to the run folder, so a copied run, or one resumed from another working directory,
deploys its own policies."""
from __future__ import annotations

import json
import os
import shutil

import pytest

import specpilot.train.rl.ppo as ppo
from specpilot.policies.ppo import load_sb3_model
from specpilot.train.rl import pipeline as P
from specpilot.train.rl.stages import recorded_policy

from test_pipeline import STATIC, SMALL, TREE, tiny_task_traces


def _kw(**options):
    return {"options": P.TrainOptions(static=STATIC, ppo=SMALL, **options), "wandb": "disabled"}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return tiny_task_traces(tmp_path_factory.mktemp("traces"), TREE, noise=0.2, seed=1)


@pytest.fixture(scope="module")
def finished(traces, tmp_path_factory):
    """A finished run: stage 1 and one co-adaptation round (co1_size)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    P.train_size(run, traces, steps=128, **_kw())
    P.train_depth(run, traces, steps=128, **_kw())
    P.coadapt(run, traces, rounds=1, steps=64, **_kw())
    return run


def _copy(run, dest):
    shutil.copytree(run, dest)
    return dest


def _manifest(run) -> dict:
    return json.loads((run / "manifest.json").read_text())


def _edit_manifest(run, edit) -> None:
    data = _manifest(run)
    edit(data)
    (run / "manifest.json").write_text(json.dumps(data))


def _deployed_size(run) -> str:
    return json.loads((run / "policies.json").read_text())["size"]["path"]


def _resume_without_training(run, traces, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a finished stage was trained again")

    monkeypatch.setattr(ppo, "train_policy", boom)
    return P.coadapt(run, traces, rounds=1, steps=64, **_kw(resume=True))


def _set_best_score(run, score):
    best = json.loads((run / "co1_size" / "best.json").read_text())
    (run / "co1_size" / "best.json").write_text(json.dumps({**best, "score": score}))


@pytest.mark.parametrize("stage_best_score, deployed", [
    (None, None),  # as trained: the uninterrupted run's own choice
    (0.0, "size_s1/best.zip"),  # the starting policy validates better
    (1e12, "co1_size/best.zip"),  # the stage's best validates better
])
def test_a_finished_stage_without_its_recorded_choice_chooses_again(finished, traces, tmp_path, monkeypatch,
                                                                   stage_best_score, deployed):
    run = _copy(finished, tmp_path / "run")
    if stage_best_score is not None:
        _set_best_score(run, stage_best_score)
    _edit_manifest(run, lambda m: m["stage_selection"].pop("co1_size"))  # killed before the choice was recorded
    out = _resume_without_training(run, traces, monkeypatch)
    assert _deployed_size(run) == (deployed or _deployed_size(finished))
    assert out["rounds"][0]["skipped"]
    assert _manifest(run)["stage_selection"]["co1_size"]["final"] == _deployed_size(run)


def test_chosen_policies_are_recorded_relative_to_the_run(finished):
    final = _manifest(finished)["stage_selection"]["co1_size"]["final"]
    assert final in ("size_s1/best.zip", "co1_size/best.zip")
    assert set(_manifest(finished)["coadapt"]["final"].values()) <= {"depth_s1/best.zip", final}


def test_a_copied_run_resumed_from_another_directory_deploys_its_own_policies(finished, traces, tmp_path,
                                                                            monkeypatch):
    run = _copy(finished, tmp_path / "copy")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    _resume_without_training(run, traces, monkeypatch)
    index = json.loads((run / "policies.json").read_text())
    for kind in ("depth", "size"):
        assert index[kind]["path"] == json.loads((finished / "policies.json").read_text())[kind]["path"]
        assert (run / index[kind]["path"]).resolve().is_relative_to(run.resolve())


@pytest.mark.parametrize("recorded, found", [
    ("co1_size/best.zip", "co1_size/best.zip"),  # as recorded now: relative to the run
    ("run/co1_size/best.zip", "co1_size/best.zip"),  # an older manifest: relative to the working directory
    ("ABSOLUTE", "co1_size/best.zip"),  # an older manifest: absolute, inside the run
    ("other/co1_size/best.zip", None),  # relative to the working directory, inside another run (a copy's original)
    ("missing/best.zip", None),
    (None, None),
])
def test_recorded_policy_paths_resolve_inside_the_run_only(tmp_path, monkeypatch, recorded, found):
    for run in ("run", "other"):
        (tmp_path / run / "co1_size").mkdir(parents=True)
        (tmp_path / run / "co1_size" / "best.zip").write_bytes(b"zip")
    monkeypatch.chdir(tmp_path)
    if recorded == "ABSOLUTE":
        recorded = os.fspath(tmp_path / "run" / "co1_size" / "best.zip")
    got = recorded_policy(tmp_path / "run", recorded)
    assert got == (None if found is None else tmp_path / "run" / found)


def test_the_starting_policy_is_validated_at_the_stage_step_0(traces, tmp_path):
    from specpilot.train.rl.logging import RunLogger

    logged = []

    class Recording(RunLogger):
        def log(self, metrics, step):
            super().log(metrics, step)
            logged.extend((key.split("/")[0], step) for key in metrics if "/val/" in key)

    run = tmp_path / "run"
    P.train_size(run, traces, steps=128, **_kw())
    P.train_depth(run, traces, steps=128, **_kw())
    with Recording(run, {}, mode="disabled") as log:
        P.coadapt(run, traces, rounds=1, steps=64, logger=log, options=_kw()["options"])
    co1 = [step for stage, step in logged if stage == "co1_size"]
    assert 0 in co1 and all(step <= 64 for step in co1)  # never the starting policy's own step count (128)


def test_a_finished_stage_with_a_damaged_best_is_rescored_not_skipped(finished, traces, tmp_path):
    """A best.zip damaged after its stage finished (a kill mid-write before writes were atomic): the resume validates
    the stage's final policy instead of deploying the damaged file or refusing a budget already spent."""
    run = _copy(finished, tmp_path / "run")
    best = run / "co1_size" / "best.zip"
    best.write_bytes(best.read_bytes()[: best.stat().st_size // 2])
    assert ppo.damaged_best(run / "co1_size") is not None
    P.coadapt(run, traces, rounds=1, steps=64, **_kw(resume=True))
    assert ppo.damaged_best(run / "co1_size") is None
    load_sb3_model(run / _deployed_size(run))  # whole (an absolute path joins as itself)
