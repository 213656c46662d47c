"""Draft LMs whose output rows are padded differently from the target's (one tokenizer; Qwen2.5-0.5B has 151,936
logits, Qwen2.5-7B 152,064): accepted when the tokenizer's ids lie below both sizes, exact greedy and exact law."""
from __future__ import annotations

import pytest
from tiny import outputs_tv, target_law, tiny_model

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.control import FixedController
from specpilot.drafting.pair import VocabularyMismatchError


class SharedTokenizer:
    """What the pair reads of a tokenizer here: how many ids it produces (and decode for outputs)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __call__(self, text: str, **kwargs) -> dict:
        return {"input_ids": [ord(c) % self.size for c in text]}

    def decode(self, ids, **kwargs) -> str:
        return " ".join(map(str, ids))


def padded_pair(target_rows: int, draft_rows: int, tokens: int, *, vocab_hidden: int = 32) -> ModelPair:
    target = tiny_model(vocab=target_rows, hidden=vocab_hidden, layers=1, eos=None, seed=3)
    draft = tiny_model(vocab=draft_rows, hidden=vocab_hidden, layers=1, eos=None, seed=4)
    return ModelPair(target, draft, tokenizer=SharedTokenizer(tokens))


@pytest.mark.parametrize("target_rows,draft_rows", [(40, 48), (48, 40)])
def test_greedy_is_exact_whichever_model_has_more_rows(target_rows, draft_rows):
    pair = padded_pair(target_rows, draft_rows, tokens=40)
    assert pair.drafter_vocab_size == 40
    decoder = SpeculativeDecoder(pair, TreeConfig(width=3, max_depth=4, max_size=10))
    prompts = [[1, 2, 3], [7, 8, 9, 10]]
    refs = [autoregressive_generate(pair, p, max_new_tokens=24).tokens for p in prompts]
    outs = [decoder.generate(p, controller=FixedController(3, 8), max_new_tokens=24).tokens for p in prompts]
    assert outs == refs
    assert [o.tokens for o in decoder.generate_batch(prompts, controller=FixedController(3, 8),
                                                     max_new_tokens=24)] == refs


@pytest.mark.heavy
@pytest.mark.parametrize("target_rows,draft_rows", [(6, 8), (8, 6)])
def test_sampled_output_follows_the_target_law(target_rows, draft_rows):
    """The target with more rows can emit an id the draft has no row for (the draft then reads its last row): the
    law over the target's ids is still exact."""
    pair = padded_pair(target_rows, draft_rows, tokens=6, vocab_hidden=16)
    sampling = (1.0, 0, 1.0)
    law = target_law(pair.target, [1, 2], 2, sampling)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=1, max_depth=3, max_size=3, sampled_children=True))
    outs = [decoder.generate([1, 2], controller=FixedController(3, 3), max_new_tokens=2, temperature=1.0, seed=s)
            for s in range(2000)]
    tv, bound = outputs_tv(outs, law)
    assert tv < bound, f"TV {tv:.4f} >= {bound:.4f}"


@pytest.mark.parametrize("tokenizer,fragment", [
    (None, r"differ \(40 vs 48 logits\).*give the pair its tokenizer"),
    (SharedTokenizer(44), "the tokenizer has 44 tokens, more than the smaller model's 40 rows"),
])
def test_other_sizes_without_proof_of_padding_are_refused(tokenizer, fragment):
    with pytest.raises(VocabularyMismatchError, match=fragment):
        ModelPair(tiny_model(vocab=40, eos=None), tiny_model(vocab=48, eos=None, seed=1), tokenizer=tokenizer)


def test_assisted_generation_is_refused_for_a_padded_draft_by_a_worker():
    """transformers' assisted generation takes differently sized outputs for two tokenizers: hf_assisted is refused
    before any work. The driver asks a worker (on Ray it has no pair); here the worker is this process."""
    from specpilot.drafting.executor import LocalExecutor
    from specpilot.eval.methods import assisted_refusal_on

    assert "equal output sizes" in assisted_refusal_on(LocalExecutor(padded_pair(40, 48, tokens=40)))
    assert assisted_refusal_on(LocalExecutor(padded_pair(40, 40, tokens=40))) is None
