"""Tiny random target/draft pairs built in memory for fast tests (no hub, no disk)."""
from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specpilot.drafting import ModelPair


def tiny_model(*, vocab: int = 96, hidden: int = 32, layers: int = 2, seed: int = 0, eos: int | None = 95,
               sharpness: float = 4.0, context: int = 512) -> LlamaForCausalLM:
    """A random Llama; `sharpness` scales the weights so next-token distributions are peaked like a real LM's."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                         intermediate_size=2 * hidden, max_position_embeddings=context, eos_token_id=eos,
                         bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = eos
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(sharpness)
    return model.eval()


def noisy_copy(model: LlamaForCausalLM, noise: float, seed: int = 1) -> LlamaForCausalLM:
    """A draft that agrees with `model` more or less often, depending on `noise` (0 = identical)."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen) * p.std())
    return draft.eval()


def tiny_pair(noise: float = 0.3, **kwargs) -> ModelPair:
    target = tiny_model(**kwargs)
    return ModelPair(target, noisy_copy(target, noise))
