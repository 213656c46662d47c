"""What a trained run fixes, and reading only the run's own files: `specpilot eval --run` uses the run's tree (or
refuses a conflicting one), methods asked for by name that cannot run are errors before anything is measured, and
exporting a copied run never reads the original run's files through absolute paths."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_eval_cli import _ByteTokenizer
from test_export import SIZE_ACTIONS, make_policy
from tiny import tiny_model

from specpilot.cli import main
from specpilot.drafting import ModelPair, TreeConfig
from specpilot.envs.record import record_task
from specpilot.eval.inputs import EvalInputError, check_methods, resolve_tree, run_tree
from specpilot.policies.observation import ObservationSpec
from specpilot.train.export.writer import ExportError, export_run
from specpilot.train.rl.ppo import update_manifest, write_policies_index

WIDTH, MAX_DEPTH = 2, 5
VOCAB = 64


def tiny_text_pair():
    target = tiny_model(vocab=VOCAB, eos=None, seed=0)
    draft = tiny_model(vocab=VOCAB, eos=None, seed=1)
    return ModelPair(target, draft, _ByteTokenizer(), name="tiny")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A trained run in train/rl/ppo.py's layout (W=2, D=5, sizes up to 8) with a recorded validation trace."""
    run = tmp_path_factory.mktemp("runs") / "original"
    depth_spec = ObservationSpec.for_depth(WIDTH, MAX_DEPTH)
    size_spec = ObservationSpec.for_size(WIDTH, MAX_DEPTH, SIZE_ACTIONS)
    for name in ("depth_s1", "size_s1"):
        (run / name).mkdir(parents=True)
    make_policy(depth_spec, 2, [32], seed=0).save(run / "depth_s1" / "best.zip")
    make_policy(size_spec, len(SIZE_ACTIONS), [32], seed=1).save(run / "size_s1" / "best.zip")
    write_policies_index(run, run / "depth_s1" / "best.zip", run / "size_s1" / "best.zip", depth_spec=depth_spec,
                         size_spec=size_spec, size_actions=SIZE_ACTIONS, fallback_depth=3, fallback_size=4)
    pair = tiny_text_pair()
    trace = record_task(pair, TreeConfig(WIDTH, MAX_DEPTH, max(SIZE_ACTIONS)), [[5, 17, 3, 42], [60, 2, 2, 9]],
                        run / "traces" / "validation", max_new_tokens=12)[0]
    # what train/rl/stages.py records: absolute paths into this run folder
    update_manifest(run, pair=pair.identity(), traces={"validation": str(trace.resolve()), "train": str(trace)})
    return run


def test_run_tree_is_the_policies_contract(run_dir):
    assert run_tree(run_dir) == {"width": WIDTH, "max_depth": MAX_DEPTH, "max_size": max(SIZE_ACTIONS),
                                 "policies": ["depth", "size"]}
    assert resolve_tree(run_dir) == TreeConfig(WIDTH, MAX_DEPTH, max(SIZE_ACTIONS))
    assert resolve_tree(run_dir, width=WIDTH, max_depth=MAX_DEPTH) == TreeConfig(WIDTH, MAX_DEPTH, 8)
    assert resolve_tree(None, width=3) == TreeConfig(3, 12, 64)


@pytest.mark.parametrize("given", [{"width": 8}, {"max_depth": 12}, {"max_size": 64}])
def test_a_conflicting_tree_is_refused(run_dir, given):
    with pytest.raises(EvalInputError, match="policies' contract"):
        resolve_tree(run_dir, **given)


@pytest.fixture
def no_measuring(monkeypatch):
    """Fail loudly if anything gets loaded or measured."""
    import specpilot.eval.full as full  # imported here, so its `evaluate` is the real one once the patch is undone
    import specpilot.eval.runner as runner

    def never(*args, **kwargs):
        raise AssertionError("measured or loaded a model although the inputs are unusable")

    monkeypatch.setattr(runner, "evaluate", never)
    monkeypatch.setattr(full, "evaluate", never)
    monkeypatch.setattr(ModelPair, "from_pretrained", classmethod(never))


def _eval(argv, tmp_path, capsys):
    try:
        code = main(["eval", "--out", str(tmp_path / "out"), "--limit", "1", *argv])
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("argv, fragment", [
    (["--width", "8"], "--width 8 (the run's is 2)"),
    (["--max-depth", "12", "--max-size", "8"], "--max-depth 12"),
])
def test_cli_refuses_a_tree_the_run_was_not_trained_on(run_dir, tmp_path, capsys, no_measuring, argv, fragment):
    code, err = _eval(["--run", str(run_dir), *argv], tmp_path, capsys)
    assert code == 2 and err.count("\n") == 0 and fragment in err


def _broken_run(run_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    (broken / "size_s1" / "best.zip").write_bytes(b"PK\x03\x04 truncated")
    return broken


@pytest.mark.parametrize("methods", [["--methods", "ltd"], ["--methods", "fixed", "--sampled-methods", "ltd"], []])
def test_a_broken_run_is_an_error_before_measuring(run_dir, tmp_path, capsys, no_measuring, methods):
    broken = _broken_run(run_dir, tmp_path)
    code, err = _eval(["--run", str(broken), *methods], tmp_path, capsys)
    assert code == 2 and err.count("\n") == 0 and str(broken / "size_s1" / "best.zip") in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, fragment", [
    (["--methods", "ltd"], "ltd needs a trained run"),
    (["--methods", "grid"], "grid needs a grid-search result"),
    (["--methods", "depth_only", "--run", "RUN_WITHOUT_DEPTH"], "needs a depth policy"),
])
def test_methods_asked_for_by_name_must_be_able_to_run(run_dir, tmp_path, capsys, no_measuring, argv, fragment):
    if "RUN_WITHOUT_DEPTH" in argv:
        size_only = tmp_path / "size_only"
        shutil.copytree(run_dir, size_only)
        index = json.loads((size_only / "policies.json").read_text())
        index["depth"] = None
        (size_only / "policies.json").write_text(json.dumps(index))
        argv = [str(size_only) if a == "RUN_WITHOUT_DEPTH" else a for a in argv]
    code, err = _eval(argv, tmp_path, capsys)
    assert code == 2 and err.count("\n") == 0 and fragment in err


