"""Decisions under load: the batch size reaches the controllers (`DraftState.batch_size` from BatchSession), the
batch-aware baselines (BatchTableController, SpeculateBelowBatch), the `batch_table` method from a grid's
per_batch_size table, and `specpilot eval --batch-sizes` end to end with per-sequence greedy identity."""
import json

import numpy as np
import pytest

from specpilot.drafting import SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.types import DraftState
from specpilot.eval.batched import batch_units, evaluate_batches
from specpilot.eval.methods import EvalContext, MethodUnavailable, METHODS
from specpilot.policies import BatchTableController, Controller, FixedController, SpeculateBelowBatch
from tiny import tiny_pair

PROMPTS = [[7], [1, 2, 3, 4, 5], list(range(10, 30)), [9, 9]]
BUDGETS = [20, 6, 14, 10]  # ragged finishing: the batch shrinks as rows finish


class _Spy(FixedController):
    """A fixed config that records the batch size and context lengths of every state it is asked about."""

    def __init__(self, depth=2, size=3):
        super().__init__(depth, size)
        self.seen = []

    def skip_drafting(self, state):
        self.seen.append((state.batch_size, state.context_max, state.context_mean, state.context_len))
        return super().skip_drafting(state)


def _state(batch_size, depth=0):
    return DraftState(depth=depth, max_depth=6, width=2, context_len=5, batch_size=batch_size)


def test_batch_session_gives_controllers_the_live_batch_size():
    pair = tiny_pair(noise=0.3)
    spy = _Spy()
    SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4)).generate_batch(PROMPTS, controller=spy,
                                                                             max_new_tokens=BUDGETS)
    sizes = [s[0] for s in spy.seen]
    assert sizes[0] == len(PROMPTS) and sizes[-1] == 1           # every row live at first, the longest row last
    assert sizes == sorted(sizes, reverse=True)                  # rows only leave
    first = spy.seen[0]
    assert first[1] == max(len(p) for p in PROMPTS) and first[2] == pytest.approx(sum(map(len, PROMPTS)) / 4)
    assert first[3] == len(PROMPTS[0])                           # context_len stays the lead row's
    # one sequence at a time: batch size 1 and the context summaries equal its own context
    single = _Spy()
    SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4)).generate(PROMPTS[2], controller=single,
                                                                       max_new_tokens=8)
    assert all(b == 1 and m == n == c for b, m, n, c in single.seen)
    assert _state(3).detached().batch_size == 3


@pytest.mark.parametrize("batch, expected", [(1, (4, 12)), (2, (4, 12)), (3, (4, 12)), (4, (2, 4)), (15, (2, 4)),
                                             (16, (0, 0)), (64, (0, 0))])
def test_batch_table_takes_the_largest_key_not_above_the_batch_size(batch, expected):
    table = BatchTableController({16: (0, 0), 1: (4, 12), 4: (2, 4)})
    assert table.lookup(batch) == expected
    state = _state(batch)
    assert table.skip_drafting(state) == (expected[0] == 0)
    if expected[0]:
        assert not table.should_stop(_state(batch, depth=expected[0] - 1))
        assert table.should_stop(_state(batch, depth=expected[0]))
        assert table.choose_size(_state(batch, depth=expected[0])) == expected[1]


def test_batch_table_below_its_smallest_key_and_bad_tables():
    assert BatchTableController({2: (3, 5), 8: (1, 1)}).lookup(1) == (3, 5)
    for bad in [{}, {0: (2, 2)}, {1: (2, 0)}, {1: (-1, 0)}, {1: "x"}, [(1, 2)], {2.5: (4, 8)}, {1: (2.9, 4)},
                {1: "24"}, {1: (2, 4, 99)}, {float("inf"): (2, 4)}, {"two": (2, 4)}, {1: (3, 6), "1": (0, 0)}]:
        with pytest.raises(ValueError, match="(?i)batch ?table"):
            BatchTableController(bad)
    assert BatchTableController({"1": [2, 4], np.int64(4): np.array([0, 0])}).entries == [(1, 2, 4), (4, 0, 0)]
    with pytest.raises(ValueError, match="max_depth"):
        BatchTableController({1: (9, 4)}).check_tree(TreeConfig(width=2, max_depth=6))
    # a depth-0 entry never verifies: its size need not fit the tree
    BatchTableController({1: (2, 4), 4: (0, 20)}).check_tree(TreeConfig(width=2, max_depth=4, max_size=8))


