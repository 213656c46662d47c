"""Bad input on the command line: one line on stderr (`specpilot <command>: <message>`), exit code 2, no traceback,
nothing measured or written; real bugs keep their traceback, and `--debug` shows it for bad input too."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specpilot.cli import main
from specpilot.drafting.errors import is_user_error
from specpilot.drafting.pair import DEFAULT_PAIR_DIR


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, stderr) of `specpilot ARGV` run in this process (argparse refusals raise SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("specpilot"), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def paths(saved_pair, tmp_path_factory):
    """The saved tiny pair, an existing file, a draft folder without tokenizer files, a broken export dir."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("cli_errors")
    (root / "file.txt").write_text("not a folder")
    bare = root / "bare_draft"
    AutoModelForCausalLM.from_pretrained(saved_pair / "draft").save_pretrained(bare)  # no tokenizer files
    return {"target": str(saved_pair / "target"), "draft": str(saved_pair / "draft"), "file": str(root / "file.txt"),
            "bare": str(bare), "root": root}


def _pair(p):
    return ["--target", p["target"], "--draft", p["draft"]]


def _file_at(p, rel: str) -> str:
    """p["root"]/rel made a file (where a command's folder goes); returns the folder above it."""
    path = p["root"] / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("in the way")
    return str(path.parent)


def _dangling_at(p, rel: str) -> str:
    """p["root"]/rel made a symbolic link to nowhere (a folder no run can write into); returns the folder above."""
    path = p["root"] / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_symlink():
        path.symlink_to(p["root"] / "no-such-folder")
    return str(path.parent)


