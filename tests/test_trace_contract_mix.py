"""Training refuses, before any work, a validation trace or a latency profile that was not made like the training
trace (another tree, pair, budget): it would validate on the wrong tree or time replay with another pair's costs."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny import tiny_pair

from specpilot.artifacts.contract import ContractError
from specpilot.drafting.types import TreeConfig
from specpilot.envs.record import record_task
from specpilot.train.rl.traces import TaskTraces

PROMPTS = [[5, 17, 3, 42], [60, 2, 2, 9]]
TREE = TreeConfig(width=2, max_depth=3, max_size=4)


def _record(pair, out, tree=TREE, max_new_tokens=6):
    record_task(pair, tree, PROMPTS, out, max_new_tokens=max_new_tokens, profile_cycles=0)
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """{name: trace folder}: the run's own train/validation splits, and validation splits recorded otherwise."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("traces")
    pair, other_pair = tiny_pair(seed=0), tiny_pair(seed=5)
    return {"train": _record(pair, root / "train"), "validation": _record(pair, root / "validation"),
            "other_tree": _record(pair, root / "other_tree", tree=TreeConfig(width=3, max_depth=4, max_size=4)),
            "other_pair": _record(other_pair, root / "other_pair"),
            "other_budget": _record(pair, root / "other_budget", max_new_tokens=8)}


def _run_traces(recorded, tmp_path, validation="validation"):
    """RUN/traces with the run's train split and the named validation split (copies: the tests edit them)."""
    traces = tmp_path / "traces"
    shutil.copytree(recorded["train"], traces / "train")
    shutil.copytree(recorded[validation], traces / "validation")
    return traces


def _refusal(traces) -> str:
    with pytest.raises(ContractError) as info:
        TaskTraces.resolve(traces)
    return str(info.value)


def test_the_runs_own_traces_are_accepted(recorded, tmp_path):
    traces = _run_traces(recorded, tmp_path)
    assert TaskTraces.resolve(traces).train == traces / "train"


@pytest.mark.parametrize("validation, fragments", [
    ("other_tree", ["width 3 (training trace: 2)", "max_depth 4 (training trace: 3)"]),
    ("other_pair", ["pair custom", "training trace: custom"]),
    ("other_budget", ["max_new_tokens 8 (training trace: 6)"]),
])
def test_a_validation_trace_made_otherwise_is_refused(recorded, tmp_path, validation, fragments):
    traces = _run_traces(recorded, tmp_path, validation)
    msg = _refusal(traces)
    assert f"validation trace {traces / 'validation'}" in msg
    assert all(f in msg for f in fragments), msg


@pytest.mark.parametrize("split", ["train", "validation"])
def test_a_profile_of_another_tree_is_refused(recorded, tmp_path, split):
    traces = _run_traces(recorded, tmp_path)
    shutil.copy(recorded["other_tree"] / "profile.json", traces / split / "profile.json")
    msg = _refusal(traces)
    assert str(traces / split / "profile.json") in msg and "width 3 (training trace: 2)" in msg


def test_a_profile_measured_on_another_pair_is_refused(recorded, tmp_path):
    traces = _run_traces(recorded, tmp_path)
    path = traces / "train" / "profile.json"
    data = json.loads(path.read_text())
    data["meta"]["pair"]["target_hash"] = "0" * 16
    path.write_text(json.dumps(data))
    msg = _refusal(traces)
    assert str(path) in msg and "target 0000000000" in msg


def test_a_task_traces_object_is_checked_too(recorded):
    with pytest.raises(ContractError, match="width 3"):
        TaskTraces.resolve(TaskTraces(recorded["train"], recorded["other_tree"]))


def _other_tree_profile(recorded, tmp_path):
    return shutil.copy(recorded["other_tree"] / "profile.json", tmp_path / "batch_profile.json")


def test_a_batch_profile_of_another_tree_is_refused_by_train(recorded, tmp_path):
    from specpilot.envs.replay import load_trace
    from specpilot.train.rl.stages import TrainOptions, batch_profile_for

    trace = load_trace(recorded["train"])
    given = _other_tree_profile(recorded, tmp_path)
    with pytest.raises(ContractError, match=r"--batch-profile .*width 3 \(trace: 2\)"):
        batch_profile_for(tmp_path, trace, TrainOptions(batch_profile=given))
    own = recorded["train"] / "profile.json"
    assert batch_profile_for(tmp_path, trace, TrainOptions(batch_profile=own)) == own
    saved = shutil.copy(given, tmp_path / f"grid.profile_w{trace.width}.json")  # a run folder's grid profile
    with pytest.raises(ContractError, match="the run's batch profile .*max_depth 4 \\(trace: 3\\)"):
        batch_profile_for(tmp_path, trace, TrainOptions())


def test_a_batch_profile_of_another_tree_is_refused_by_the_grid(recorded, tmp_path):
    from specpilot.envs.replay import load_trace
    from specpilot.train.grid.search import _batch_profile

    given = _other_tree_profile(recorded, tmp_path)
    with pytest.raises(ContractError, match=r"--batch-profile .*width 3 \(trace: 2\)"):
        _batch_profile(load_trace(recorded["train"]), None, given, [1, 2], None, prompts=1, max_new_tokens=4,
                       out=None, progress=False)