class _Recorder(Controller):
    def __init__(self):
        self.observed = 0

    def skip_drafting(self, state):
        return False

    def should_stop(self, state):
        return state.depth >= 2

    def choose_size(self, state):
        return 3

    def observe(self, record):
        self.observed += 1


def test_speculate_below_batch_is_plain_steps_at_and_above_b():
    inner = _Recorder()
    gate = SpeculateBelowBatch(inner, max_batch=4)
    assert not gate.skip_drafting(_state(3)) and gate.should_stop(_state(3, depth=2)) and gate.choose_size(
        _state(3, depth=2)) == 3
    gate.observe(None)
    assert gate.skip_drafting(_state(4)) and gate.skip_drafting(_state(9))
    gate.observe(None)                                           # a forced plain step is not the inner's cycle
    assert inner.observed == 1
    gate.observe(None)            # a cycle that asked no skip question (nothing to draft from yet) was not forced
    assert inner.observed == 2
    for bad in [0, True, 2.5]:
        with pytest.raises((TypeError, ValueError), match="max_batch"):
            SpeculateBelowBatch(inner, bad)
    assert SpeculateBelowBatch(inner, np.int64(2)).max_batch == 2


@pytest.mark.parametrize("controller", [
    BatchTableController({1: (3, 6), 2: (2, 3), 3: (0, 0)}),
    SpeculateBelowBatch(FixedController(3, 6), max_batch=3),
], ids=["table", "below"])
def test_batch_aware_controllers_are_exact_and_plain_under_load(controller):
    pair = tiny_pair(noise=0.3)
    refs = [autoregressive_generate(pair, p, max_new_tokens=m).tokens for p, m in zip(PROMPTS, BUDGETS)]
    outs = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4, max_size=16)).generate_batch(
        PROMPTS, controller=controller, max_new_tokens=BUDGETS)
    assert [o.tokens for o in outs] == refs
    longest = max(outs, key=lambda o: len(o.cycles))
    # plain steps while 3 or 4 rows were live, speculation once the batch shrank below 3
    assert longest.cycles[0].depth == 0 and longest.cycles[-1].depth > 0


def _grid_file(tmp_path, per_batch=None):
    data = {"format_version": 1, "best": {"width": 2, "depth": 3, "size": 6}}
    if per_batch is not None:
        data["per_batch_size"] = per_batch
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(data))
    return path


def test_batch_table_method_reads_the_grids_per_batch_size(tmp_path):
    pair = tiny_pair(noise=0.3)
    tree = TreeConfig(width=2, max_depth=4, max_size=16)
    with pytest.raises(MethodUnavailable, match="no per_batch_size"):
        METHODS["batch_table"](EvalContext(pair=pair, tree=tree, grid=_grid_file(tmp_path)), "batch_table")
    with pytest.raises(MethodUnavailable, match="no grid"):
        METHODS["batch_table"](EvalContext(pair=pair, tree=tree), "batch_table")
    grid = _grid_file(tmp_path, [{"batch_size": 1, "depth": 5, "size": 20, "width": 2, "tokens_per_s": 1.0},
                                 {"batch_size": 4, "depth": 0, "size": 0}])
    method = METHODS["batch_table"](EvalContext(pair=pair, tree=tree, grid=grid), "batch_table")
    assert method.controller.lookup(2) == (5, 20) and method.controller.lookup(4) == (0, 0)
    assert method.decoder.tree.max_depth == 5 and method.decoder.tree.max_size == 20