# (argv builder, fragments of the one line) -- parse-time refusals and library validation alike
CASES = {
    "width 0": (lambda p: ["generate", "--prompt", "x", "--width", "0"], ["--width", ">= 1"]),
    "non-integer max-new-tokens": (lambda p: ["generate", "--prompt", "x", "--max-new-tokens", "2.5"],
                                   ["--max-new-tokens", "integer"]),
    "nan temperature": (lambda p: ["generate", "--prompt", "x", "--temperature", "nan"], ["--temperature", "finite"]),
    "inf temperature": (lambda p: ["generate", "--prompt", "x", "--temperature", "inf"], ["--temperature"]),
    "top-p 0": (lambda p: ["generate", "--prompt", "x", "--top-p", "0"], ["--top-p", "(0, 1]"]),
    "negative top-k": (lambda p: ["generate", "--prompt", "x", "--top-k", "-1"], ["--top-k", ">= 0"]),
    "max-depth 0": (lambda p: ["generate", "--prompt", "x", "--max-depth", "0"], ["--max-depth"]),
    "unknown device": (lambda p: ["generate", "--prompt", "x", "--device", "gpu"], ["--device", "cpu, cuda"]),
    "unknown dtype": (lambda p: ["generate", "--prompt", "x", "--dtype", "int8"], ["--dtype", "float32"]),
    "invalid utf-8 prompt": (lambda p: ["generate", "--prompt", "ab\udcff\udcfe"], ["--prompt", "UTF-8"]),
    "empty prompt": (lambda p: ["generate", "--prompt", ""], ["--prompt", "empty"]),
    "threads 0": (lambda p: ["--threads", "0", "generate", "--prompt", "x"], ["--threads"]),
    "temperature twice": (lambda p: ["eval", "--temperatures", "0,1,0"], ["--temperatures", "0 given more than once"]),
    "repeats and rounds": (lambda p: ["eval", "--repeats=3", "--rounds", "2"], ["--repeats", "--rounds"]),
    "prompts to a .txt suite": (lambda p: ["prompts", "--from", str(p["root"]), "--out", str(p["root"] / "s.txt")],
                                ["s.txt", "must end in .jsonl"]),
    "prompts with an empty split": (lambda p: ["prompts", "--from", str(p["root"]), "--out",
                                               str(p["root"] / "s.jsonl"), "--split", " "], ["--split"]),
    "depth past max-depth": (lambda p: ["generate", "--prompt", "x", "--depth", "20", "--max-depth", "5"],
                             ["--depth 20", "--max-depth 5"]),
    "size with depth 0": (lambda p: ["generate", "--prompt", "x", "--depth", "0", "--size", "40"],
                          ["--size 40", "--depth 0"]),
    "near-tie without the guard": (lambda p: ["agreement", "--guard", "off", "--near-tie", "3", "--out",
                                                 str(p["root"] / "agree.json")],
                                   ["--near-tie", "--guard on"]),
    "models build quick with a budget": (lambda p: ["models", "build", "--quick", "--target-tokens", "1000"],
                                         ["--target-tokens", "--quick"]),
    "models build target-only with eagle": (lambda p: ["models", "build", "--quick", "--target-only", "--eagle"],
                                            ["--eagle", "--target-only"]),
    "grid live options without the live phase": (lambda p: ["grid", "--traces", str(p["root"]), "--out",
                                                            str(p["root"] / "g.json"), "--live-top", "0",
                                                            "--val-limit", "3"], ["--val-limit", "--live-top 0"]),
    "train all with one budget": (lambda p: ["train", "all", "--run", str(p["root"] / "ta"), "--steps", "5"],
                                  ["--steps"]),  # it budgets each stage: --size-steps, --depth-steps, ...
    "threads past the pool": (lambda p: ["--threads", "99999", "generate", "--prompt", "x"], ["--threads", "1024"]),
    "seed past 64 bits": (lambda p: ["generate", "--prompt", "x", "--seed", "9" * 23, "--temperature", "1"],
                          ["--seed", "2^63 - 1"]),
    "depth range with a dash": (lambda p: ["train", "size", "--run", str(p["root"] / "t"), "--depth-range", "3-9"],
                                ["--depth-range", "LOW,HIGH", "'3-9'"]),
    "record lookahead past the context": (lambda p: ["record", "--out", str(p["root"] / "deep"), *_pair(p),
                                                     "--width", "1", "--max-depth", "600", "--max-new-tokens", "4",
                                                     "--limit", "1"], ["context", "lower --max-depth"]),
    "missing target path": (lambda p: ["generate", "--prompt", "x", "--target", "/no/such/target", "--draft",
                                       p["draft"]], ["/no/such/target", "does not exist"]),
    "missing relative path": (lambda p: ["generate", "--prompt", "x", "--target", "runs/nosuchmodel", "--draft",
                                         p["draft"]], ["runs/nosuchmodel", "no local path"]),
    "pair mismatch flag without config": (lambda p: ["generate", "--prompt", "x", "--allow-pair-mismatch"],
                                          ["--allow-pair-mismatch", "--config"]),
    "target without drafter": (lambda p: ["generate", "--prompt", "x", "--target", p["target"]],
                               ["--target needs its drafter"]),
    "missing target without drafter": (lambda p: ["generate", "--prompt", "x", "--target", "/no/such/target"],
                                       ["/no/such/target", "does not exist"]),
    "draft and eagle": (lambda p: ["generate", "--prompt", "x", *_pair(p), "--eagle", p["draft"]],
                        ["--draft", "--eagle", "not both"]),
    "embedded draft with a target": (lambda p: ["generate", "--prompt", "x", "--target", p["target"], "--draft",
                                                "embedded"], ["--draft embedded", "--target"]),
    "config with depth": (lambda p: ["generate", "--prompt", "x", "--config", str(p["root"]), "--depth", "7"],
                          ["--depth", "conflict", "--config"]),
    "width over vocabulary": (lambda p: ["generate", "--prompt", "x", *_pair(p), "--width", "5000",
                                         "--max-new-tokens", "4"], ["width=5000", "vocabulary"]),
    "over-long prompt": (lambda p: ["generate", "--prompt", "return x + 1\n" * 400, *_pair(p), "--width", "2",
                                    "--max-new-tokens", "4"], ["context", "shorten the prompt"]),
    "eval tb folder is a file": (lambda p: ["eval", "--out", _file_at(p, "evt/tb"), "--limit", "1"],
                                 ["evt/tb is a file", "TensorBoard", "another --out folder"]),
    "eval tb folder leads nowhere": (lambda p: ["eval", "--out", _dangling_at(p, "evd/tb"), "--limit", "1"],
                                     ["TensorBoard logs' folder", "evd/tb", "leads nowhere"]),
    "record out is a file": (lambda p: ["record", "--out", p["file"]], ["--out", "not a folder"]),
    "record width 0": (lambda p: ["record", "--out", str(p["root"] / "r"), "--width", "0"], ["--width"]),
    "grid out is a folder": (lambda p: ["grid", "--traces", "x", "--out", str(p["root"])], ["--out", "is a folder"]),
    "grid missing traces": (lambda p: ["grid", "--traces", str(p["root"] / "none"), "--out",
                                       str(p["root"] / "g.json")], ["no trace under"]),
    "eval out is a file": (lambda p: ["eval", "--out", p["file"]], ["--out", "not a folder"]),
    "eval nan temperature": (lambda p: ["eval", "--temperatures", "0,nan"], ["--temperatures"]),
    "eval unknown method": (lambda p: ["eval", "--methods", "fixed,warp"], ["unknown method(s) warp"]),
    "eval ltd without run": (lambda p: ["eval", "--out", str(p["root"] / "e"), "--methods", "ltd"],
                             ["ltd needs a trained run", "--run"]),
    "eval grid missing": (lambda p: ["eval", "--out", str(p["root"] / "e"), "--grid", str(p["root"] / "g.json")],
                          ["g.json", "not found"]),
    "train no stage": (lambda p: ["train"], ["choose a stage"]),
    "train steps 0": (lambda p: ["train", "size", "--run", str(p["root"] / "t"), "--steps", "0"], ["--steps"]),
    "train static one value": (lambda p: ["train", "size", "--run", str(p["root"] / "t"), "--static", "4"],
                               ["--static", "DEPTH,SIZE"]),
    "train no traces": (lambda p: ["train", "size", "--run", str(p["root"] / "t")], ["no trace at"]),
    "train run is a file": (lambda p: ["train", "size", "--run", p["file"]], ["--run", "not a folder"]),
    "export missing run": (lambda p: ["export", "--run", str(p["root"] / "nope"), "--out", str(p["root"] / "x")],
                           ["--run", "nope: no such run folder"]),
    "export run is a file": (lambda p: ["export", "--run", p["file"], "--out", str(p["root"] / "x")],
                             ["--run", "is a file, not a run folder"]),
    "export out is a file": (lambda p: ["export", "--out", p["file"], "--run", "x"], ["--out", "not a folder"]),
    "models build without out": (lambda p: ["models", "build"], ["--out is required"]),
    "models build threads 0": (lambda p: ["models", "build", "--threads", "0"], ["--threads"]),
    "models build threads past the pool": (lambda p: ["models", "build", "--threads", "99999"], ["--threads", "1024"]),
    "demo out is a file": (lambda p: ["demo", "--out", p["file"]], ["--out", "not a folder"]),
    "negative seed": (lambda p: ["record", "--out", str(p["root"] / "r"), "--seed", "-1"], ["--seed", ">= 0"]),
    "stage with a path": (lambda p: ["train", "size", "--run", str(p["root"] / "t"), "--stage", "../x"],
                          ["--stage", "folder name"]),
    "eval decide one method": (lambda p: ["eval", "--decide", "ltd"], ["--decide", "METHOD,BASELINE"]),
    "eval min rounds above max": (lambda p: ["eval", "--out", str(p["root"] / "e"), "--min-rounds", "5",
                                             "--max-rounds", "3"], ["--min-rounds 5 exceeds --max-rounds 3"]),
    "eval grid without a result": (lambda p: ["eval", "--out", str(p["root"] / "e"), "--methods", "grid"],
                                      ["grid needs a grid-search result"]),
    "train gamma above 1": (lambda p: ["train", "size", "--run", str(p["root"] / "t"), "--gamma", "1.5"],
                            ["--gamma", "(0, 1]"]),
    "train unknown reward": (lambda p: ["train", "ablation", "--run", str(p["root"] / "t"), "--rewards", "speed"],
                             ["unknown reward(s) speed"]),
    "grid depths range": (lambda p: ["grid", "--traces", "x", "--out", str(p["root"] / "g.json"), "--depths", "5-2"],
                          ["--depths", "empty range"]),
    "workers 0": (lambda p: ["record", "--out", str(p["root"] / "r"), "--ray", "local", "--workers", "0"],
                  ["--workers"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2(case, paths, capsys):
    build, fragments = CASES[case]
    code, err = run_cli(build(paths), capsys)
    assert_one_line(code, err, *fragments)


@pytest.mark.parametrize("stage", [[], ["--target-only"]])
def test_models_build_refuses_a_folder_of_someone_elses_models(tmp_path, capsys, stage):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    (tmp_path / "eagle").mkdir()
    code, err = run_cli(["models", "build", "--quick", "--out", str(tmp_path), *stage], capsys)
    assert_one_line(code, err, "not an earlier `specpilot models build` folder", "new or empty folder")
    assert (tmp_path / "target" / "config.json").read_text() == "{}" and (tmp_path / "eagle").is_dir()


@pytest.mark.skipif((DEFAULT_PAIR_DIR / "eagle" / "config.json").exists(), reason="the package ships a head")
def test_embedded_eagle_when_none_is_shipped(capsys):
    code, err = run_cli(["generate", "--prompt", "x", "--eagle", "embedded"], capsys)
    assert_one_line(code, err, "ships no EAGLE-3 head", "--draft embedded")


def test_tokenizerless_draft_folder_is_not_a_mismatch(paths, capsys):
    """transformers builds an empty tokenizer for a folder without tokenizer files: that is a missing tokenizer
    (the target's is used), not a vocabulary mismatch."""
    code = main(["generate", "--prompt", "def f(x):", "--target", paths["target"], "--draft", paths["bare"],
                 "--width", "2", "--depth", "2", "--size", "3", "--max-new-tokens", "4"])
    assert code == 0, capsys.readouterr().err


def test_debug_shows_the_traceback(paths):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["--debug", "generate", "--prompt", "x", "--target", "/no/such/target", "--draft", paths["draft"]])


def test_a_real_bug_keeps_its_traceback(monkeypatch):
    import specpilot.drafting.cli as gen

    def buggy(args):
        return {}["missing"]  # a KeyError from our own code is a bug, not bad input

    monkeypatch.setattr(gen, "run", buggy)
    with pytest.raises(KeyError):
        main(["generate", "--prompt", "x"])


def test_a_broken_internal_import_raises(monkeypatch):
    """A command module that fails to import is a bug: it raises, it is not reported as "not built"."""
    import specpilot.cli as cli

    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, ("broken", "specpilot.no_such_module", "a broken import")])
    with pytest.raises(ModuleNotFoundError, match="specpilot.no_such_module"):
        main(["broken", "--help"])  # only the command run is imported


