"""Inputs that used to be taken and then capped, clipped or found only at the end: refused up front in one line (a
folder where a report file goes, agreement depths past its tree, a generate --size the tree cannot draft, a batch
size given twice), or honoured (--max-depth below the default depth caps that depth)."""
from __future__ import annotations

import pytest
from test_cli_errors import assert_one_line, run_cli

from specpilot.cli import build_parser


@pytest.fixture
def no_model_loads(monkeypatch):
    from specpilot.drafting.pair import ModelPair

    def never(*a, **k):
        raise AssertionError("loaded a model although the request is refused up front")

    monkeypatch.setattr(ModelPair, "from_pretrained", classmethod(never))


@pytest.mark.parametrize("argv, blocked", [
    (["eval", "--methods", "fixed", "--temperatures", "0"], "report.json"),
    (["eval", "--methods", "fixed", "--temperatures", "0"], "report.md"),
    (["eval", "--methods", "fixed", "--temperatures", "0,0.7"], "forest_speedup_T0.7.png"),
    (["agreement"], "agreement.json"),
])
def test_a_folder_where_a_report_file_goes_is_refused_before_measuring(tmp_path, capsys, no_model_loads, argv,
                                                                       blocked):
    out = tmp_path / "out"
    (out / blocked).mkdir(parents=True)
    code, err = run_cli([*argv, "--out", str(out)], capsys)
    assert_one_line(code, err, f"{out / blocked} is a folder, where this command writes a file",
                    "nothing was measured")


@pytest.mark.parametrize("argv, fragment", [
    (["--depth", "13"], "--depth 13 is beyond the agreement's tree (depth up to 12"),
    (["--size", "65"], "--size 65 is beyond the agreement's tree"),
])
def test_agreement_refuses_a_config_its_tree_would_cap(tmp_path, capsys, no_model_loads, argv, fragment):
    code, err = run_cli(["agreement", *argv, "--out", str(tmp_path / "a")], capsys)
    assert_one_line(code, err, fragment)


def test_agreement_report_refuses_a_config_past_its_tree():
    from tiny import tiny_pair

    from specpilot.eval.agreement import agreement_report

    with pytest.raises(ValueError, match="depth 20 is deeper than the tree's max_depth 12"):
        agreement_report(tiny_pair(noise=0.2, eos=None), ["ab"], depth=20, max_new_tokens=4)


def _generate_decoder(saved_pair, *options):
    from specpilot.drafting.cli import _decoder

    args = build_parser().parse_args(["generate", "--prompt", "x", "--target", str(saved_pair / "target"),
                                      "--draft", str(saved_pair / "draft"), "--device", "cpu", *options])
    return _decoder(args)


@pytest.mark.parametrize("options, depth, max_depth", [
    (["--max-depth", "2"], 2, 2),        # the default depth (4 on CPU) capped by the tree asked for
    (["--max-depth", "9"], 4, 9),
    (["--depth", "6"], 6, 12),
    (["--depth", "2", "--max-depth", "3"], 2, 3),
])
def test_generate_max_depth_caps_the_default_depth(saved_pair, options, depth, max_depth):
    decoder, controller = _generate_decoder(saved_pair, *options)
    assert (controller.depth, decoder.tree.max_depth) == (depth, max_depth)
    out = decoder.generate("ab", controller=controller, max_new_tokens=12)
    assert max(c.depth for c in out.cycles) <= depth


@pytest.mark.parametrize("options, fragment", [
    (["--width", "1", "--size", "50"], "--size 50 is more than the 4 candidates a width-1 tree drafts in 4 levels"),
    (["--width", "2", "--depth", "2", "--size", "7"], "--size 7 is more than the 6 candidates"),
])
def test_generate_refuses_a_size_the_tree_cannot_draft(saved_pair, capsys, options, fragment):
    code, err = run_cli(["generate", "--prompt", "x", "--target", str(saved_pair / "target"), "--draft",
                         str(saved_pair / "draft"), "--device", "cpu", *options], capsys)
    assert_one_line(code, err, fragment)


