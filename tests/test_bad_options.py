"""Values are never changed quietly, and what used to end in a traceback is one line: options out of range for the
trace or the run are refused (exit 2, naming the value and the allowed range), options that cannot take effect are
refused, a co-adaptation whose --pi-arch / --vf-arch differ from stage 1's is refused before any work, and resuming a
stage already past its budget says so instead of an AttributeError."""
from __future__ import annotations

import numpy as np
import pytest
from test_cli_errors import assert_one_line, run_cli
from test_grid import synthetic_profile
from tiny import tiny_pair

from specpilot.drafting import SpeculativeDecoder, TreeConfig
from specpilot.drafting.control import FixedController
from specpilot.envs.record import record_trace

TREE = TreeConfig(width=3, max_depth=4, max_size=8)
TINY_PPO = ["--n-steps", "64", "--batch-size", "32", "--n-epochs", "1", "--wandb", "disabled", "--static", "2,4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """RUN/traces/{train,validation} recorded on a tiny pair (W=3, depth 4, max_size 8) with a latency profile."""
    pair = tiny_pair(noise=0.2, eos=None)
    rng = np.random.default_rng(2)
    root = tmp_path_factory.mktemp("bad_options") / "run"
    for split, n in (("train", 2), ("validation", 2)):
        prompts = [rng.integers(0, 95, size=5).tolist() for _ in range(n)]
        record_trace(pair, TREE, prompts, max_new_tokens=12).save(root / "traces" / split)
        synthetic_profile(TREE).save(root / "traces" / split / "profile.json")
    return root


@pytest.mark.parametrize("argv, fragments", [
    (["--depths", "0-20"], ["--depths 5..20", "recorded to depth 4", "0..4"]),
    (["--sizes", "4,1000"], ["--sizes 1000", "max_size 8", "1..8"]),
])
def test_grid_refuses_cells_the_trace_cannot_replay(run, tmp_path, capsys, argv, fragments):
    code, err = run_cli(["grid", "--traces", str(run / "traces"), "--out", str(tmp_path / "g.json"), "--live-top",
                         "0", *argv], capsys)
    assert_one_line(code, err, *fragments)
    assert not (tmp_path / "g.json").exists()


def test_grid_never_selects_on_heldout_prompts(run, tmp_path, capsys):
    code, err = run_cli(["grid", "--traces", str(run / "traces"), "--out", str(tmp_path / "g.json"), "--val-suite",
                         "heldout"], capsys)
    assert_one_line(code, err, "--val-suite heldout", "never used for selection")


@pytest.mark.parametrize("argv, fragments", [
    (["size", "--size-actions", "4,1000"], ["--size-actions 1000", "max_size 8", "1..8"]),
    (["size", "--depth-range", "1,9"], ["--depth-range 1,9", "depth 4"]),
    (["depth", "--static", "40,900"], ["--static 40,900", "DEPTH in 1..4", "SIZE in 1..8"]),
])
def test_train_refuses_tree_values_beyond_the_trace(run, tmp_path, capsys, argv, fragments):
    stage, *rest = argv
    argv = ["train", stage, "--run", str(tmp_path / "r"), "--traces", str(run / "traces"), "--steps", "64", *rest]
    if "--static" not in rest:
        argv += ["--static", "2,4"]
    code, err = run_cli(argv, capsys)
    assert_one_line(code, err, *fragments)
    assert not (tmp_path / "r" / "size_s1").exists() and not (tmp_path / "r" / "depth_s1").exists()


def _train(run_dir, traces, stage, capsys, *extra):
    code, err = run_cli(["train", stage, "--run", str(run_dir), "--traces", str(traces), "--steps", "64",
                         *TINY_PPO, *extra], capsys)
    assert code == 0, err


def test_coadapt_with_other_layers_than_stage1_is_refused_before_any_work(run, tmp_path, capsys):
    """It used to end in `RuntimeError: Error(s) in loading state_dict` with an empty co1_size/ left."""
    run_dir = tmp_path / "r"
    for stage in ("size", "depth"):
        _train(run_dir, run / "traces", stage, capsys, "--pi-arch", "8", "--vf-arch", "8")
    code, err = run_cli(["train", "coadapt", "--run", str(run_dir), "--traces", str(run / "traces"), "--rounds", "1",
                         "--steps", "64", *TINY_PPO, "--pi-arch", "16", "--vf-arch", "16"], capsys)
    assert_one_line(code, err, "--pi-arch 16", "size_s1", "--pi-arch is 8")
    assert not (run_dir / "co1_size").exists()
    # without the options the stage takes stage 1's layers and trains
    _train(run_dir, run / "traces", "coadapt", capsys, "--rounds", "1")
    assert (run_dir / "co1_size" / "best.zip").is_file()


def test_resume_past_the_budget_says_so(run, tmp_path, capsys):
    """It used to end in `AttributeError: '_StageCallback' object has no attribute 'model'`."""
    run_dir = tmp_path / "r"
    _train(run_dir, run / "traces", "size", capsys, "--pi-arch", "8", "--vf-arch", "8", "--steps", "128")
    for name in ("best.zip", "best.json"):  # as after an interrupt before the first validation
        (run_dir / "size_s1" / name).unlink()
    code, err = run_cli(["train", "size", "--run", str(run_dir), "--traces", str(run / "traces"), *TINY_PPO,
                         "--pi-arch", "8", "--vf-arch", "8", "--steps", "64", "--resume"], capsys)
    assert_one_line(code, err, "already at 128 steps", "budget of 64", "larger --steps")


def test_fixed_controller_beyond_the_tree_is_refused():
    pair = tiny_pair(noise=0.2, eos=None)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=6, max_size=16))
    with pytest.raises(ValueError, match="depth 20 is deeper than the tree's max_depth 6"):
        decoder.generate([1, 2, 3], controller=FixedController(20, 8), max_new_tokens=4)
    with pytest.raises(ValueError, match="size 40 is larger than the tree's max_size 16"):
        decoder.generate([1, 2, 3], controller=FixedController(3, 40), max_new_tokens=4)
    # the default controller is fitted to the tree (it is not a value the user gave)
    shallow = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=2, max_size=4))
    assert all(c.depth <= 2 for c in shallow.generate([1, 2, 3], max_new_tokens=8).cycles)


@pytest.mark.parametrize("argv, fragments", [
    (["generate", "--prompt", "x", "--top-k", "5"], ["--top-k", "--temperature is 0"]),
    (["generate", "--prompt", "x", "--top-p", "0.9"], ["--top-p", "--temperature is 0"]),
    (["eval", "--temperatures", "0", "--top-k", "5"], ["--top-k", "greedy only"]),
    (["eval", "--temperatures", "-1,0"], ["--temperatures", "got '-1'"]),
])
def test_options_that_cannot_take_effect_are_refused(argv, fragments, capsys, tmp_path, monkeypatch):
    from specpilot.drafting.pair import ModelPair

    def never(*a, **k):
        raise AssertionError("loaded a model although an option cannot take effect")

    monkeypatch.setattr(ModelPair, "from_pretrained", classmethod(never))
    if argv[0] == "eval":
        argv = [*argv, "--out", str(tmp_path / "e")]
    code, err = run_cli(argv, capsys)
    assert_one_line(code, err, *fragments)


# ---------------------------------------------------------------------------------------------------------------
# a fast --help: parsing arguments imports no heavy library


def test_eval_cli_method_names_match_the_registry():
    from specpilot.eval.cli import METHODS as NAMES
    from specpilot.eval.methods import METHODS

    assert NAMES == tuple(METHODS)


@pytest.mark.parametrize("argv", [["--help"], ["eval", "--help"], ["grid", "--help"], ["export", "--help"],
                                  ["generate", "--help"], ["train", "size", "--help"], ["eval", "--temperatures", "x"],
                                  ["grid", "--traces", "t", "--out", "g.json", "--depths", "5-2"]])
def test_help_and_argument_errors_import_no_heavy_library(argv):
    import subprocess
    import sys

    code = ("import sys\nfrom specpilot.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'matplotlib', 'stable_baselines3') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300).stdout
    assert "HEAVY []" in out, out[-500:]


# ---------------------------------------------------------------------------------------------------------------
# input files as users write them


@pytest.mark.parametrize("encoding, newline", [("utf-8", "\n"), ("utf-8-sig", "\r\n"), ("utf-16", "\r\n"),
                                               ("utf-16", "\n")])
@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_suites_read_bom_utf16_and_crlf(tmp_path, encoding, newline, suffix):
    from specpilot.eval.suites import load_suite

    lines = ['{"id": "a", "prompt": "caf\u00e9 1"}', '{"id": "b", "prompt": "\u4f60\u597d 2"}'] if suffix == ".jsonl" \
        else ["caf\u00e9 1", "\u4f60\u597d 2"]
    path = tmp_path / f"mine{suffix}"
    path.write_bytes((newline.join(lines) + newline).encode(encoding))  # utf-8-sig / utf-16 write a BOM first
    assert [p.prompt for p in load_suite(path)] == ["caf\u00e9 1", "\u4f60\u597d 2"]


@pytest.mark.parametrize("content, fragment", [
    ('{"prompt": 123}\n', '"prompt" must be a string, got int 123'),
    ("\xff\xfe".encode("latin-1") + b"\x00\xd8", "UTF-16"),  # a lone surrogate: not valid UTF-16
    (b"caf\xe9\n", "not UTF-8 text (byte 3"),
])
def test_suite_errors_name_the_real_problem(tmp_path, content, fragment):
    from specpilot.eval.suites import SuiteError, load_suite

    path = tmp_path / "bad.jsonl"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(SuiteError) as info:
        load_suite(path)
    assert fragment in str(info.value) or ("not UTF-8" in str(info.value) and fragment == "UTF-16")


def test_a_missing_suite_path_says_so(capsys, tmp_path):
    code, err = run_cli(["record", "--suite", "prompts/mine.jsonl", "--out", str(tmp_path / "r")], capsys)
    assert_one_line(code, err, "prompts/mine.jsonl: no such file")


def test_eval_refuses_prompts_that_do_not_fit_unless_told(saved_pair, tmp_path, capsys, monkeypatch):
    import specpilot.eval.full  # noqa: F401  (imported first: its `evaluate` name is bound before the patch)
    import specpilot.eval.runner as runner

    long = tmp_path / "long.txt"
    long.write_text("return x + 1 " * 400 + "\n")
    argv = ["eval", "--suite", str(long), "--target", str(saved_pair / "target"), "--draft",
            str(saved_pair / "draft"), "--methods", "fixed", "--temperatures", "0", "--rounds", "1", "--warmup", "0",
            "--max-new-tokens", "8", "--width", "2", "--max-depth", "3", "--no-plots", "--out", str(tmp_path / "e")]
    monkeypatch.setattr(runner, "evaluate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    code, err = run_cli(argv, capsys)
    assert_one_line(code, err, "tokens", "--max-new-tokens 8", "--truncate-prompts")
    monkeypatch.undo()
    code, err = run_cli([*argv, "--truncate-prompts"], capsys)
    assert code == 0 and "prompt(s) truncated to their last" in err


def test_generate_checks_the_real_request_before_the_warm_up(saved_pair, capsys):
    code, err = run_cli(["generate", "--prompt", "x", "--target", str(saved_pair / "target"), "--draft",
                         str(saved_pair / "draft"), "--max-new-tokens", "100000000"], capsys)
    assert_one_line(code, err, "max_new_tokens=100000000")


def test_grid_refuses_live_prompts_that_do_not_fit_before_measuring(saved_pair, tmp_path, capsys):
    pair = ["--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft")]
    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n")
    assert run_cli(["record", "--suite", str(short), *pair, "--out", str(tmp_path / "t"), "--max-new-tokens", "4",
                    "--width", "2", "--max-depth", "2", "--max-size", "4", "--profile-cycles", "0"], capsys)[0] == 0
    long = tmp_path / "long.txt"
    long.write_text("return x + 1 " * 400 + "\n")
    code, err = run_cli(["grid", "--traces", str(tmp_path / "t"), *pair, "--out", str(tmp_path / "g.json"),
                         "--live-top", "1", "--val-suite", str(long)], capsys)
    assert_one_line(code, err, "tokens", "context; shorten them, or lower --max-new-tokens")
    assert not (tmp_path / "g.json").exists()


def test_eval_never_overwrites_another_pairs_trace_in_replay_dir(saved_pair, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n")
    assert run_cli(["record", "--suite", str(short), "--target", str(saved_pair / "target"), "--draft",
                    str(saved_pair / "draft"), "--out", str(tmp_path / "t"), "--max-new-tokens", "4", "--width", "2",
                    "--max-depth", "2", "--max-size", "4", "--profile-cycles", "0"], capsys)[0] == 0
    before = (tmp_path / "t" / "trace.npz").read_bytes()
    code, err = run_cli(["eval", "--suite", str(short), "--methods", "fixed", "--temperatures", "0", "--rounds", "1",
                         "--max-new-tokens", "4", "--no-plots", "--out", str(tmp_path / "e"), "--replay-dir",
                         str(tmp_path / "t")], capsys)  # the embedded pair, not the trace's
    assert_one_line(code, err, "the trace in --replay-dir", "specpilot-default", "that trace is left as it is")
    assert (tmp_path / "t" / "trace.npz").read_bytes() == before


@pytest.mark.parametrize("change", [["--max-new-tokens", "6"], ["--max-depth", "3"], ["--limit", "1"]])
def test_eval_never_records_over_a_trace_it_did_not_record(saved_pair, tmp_path, capsys, change):
    """A `specpilot record` trace in --replay-dir (a training trace, say) is refused before any work when the
    evaluation asks for other prompts, tree or budget; evaluation's own cache is re-recorded as before."""
    suite = tmp_path / "two.txt"
    suite.write_text("def f(x):\ndef g(y):\n")
    pair = ["--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft")]
    shape = ["--width", "2", "--max-depth", "2", "--max-size", "4"]
    assert run_cli(["record", "--suite", str(suite), *pair, "--out", str(tmp_path / "t"), "--max-new-tokens", "4",
                    *shape, "--profile-cycles", "0"], capsys)[0] == 0
    before = {f.name: f.read_bytes() for f in (tmp_path / "t").iterdir() if f.is_file()}
    args = {"--max-new-tokens": "4", "--max-depth": "2", "--limit": "2"}
    args.update(dict(zip(change[::2], change[1::2])))
    shape = ["--width", "2", "--max-depth", args.pop("--max-depth"), "--max-size", "4"]
    code, err = run_cli(["eval", "--suite", str(suite), *pair, *shape, "--methods", "fixed", "--temperatures", "0",
                         "--rounds", "1", "--no-plots", "--out", str(tmp_path / "e"), "--replay-dir",
                         str(tmp_path / "t"), *[x for kv in args.items() for x in kv]], capsys)
    assert_one_line(code, err, "holds a trace this evaluation did not record", "that trace is left as it is")
    assert {f.name: f.read_bytes() for f in (tmp_path / "t").iterdir() if f.is_file()} == before
    assert not (tmp_path / "e" / "report.json").exists()


