"""Every stage folder and output file a train command writes is checked before any work: a file where a stage folder
goes, or a folder where policies.json goes, is refused in one line (exit 2), not after the stages before it trained
(some as raw [Errno] text)."""
from __future__ import annotations

import pytest
from test_cli_errors import assert_one_line, run_cli

import specpilot.train.rl.ppo as ppo
from specpilot.train.rl import pipeline as P

from test_pipeline import SMALL, STATIC, TREE, tiny_task_traces

# (obstacle, what the command writes there)
FILE_WHERE_A_FOLDER_GOES = ["size_s1", "stage1", "co2_depth", "tb"]
FOLDER_WHERE_A_FILE_GOES = ["policies.json", "stage1/policies.json", "manifest.json"]
OBSTACLES = [(p, "file") for p in FILE_WHERE_A_FOLDER_GOES] + [(p, "folder") for p in FOLDER_WHERE_A_FILE_GOES]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return tiny_task_traces(tmp_path_factory.mktemp("traces"), TREE, noise=0.2, seed=1)


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a stage trained before the refusal")

    monkeypatch.setattr(ppo, "train_policy", boom)


def _place(run, obstacle: str, kind: str):
    path = run / obstacle
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir() if kind == "folder" else path.write_text("x")
    return path


@pytest.mark.parametrize("obstacle, kind", OBSTACLES)
def test_an_obstacle_in_the_run_is_refused_by_the_pipeline_before_any_work(traces, tmp_path, obstacle, kind):
    from specpilot.drafting.errors import OutputPathError

    path = _place(tmp_path / "run", obstacle, kind)
    with pytest.raises(OutputPathError, match=f"{path} is a {kind}, where this command writes"):
        P.run_pipeline(tmp_path / "run", traces, rounds=2, options=P.TrainOptions(static=STATIC, ppo=SMALL),
                       wandb="disabled")


@pytest.mark.parametrize("obstacle, kind", OBSTACLES)
def test_an_obstacle_in_the_run_is_refused_by_train_all_in_one_line(traces, tmp_path, capsys, obstacle, kind):
    path = _place(tmp_path / "run", obstacle, kind)
    code, err = run_cli(["--threads", "1", "train", "all", "--run", str(tmp_path / "run"), "--traces", str(traces.train.parent),
                         "--static", "2,4", "--rounds", "2", "--wandb", "disabled"], capsys)
    assert_one_line(code, err, f"{path} is a {kind}, where this command writes")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [path.relative_to(tmp_path / "run").parts[0]]