@pytest.mark.parametrize("argv", [
    ["eval", "--batch-sizes", "1,2,1"],
    ["grid", "--traces", "t", "--out", "g.json", "--batch-sizes", "2,1-4"],
    ["train", "all", "--run", "r", "--traces", "t", "--batch-sizes", "4,4"],
])
def test_a_batch_size_given_twice_is_refused(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(argv, capsys)
    assert_one_line(code, err, "given more than once")


def test_batch_sizes_are_sorted():
    from specpilot.drafting.cliargs import batch_sizes

    assert batch_sizes("8,1-2,4") == [1, 2, 4, 8]


@pytest.mark.parametrize("argv, fragment", [
    (["train", "depth", "--seed", "4294967296"], "--seed 4294967296: training seeds SB3, which takes 0..4294967295"),
    (["train", "all", "--seed", "4294967295", "--seeds", "2"], "for each of the seeds up to 4294967296"),
    (["train", "all", "--init-from", "x.zip"], "--init-from starts one stage from a policy zip"),
    (["train", "coadapt", "--init-from", "x.zip"], "`train coadapt` starts its stages from stage 1"),
    (["train", "all", "--bc-iters", "3"], "--bc-iters set(s) the behaviour cloning of --bc, which was not given"),
    (["train", "all", "--bc-epochs", "2", "--bc-it", "3"], "--bc-iters and --bc-epochs set(s)"),  # abbreviated too
    (["train", "all", "--seed-workers", "2"], "--seed-workers trains several --seeds at once"),
    (["train", "size", "--batch-profile", "p.json"], "--batch-profile gives the latencies of --batch-sizes"),
])
def test_train_refuses_options_it_would_ignore_before_creating_the_run(argv, fragment, tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli([*argv[:2], "--run", "r", *argv[2:]], capsys)
    assert_one_line(code, err, fragment)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, fragment", [
    (["--rounds", "2", "--max-rounds", "5"], "--max-rounds applies only with --rounds auto, but --rounds 2"),
    (["--rounds", "1", "--min-rounds", "3", "--target-half-width", "0.5"], "--min-rounds, --target-half-width apply"),
    (["--decide", "ltd,ltd"], "--decide ltd,ltd compares a method with itself"),
    (["--methods", "ddd", "--decide", "svip,confidence"], "--decide names svip and confidence, which --methods ddd"),
    (["--temperatures", "0", "--sampled-methods", "svip"], "--sampled-methods names the methods run at temperatures"),
])
def test_eval_refuses_round_and_deciding_options_that_would_decide_nothing(argv, fragment, tmp_path, capsys,
                                                                            no_model_loads):
    code, err = run_cli(["eval", *argv, "--out", str(tmp_path / "e")], capsys)
    assert_one_line(code, err, fragment)


def test_eval_decides_on_ar_without_naming_it_in_methods(tmp_path):
    from specpilot.eval.cli import _check_round_options

    args = build_parser().parse_args(["eval", "--methods", "ddd", "--decide", "ddd,ar", "--out", str(tmp_path)])
    args._argv = ["--methods", "ddd", "--decide", "ddd,ar"]
    _check_round_options(args)  # `ar` always runs


def test_a_write_error_names_the_file_and_a_full_disk_is_bad_input(tmp_path):
    import errno

    from safetensors import SafetensorError

    from specpilot.drafting.errors import is_user_error
    from specpilot.drafting.files import atomic_path

    target = tmp_path / "out.json"
    with pytest.raises(OSError, match=f"No space left on device while writing {target}"):
        with atomic_path(target):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not list(tmp_path.iterdir())  # the temporary file is gone
    assert is_user_error(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))


def test_generate_says_when_the_target_names_no_end_token(saved_pair, tmp_path, capsys):
    import json
    import shutil

    target = tmp_path / "target"
    shutil.copytree(saved_pair / "target", target)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((target / name).read_text())
        data["eos_token_id"] = None
        (target / name).write_text(json.dumps(data))
    code, err = run_cli(["generate", "--prompt", "ab", "--target", str(target), "--draft", str(saved_pair / "draft"),
                         "--device", "cpu", "--max-new-tokens", "4"], capsys)
    assert code == 0
    assert "names no end token (neither its generation_config nor config.json)" in err
    assert "pass --stop-token-id" in err
    code, err = run_cli(["generate", "--prompt", "ab", "--target", str(saved_pair / "target"), "--draft",
                         str(saved_pair / "draft"), "--device", "cpu", "--max-new-tokens", "4"], capsys)
    assert code == 0 and "no end token" not in err