def test_eval_cli_uses_the_runs_tree(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ModelPair, "from_pretrained", classmethod(lambda cls, *a, **k: tiny_text_pair()))
    suite = tmp_path / "mine.txt"
    suite.write_text("def f(x):\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["eval", "--suite", str(suite), "--run", str(run_dir), "--methods", "ltd", "--temperatures", "0",
                     "--max-new-tokens", "4", "--warmup", "0", "--rounds", "1", "--no-plots",
                     "--out", str(tmp_path / "out")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["meta"]["tree"] == {"width": WIDTH, "max_depth": MAX_DEPTH, "max_size": max(SIZE_ACTIONS)}
    assert {r["method"] for r in report["results"]} == {"ar", "ltd"}


def tiny_eagle_pair():
    from specpilot.drafting.eagle import Eagle3Config, Eagle3Head

    target = tiny_model(vocab=VOCAB, eos=None, layers=4, seed=0)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=VOCAB), target).eval()
    return ModelPair(target, tokenizer=_ByteTokenizer(), name="tiny-eagle", eagle=head)


def test_eval_run_grid_methods_on_an_eagle_pair(run_dir, tmp_path, monkeypatch, capsys):
    """--run and --grid given: grid and ltd run with an EAGLE-3 drafter (the drafter check must not re-ask for
    them)."""
    import shutil

    pair = tiny_eagle_pair()
    monkeypatch.setattr(ModelPair, "from_pretrained", classmethod(lambda cls, *a, **k: pair))
    eagle_run = tmp_path / "eagle_run"  # the same policies, recorded as trained on the EAGLE-3 pair (run contract)
    shutil.copytree(run_dir, eagle_run)
    update_manifest(eagle_run, pair=pair.identity())
    run_dir = eagle_run
    suite = tmp_path / "mine.txt"
    suite.write_text("def f(x):\n")
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"best": {"depth": 3, "size": 5, "width": WIDTH}}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["eval", "--suite", str(suite), "--run", str(run_dir), "--grid", str(grid), "--methods",
                     "ar,grid,ltd", "--temperatures", "0", "--max-new-tokens", "4", "--warmup", "0", "--repeats", "1",
                     "--no-plots", "--out", str(tmp_path / "out")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert {r["method"] for r in report["results"]} == {"ar", "grid", "ltd"}
    code, err = _eval(["--run", str(run_dir), "--grid", str(grid), "--methods", "hf_assisted", "--temperatures", "0"],
                      tmp_path, capsys)
    assert code == 2 and "hf_assisted needs a draft LM" in err


def test_check_methods_for_an_eagle_pair():
    with pytest.raises(EvalInputError, match="hf_assisted needs a draft LM"):
        check_methods(["hf_assisted"], drafter_kind="eagle3")
    check_methods(["hf_assisted", "fixed"], drafter_kind="draft_lm")


# ---------------------------------------------------------------------------------------------------------------
# export of a copied run


def _copy_run(run_dir, tmp_path, *, absolute_zips: bool):
    original = tmp_path / "original"
    shutil.copytree(run_dir, original)
    update_manifest(original, traces={"validation": str((original / "traces" / "validation").resolve())})
    if absolute_zips:  # an index that recorded absolute paths (e.g. written by an older version)
        index = json.loads((original / "policies.json").read_text())
        for kind in ("depth", "size"):
            index[kind]["path"] = str((original / index[kind]["path"]).resolve())
        (original / "policies.json").write_text(json.dumps(index))
    copy = tmp_path / "copied"
    shutil.copytree(original, copy)
    return original, copy


@pytest.mark.parametrize("absolute_zips", [False, True])
def test_export_of_a_copied_run_reads_only_the_copy(run_dir, tmp_path, absolute_zips):
    original, copy = _copy_run(run_dir, tmp_path, absolute_zips=absolute_zips)
    # the original changes after the copy: reading any of its files would fail or give other numbers
    (original / "traces" / "validation" / "trace.npz").write_bytes(b"garbage")
    for kind in ("depth", "size"):
        (original / f"{kind}_s1" / "best.zip").write_bytes(b"garbage")
    meta = export_run(copy, tmp_path / "export", num_prompts=1, max_new_tokens=8, num_random=100,
                      log=lambda *a: None)
    assert str(copy / "traces" / "validation") in meta["measured"]["choices_source"]
    assert str(original) not in json.dumps({k: v for k, v in meta.items() if k != "source_run"})


def test_export_refuses_a_policy_of_another_run(run_dir, tmp_path):
    original, copy = _copy_run(run_dir, tmp_path, absolute_zips=True)
    shutil.rmtree(copy / "size_s1")  # the copy lacks the zip its index points at in the original
    with pytest.raises(ExportError, match="belongs to another run"):
        export_run(copy, tmp_path / "export", num_prompts=1, max_new_tokens=8, num_random=100, log=lambda *a: None)


def test_export_names_a_garbage_manifest(run_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    (copy / "manifest.json").write_text("{\"pair\": ")
    with pytest.raises(ValueError, match="manifest.json"):
        export_run(copy, tmp_path / "export", num_prompts=1, max_new_tokens=8, num_random=100, log=lambda *a: None)
