"""Validation at the library boundary (constructors, `generate`, `encode`, `from_pretrained`): each bad value raises
TypeError / ValueError naming the argument and the accepted range; output locations are checked before any work
and results are written atomically."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import tiny_model, tiny_pair

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.errors import OutputPathError, is_user_error
from specpilot.drafting.files import atomic_path, atomic_write_text, check_writable
from specpilot.drafting.pair import check_device, check_dtype


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"width": 2.0}, TypeError, "TreeConfig.width must be an integer >= 1, got 2.0"),
    ({"width": "4"}, TypeError, "TreeConfig.width"),
    ({"width": True}, TypeError, "TreeConfig.width"),
    ({"max_depth": 3.5}, TypeError, "TreeConfig.max_depth"),
    ({"max_size": None}, TypeError, "TreeConfig.max_size"),
    ({"width": 0}, ValueError, "TreeConfig.width must be an integer >= 1, got 0"),
    ({"max_depth": -2}, ValueError, "TreeConfig.max_depth"),
])
def test_tree_config_refuses_non_integers_and_out_of_range(kwargs, error, fragment):
    with pytest.raises(error, match=fragment.replace(".", r"\.")) as info:
        TreeConfig(**kwargs)
    assert is_user_error(info.value)


def test_tree_config_takes_numpy_integers():
    tree = TreeConfig(width=np.int64(2), max_depth=np.int32(3), max_size=6)
    assert tree == TreeConfig(2, 3, 6) and type(tree.width) is int


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an integer >= 1"),
    ({"max_new_tokens": "8"}, TypeError, "max_new_tokens"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
    ({"temperature": math.nan}, ValueError, "temperature must be a finite number >= 0"),
    ({"temperature": math.inf}, ValueError, "temperature"),
    ({"temperature": -0.5}, ValueError, "temperature"),
    ({"temperature": "hot"}, TypeError, "temperature"),
    ({"top_p": math.nan}, ValueError, "top_p"),
    ({"top_p": 0.0}, ValueError, "top_p must be a finite number > 0 and <= 1"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"top_k": 1.5}, TypeError, "top_k"),
    ({"top_k": -1}, ValueError, "top_k"),
    ({"seed": 1.5}, TypeError, "seed"),
])
@pytest.mark.parametrize("entry", ["speculative", "autoregressive"])
def test_sampling_arguments_are_checked(pair, kwargs, error, fragment, entry):
    with pytest.raises(error, match=fragment) as info:
        if entry == "speculative":
            SpeculativeDecoder(pair, TreeConfig(2, 3, 6)).generate([5, 6, 7], **{"max_new_tokens": 4, **kwargs})
        else:
            autoregressive_generate(pair, [5, 6, 7], **{"max_new_tokens": 4, **kwargs})
    assert is_user_error(info.value)


@pytest.mark.parametrize("prompt, error, fragment", [
    ([5, 96, 7], ValueError, "prompt token id 96 at position 1 is outside the vocabulary: token ids must be in 0..95"),
    ([5, -1], ValueError, "prompt token id -1 at position 1"),
    ([5, 2.0], TypeError, "prompt token id at position 1 must be an integer"),
    (torch.tensor([1.0, 2.0]), TypeError, "must be integers"),
    (np.array([1.5]), TypeError, "must be integers"),
    (torch.tensor([3, 200]), ValueError, "prompt token id 200"),
    (b"\x01\x02", TypeError, "bytes"),
    (17, TypeError, "text \\(str\\), a list of token ids or a tokenizer's output"),
    (torch.tensor([[1, 2], [3, 4]]), ValueError, r"one sequence of token ids \(\[n\] or \[1, n\]\), got shape \[2, 2\]"),
    (np.array([[1, 2], [3, 4]]), ValueError, "call generate_batch"),
])
def test_prompt_ids_are_checked_against_the_vocabulary(pair, prompt, error, fragment):
    with pytest.raises(error, match=fragment) as info:
        pair.encode(prompt)
    assert is_user_error(info.value)
    with pytest.raises(error):
        SpeculativeDecoder(pair, TreeConfig(2, 3, 6)).generate(prompt, max_new_tokens=2)


def test_valid_ids_of_every_kind_encode(pair):
    for prompt in ([5, 6], (5, 6), np.array([5, 6]), torch.tensor([[5, 6]]), range(5, 7)):
        assert pair.encode(prompt) == [5, 6]


def test_text_with_invalid_utf8_is_refused(saved_pair):
    p = ModelPair.from_pretrained(saved_pair / "target", saved_pair / "draft", device="cpu")
    bad = b"def f(\xff):".decode("utf-8", "surrogateescape")  # what argv holds for invalid UTF-8 bytes
    with pytest.raises(ValueError, match="not valid UTF-8") as info:
        p.encode(bad)
    assert "xff" in str(info.value)


def test_width_larger_than_the_drafter_vocabulary(pair):
    with pytest.raises(ValueError, match="width=97 exceeds the drafter's vocabulary of 96 tokens"):
        SpeculativeDecoder(pair, TreeConfig(width=97))
    SpeculativeDecoder(pair, TreeConfig(width=96, max_depth=2))  # the largest width that fits


@pytest.mark.parametrize("width, max_depth, ok", [(64, 4, True), (64, 5, False), (8, 256, True), (90, 12, False)])
def test_trees_too_large_to_hold_are_refused_before_anything_is_allocated(pair, width, max_depth, ok):
    tree = TreeConfig(width=width, max_depth=max_depth)
    if ok:
        SpeculativeDecoder(pair, tree)
    else:
        with pytest.raises(ValueError, match=r"drafted nodes per cycle .* GiB\); at most 16,384: lower the width"):
            SpeculativeDecoder(pair, tree)


def test_width_larger_than_an_eagle_heads_draft_vocabulary():
    from test_eagle_decoder import random_head

    target = tiny_model(vocab=96, hidden=32, layers=4)
    eagle_pair = ModelPair(target, eagle=random_head(target, draft_vocab=48))
    with pytest.raises(ValueError, match="vocabulary of 48 tokens"):
        SpeculativeDecoder(eagle_pair, TreeConfig(width=64))


@pytest.mark.parametrize("depth, size, error", [(2.5, 4, TypeError), (2, "4", TypeError), (-1, 4, ValueError),
                                                 (3, 0, ValueError)])
def test_fixed_controller_takes_integers_only(depth, size, error):
    from specpilot.policies import FixedController

    with pytest.raises(error, match="FixedController"):
        FixedController(depth, size)
    assert FixedController(np.int64(0), 0).depth == 0  # never drafts: verifies nothing


def test_decoder_arguments_have_the_right_types(pair):
    with pytest.raises(TypeError, match="TreeConfig"):
        SpeculativeDecoder(pair, {"width": 4})
    with pytest.raises(TypeError, match="ModelPair"):
        SpeculativeDecoder("pair")


@pytest.mark.parametrize("device, fragment", [("gpu", "not supported"), ("cuda:x", "not supported"),
                                              ("tpu:0", "not supported")])
def test_unknown_device_strings(device, fragment):
    with pytest.raises(ValueError, match=fragment):
        check_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_says_so(saved_pair):
    with pytest.raises(ValueError, match="needs CUDA.*use cpu"):
        ModelPair.from_pretrained(saved_pair / "target", saved_pair / "draft", device="cuda")


@pytest.mark.parametrize("dtype", ["int8", "float64x", torch.int64])
def test_unsupported_dtypes(dtype):
    with pytest.raises(ValueError, match="choose one of"):
        check_dtype(dtype, "cpu")


def test_missing_paths_say_the_path_does_not_exist(saved_pair):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelPair.from_pretrained("/no/such/dir", saved_pair / "draft", device="cpu")
    with pytest.raises(FileNotFoundError, match="no local path 'nosuch/model' exists"):
        ModelPair.from_pretrained("nosuch/model", saved_pair / "draft", device="cpu")


# ---------------------------------------------------------------------------------------------------------------
# output locations


def _read_only_folder(tmp_path: Path) -> Path:
    """A folder this process cannot write: chmod 555 (root ignores that: then a read-only mount)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):
        for candidate in (Path("/sys"), Path("/proc/sys")):
            try:
                with open(candidate / ".specpilot-write-test", "w"):
                    pass
            except OSError:
                return candidate
        pytest.skip("no read-only folder available to this user")
    return folder