def test_record_refuses_more_profile_prompts_than_it_records(tmp_path, capsys, no_model_loads):
    code, err = run_cli(["record", "--suite", "train", "--limit", "2", "--profile-prompts", "5", "--out",
                         str(tmp_path / "t")], capsys)
    assert_one_line(code, err, "--profile-prompts 5 is more than the 2 prompt(s) recorded", "or a larger --limit")


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x", "--threads", "1"], ["eval", "--threads=2"]])
def test_a_global_option_after_the_command_says_where_it_goes(argv, capsys):
    code, err = run_cli(argv, capsys)
    assert_one_line(code, err, "--threads is an option of `specpilot` itself: put it before the command")


def test_the_context_refusal_names_the_model_that_limits_it():
    from tiny import tiny_pair

    from specpilot.drafting.checks import check_context

    pair = tiny_pair(noise=0.2, eos=None)
    pair.draft.config.max_position_embeddings = 24
    with pytest.raises(ValueError, match=r"the models' context is 24 \(the draft's; the target takes 512\)"):
        check_context(pair, 10, 40, 0)


@pytest.mark.parametrize("answer", ["no", None, 1, [True]])
def test_a_controller_answer_that_is_not_a_bool_is_refused_not_coerced(answer):
    from tiny import tiny_pair

    from specpilot.drafting import SpeculativeDecoder, TreeConfig

    class Odd:
        def should_stop(self, state):
            return answer

        def choose_size(self, state):
            return 3

    decoder = SpeculativeDecoder(tiny_pair(noise=0.2, eos=None), TreeConfig(width=2, max_depth=4, max_size=8))
    with pytest.raises(TypeError, match=r"Odd.should_stop returned .* it must return True or False"):
        decoder.generate([1, 2, 3], controller=Odd(), max_new_tokens=4)


def test_a_numpy_bool_answer_is_a_bool():
    import numpy as np
    from tiny import tiny_pair

    from specpilot.drafting import SpeculativeDecoder, TreeConfig

    class NumpyStop:
        def should_stop(self, state):
            return np.bool_(state.depth >= 2)

        def choose_size(self, state):
            return 3

    decoder = SpeculativeDecoder(tiny_pair(noise=0.2, eos=None), TreeConfig(width=2, max_depth=4, max_size=8))
    out = decoder.generate([1, 2, 3], controller=NumpyStop(), max_new_tokens=6)
    assert len(out.tokens) == 6 and all(c.depth <= 2 for c in out.cycles)


@pytest.mark.parametrize("config, kwargs, fragment", [
    (None, {}, "config must be the path of an export folder"),
    (5, {}, "config must be the path of an export folder"),
])
def test_from_config_names_a_wrong_argument(config, kwargs, fragment):
    from specpilot.drafting import SpeculativeDecoder

    with pytest.raises(TypeError, match=fragment):
        SpeculativeDecoder.from_config(config, **kwargs)


def test_resolve_pair_refuses_what_is_not_a_pair():
    from specpilot.policies.exported import resolve_pair

    with pytest.raises(TypeError, match="pair must be a ModelPair"):
        resolve_pair({"pair": {"name": "x"}}, pair="x")


def test_the_exported_tokenizer_folder_is_the_recorded_pair_s(tmp_path):
    from specpilot.train.export.writer import _tokenizer_folder

    (tmp_path / "pair" / "target").mkdir(parents=True)
    (tmp_path / "pair" / "tokenizer").mkdir()
    assert _tokenizer_folder(None, {"name": "specpilot-default", "target": str(tmp_path / "pair" / "target")}) == \
        str(tmp_path / "pair" / "tokenizer")


