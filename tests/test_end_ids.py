"""Several end ids (Llama-3 Instruct lists three): every decoding path stops at any of them, as generate() does."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import tiny_pair

from specpilot.drafting.control import FixedController
from specpilot.drafting.decoder import SpeculativeDecoder, autoregressive_generate
from specpilot.drafting.batch_ar import autoregressive_generate_batch
from specpilot.drafting.types import TreeConfig

PROMPTS = [[1, 2, 3, 4], [7, 8, 9], [20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def pair():
    """A pair whose end ids are an unused id first, then a token the greedy continuation of PROMPTS[0] emits."""
    pair = tiny_pair(noise=0.3, eos=None)
    free = autoregressive_generate(pair, PROMPTS[0], max_new_tokens=12).tokens
    stop = next(t for t in free[2:] if t not in free[:2])
    for config in (pair.target.generation_config, pair.target.config):
        config.eos_token_id = [95, stop]
    return pair


def reference(pair, prompt):
    out = pair.target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_pair_lists_every_end_id(pair):
    assert pair.eos_token_ids[0] == 95 and len(pair.eos_token_ids) == 2 and pair.eos_token_id == 95


@pytest.mark.parametrize("method", ["ar", "speculative", "batch", "batch_ar"])
def test_every_path_stops_at_any_end_id(pair, method):
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4, max_size=8))
    if method == "ar":
        outs = [autoregressive_generate(pair, p, max_new_tokens=12) for p in PROMPTS]
    elif method == "speculative":
        outs = [decoder.generate(p, controller=FixedController(3, 6), max_new_tokens=12) for p in PROMPTS]
    elif method == "batch":
        outs = decoder.generate_batch(PROMPTS, controller=FixedController(3, 6), max_new_tokens=12)
    else:
        outs = autoregressive_generate_batch(pair, PROMPTS, max_new_tokens=12)
    for prompt, out in zip(PROMPTS, outs):
        assert out.tokens == reference(pair, prompt)
    assert outs[0].finished_by == "eos" and outs[0].tokens[-1] == pair.eos_token_ids[1]


@pytest.mark.parametrize("generation,config,expected", [
    (np.int64(42), None, (42,)),
    (torch.tensor(42), None, (42,)),
    (None, [42, 7], ()),     # generate() reads generation_config only: config.json's end ids are not read
    ([], [42], ()),
    ([42, 42, 7], 3, (42, 7)),
    (None, None, ()),
])
def test_end_ids_of_every_stored_form(generation, config, expected):
    pair = tiny_pair(noise=0.3, eos=None)
    pair.target.generation_config.eos_token_id = generation
    pair.target.config.eos_token_id = config
    assert pair.eos_token_ids == expected
    assert pair.eos_token_id == (expected[0] if expected else None)
