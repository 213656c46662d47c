"""Sampled speculative output in bf16 follows the target's law up to rounding (tests/test_sampling_law.py in half
precision).

The reference is the exact law of the *same bf16 weights computed in fp32* (law32, by enumeration). A bf16 decoder
cannot match it exactly: its forwards round every logit, so even a perfect sampler draws from a slightly different
law. How far rounding alone moves the law is measured, not assumed: rounding_tv = TV(law16, law32), where law16 is
the same enumeration computed in bf16. The decoder's tree and one-token forwards round differently from that full
forward, by rounding of the same size, so the bound is relaxed by 2 * rounding_tv (once for the enumeration's
rounding, once for the decoder's) and by nothing else: the Monte-Carlo bound of tiny.sampled_tv stays as in fp32.
The negative control (the naive "resample from p" rule) must still fail the relaxed bound: the relaxation is far
smaller than the error a wrong rule makes."""
from __future__ import annotations

import copy

import pytest
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig
from specpilot.policies import FixedController
from tiny import noisy_copy, sampled_tv, target_law, tiny_model

PROMPT, STEPS = [1, 2], 2


def _half_tv(width, depth, size, sampling, *, sampled=True, n=2000):
    """(TV of n bf16 generations from law32, the fp32 Monte-Carlo bound, rounding_tv)."""
    target = tiny_model(vocab=6, hidden=16, layers=1, eos=None, sharpness=4.0, seed=3)
    pair = ModelPair(target, noisy_copy(target, 2.0, seed=4)).to(dtype=torch.bfloat16)
    exact = copy.deepcopy(pair.target).to(torch.float32)  # the same (rounded) weights, unrounded arithmetic
    law32 = target_law(exact, PROMPT, STEPS, sampling)
    law16 = target_law(pair.target, PROMPT, STEPS, sampling)
    rounding_tv = 0.5 * sum(abs(law16[s] - law32[s]) for s in law32)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=depth, max_size=size,
                                                  sampled_children=sampled))
    tv, bound = sampled_tv(decoder, PROMPT, law32, FixedController(depth, size), sampling, n)
    return tv, bound, rounding_tv


@pytest.mark.heavy
@pytest.mark.parametrize("width,depth,size,sampling,sampled", [
    (3, 3, 12, (1.0, 0, 1.0), True),     # sampled children, recursive rejection sampling
    pytest.param(2, 3, 8, (0.7, 4, 0.9), False, marks=pytest.mark.slow),  # top-W children, top-k and top-p
])
def test_bf16_decoder_samples_the_target_law_up_to_rounding(width, depth, size, sampling, sampled):
    tv, bound, rounding_tv = _half_tv(width, depth, size, sampling, sampled=sampled)
    assert rounding_tv < 0.02, f"rounding moved the law by TV {rounding_tv:.4f}: too coarse a test"
    assert tv < bound + 2 * rounding_tv, f"TV {tv:.4f} >= {bound:.4f} + 2 x {rounding_tv:.4f}"


@pytest.mark.slow
def test_negative_control_the_naive_rule_fails_the_relaxed_bound(monkeypatch):
    import specpilot.drafting.verify as verify

    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    tv, bound, rounding_tv = _half_tv(1, 3, 3, (1.0, 0, 1.0))
    assert tv >= bound + 2 * rounding_tv, f"the naive rule passed: TV {tv:.4f} < {bound:.4f} + 2 x {rounding_tv:.4f}"