def test_console_exit_code_and_single_line():
    """The real console script: exit status 2, one stderr line, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "specpilot.cli", "generate", "--prompt", "x", "--target",
                           "/no/such/target", "--draft", "/no/such/draft"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("specpilot generate: ")


def test_invalid_utf8_argv_from_the_shell():
    """Invalid UTF-8 bytes in argv reach Python as lone surrogates (surrogateescape): refused on one line."""
    proc = subprocess.run([sys.executable.encode(), b"-m", b"specpilot.cli", b"generate", b"--prompt", b"ab\xff\xfe"],
                          capture_output=True, timeout=300)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2 and err.count("\n") == 1 and "UTF-8" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------------------
# what counts as bad input


def _raise(err):
    raise err


@pytest.mark.parametrize("make, user", [
    (lambda: _raise(ValueError("raised outside the package")), False),  # tests are not package code
    (lambda: __import__("numpy").zeros(-1), False),                       # a ValueError inside numpy: our bug
    (lambda: {}["x"], False),                                             # KeyError: a bug
    (lambda: open("/no/such/file"), True),                                # OSError: about the paths given
])
def test_user_error_classification(make, user):
    with pytest.raises(Exception) as info:
        make()
    assert is_user_error(info.value) is user


def test_package_validation_errors_count_as_bad_input():
    from specpilot.drafting.types import TreeConfig
    from specpilot.eval.suites import SuiteError

    for make in (lambda: TreeConfig(width=2.5), lambda: TreeConfig(max_depth=0)):
        with pytest.raises((TypeError, ValueError)) as info:
            make()
        assert is_user_error(info.value)
    assert is_user_error(SuiteError("any package error class, wherever raised"))


# ---------------------------------------------------------------------------------------------------------------
# train: Ctrl-C and an existing stage name the CLI flag


@pytest.fixture
def fake_traces(tmp_path):
    run = tmp_path / "run"
    for split in ("train", "validation"):
        (run / "traces" / split).mkdir(parents=True)
        (run / "traces" / split / "trace.npz").write_bytes(b"")
    return run


def _interrupting_train_size(interrupt_at):
    """train_size replaced by a real train_policy on a tiny env that raises KeyboardInterrupt at step N."""
    import gymnasium as gym
    import numpy as np

    from specpilot.train.rl.ppo import settings_for, train_policy

    class Env(gym.Env):
        observation_space = gym.spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32)
        action_space = gym.spaces.Discrete(2)
        steps = 0

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return np.zeros(2, dtype=np.float32), {}

        def step(self, action):
            Env.steps += 1
            if interrupt_at is not None and Env.steps >= interrupt_at:
                raise KeyboardInterrupt
            return np.zeros(2, dtype=np.float32), float(action), True, False, {}

    def train_size(run_dir, traces, *, options, stage, **_):
        settings = settings_for("size", total_timesteps=256, n_steps=64, batch_size=32, n_epochs=1, pi_arch=[8],
                                vf_arch=[8], seed=0, checkpoint_every=64, eval_every=10_000)
        train_policy(Env, None, settings, run_dir, stage, resume=options.resume)

        class Result:
            def to_dict(self):
                return {"stage": stage}
        return Result()

    return train_size


def test_ctrl_c_prints_checkpoint_and_resume_command(fake_traces, monkeypatch, capsys):
    import specpilot.train.rl.pipeline as pipeline

    argv = ["train", "size", "--run", str(fake_traces), "--wandb", "disabled"]
    monkeypatch.setattr(pipeline, "train_size", _interrupting_train_size(interrupt_at=150))
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted" in err
    manifest = json.loads((fake_traces / "manifest.json").read_text())
    checkpoint = manifest["stages"]["size_s1"]["checkpoint"]
    assert checkpoint in err
    resume = err.strip().splitlines()[-1].strip()
    assert resume.startswith("specpilot train size --run") and resume.endswith("--resume")

    # the same command without --resume is refused, naming the CLI flag (not the API's resume=True)
    code, err = run_cli(argv, capsys)
    assert_one_line(code, err, "already has checkpoints", "--resume")
    assert "resume=True" not in err

    # the printed command resumes it
    monkeypatch.setattr(pipeline, "train_size", _interrupting_train_size(interrupt_at=None))
    assert main(resume.split()[1:]) == 0
    assert json.loads((fake_traces / "manifest.json").read_text())["stages"]["size_s1"]["status"] == "done"


@pytest.mark.parametrize("extra, fragment", [
    (["--ray", "local"], "--ray"),                      # replay training stays local: refused, not ignored
    (["--target", "t", "--draft", "d"], "--backend live"),  # pair options only load the live backend's pair
    (["--static", "4,12", "--grid", "g.json"], "give one"),
])
def test_train_refuses_options_it_would_ignore(fake_traces, extra, fragment, capsys):
    code, err = run_cli(["train", "size", "--run", str(fake_traces), *extra], capsys)
    assert_one_line(code, err, fragment)


def test_the_interrupt_message_names_the_checkpoints_of_every_seed(tmp_path):
    import argparse

    from specpilot.artifacts.run import RunManifest
    from specpilot.train.cli import interrupted_message

    run = tmp_path / "run"
    RunManifest.update(run / "seed0", stages={"co1_size": {"status": "interrupted", "checkpoint": "s0/step_2048.zip"}})
    RunManifest.update(run / "seed1", stages={"bc_depth": {"status": "done"}})
    args = argparse.Namespace(_label="specpilot train all", _argv=["train", "all", "--run", str(run), "--seeds", "2"])
    message = interrupted_message(args, run)
    assert "seed0/co1_size: s0/step_2048.zip" in message and "bc_depth" not in message
    assert message.splitlines()[-1].strip().endswith("--seeds 2 --resume")


@pytest.mark.parametrize("where, ours", [
    ("drafting/somewhere.py", True),
    (".venv/lib/python3.11/site-packages/transformers/x.py", False),  # a venv in the checkout holds libraries
    ("build/lib/site-packages/x.py", False),
    ("tests/test_x.py", False),
])
def test_only_specpilots_own_frames_count_as_raised_in_the_package(where, ours):
    from specpilot.drafting.errors import PACKAGE_DIR, raised_in_package

    try:
        exec(compile("raise ValueError('x')", str(PACKAGE_DIR / where), "exec"))
    except ValueError as err:
        assert raised_in_package(err) is ours


def test_an_interrupted_record_says_how_to_resume(paths, tmp_path, monkeypatch, capsys):
    import specpilot.envs.record as record

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(record, "record_task", interrupted)
    code, err = run_cli(["record", "--suite", "train", "--limit", "1", "--target", paths["target"], "--draft",
                         paths["draft"], "--out", str(tmp_path / "t")], capsys)
    assert code == 130
    assert "interrupted; no shard had finished, so nothing was kept" in err


@pytest.mark.parametrize("command, kept", [("demo", "run the same command again to resume"),
                                           ("eval", "nothing was kept"), ("grid", "nothing was kept"),
                                           ("agreement", "nothing was kept"), ("generate", None)])
def test_ctrl_c_says_what_the_command_kept(monkeypatch, capsys, command, kept):
    """A demo interrupted keeps its finished stages and resumes; eval keeps nothing (its report is written at the
    end): the one line says which, so the user knows whether a rerun starts over."""
    import specpilot.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda argv=None: _with_handler(parser(argv), interrupted))
    argv = {"demo": ["demo", "--quick"], "eval": ["eval"], "generate": ["generate", "--prompt", "x"],
            "grid": ["grid", "--traces", "t", "--out", "g.json"], "agreement": ["agreement", "--out", "a"]}[command]
    assert cli.main(argv) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"specpilot {command}: interrupted") and "\n" not in err
    assert (kept in err) if kept else err == f"specpilot {command}: interrupted"


def _with_handler(parser, handler):
    """`parser` whose every command runs `handler`."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(_handler=handler)
    return parser
