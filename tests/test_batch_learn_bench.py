"""benchmarks/batch_learn.py's drafter choice: the EAGLE-3 recipe is the demo's (issue 23's) settings, unset flags
follow the drafter while given ones win, and `prep` (with the embedded head or the draft LM) measures the batch
profile first, once per folder, and records every split with that drafter."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from specpilot.demo import DemoBudget

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "batch_learn.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("batch_learn_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(bench, monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["batch_learn.py", *argv])
    bench.main()


def test_eagle_recipe_is_the_demo_defaults(bench):
    budget, recipe = DemoBudget(), bench.RECIPES["eagle"]
    for key in ("width", "max_depth", "max_size", "max_new_tokens", "bc_iters", "bc_epochs", "rounds",
                "coadapt_steps", "n_steps", "n_epochs"):
        assert recipe[key] == getattr(budget, key), key
    assert recipe["ppo_batch_size"] == budget.batch_size
    assert (recipe["pi_arch"], recipe["vf_arch"]) == (list(budget.pi_arch), list(budget.vf_arch))


@pytest.mark.parametrize("drafter", ["draft", "eagle"])
def test_unset_settings_follow_the_drafter_and_given_ones_win(bench, drafter):
    import argparse

    args = argparse.Namespace(**{k: None for k in bench.RECIPES[drafter]})
    args.max_depth = 3
    bench.resolve(args, drafter)
    assert args.max_depth == 3
    assert {k: getattr(args, k) for k in bench.RECIPES[drafter] if k != "max_depth"} == \
        {k: v for k, v in bench.RECIPES[drafter].items() if k != "max_depth"}


def test_draft_recipe_keeps_the_old_defaults(bench):
    draft = bench.RECIPES["draft"]
    assert (draft["width"], draft["max_depth"], draft["max_size"], draft["max_new_tokens"]) == (2, 6, 12, 32)
    assert (draft["bc_iters"], draft["bc_epochs"], draft["rounds"], draft["coadapt_steps"]) == (0, 30, 0, 2048)


@pytest.mark.parametrize("drafter", ["eagle", "draft"])
def test_prep_profiles_first_then_records_each_split(bench, monkeypatch, tmp_path, drafter):
    from specpilot.envs.profile import LatencyProfile
    from specpilot.envs.replay import ReplayModel

    out = tmp_path / drafter
    common = ["--drafter", drafter, "--out", str(out), "--batch-sizes", "1,2", "--train-prompts", "2",
              "--val-prompts", "1", "--test-prompts", "2", "--max-new-tokens", "8", "--width", "2", "--max-depth",
              "2", "--max-size", "4", "--profile-prompts", "2"]
    _run(bench, monkeypatch, "prep", *common, "--splits", "train")
    meta = json.loads((out / "prep.json").read_text())
    assert meta["settings"] == {"drafter": drafter, "width": 2, "max_depth": 2, "max_size": 4, "max_new_tokens": 8}
    assert len(meta["profile"]["loadavg_before"]) == 3 and meta["profile"]["batch_sizes"] == [1, 2]
    profile = LatencyProfile.load(out / "profile.json")
    assert profile.batch_sizes == [1, 2]
    assert (out / "traces" / "train" / "profile.json").is_file()
    assert not (out / "grid_table.json").exists()   # waits for every split
    # the second call reuses the folder's profile (no new measurement) and writes the table
    before = (out / "profile.json").read_bytes()
    _run(bench, monkeypatch, "prep", *common, "--splits", "validation,test")
    assert (out / "profile.json").read_bytes() == before
    assert ReplayModel(out / "traces" / "test").num_prompts == 2
    table = json.loads((out / "grid_table.json").read_text())
    assert [r["batch_size"] for r in table["per_batch_size"]] == [1, 2]
    # one folder = one pair, tree and length
    with pytest.raises(SystemExit, match="was prepared with"):
        _run(bench, monkeypatch, "prep", *common, "--max-size", "6")
    # train / eval read the drafter from the folder and refuse another one
    other = "draft" if drafter == "eagle" else "eagle"
    with pytest.raises(SystemExit, match=f"prepared with --drafter {drafter}"):
        _run(bench, monkeypatch, "train", "--out", str(out), "--drafter", other)


def _eval_rows(ratios: list[float]) -> list[dict]:
    rows = []
    for b, r in zip((1, 2), ratios):
        cell = [r, r - 0.01, r + 0.01]
        rows.append({"batch_size": b, "batches": 4, "ar_tokens_per_s": 10.0, "b1_static_vs_ar": [1.1] * 3,
                     "table_vs_ar": [1.2] * 3, "learned_vs_ar": cell, "guarded_vs_ar": cell, "oracle_vs_ar": [1.5] * 3,
                     "guarded_vs_table": cell})
    return rows


def test_summary_deploys_the_run_best_on_validation_not_on_held_out(bench, monkeypatch, tmp_path, capsys):
    # run a wins on held-out, run b on validation (geometric mean over batch sizes): b is deployed
    for run, test, val in (("a", [1.10, 1.10], [1.00, 1.02]), ("b", [0.90, 0.90], [1.03, 1.00])):
        (tmp_path / f"eval_{run}.json").write_text(json.dumps({"test": _eval_rows(test),
                                                               "validation": _eval_rows(val)}))
    _run(bench, monkeypatch, "summary", "--out", str(tmp_path), "--runs", "a,b")
    text = capsys.readouterr().out
    assert "deployed: b" in text
    assert "| 1 | 4 | 10.0 |" in text and "1.000" in text   # median of 1.10 and 0.90 on held-out
    with pytest.raises(SystemExit, match="summary needs --runs"):
        _run(bench, monkeypatch, "summary", "--out", str(tmp_path))


def test_live_grid_is_a_grid_result_eval_reads(bench, tmp_path):
    # the table prep ranks in replay, written so `specpilot eval --grid` runs `batch_table` live from it
    from specpilot.artifacts.grid import GridResult
    from specpilot.eval.methods import grid_batch_table

    table = [{"batch_size": b, "depth": d, "size": v, "tokens_per_s": 10.0 * b}
             for b, d, v in ((1, 3, 8), (2, 3, 8), (4, 1, 1), (16, 0, 0))]
    path = bench.write_live_grid(tmp_path / "grid.json", table, width=4)
    result = GridResult.load(path)
    assert (result.best["depth"], result.best["size"], result.best["width"]) == (3, 8, 4)
    cells = grid_batch_table(path)
    assert {b: (c["depth"], c["size"], c["width"]) for b, c in cells.items()} == {
        1: (3, 8, 4), 2: (3, 8, 4), 4: (1, 1, 4), 16: (0, 0, 4)}