def test_batch_units_wrap_to_full_batches():
    ids = [[1], [2], [3]]
    assert batch_units(ids, 2) == [[[1], [2]], [[3], [1]]]
    assert batch_units(ids, 4) == [[[1], [2], [3], [1]]]


def test_evaluate_batches_sections_and_identity():
    pair = tiny_pair(noise=0.3)
    result = evaluate_batches(PROMPTS, pair=pair, batch_sizes=[1, 2, 4], tree=TreeConfig(width=2, max_depth=4,
                                                                                          max_size=16),
                              methods=["fixed", "hf_generate"], max_new_tokens=8, warmup=0,
                              controllers={"table": BatchTableController({1: (3, 6), 4: (0, 0)})})
    assert [s["batch_size"] for s in result["batch_sizes"]] == [1, 2, 4]
    assert "hf_generate" in result["skipped"]
    for section in result["batch_sizes"]:
        rows = {r["method"]: r for r in section["methods"]}
        assert set(rows) == {"ar", "fixed", "table"}
        assert all(r["identical_to_ar"] and r["tokens_per_s"] > 0 and r["per_token_ms"] > 0 for r in rows.values())
        assert rows["ar"]["speedup"] == 1.0 and rows["fixed"]["n_units"] == section["units"]
    assert {r["method"]: r["depth_mean"] for r in result["batch_sizes"][2]["methods"]}["table"] < 3


@pytest.mark.parametrize("sizes,error,match", [([1.5], TypeError, "batch size must be an integer"),
                                                ([2, 2], ValueError, "names a size twice"),
                                                ("12", TypeError, "list of integers"),
                                                ([0], ValueError, "batch size must be an integer >= 1")])
def test_evaluate_batches_refuses_sizes_it_would_truncate_or_merge(sizes, error, match):
    with pytest.raises(error, match=match):
        evaluate_batches(PROMPTS, pair=tiny_pair(noise=0.3), batch_sizes=sizes, tree=TreeConfig(width=2, max_depth=4),
                         methods=["fixed"], max_new_tokens=4, warmup=0)


def test_evaluate_batches_sampled_sections():
    """At temperature > 0: every method (batched ar too) samples with per-sequence seeds; each section names its
    temperature and that exactness there is the law (no token identity), with tokens/s, ms/token and paired
    intervals as when greedy."""
    from specpilot.eval.batched import SAMPLED_EXACTNESS, sequence_seeds

    pair = tiny_pair(noise=0.3)
    result = evaluate_batches(PROMPTS, pair=pair, batch_sizes=[1, 2], tree=TreeConfig(width=2, max_depth=4,
                                                                                       max_size=16),
                              methods=["fixed"], max_new_tokens=8, warmup=0, temperature=0.8, top_k=4,
                              controllers={"table": BatchTableController({1: (3, 6), 2: (0, 0)})})
    assert result["protocol"]["temperature"] == 0.8 and result["protocol"]["top_k"] == 4
    for section in result["batch_sizes"]:
        assert section["temperature"] == 0.8 and section["exactness"] == SAMPLED_EXACTNESS
        assert "test_sampled_law_per_sequence" in section["exactness"]
        rows = {r["method"]: r for r in section["methods"]}
        assert set(rows) == {"ar", "fixed", "table"}
        for r in rows.values():
            assert r["identical_to_ar"] is None and r["mismatched_sequences"] is None
            assert r["tokens_per_s"] > 0 and r["per_token_ms"] > 0 and r["n_units"] == section["units"]
        assert rows["ar"]["speedup"] == 1.0
        assert rows["fixed"]["speedup"] > 0 and None not in rows["fixed"]["speedup_ci"]
        assert all(c["temperature"] == 0.8 for c in section["comparisons"])
    records = result["records"][2]
    assert {r.temperature for r in records} == {0.8}
    assert sequence_seeds(3, 4) == [12, 13, 14, 15]