@pytest.mark.parametrize("prompts, error, fragment", [
    ("def f():", TypeError, "got one string: pass \\[text\\] for a batch of one, or call generate"),
    (None, TypeError, "got NoneType"),
    ([], ValueError, "non-empty list"),
])
def test_generate_batch_names_what_is_not_a_batch(prompts, error, fragment):
    from tiny import tiny_pair

    from specpilot.drafting import SpeculativeDecoder, TreeConfig

    decoder = SpeculativeDecoder(tiny_pair(noise=0.2, eos=None), TreeConfig(width=2, max_depth=4, max_size=8))
    with pytest.raises(error, match=fragment):
        decoder.generate_batch(prompts, max_new_tokens=4)


def test_a_quick_build_never_replaces_a_full_one(tmp_path, capsys):
    import json

    full = tmp_path / "pair"
    full.mkdir()
    (full / "metrics.json").write_text(json.dumps({"quick": False}))
    code, err = run_cli(["models", "build", "--quick", "--out", str(full)], capsys)
    assert_one_line(code, err, "holds a full build", "would replace its models")
    assert json.loads((full / "metrics.json").read_text()) == {"quick": False}


def test_models_build_refuses_two_different_thread_counts(tmp_path, capsys):
    code, err = run_cli(["--threads", "1", "models", "build", "--quick", "--out", str(tmp_path / "p"), "--threads",
                         "2"], capsys)
    assert_one_line(code, err, "`specpilot --threads 1` and `models build --threads 2` disagree")


@pytest.mark.parametrize("argv", [["record", "--out", "r"], ["eval", "--out", "e"], ["demo", "--out", "d"],
                                  ["train", "size", "--run", "t"]])
def test_workers_without_ray_is_refused(argv, tmp_path, capsys, monkeypatch, no_model_loads):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli([*argv, "--workers", "2"], capsys)
    assert_one_line(code, err, "--workers sets how many Ray workers", "add --ray local")
    assert not list(tmp_path.iterdir())


def test_the_global_threads_reach_every_ray_worker(monkeypatch):
    import argparse

    import specpilot.train.scale.cluster as cluster
    from specpilot.train.scale.cluster_cli import open_pool

    seen = {}

    class Pool:
        workers = [{"device": "cpu", "host": "h"}]

        def __init__(self, spec, workers):
            seen.update(threads=spec.threads, workers=workers)

        def __len__(self):
            return 1

        def close(self):
            pass

    monkeypatch.setattr(cluster, "connect", lambda address: {"CPU": 4})
    monkeypatch.setattr(cluster, "WorkerPool", Pool)
    monkeypatch.setattr(cluster, "shutdown", lambda: None)
    args = argparse.Namespace(ray="local", workers=None, global_threads=2)
    with open_pool(args, say=lambda msg: seen.setdefault("said", msg)):
        pass
    assert seen["threads"] == 2 and seen["workers"] == 2  # 4 CPUs // 2 threads
    assert seen["said"].startswith("ray local: 1 worker (")


def test_train_ray_refusal_names_the_command_not_the_backend(tmp_path, capsys):
    code, err = run_cli(["train", "all", "--run", str(tmp_path / "r"), "--backend", "live", "--ray", "local"], capsys)
    assert_one_line(code, err, "`train all` runs its stages in this process")


def test_demo_ray_workers_get_the_dtype_the_run_decodes_in(saved_pair, tmp_path):
    import json

    from specpilot.demo import demo_dtype

    pair = dict(target=str(saved_pair / "target"), draft=str(saved_pair / "draft"), device="cpu")
    measured = demo_dtype(tmp_path / "new", **pair)
    assert measured in ("float32", "bfloat16")
    run = tmp_path / "run"
    run.mkdir()
    kept = "bfloat16" if measured == "float32" else "float32"
    (run / "demo_state.json").write_text(json.dumps({"dtype": {"dtype": kept, "reason": "r"},
                                                     "record": {"key": "k", "result": {}, "seconds": 1}}))
    expected = kept
    from specpilot.drafting.pair import DTYPES, half_support

    if half_support(DTYPES[kept], "cpu")[0] != "native":  # a run kept in a dtype this CPU only emulates: measured
        expected = measured
    assert demo_dtype(run, **pair) == expected
