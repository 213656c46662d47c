"""Prompts as a user of the model sends them: chat templates for natural-language prompts, the tokenizer's BOS, and
no second BOS on a templated prompt."""
from __future__ import annotations

import argparse

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from specpilot.drafting import ModelPair
from specpilot.eval.suites import Prompt, chat_template_note, is_completion, load_suite, with_chat_template
from tiny import tiny_model

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A byte-level BPE tokenizer that adds a BOS like Llama's and ships a chat template like an instruct model."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "What is the capital of Italy?"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=specials[2:])
    fast.chat_template = TEMPLATE
    return fast


PROSE = Prompt("q1", "qa", "en", "heldout", "What is the capital of Italy?")
CODE = Prompt("c1", "numerics", "python", "heldout", "def f(x):")


@pytest.mark.parametrize("mode, templated", [("auto", [True, False]), ("on", [True, True]), ("off", [False, False])])
def test_modes_template_prose_and_keep_completions_raw(chat_tokenizer, mode, templated):
    out, info = with_chat_template([PROSE, CODE], chat_tokenizer, mode)
    assert [p.prompt != q.prompt for p, q in zip(out, [PROSE, CODE])] == templated
    assert info == {"mode": mode, "applied": sum(templated), "of": 2}
    if templated[0]:
        assert out[0].prompt == "<s><|user|>What is the capital of Italy?<|end|><|assistant|>"
        assert (out[0].id, out[0].task, out[0].language) == (PROSE.id, PROSE.task, PROSE.language)


def test_auto_is_a_no_op_without_a_template_and_on_is_refused(saved_pair):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(saved_pair / "target")
    out, info = with_chat_template([PROSE, CODE], plain, "auto")
    assert out == [PROSE, CODE] and info["applied"] == 0 and chat_template_note({"chat_template": info}) == ""
    with pytest.raises(ValueError, match="no chat template"):
        with_chat_template([PROSE], plain, "on")
    with pytest.raises(ValueError, match="choose one of"):
        with_chat_template([PROSE], plain, "always")


def test_bundled_suites_split_into_prose_and_completions():
    heldout = load_suite("heldout")
    assert {p.task for p in heldout if is_completion(p)} == {"code"}
    assert {p.task for p in heldout if not is_completion(p)} == {"instruction", "qa", "math", "conversation"}
    assert all(is_completion(p) for name in ("train", "validation", "heldout_code") for p in load_suite(name))


def test_encode_adds_the_tokenizers_bos_once(chat_tokenizer):
    target = tiny_model(vocab=len(chat_tokenizer), eos=None)
    pair = ModelPair(target, target, tokenizer=chat_tokenizer)
    bos = chat_tokenizer.bos_token_id
    raw = pair.encode("What is the capital of Italy?")
    assert raw[0] == bos and raw.count(bos) == 1  # as tokenizer(text) gives generate() users
    templated = with_chat_template([PROSE], chat_tokenizer, "on")[0][0].prompt
    ids = pair.encode(templated)
    assert ids[0] == bos and ids.count(bos) == 1
    assert ids == chat_tokenizer.apply_chat_template([{"role": "user", "content": PROSE.prompt}], tokenize=True,
                                                     add_generation_prompt=True, return_dict=False)


def test_eval_reports_how_many_prompts_were_templated(saved_pair, capsys):
    from specpilot.cli import main
    from specpilot.eval import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    plan = cli.prepare(parser.parse_args(["--methods", "fixed", "--suite", "heldout"]))
    assert plan.suite["chat_template"] == {"mode": "auto", "applied": 0, "of": 96}  # the embedded pair: no template
    code = main(["eval", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
                 "--suite", "heldout", "--chat-template", "on", "--methods", "fixed"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no chat template" in err[0], err
    assert chat_template_note({"chat_template": {"mode": "auto", "applied": 80, "of": 96}}) == \
        ", chat template on 80 of 96 prompts (--chat-template auto)"
