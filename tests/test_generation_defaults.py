"""What the target's generation_config asks for that decoding does not do is said (CLI note, one library warning
per pair), output text leaves out special tokens as transformers' pipeline and vLLM do, top-k / top-p at greedy are
warned about, and a closed stdout ends the CLI quietly."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
from transformers import GenerationConfig

from specpilot.cli import BROKEN_PIPE, main
from specpilot.drafting import SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.generation_defaults import generation_config_differences, generation_config_note

from tiny import tiny_pair

ASKS = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.9, max_new_tokens=7, repetition_penalty=1.3,
            no_repeat_ngram_size=2, min_new_tokens=5, suppress_tokens=[10, 11])


def _pair(**settings):
    pair = tiny_pair(noise=0.3, eos=None)
    pair.target.generation_config = GenerationConfig(eos_token_id=95, **settings)
    return pair


def test_the_differences_are_classified():
    diff = generation_config_differences(_pair(**ASKS).target)
    assert diff["sampling"] == {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.9}
    assert diff["length"] == {"max_new_tokens": 7}
    assert diff["not_applied"] == {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 5,
                                   "suppress_tokens": [10, 11]}
    # neutral values and greedy settings are no difference: generate() would not use them either
    quiet = _pair(do_sample=False, temperature=0.6, repetition_penalty=1.0, num_beams=1)
    assert generation_config_note(quiet.target) is None


def test_the_note_names_flags_and_leaves_out_what_the_caller_gave():
    target = _pair(**ASKS).target
    cli = generation_config_note(target, cli=True)
    assert "pass --temperature 0.6 --top-k 20 --top-p 0.9 to sample as it suggests" in cli
    assert "its length (max_new_tokens=7) is not read: specpilot's --max-new-tokens applies" in cli
    assert "repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=5, suppress_tokens=[10, 11] are not " \
           "applied" in cli
    given = generation_config_note(target, cli=True, given={"temperature", "max_new_tokens"})
    assert "samples" not in given and "length" not in given and "repetition_penalty=1.3" in given
    assert "pass temperature=0.6, top_k=20, top_p=0.9" in generation_config_note(target)


def test_the_library_warns_once_per_pair_and_decodes_as_asked():
    pair = _pair(**ASKS)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=3, max_size=6))
    with pytest.warns(UserWarning, match="the target's generation_config: it samples"):
        out = decoder.generate([1, 2, 3], max_new_tokens=9)
    assert len(out.tokens) == 9                                    # its own max_new_tokens, greedy
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autoregressive_generate(pair, [1, 2, 3], max_new_tokens=9)  # the same pair: said once
        plain = tiny_pair(noise=0.3)
        autoregressive_generate(plain, [1, 2, 3], max_new_tokens=4)  # nothing to say


def test_a_generation_config_without_end_ids_stops_nowhere_as_generate_does():
    pair = tiny_pair(noise=0.3, eos=None)
    pair.target.generation_config.eos_token_id = None
    pair.target.config.eos_token_id = 7
    assert pair.eos_token_ids == ()
    assert "config.json's eos_token_id=7 is not read" in generation_config_note(pair.target)


def test_output_text_leaves_out_special_tokens_and_the_ids_keep_them(saved_pair):
    from specpilot.drafting import ModelPair

    pair = ModelPair.from_pretrained(saved_pair / "target", saved_pair / "draft")
    tokens = [*pair.encode("def f(x):"), pair.eos_token_id]
    assert pair.decode(tokens) == "def f(x):"
    assert pair.decode(tokens, skip_special_tokens=False).endswith("<|endoftext|>")
    out = autoregressive_generate(pair, "def f(x):", max_new_tokens=6)
    assert out.text == pair.tokenizer.decode(out.tokens, skip_special_tokens=True)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.5)])
def test_top_k_or_top_p_at_greedy_is_warned_in_the_library(top_k, top_p):
    pair = tiny_pair(noise=0.3)
    with pytest.warns(UserWarning, match="at temperature 0 \\(greedy\\) decoding ignores them"):
        autoregressive_generate(pair, [1, 2, 3], max_new_tokens=3, top_k=top_k, top_p=top_p)


def test_the_cli_prints_the_note_once(saved_pair, tmp_path, capsys):
    target = tmp_path / "target"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(saved_pair / "target")
    model.generation_config = GenerationConfig(eos_token_id=model.config.eos_token_id, do_sample=True,
                                               temperature=0.7, repetition_penalty=1.2)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(saved_pair / "target").save_pretrained(target)
    code = main(["generate", "--target", str(target), "--draft", str(saved_pair / "draft"), "--prompt", "def f",
                 "--max-new-tokens", "4", "--depth", "2", "--size", "4"])
    err = capsys.readouterr().err
    assert code == 0 and err.count("note: the target's generation_config") == 1
    assert "pass --temperature 0.7 to sample as it suggests" in err and "repetition_penalty=1.2 is not applied" in err


def test_a_closed_stdout_ends_the_cli_quietly(saved_pair):
    read, write = os.pipe()
    os.close(read)  # every write to stdout now fails with EPIPE
    try:
        result = subprocess.run([sys.executable, "-m", "specpilot.cli", "--threads", "1", "generate", "--target",
                                 str(saved_pair / "target"), "--draft", str(saved_pair / "draft"), "--prompt", "def",
                                 "--max-new-tokens", "3"], stdout=write, stderr=subprocess.PIPE, text=True,
                                timeout=300)
    finally:
        os.close(write)
    # stderr holds only the header's dtype line, written before stdout was touched: no traceback, no error
    assert result.returncode == BROKEN_PIPE and result.stderr.startswith("dtype float32: the default on cpu")
    assert len(result.stderr.splitlines()) == 1, result.stderr
