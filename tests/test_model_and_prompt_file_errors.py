"""Damaged model folders and prompt files that are not text: an error naming the file and the fix (InputFileError /
SuiteError; on the command line one line, exit code 2), never a safetensors, pickle or transformers traceback, and
never garbage recorded as prompts.

- a target, draft or EAGLE-3 head whose weights file is truncated, garbled or empty (safetensors or .bin);
- a folder that is no model: empty, a file, a config.json without a known model_type;
- a prompt file with NUL characters: UTF-16 saved without a byte-order mark, or binary (UTF-16 *with* one loads).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_cli_errors import assert_one_line, run_cli
from tiny import tiny_model

from specpilot.drafting.errors import InputFileError, is_user_error
from specpilot.drafting.files import model_files_fix
from specpilot.drafting.pair import DEFAULT_PAIR_DIR, ModelPair
from specpilot.eval.suites import SuiteError, load_suite

ROLES = ("target", "draft", "eagle")


@pytest.fixture(scope="module")
def good(saved_pair, tmp_path_factory) -> dict[str, Path]:
    """Good target/ and draft/ folders (with tokenizer files) and an EAGLE-3 head for that target."""
    from transformers import AutoModelForCausalLM

    from specpilot.drafting.eagle import Eagle3Config, Eagle3Head

    root = tmp_path_factory.mktemp("good_models")
    target = AutoModelForCausalLM.from_pretrained(saved_pair / "target")
    # the tiny target has 2 layers: name feature layers it has (the defaults assume >= 3)
    config = Eagle3Config.for_target(target.config, draft_vocab_size=target.config.vocab_size, aux_layer_ids=(0, 1, 2))
    Eagle3Head(config, target).save_pretrained(root / "eagle")
    return {"target": saved_pair / "target", "draft": saved_pair / "draft", "eagle": root / "eagle"}


def _copy(folder: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(folder, dst)
    return dst


def _as_bin(folder: Path) -> Path:
    """Rewrite the folder's model.safetensors as pytorch_model.bin (what older checkpoints ship)."""
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    return folder / "pytorch_model.bin"


def _truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _garble_header(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"\x5a" * 56 + data[64:])  # the length prefix stays, its JSON header does not
    return path


def _empty(path: Path) -> Path:
    path.write_bytes(b"")
    return path


# how the weights get damaged -> (folder) -> the damaged file
DAMAGE = {
    "truncated": lambda d: _truncate(d / "model.safetensors"),
    "garbled header": lambda d: _garble_header(d / "model.safetensors"),
    "empty": lambda d: _empty(d / "model.safetensors"),
    "truncated .bin": lambda d: _truncate(_as_bin(d)),
    "empty .bin": lambda d: _empty(_as_bin(d)),
}


def _pair_kwargs(good: dict[str, Path], role: str, folder: Path) -> dict:
    """ModelPair.from_pretrained arguments with `folder` in `role` and good models in the other places."""
    drafter = "eagle" if role == "eagle" else "draft"
    kwargs = {"target": good["target"], drafter: good[drafter]}
    kwargs[role] = folder
    return kwargs


def _pair_args(good: dict[str, Path], role: str, folder: Path) -> list[str]:
    """The same as command-line options (--target T --draft D / --eagle E)."""
    return [arg for name, path in _pair_kwargs(good, role, folder).items() for arg in (f"--{name}", str(path))]


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("role", ROLES)
def test_damaged_weights_are_an_input_file_error(good, tmp_path, role, damage):
    folder = _copy(good[role], tmp_path, f"damaged_{role}")
    broken = DAMAGE[damage](folder)
    with pytest.raises(InputFileError) as info:
        ModelPair.from_pretrained(**_pair_kwargs(good, role, folder), device="cpu")
    message = str(info.value)
    assert str(broken) in message and "damaged or incomplete" in message, message
    assert "save_pretrained" in message, message  # the fix for a user's folder
    assert is_user_error(info.value)


@pytest.mark.parametrize("role", ROLES)
def test_cli_damaged_weights_in_one_line(good, tmp_path, capsys, role):
    folder = _copy(good[role], tmp_path, f"damaged_{role}")
    broken = _truncate(folder / "model.safetensors")
    code, err = run_cli(["generate", "--prompt", "def f(x):", "--max-new-tokens", "4",
                         *_pair_args(good, role, folder)], capsys)
    assert_one_line(code, err, str(broken), "damaged or incomplete")