def _with_foreign_profile(run, tmp_path):
    """A copy of RUN/traces whose train profile.json says it was measured with another pair."""
    import json
    import shutil

    traces = tmp_path / "traces"
    shutil.copytree(run / "traces", traces)
    pair = dict(json.loads((traces / "train" / "trace.json").read_text())["pair"])
    pair.update(target_hash="0" * 16, draft_hash="1" * 16, target="another/target")
    profile = json.loads((traces / "train" / "profile.json").read_text())
    profile["meta"] = {**(profile.get("meta") or {}), "pair": pair}
    (traces / "train" / "profile.json").write_text(json.dumps(profile))
    return traces


def test_replay_refuses_a_profile_measured_with_another_pair(run, tmp_path, capsys):
    from specpilot.artifacts.contract import ContractError
    from specpilot.envs.replay import ReplayModel

    traces = _with_foreign_profile(run, tmp_path)
    with pytest.raises(ContractError, match="does not belong with"):
        ReplayModel(traces / "train")
    ReplayModel(run / "traces" / "train")  # its own profile still loads
    code, err = run_cli(["grid", "--traces", str(traces / "train"), "--out", str(tmp_path / "g.json"),
                         "--live-top", "0"], capsys)
    assert_one_line(code, err, "profile.json", "does not belong with")
    assert not (tmp_path / "g.json").exists()


