"""Every decoding forward runs in `decoding_mode`: inference mode and, on CUDA, SDPA without its cuDNN backend (which
builds a graph per new query/key length: seconds of one-time costs per prompt on an H200 in bf16). CI has no GPU,
so `limits_sdpa` is told to treat the CPU as CUDA and forward hooks read the backend flags each forward saw."""
from __future__ import annotations

import pytest
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting import attention
from specpilot.drafting.attention import decoding_mode
from specpilot.drafting.batch_ar import autoregressive_generate_batch
from specpilot.drafting.eagle import Eagle3Config, Eagle3Head
from specpilot.policies import FixedController
from tiny import noisy_copy, tiny_model

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 9, 11], [40]]


def _flags() -> dict:
    return {"cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "flash": torch.backends.cuda.flash_sdp_enabled(),
            "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled(),
            "inference": torch.is_inference_mode_enabled()}


def test_cuda_decoding_turns_cudnn_off_and_restores_the_callers_choice():
    before = _flags()
    with decoding_mode("cuda"):
        inside = _flags()
    assert inside == {"cudnn": False, "flash": True, "efficient": True, "math": True, "inference": True}
    assert _flags() == before


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_other_devices_keep_the_backends(device):
    before = _flags()
    with decoding_mode(device):
        inside = _flags()
    assert inside == {**before, "inference": True}


def test_a_raising_forward_still_restores_the_flags():
    before = _flags()
    with pytest.raises(KeyError), decoding_mode("cuda"):
        raise KeyError("a forward failed")
    assert _flags() == before


def _pairs():
    target = tiny_model(layers=4)  # an EAGLE-3 head reads three of its layers
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=48), target)
    head.set_draft_vocab(torch.arange(48) * 2)
    return {"draft_lm": ModelPair(target, noisy_copy(target, 0.3)), "eagle3": ModelPair(target, eagle=head.eval())}


@pytest.mark.parametrize("kind", ["draft_lm", "eagle3"])
def test_every_decoding_forward_runs_without_cudnn(kind, monkeypatch):
    """generate, generate_batch and both AR baselines: each forward of the target and the drafter (prefill, draft
    levels, verification, plain steps) saw cuDNN off; the caller's flags are back afterwards."""
    monkeypatch.setattr(attention, "limits_sdpa", lambda device: True)
    pair = _pairs()[kind]
    seen: list[dict] = []
    modules = [pair.target, pair.draft if pair.draft is not None else pair.eagle]
    handles = [m.register_forward_pre_hook(lambda module, args: seen.append(_flags())) for m in modules]
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=3, max_size=6))
    before = _flags()
    try:
        reference = [autoregressive_generate(pair, p, max_new_tokens=12).tokens for p in PROMPTS]
        single = [decoder.generate(p, controller=FixedController(3, 6), max_new_tokens=12).tokens for p in PROMPTS]
        batched = [o.tokens for o in decoder.generate_batch(PROMPTS, controller=FixedController(3, 6),
                                                            max_new_tokens=12)]
        plain = [o.tokens for o in autoregressive_generate_batch(pair, PROMPTS, max_new_tokens=12)]
        sampled = decoder.generate(PROMPTS[0], controller=FixedController(2, 4), max_new_tokens=8, temperature=1.0,
                                   seed=3)
    finally:
        for handle in handles:
            handle.remove()
    assert _flags() == before
    assert single == batched == plain == reference  # the context changes no token
    assert sampled.num_tokens == 8
    assert len(seen) > 40
    assert all(not flags["cudnn"] and flags["efficient"] and flags["inference"] for flags in seen), seen


@pytest.mark.parametrize("kind", ["draft_lm", "eagle3"])
def test_recording_a_trace_runs_without_cudnn(kind, monkeypatch):
    """The replay recorder's forwards (the target's continuation and features, every draft level) use the kernels
    live decoding uses."""
    from specpilot.envs.record import _record_prompt

    monkeypatch.setattr(attention, "limits_sdpa", lambda device: True)
    pair = _pairs()[kind]
    seen: list[dict] = []
    modules = [pair.target, pair.draft if pair.draft is not None else pair.eagle]
    handles = [m.register_forward_pre_hook(lambda module, args: seen.append(_flags())) for m in modules]
    try:
        _record_prompt(pair, TreeConfig(width=2, max_depth=3, max_size=6), PROMPTS[1], 8)
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen) > 10
    assert all(not flags["cudnn"] and flags["inference"] for flags in seen), seen
