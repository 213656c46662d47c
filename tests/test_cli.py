"""End-to-end smoke of the `specpilot` command line on a tiny pair saved to disk (loaded with from_pretrained)."""
import subprocess
import sys

import pytest
from specpilot.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name, _, _ in COMMANDS:
        assert name in out


@pytest.mark.parametrize("command", [name for name, _, _ in COMMANDS])
def test_each_command_has_help(command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0


def test_generate_compare_from_saved_pair(saved_pair, capsys):
    code = main(["generate", "--prompt", "def f(x):", "--target", str(saved_pair / "target"), "--draft",
                 str(saved_pair / "draft"), "--depth", "3", "--size", "6", "--width", "2", "--max-new-tokens", "12",
                 "--compare"])
    assert code == 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "identical to target-only" in out


@pytest.mark.parametrize("prompt", ["    ", "\n\n"])
def test_generate_takes_a_prompt_of_whitespace_only(saved_pair, capsys, prompt):
    """Indentation alone is a prompt a code model continues (vLLM takes it): decoded, and exact, not refused."""
    assert main(["generate", "--prompt", prompt, "--target", str(saved_pair / "target"), "--draft",
                 str(saved_pair / "draft"), "--width", "2", "--max-new-tokens", "8", "--compare"]) == 0
    assert "identical to target-only" in capsys.readouterr().out


def test_generate_takes_what_target_only_decoding_takes(saved_pair, capsys):
    """A prompt that leaves room for the new tokens but not for a full-depth draft is decoded (its last cycles draft
    shallower), not refused; one token more is refused, naming the context."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(saved_pair / "target")
    prompt = "return x + 1\n" * 80
    n, new = len(tokenizer(prompt)["input_ids"]), 6
    assert n < 512
    pair = ["--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"), "--width", "1",
            "--max-depth", "12", "--depth", "12"]
    assert main(["generate", "--prompt", prompt, *pair, "--max-new-tokens", str(512 + 1 - n), "--compare"]) == 0
    assert "identical to target-only" in capsys.readouterr().out
    assert main(["generate", "--prompt", prompt, *pair, "--max-new-tokens", str(512 + 2 - n)]) == 2
    assert "context is 512" in capsys.readouterr().err


def test_console_script_runs():
    result = subprocess.run([sys.executable, "-m", "specpilot.cli", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "generate" in result.stdout


@pytest.mark.parametrize("command", ["grid", "train", "record", "eval", "demo", "models"])
def test_global_threads_reaches_every_command(command, monkeypatch):
    """`specpilot --threads N CMD` runs CMD on N threads: no sub-command default may overwrite the global flag."""
    import importlib

    import torch

    from specpilot.cli import COMMANDS

    module = importlib.import_module(next(m for name, m, _ in COMMANDS if name == command))
    seen = {}
    monkeypatch.setattr(module, "run", lambda args: seen.setdefault("threads", torch.get_num_threads()) and 0)
    before = torch.get_num_threads()
    target = 3 if before != 3 else 2
    try:
        argv = {"grid": ["grid", "--traces", "x", "--out", "x"], "train": ["train", "size", "--run", "x"],
                "record": ["record", "--out", "x"], "eval": ["eval", "--out", "x"], "demo": ["demo"],
                "models": ["models", "build"]}[command]
        main(["--threads", str(target)] + argv)
    finally:
        torch.set_num_threads(before)
    assert seen["threads"] == target


def test_threads_below_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--threads", "0", "generate", "--prompt", "x"])
    assert exit_info.value.code == 2 and "--threads" in capsys.readouterr().err


@pytest.mark.parametrize("tokens,temperature,dtype,expected", [
    ([1, 2, 3], 0.0, "torch.float32", "identical to target-only"),
    ([1, 9, 3], 1.0, "torch.float32", "differs from target-only (sampling)"),
    ([1, 9, 3], 0.0, "torch.bfloat16", "from token 1 (bfloat16 rounding"),
    ([1, 2, 3, 4], 0.0, "torch.float32", "DIFFERS from target-only greedy from token 3 in float32: this is a bug"),
])
def test_generate_compare_says_why_output_differs(tokens, temperature, dtype, expected):
    from specpilot.drafting.cli import agreement_note

    assert expected in agreement_note(tokens, [1, 2, 3], temperature=temperature, dtype=dtype)