def test_check_writable_refuses_read_only_folders(tmp_path):
    ro = _read_only_folder(tmp_path)
    for path, kind in ((ro, "dir"), (ro / "new" / "deeper", "dir"), (ro / "grid.json", "file")):
        with pytest.raises(OutputPathError, match="cannot write"):
            check_writable(path, kind=kind, what="--out")


@pytest.mark.parametrize("flag", ["i", "a"])
def test_check_writable_refuses_a_file_that_cannot_be_replaced(tmp_path, flag):
    """An immutable or append-only demo_state.json / report.json: refused before the work, not found by the
    os.replace that writes the results at its end (EPERM, for root too)."""
    import shutil
    import subprocess

    existing = tmp_path / "demo_state.json"
    existing.write_text("{}")
    if shutil.which("chattr") is None or subprocess.run(["chattr", f"+{flag}", str(existing)],
                                                         capture_output=True).returncode != 0:
        pytest.skip("chattr is not available or not permitted here")
    try:
        name = {"i": "immutable", "a": "append-only"}[flag]
        with pytest.raises(OutputPathError, match=f"is marked {name} \\(chattr \\+{flag}.*chattr -{flag}"):
            check_writable(existing, kind="file", what="--out")
    finally:
        subprocess.run(["chattr", f"-{flag}", str(existing)], check=True)
    assert check_writable(existing, kind="file") == existing