def test_grid_never_replaces_a_file_that_is_not_a_grid(run, tmp_path, capsys):
    other = tmp_path / "policies.json"
    other.write_text('{"depth": "depth.zip"}')
    code, err = run_cli(["grid", "--traces", str(run / "traces"), "--out", str(other), "--live-top", "0"], capsys)
    assert_one_line(code, err, f"--out {other}", "not a grid result")
    assert other.read_text() == '{"depth": "depth.zip"}'
    grid = tmp_path / "grid.json"
    for _ in range(2):  # an older grid.json is replaced
        code, err = run_cli(["grid", "--traces", str(run / "traces"), "--out", str(grid), "--live-top", "0"], capsys)
        assert code == 0, err


@pytest.mark.parametrize("option", ["--batch-size", "--n-steps"])
def test_ppo_minibatches_of_one_are_refused_before_any_work(run, tmp_path, capsys, option):
    code, err = run_cli(["train", "size", "--run", str(tmp_path / "r"), "--traces", str(run / "traces"), "--steps",
                         "64", "--static", "2,4", option, "1"], capsys)
    assert code == 2 and f"{option}: expected an integer >= 2" in err, err
    assert not (tmp_path / "r").exists()
    from specpilot.train.rl.ppo import settings_for

    with pytest.raises(ValueError, match="at least 2"):
        settings_for("size", batch_size=1)
    with pytest.raises(ValueError, match="at least 2"):
        settings_for("size", n_steps=1)


def test_eval_refuses_a_check_profile_for_a_shallower_tree_before_recording(tmp_path, capsys):
    shallow = tmp_path / "shallow.json"
    synthetic_profile(TreeConfig(width=3, max_depth=2, max_size=8)).save(shallow)
    code, err = run_cli(["eval", "--out", str(tmp_path / "e"), "--replay-dir", str(tmp_path / "replay"),
                         "--check-profile", str(shallow), "--max-depth", "4", "--limit", "1"], capsys)
    assert_one_line(code, err, f"--check-profile {shallow}", "depths up to 2", "drafts up to 4")
    assert not (tmp_path / "replay").exists() and not (tmp_path / "e").exists()
