"""Several pipeline seeds: the deployed one is the best on validation, every seed's ratio and their aggregate are
reported."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specpilot.policies.ppo import load_run_controllers
from specpilot.train.rl.seeds import aggregate, choose_seed, evaluate_seeds, iqm, run_seeds

from test_imitation import STATIC, _options, traces  # noqa: F401 (fixture)


def test_iqm_and_aggregate():
    assert iqm([1.0, 2.0, 3.0]) == pytest.approx(2.0)
    assert iqm([0.0, 1.0, 2.0, 100.0]) == pytest.approx(1.5)  # the outer quarters do not count
    agg = aggregate([1.1, 0.9, 1.3])
    assert agg["median"] == pytest.approx(1.1) and agg["min"] == pytest.approx(0.9) and agg["n"] == 3


def test_choose_seed_takes_the_best_validation_score_and_the_smallest_on_ties():
    assert choose_seed({0: 1.0, 1: 3.0, 2: 2.0}) == 1
    assert choose_seed({4: 2.0, 3: 2.0}) == 3


def test_run_seeds_deploys_the_best_on_validation(traces, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    out = run_seeds(run, traces, seeds=2, size_steps=64, depth_steps=64, rounds=0, options=_options(seed=5),
                    size_actions=[2, 4, 8], wandb="disabled")
    assert [s["seed"] for s in out["seeds"]] == [5, 6]
    best = max(out["seeds"], key=lambda s: s["val_tokens_per_s"])
    assert out["chosen"] == best["seed"] and out["static"] == list(STATIC)
    assert json.loads((run / "seeds.json").read_text())["chosen"] == out["chosen"]
    # the deployed policies are the chosen seed's: the same decisions, the same validation score
    from specpilot.envs.replay import ReplayModel
    from specpilot.train.rl.validation import evaluate_replay

    deployed = evaluate_replay(load_run_controllers(run)["ltd"], ReplayModel(traces.validation))["tokens_per_s"]
    assert deployed == pytest.approx(best["val_tokens_per_s"])
    agg = evaluate_seeds(run, traces.validation)
    assert [r["ltd_vs_static"] for r in agg["seeds"]] == pytest.approx([s["ltd_vs_static"] for s in out["seeds"]])
    assert np.isfinite(agg["ltd_vs_static"]["iqm"])
    # the demo's per-seed line compares with the grid's best, the evaluation's `grid`, even when it never drafts
    # (the seeds' own static partner must draft, so it is another config then)
    import shutil
    from types import SimpleNamespace

    from specpilot import demo
    from specpilot.policies import FixedController

    shutil.copytree(traces.validation, run / "traces" / "heldout")
    (run / "grid.json").write_text("{}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(demo.GridResult, "load", staticmethod(lambda path: SimpleNamespace(best={"depth": 0, "size": 0})))
        heldout = demo._heldout_seeds(run)
    plain = evaluate_replay(FixedController(0), ReplayModel(traces.validation))["tokens_per_s"]
    assert heldout["static"] == [0, 0] and heldout["static_tokens_per_s"] == pytest.approx(plain)


def test_seeds_trained_in_worker_processes_equal_seeds_trained_in_turn(traces, tmp_path):  # noqa: F811
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers get threads // workers = 1 as well: the same arithmetic both ways
    try:
        kwargs = dict(seeds=2, size_steps=64, depth_steps=64, rounds=0, options=_options(seed=5),
                      size_actions=[2, 4, 8], wandb="disabled")
        in_turn = run_seeds(tmp_path / "in_turn", traces, **kwargs)
        lines = []
        parallel = run_seeds(tmp_path / "parallel", traces, workers=2, progress=lines.append, **kwargs)
    finally:
        torch.set_num_threads(threads)
    assert [s["seed"] for s in parallel["seeds"]] == [5, 6]
    assert [s["val_tokens_per_s"] for s in parallel["seeds"]] == pytest.approx(
        [s["val_tokens_per_s"] for s in in_turn["seeds"]], rel=1e-9)
    assert parallel["chosen"] == in_turn["chosen"]
    assert (tmp_path / "parallel" / "policies.json").is_file()
    assert "2 worker processes" in lines[0] and sorted(line.split()[1] for line in lines[1:]) == ["5", "6"]


def test_run_seeds_refuses_zero_workers(traces, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="workers"):
        run_seeds(tmp_path / "run", traces, seeds=2, workers=0, options=_options(seed=5))


@pytest.mark.parametrize("content,fragment", [
    ("{", "is not a readable seeds record"),
    ('{"seeds": "x", "static": [2, 4], "chosen": 0}', "is damaged"),
    ('{"seeds": [{"seed": 0}], "static": [2, 4], "chosen": 0}', "is damaged"),
    ('{"seeds": [{"seed": 0, "dir": "s0"}], "chosen": 0}', "is damaged"),
])
def test_a_damaged_seeds_record_is_named(tmp_path, content, fragment):
    from specpilot.drafting.errors import InputFileError, is_user_error

    (tmp_path / "seeds.json").write_text(content)
    with pytest.raises(InputFileError) as info:
        evaluate_seeds(tmp_path, tmp_path / "no-trace")
    assert str(tmp_path / "seeds.json") in str(info.value) and is_user_error(info.value)
    assert fragment in str(info.value)


@pytest.mark.parametrize("entry", ["x", {"key": "k"}, {"key": "k", "result": "r", "seconds": 1.0},
                                   {"key": "k", "result": {}, "seconds": "1"}])
def test_a_damaged_demo_state_entry_reruns_its_stage(tmp_path, entry):
    import json

    from specpilot.demo import DemoState

    (tmp_path / "demo_state.json").write_text(json.dumps({"record": entry}))
    assert DemoState(tmp_path).done("record", "k") is None
    (tmp_path / "demo_state.json").write_text(json.dumps({"record": {"key": "k", "result": {}, "seconds": 1.0}}))
    assert DemoState(tmp_path).done("record", "k") == {"key": "k", "result": {}, "seconds": 1.0}


def test_a_users_wandb_run_id_gives_each_seed_worker_its_own_run(traces, tmp_path, monkeypatch):  # noqa: F811
    """$WANDB_RUN_ID names one run: the seed workers each log into a run of their own, derived from it."""
    monkeypatch.setenv("WANDB_RUN_ID", "mine")
    run_seeds(tmp_path, traces, seeds=2, workers=2, size_steps=64, depth_steps=64, rounds=0,
              options=_options(seed=5), size_actions=[2, 4, 8], wandb="offline")
    for k in range(2):
        runs = [p.name for p in (tmp_path / f"seed{k}" / "wandb").glob("offline-run-*")]
        assert len(runs) == 1 and runs[0].endswith(f"-mine-seed{k}-run"), runs


@pytest.mark.parametrize("seeds, cores, workers", [(1, 2, 1), (2, 2, 2), (3, 2, 3), (4, 2, 2), (5, 2, 3), (3, 1, 1),
                                                   (6, 4, 6), (8, 4, 4)])
def test_seed_worker_count_ends_the_schedule_first(seeds, cores, workers):
    from specpilot.train.rl.seeds import seed_worker_count

    assert seed_worker_count(seeds, cores) == workers