def test_batch_method_passes_per_sequence_seeds():
    """The batched method hands its decoder temperature, top-k/p and one seed per sequence (unit seed * B + row),
    the same for every method of a unit; greedy hands nothing."""
    from specpilot.eval.batched import BatchMethod
    from specpilot.drafting.batch_ar import autoregressive_generate_batch

    pair, seen = tiny_pair(noise=0.3), []

    def run(batch, n, sampling):
        seen.append(sampling)
        return autoregressive_generate_batch(pair, batch, max_new_tokens=n, **sampling)

    method = BatchMethod("ar", run, {})
    first = method(PROMPTS[:2], max_new_tokens=5, temperature=0.7, top_k=3, top_p=0.9, seed=4)
    again = method(PROMPTS[:2], max_new_tokens=5, temperature=0.7, top_k=3, top_p=0.9, seed=4)
    method(PROMPTS[:2], max_new_tokens=5, seed=4)
    assert seen[0] == {"temperature": 0.7, "top_k": 3, "top_p": 0.9, "seed": [8, 9]} and seen[2] == {}
    assert first.sequences == again.sequences and first.batch_size == 2


def test_eval_batch_sizes_end_to_end(saved_pair, tmp_path, capsys):
    from specpilot.cli import main

    suite = tmp_path / "mine.txt"
    suite.write_text("def f(x):\nreturn x + 1\ndef g(y):\n")
    out = tmp_path / "out"
    code = main(["--threads", "1", "eval", "--target", str(saved_pair / "target"), "--draft",
                 str(saved_pair / "draft"), "--device", "cpu", "--suite", str(suite), "--methods", "fixed",
                 "--batch-sizes", "1,2", "--temperatures", "0", "--max-new-tokens", "6", "--rounds", "1",
                 "--warmup", "0", "--width", "2", "--max-depth", "3", "--max-size", "6", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((out / "report.json").read_text())
    sections = report["batch_sizes"]
    assert [s["batch_size"] for s in sections] == [1, 2]
    assert all(r["identical_to_ar"] for s in sections for r in s["methods"])
    assert {r["method"] for r in sections[1]["methods"]} == {"ar", "fixed"}
    assert "### Batch size 2" in (out / "report.md").read_text() and "Batch size 1" in printed


@pytest.mark.parametrize("value", ["0", "two", "1,0", ""])
def test_eval_bad_batch_sizes_is_one_line_exit_2(value, tmp_path, capsys):
    from specpilot.cli import main

    try:
        code = main(["eval", "--out", str(tmp_path / "out"), "--batch-sizes", value])
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "--batch-sizes" in err[-1]


def test_eval_batch_sizes_sampled_end_to_end(saved_pair, tmp_path, capsys):
    """`eval --batch-sizes` at temperature > 0 (sampling only): report sections per batch size at that temperature,
    no token identity there, the report naming the temperature and the sampled-law tests."""
    from specpilot.cli import main

    suite = tmp_path / "mine.txt"
    suite.write_text("def f(x):\nreturn x + 1\ndef g(y):\n")
    out = tmp_path / "out"
    code = main(["--threads", "1", "eval", "--target", str(saved_pair / "target"), "--draft",
                 str(saved_pair / "draft"), "--device", "cpu", "--suite", str(suite), "--methods", "fixed",
                 "--batch-sizes", "1,2", "--temperatures", "0.7", "--top-k", "5", "--max-new-tokens", "6",
                 "--rounds", "1", "--warmup", "0", "--width", "2", "--max-depth", "3", "--max-size", "6",
                 "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    report = json.loads((out / "report.json").read_text())
    sections = report["batch_sizes"]
    assert [(s["batch_size"], s["temperature"]) for s in sections] == [(1, 0.7), (2, 0.7)]
    assert all(r["identical_to_ar"] is None and r["tokens_per_s"] > 0 for s in sections for r in s["methods"])
    assert report["meta"]["batch_protocol"][0]["temperature"] == 0.7
    md = (out / "report.md").read_text()
    assert "sampled, T=0.7" in md and "test_sampled_law_per_sequence" in md and "### Batch size 2" in md
    assert "differs from batched ar" not in printed.err