def test_cli_record_damaged_target_in_one_line(good, tmp_path, capsys):
    folder = _copy(good["target"], tmp_path, "damaged_target")
    broken = _truncate(folder / "model.safetensors")
    suite = tmp_path / "suite.txt"
    suite.write_text("def f(x):\n")
    code, err = run_cli(["record", "--suite", str(suite), "--out", str(tmp_path / "rec"), "--limit", "1",
                         "--max-new-tokens", "4", "--profile-cycles", "0", *_pair_args(good, "target", folder)],
                        capsys)
    assert_one_line(code, err, str(broken), "damaged or incomplete")
    assert not (tmp_path / "rec" / "trace.npz").exists()


def test_damaged_embedded_files_say_rebuild():
    assert "specpilot models build" in model_files_fix(DEFAULT_PAIR_DIR / "eagle")
    assert model_files_fix(DEFAULT_PAIR_DIR / "eagle").startswith("rebuild")


def _drop_model_type(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("model_type")
    (folder / "config.json").write_text(json.dumps(cfg))


def _unknown_model_type(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "no-such-architecture"
    (folder / "config.json").write_text(json.dumps(cfg))


# what makes the folder no model -> (make it from a good copy, fragments of the error)
NOT_A_MODEL = {
    "empty folder": (lambda d: [f.unlink() for f in d.iterdir()], ["is not a model folder", "no config.json"]),
    "a file": (lambda d: None, ["is a file, not a model folder"]),
    "no model_type": (_drop_model_type, ["config.json has no model_type key"]),
    "unknown model_type": (_unknown_model_type, ["'no-such-architecture' is unknown to transformers"]),
}


@pytest.mark.parametrize("case", list(NOT_A_MODEL))
@pytest.mark.parametrize("role", ("target", "draft"))
def test_not_a_model_folder(good, tmp_path, role, case):
    folder = _copy(good[role], tmp_path, "folder")
    make, fragments = NOT_A_MODEL[case]
    make(folder)
    given = folder / "model.safetensors" if case == "a file" else folder
    with pytest.raises(InputFileError) as info:
        ModelPair.from_pretrained(**_pair_kwargs(good, role, given), device="cpu")
    assert str(given) in str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("role", ("target", "draft"))
def test_cli_empty_folder_in_one_line(good, tmp_path, capsys, role):
    empty = tmp_path / "emptydir"
    empty.mkdir()
    code, err = run_cli(["generate", "--prompt", "x", "--max-new-tokens", "4", *_pair_args(good, role, empty)], capsys)
    assert_one_line(code, err, f"the {role} model {empty} is not a model folder", "no config.json")


@pytest.mark.parametrize("role,fix", [("draft", "pass it as the drafter with --eagle"),
                                      ("target", "give the target LM it drafts for as --target")])
def test_cli_an_eagle_head_given_as_a_causal_lm_in_one_line(good, capsys, role, fix):
    code, err = run_cli(["generate", "--prompt", "x", "--max-new-tokens", "4", *_pair_args(good, role, good["eagle"])],
                        capsys)
    assert_one_line(code, err, f"the {role} model {good['eagle']} is an EAGLE-3 head", fix)


@pytest.mark.parametrize("role", ROLES)
def test_truncated_config_keeps_a_clean_error(good, tmp_path, capsys, role):
    """A truncated config.json: transformers' own clean message for a target/draft (kept), one naming the file for
    an EAGLE-3 head."""
    folder = _copy(good[role], tmp_path, f"cut_config_{role}")
    _truncate(folder / "config.json")
    code, err = run_cli(["generate", "--prompt", "x", "--max-new-tokens", "4", *_pair_args(good, role, folder)],
                        capsys)
    assert_one_line(code, err, str(folder / "config.json"))
    assert "damaged or incomplete" not in err  # the weights are fine: the message must not blame them


# prompt files that are not text -> (file name, bytes, the line with the first NUL)
NOT_TEXT = {
    "utf-16-le without BOM": ("suite.txt", "def f(x):\nreturn x\n".encode("utf-16-le"), 1),
    "utf-16-be without BOM": ("suite.txt", "def f(x):\nreturn x\n".encode("utf-16-be"), 1),
    "utf-16 without BOM, non-ASCII": ("suite.txt", "café au lait\n".encode("utf-16-le"), 1),
    "NUL on line 3": ("suite.txt", b"one\ntwo\nth\x00ree\n", 3),
    "jsonl utf-16 without BOM": ("suite.jsonl", '{"prompt": "a"}\n'.encode("utf-16-le"), 1),
    "jsonl NUL in a prompt": ("suite.jsonl", b'{"prompt": "a"}\n{"prompt": "b\x00c"}\n', 2),
    "binary": ("suite.txt", bytes(range(256)) * 4, 1),
}


@pytest.mark.parametrize("case", list(NOT_TEXT))
def test_prompt_file_with_nul_is_refused(tmp_path, case):
    name, data, line = NOT_TEXT[case]
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(SuiteError) as info:
        load_suite(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: NUL characters"), message
    assert "UTF-16" in message and "save it as UTF-8" in message, message


@pytest.mark.parametrize("suffix", (".txt", ".jsonl"))
@pytest.mark.parametrize("codec", ("utf-16-le", "utf-16-be"))
def test_utf16_with_bom_still_loads(tmp_path, codec, suffix):
    texts = ["def f(x):", "print('héllo')"]
    lines = texts if suffix == ".txt" else [json.dumps({"prompt": t}) for t in texts]
    path = tmp_path / f"suite{suffix}"
    path.write_bytes(("\ufeff" + "\n".join(lines) + "\n").encode(codec))
    assert [p.prompt for p in load_suite(path)] == texts


@pytest.mark.parametrize("command", ("record", "prompts --exclude"))
def test_cli_prompt_file_with_nul_in_one_line(tmp_path, capsys, command):
    bad = tmp_path / "u16nobom.txt"
    bad.write_bytes("def f(x):\nreturn x\n".encode("utf-16-le"))
    source = tmp_path / "src.py"
    source.write_text('def add(x):\n    """Add one to x and return the sum."""\n    return x + 1\n')
    argv = (["record", "--suite", str(bad), "--out", str(tmp_path / "rec"), "--limit", "2", "--max-new-tokens", "4",
             "--profile-cycles", "0"] if command == "record" else
            ["prompts", "--from", str(source), "--out", str(tmp_path / "p.jsonl"), "--exclude", str(bad)])
    code, err = run_cli(argv, capsys)
    assert_one_line(code, err, f"{bad}:1: NUL characters", "UTF-16")
    assert not (tmp_path / "rec").exists() and not (tmp_path / "p.jsonl").exists()


@pytest.mark.parametrize("damage", ("truncate", "garbage"))
def test_cli_damaged_tokenizer_in_one_line(good, tmp_path, capsys, damage):
    folder = _copy(good["target"], tmp_path, "target")
    tokenizer = folder / "tokenizer.json"
    if damage == "truncate":
        _truncate(tokenizer)
    else:
        tokenizer.write_text('{"version": "1.0", "model": 3}')  # valid JSON, not a tokenizer
    code, err = run_cli(["generate", "--prompt", "x", "--max-new-tokens", "4", "--target", str(folder), "--draft",
                         str(good["draft"])], capsys)
    assert_one_line(code, err, f"the tokenizer files in {folder} cannot be read", "damaged or incomplete")


@pytest.mark.parametrize("role", ("target", "draft"))
def test_a_config_that_does_not_fit_the_weights_names_the_tensor(good, tmp_path, capsys, role):
    folder = _copy(good[role], tmp_path, f"reshaped_{role}")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = int(config["intermediate_size"]) + 4  # the MLP weights no longer fit
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputFileError) as info:
        ModelPair.from_pretrained(**_pair_kwargs(good, role, folder), device="cpu")
    message = str(info.value)
    assert str(folder) in message and "do not fit the model its config.json describes" in message, message
    assert "mlp" in message and "model.safetensors" in message, message  # the first tensor that differs
    capsys.readouterr()  # (the library call's own output, e.g. transformers' loading bar: not the CLI's)
    code, err = run_cli(["generate", "--prompt", "def f(x):", "--max-new-tokens", "4",
                         *_pair_args(good, role, folder)], capsys)
    assert_one_line(code, err, str(folder), "config.json")
