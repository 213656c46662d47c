"""`ltd_guarded` in evaluation: a run's deployed batch-aware controller (its policy behind the validation guard,
RUN/batch_guard.json) is a method of `specpilot eval` like `ltd`, enabled by default only for a run that has a guard;
asked for without one it is a clear error before anything is measured, and batched it decodes exactly, with the
table deciding at the guarded batch sizes."""
from __future__ import annotations

import json
import shutil

import pytest

from specpilot.eval.batched import BATCH_PAIRS, evaluate_batches
from specpilot.eval.inputs import EvalInputError, check_methods, requested_methods
from specpilot.eval.methods import METHODS, EvalContext
from specpilot.policies.heuristics import BatchGuardController
from specpilot.policies.ppo import BATCH_GUARD_FILE

from test_batch_learn import BATCH_SIZES, TREE, task, trained  # noqa: F401 (module-scoped fixtures)
from tiny import tiny_pair

PROMPTS = [[5, 6, 7], [1, 2, 3, 4], [9, 8]]


@pytest.fixture(scope="module")
def runs(trained, tmp_path_factory):
    """(the trained batch run without a guard, a copy of it with one: the table (depth 0) decides at B >= 2)."""
    run, _ = trained
    guarded = tmp_path_factory.mktemp("guarded") / "run"
    shutil.copytree(run, guarded)
    (guarded / BATCH_GUARD_FILE).write_text(json.dumps({"table": {"1": [2, 4], "2": [0, 0]}, "fallback": [2]}))
    return run, guarded


def test_guarded_is_a_default_method_only_for_a_run_with_a_guard(runs):
    plain, guarded = runs
    assert "ltd_guarded" not in requested_methods(None, None, grid=None, run_dir=plain)
    assert {"ltd", "ltd_guarded"} <= set(requested_methods(None, None, grid=None, run_dir=guarded))
    assert ("ltd_guarded", "batch_table") in BATCH_PAIRS


def test_guarded_without_a_guard_is_one_clear_error(runs):
    plain, guarded = runs
    with pytest.raises(EvalInputError, match="batch guard.*--batch-sizes"):
        check_methods(["ltd_guarded"], run_dir=plain)
    with pytest.raises(EvalInputError, match="needs a trained run"):
        check_methods(["ltd_guarded"])
    check_methods(["ltd", "ltd_guarded"], run_dir=guarded)


def test_guarded_decodes_exactly_with_the_table_at_guarded_sizes(runs):
    _, guarded = runs
    pair = tiny_pair(noise=0.4, eos=None)
    method = METHODS["ltd_guarded"](EvalContext(pair=pair, tree=TREE, run_dir=guarded), "ltd_guarded")
    assert isinstance(method.controller, BatchGuardController)
    assert method.controller.uses_table(2) and not method.controller.uses_table(1)
    result = evaluate_batches(PROMPTS, pair=pair, batch_sizes=[1, 2], tree=TREE, methods=["ltd", "ltd_guarded"],
                              max_new_tokens=6, warmup=0, run_dir=guarded)
    for section in result["batch_sizes"]:
        rows = {r["method"]: r for r in section["methods"]}
        assert set(rows) == {"ar", "ltd", "ltd_guarded"} and all(r["identical_to_ar"] for r in rows.values())
    at_two = {r["method"]: r for r in result["batch_sizes"][1]["methods"]}["ltd_guarded"]
    assert at_two["depth_mean"] == 0   # the table's depth 0 at batch size 2: plain batched steps
