"""End-to-end smoke of the `specpilot` command line on a tiny pair saved to disk (loaded with from_pretrained)."""
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specpilot.cli import COMMANDS, main
from tiny import noisy_copy, tiny_model


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    target = tiny_model(vocab=len(fast), eos=fast.eos_token_id)
    draft = noisy_copy(target, 0.2)
    for name, model in [("target", target), ("draft", draft)]:
        model.save_pretrained(root / name)
        fast.save_pretrained(root / name)
    return root


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


def test_generate_compare_from_saved_pair(pair_dir, capsys):
    code = main(["generate", "--prompt", "def f(x):", "--target", str(pair_dir / "target"), "--draft",
                 str(pair_dir / "draft"), "--depth", "3", "--size", "6", "--width", "2", "--max-new-tokens", "12",
                 "--compare"])
    assert code == 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "identical to target-only" in out


def test_console_script_runs():
    result = subprocess.run([sys.executable, "-m", "specpilot.cli", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "generate" in result.stdout
