"""A run resumed on traces of another tree is refused naming the traces' tree and the run's, not the options whose
defaults follow the tree (--depth-range 1,max_depth) that the user never gave."""
from __future__ import annotations

import pytest

from specpilot.artifacts.contract import ContractError
from specpilot.drafting.types import TreeConfig
from specpilot.train.rl import pipeline as P

from test_pipeline import SMALL, STATIC, TREE, tiny_task_traces


def _kw(**options):
    return {"options": P.TrainOptions(static=STATIC, ppo=SMALL, **options), "wandb": "disabled"}


@pytest.mark.parametrize("other_tree", [TreeConfig(width=3, max_depth=5, max_size=8)])
def test_resuming_on_traces_of_another_tree_names_both_trees(tmp_path, other_tree):
    run = tmp_path / "run"
    P.train_size(run, tiny_task_traces(tmp_path / "traces", TREE, noise=0.2, seed=1), steps=64, **_kw())
    other = tiny_task_traces(tmp_path / "other", other_tree, noise=0.2, seed=1)
    with pytest.raises(ContractError, match=r"has tree W=3 D=5, but run .* has W=3 D=4") as err:
        P.train_size(run, other, steps=64, **_kw(resume=True))
    assert "--depth-range" not in str(err.value)
