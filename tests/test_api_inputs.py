"""What a user of transformers' generate() passes to the Python API: tokenizer outputs (padded batches with their
attention_mask), duck-typed controllers, arrays of budgets, and models in training mode; and what is refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.batch_ar import autoregressive_generate_batch
from specpilot.policies import FixedController
from tiny import noisy_copy, tiny_model, tiny_pair

TREE = TreeConfig(width=2, max_depth=3, max_size=6)
TEXTS = ["def f(x):\n    return", "x + 1\n", "def f(x):\n    return x + 1\ndef"]


@pytest.fixture(scope="module")
def pair_and_tokenizer(saved_pair):
    from transformers import AutoTokenizer

    pair = ModelPair.from_pretrained(saved_pair / "target", draft=saved_pair / "draft")
    tokenizer = AutoTokenizer.from_pretrained(saved_pair / "target")
    tokenizer.pad_token = tokenizer.eos_token
    return pair, tokenizer


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_tokenizer_batch_decodes_each_prompt_without_its_padding(pair_and_tokenizer, side):
    pair, tokenizer = pair_and_tokenizer
    tokenizer.padding_side = side
    encoding = tokenizer(TEXTS, padding=True, return_tensors="pt")
    expected = [autoregressive_generate(pair, text, max_new_tokens=6).tokens for text in TEXTS]
    decoder = SpeculativeDecoder(pair, TREE)
    assert [o.tokens for o in decoder.generate_batch(encoding, max_new_tokens=6)] == expected
    assert [o.tokens for o in autoregressive_generate_batch(pair, encoding, max_new_tokens=6)] == expected
    assert decoder.generate(tokenizer(TEXTS[1]), max_new_tokens=6).tokens == expected[1]
    with pytest.raises(ValueError, match="attention_mask"):  # the bare ids of the same batch: padding as text
        decoder.generate_batch(encoding["input_ids"], max_new_tokens=6)
    with pytest.raises(ValueError, match="3 prompts: call generate_batch"):
        decoder.generate(encoding, max_new_tokens=6)


def test_a_duck_typed_controller_needs_only_should_stop_and_choose_size():
    class Duck:
        def should_stop(self, state):
            return state.depth >= 2

        def choose_size(self, state):
            return 4

    pair = tiny_pair()
    out = SpeculativeDecoder(pair, TREE).generate([1, 2, 3], controller=Duck(), max_new_tokens=8)
    assert out.tokens == autoregressive_generate(pair, [1, 2, 3], max_new_tokens=8).tokens
    assert max(c.depth for c in out.cycles) == 2
    with pytest.raises(TypeError, match=r"an instance, got the class FixedController: pass FixedController\(...\)"):
        SpeculativeDecoder(pair, TREE).generate([1, 2], controller=FixedController)


@pytest.mark.parametrize("budgets", [np.array([3, 5]), torch.tensor([3, 5]), [3, 5]])
def test_budgets_as_arrays(budgets):
    outs = SpeculativeDecoder(tiny_pair(), TREE).generate_batch(np.array([[1, 2], [3, 4]]), max_new_tokens=budgets)
    assert [len(o.tokens) for o in outs] == [3, 5] or any(o.finished_by == "eos" for o in outs)


def test_one_row_of_ids_is_not_a_batch():
    with pytest.raises(ValueError, match="must be 2-D .* for one prompt pass \\[ids\\] or call generate"):
        SpeculativeDecoder(tiny_pair(), TREE).generate_batch(torch.tensor([1, 2, 3]), max_new_tokens=3)


def test_model_pair_refuses_a_draft_lm_as_eagle_and_two_drafters():
    target = tiny_model()
    with pytest.raises(TypeError, match="eagle must be an EAGLE-3 head .* a separate draft LM goes in draft="):
        ModelPair(target, eagle=noisy_copy(target, 0.1))
    from test_eagle_decoder import random_head

    deep = tiny_model(layers=4)
    with pytest.raises(ValueError, match="not both"):
        ModelPair(deep, noisy_copy(deep, 0.1), eagle=random_head(deep))


def test_models_in_training_mode_are_switched_with_a_warning():
    target, draft = tiny_model(), noisy_copy(tiny_model(), 0.1)
    target.train()
    with pytest.warns(UserWarning, match="puts the target in eval mode"):
        ModelPair(target, draft)
    assert not target.training


def test_an_output_taken_before_the_end_says_unfinished():
    session = SpeculativeDecoder(tiny_pair(eos=None), TREE).start([1, 2, 3], max_new_tokens=50)
    assert session.output().finished_by == "unfinished"