def test_check_writable_refuses_files_for_folders_and_back(tmp_path):
    existing = tmp_path / "report.json"
    existing.write_text("{}")
    with pytest.raises(OutputPathError, match="existing file, not a folder"):
        check_writable(existing, kind="dir")
    with pytest.raises(OutputPathError, match="is a file, so no folder"):
        check_writable(existing / "sub", kind="dir")
    with pytest.raises(OutputPathError, match="is a folder"):
        check_writable(tmp_path, kind="file")
    assert check_writable(tmp_path / "a" / "b", kind="dir") == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()  # the check creates nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # and leaves no probe behind


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "report.json"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_cli_refuses_a_read_only_out_before_loading_anything(tmp_path, monkeypatch, capsys):
    from specpilot.cli import main

    def never(*args, **kwargs):
        raise AssertionError("the pair was loaded although the output location is unusable")

    monkeypatch.setattr(ModelPair, "from_pretrained", classmethod(never))
    ro = _read_only_folder(tmp_path)
    for argv in (["record", "--out", str(ro / "trace")], ["eval", "--out", str(ro / "eval")],
                 ["grid", "--traces", "x", "--out", str(ro / "grid.json")],
                 ["export", "--out", str(ro / "export"), "--run", "x"],
                 ["train", "size", "--run", str(ro / "run")], ["demo", "--out", str(ro / "demo")],
                 ["models", "build", "--out", str(ro / "pair")],
                 ["eval", "--out", str(tmp_path / "ok"), "--replay-dir", str(ro / "replay")]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and err.count("\n") == 0 and "cannot write" in err, (argv, err)


@pytest.mark.parametrize("tree,fragment", [
    (TreeConfig(width=2, max_depth=4, max_size=12), None),
    (TreeConfig(width=2, max_depth=3, max_size=12), "observes trees of width 2 and max_depth 4, but the decoder's"),
    (TreeConfig(width=3, max_depth=4, max_size=12), "observes trees of width 2 and max_depth 4"),
    (TreeConfig(width=2, max_depth=4, max_size=6), "verifies up to 8 candidates, more than the tree's max_size 6"),
])
def test_learned_policies_refuse_a_tree_they_were_not_trained_for(pair, tree, fragment):
    from specpilot.policies.learned import probe_controller

    controller = probe_controller(2, 4, [2, 4, 8])
    decoder = SpeculativeDecoder(pair, tree)
    if fragment is None:
        assert decoder.generate([1, 2, 3], controller=controller, max_new_tokens=4).tokens
        return
    with pytest.raises(ValueError, match=fragment):
        decoder.generate([1, 2, 3], controller=controller, max_new_tokens=4)
    with pytest.raises(ValueError, match=fragment):
        decoder.generate_batch([[1, 2, 3]], controller=controller, max_new_tokens=4)


def test_a_controller_that_is_not_one_is_a_type_error(pair):
    with pytest.raises(TypeError, match="controller must be a specpilot Controller .* got str"):
        SpeculativeDecoder(pair, TreeConfig(2, 3, 6)).generate([1, 2], controller="fixed", max_new_tokens=2)


@pytest.mark.parametrize("make,fragment", [
    (lambda m: ModelPair("abc", m), "target must be a transformers causal LM .* got str"),
    (lambda m: ModelPair(m, torch.nn.Linear(3, 3)), "draft must be a transformers causal LM .* got Linear"),
    (lambda m: ModelPair(m, m, tokenizer="gpt2"), "tokenizer must be a transformers tokenizer object, got str"),
])
def test_pair_arguments_of_the_wrong_kind_are_type_errors(make, fragment):
    with pytest.raises(TypeError, match=fragment):
        make(tiny_model())


def test_a_decision_log_is_checked_like_the_controller_it_wraps(pair):
    from specpilot.drafting.control import DecisionLog, FixedController

    with pytest.raises(ValueError, match="depth 10 is deeper than the tree's max_depth 4"):
        SpeculativeDecoder(pair, TreeConfig(2, 4, 8)).generate([1, 2], controller=DecisionLog(FixedController(10, 4)),
                                                                max_new_tokens=2)


@pytest.mark.parametrize("depth_actor,size_actor,fallback,refused", [
    (True, False, (10, 4), False),   # the fallback's depth is never used
    (False, True, (3, 40), False),   # nor its size
    (True, False, (3, 40), True),    # its size is
    (False, True, (10, 4), True),    # its depth is
])
def test_a_learned_controllers_fallback_is_checked_for_what_it_decides(pair, depth_actor, size_actor, fallback,
                                                                       refused):
    from specpilot.drafting.control import FixedController
    from specpilot.policies.learned import LearnedController, probe_controller

    probe = probe_controller(2, 4, [2, 4, 8])
    controller = LearnedController(probe.depth_actor if depth_actor else None,
                                   probe.size_actor if size_actor else None, probe.depth_spec, probe.size_spec,
                                   [2, 4, 8], FixedController(*fallback))
    decoder = SpeculativeDecoder(pair, TreeConfig(2, 4, 12))
    if refused:
        with pytest.raises(ValueError, match="FixedController"):
            decoder.generate([1, 2], controller=controller, max_new_tokens=2)
    else:
        assert decoder.generate([1, 2], controller=controller, max_new_tokens=2).tokens
