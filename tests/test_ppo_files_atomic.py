"""Policy and checkpoint zips are written atomically, and a resumed stage drops a damaged best before it trains."""
from __future__ import annotations

import json

import pytest
from stable_baselines3 import PPO

from specpilot.policies.ppo import load_sb3_model
from specpilot.train.rl import ppo as ppo_module
from specpilot.train.rl.ppo import save_atomically, train_policy

from tests.test_train_resume import CountingEnv, counting_env, tiny  # noqa: F401  (counting_env: autouse fixture)


def val_fn(model) -> float:
    return float(model.num_timesteps)  # later is better: the best is the newest validated policy


def _write_half_then_fail(error: BaseException):
    def save(path: str) -> None:
        with open(path, "wb") as out:
            out.write(b"PK\x03\x04 half a zip")
        raise error
    return save


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_failed_save_leaves_the_old_file_whole(tmp_path, error):
    target = tmp_path / "best.zip"
    target.write_bytes(b"the previous policy")
    with pytest.raises(type(error)):
        save_atomically(_write_half_then_fail(error), target)
    assert target.read_bytes() == b"the previous policy"
    assert [p.name for p in tmp_path.iterdir()] == ["best.zip"]  # no temporary file left behind


def test_training_never_writes_a_zip_in_place(tmp_path, monkeypatch):
    written = []
    real_save = PPO.save
    monkeypatch.setattr(PPO, "save", lambda self, path, *a, **kw: (written.append(str(path)),
                                                                   real_save(self, path, *a, **kw)))
    train_policy(CountingEnv, val_fn, tiny(total_timesteps=256), tmp_path, "stage")
    assert written and all(path.endswith(".zip") and "/." in path for path in written)  # hidden siblings only
    assert load_sb3_model(tmp_path / "stage" / "best.zip").num_timesteps == 256


def _truncate_zip(stage):
    data = (stage / "best.zip").read_bytes()
    (stage / "best.zip").write_bytes(data[:-7])


def _record_of_another_step(stage):
    record = json.loads((stage / "best.json").read_text())
    (stage / "best.json").write_text(json.dumps({**record, "timesteps": 128}))


DAMAGES = {
    "truncated zip": _truncate_zip,
    "garbage zip": lambda stage: (stage / "best.zip").write_bytes(b"\x00garbage"),
    "zip missing": lambda stage: (stage / "best.zip").unlink(),
    "json missing": lambda stage: (stage / "best.json").unlink(),
    "json truncated": lambda stage: (stage / "best.json").write_text('{"score": 51'),
    "json of another step": _record_of_another_step,
}


@pytest.mark.parametrize("damage", DAMAGES.values(), ids=DAMAGES.keys())
def test_resume_drops_a_damaged_best_before_training(tmp_path, monkeypatch, damage):
    CountingEnv.interrupt_at = 600  # 512 steps trained, validated at 256 and 512
    with pytest.raises(KeyboardInterrupt):
        train_policy(CountingEnv, val_fn, tiny(), tmp_path, "stage")
    stage = tmp_path / "stage"
    damage(stage)
    steps_when_checked = []
    real_drop = ppo_module.drop_damaged_best
    monkeypatch.setattr(ppo_module, "drop_damaged_best",
                        lambda d: (steps_when_checked.append(CountingEnv.steps), real_drop(d))[1])

    CountingEnv.steps, CountingEnv.interrupt_at = 0, None
    best = train_policy(CountingEnv, val_fn, tiny(), tmp_path, "stage", resume=True)
    assert steps_when_checked == [0]
    assert load_sb3_model(best).num_timesteps == 1024
    assert json.loads((stage / "best.json").read_text())["score"] == 1024.0


@pytest.mark.parametrize("damage", [_truncate_zip, DAMAGES["json missing"]], ids=["zip", "json"])
def test_finished_stage_with_a_damaged_best_scores_its_final_policy(tmp_path, damage):
    train_policy(CountingEnv, val_fn, tiny(total_timesteps=256), tmp_path, "stage")
    damage(tmp_path / "stage")
    CountingEnv.steps = 0
    best = train_policy(CountingEnv, val_fn, tiny(total_timesteps=256), tmp_path, "stage", resume=True)
    assert CountingEnv.steps == 0  # nothing left to train: the final policy is validated, not claimed unscored
    assert load_sb3_model(best).num_timesteps == 256
    assert json.loads((tmp_path / "stage" / "best.json").read_text())["score"] == 256.0


def test_resume_keeps_a_whole_best(tmp_path):
    CountingEnv.interrupt_at = 600
    with pytest.raises(KeyboardInterrupt):
        train_policy(CountingEnv, val_fn, tiny(), tmp_path, "stage")
    record = (tmp_path / "stage" / "best.json").read_text()
    assert ppo_module.drop_damaged_best(tmp_path / "stage") is None
    assert (tmp_path / "stage" / "best.json").read_text() == record
