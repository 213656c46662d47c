"""Tiny random target/draft pairs built in memory for fast tests (no hub, no disk)."""
from __future__ import annotations

import copy
import itertools
import math

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


def target_law(target, prompt: list[int], steps: int, sampling: tuple[float, int, float]) -> dict:
    """Exact probability of every continuation of `steps` tokens under the target's sampler (temperature, top_k,
    top_p), by enumeration: for tiny vocabularies only."""
    from specpilot.drafting.sampling import sampling_probs

    law = {}
    with torch.inference_mode():
        for seq in itertools.product(range(target.config.vocab_size), repeat=steps):
            logits = target(input_ids=torch.tensor([prompt + list(seq)])).logits[0]
            law[seq] = math.prod(float(sampling_probs(logits[len(prompt) - 1 + i], *sampling)[tok])
                                 for i, tok in enumerate(seq))
    return law


def target_law_until_end(target, prompt: list[int], steps: int, sampling: tuple[float, int, float],
                         end: int) -> dict:
    """Exact probability of every continuation under the target's sampler when generation stops at the end token
    `end` or after `steps` tokens (sequences ending in `end` are shorter), by enumeration over a prefix tree."""
    from specpilot.drafting.sampling import sampling_probs

    law = {}

    def walk(seq: tuple, prob: float) -> None:
        if len(seq) == steps or (seq and seq[-1] == end):
            law[seq] = law.get(seq, 0.0) + prob
            return
        logits = target(input_ids=torch.tensor([prompt + list(seq)])).logits[0, -1]
        for tok, p in enumerate(sampling_probs(logits, *sampling).tolist()):
            if p > 0:
                walk(seq + (tok,), prob * p)

    with torch.inference_mode():
        walk((), 1.0)
    return law


def sampled_tv(decoder, prompt: list[int], law: dict, controller, sampling: tuple[float, int, float],
               n: int) -> tuple[float, float]:
    """(total-variation distance of n seeded generations from `law`, its concentration bound).

    E[TV] <= 0.5 * sqrt(K / n) (Jensen), and TV concentrates: P(TV - E[TV] > t) <= exp(-2 n t^2) (McDiarmid)."""
    temperature, top_k, top_p = sampling
    steps = len(next(iter(law)))
    outs = [decoder.generate(prompt, controller=controller, max_new_tokens=steps, temperature=temperature,
                             top_k=top_k, top_p=top_p, seed=seed) for seed in range(n)]
    return outputs_tv(outs, law)


def outputs_tv(outputs, law: dict) -> tuple[float, float]:
    """(total-variation distance of the outputs' token sequences from `law`, its concentration bound; see
    sampled_tv)."""
    counts = dict.fromkeys(law, 0)
    for out in outputs:
        counts[tuple(out.tokens)] += 1
    n = len(outputs)
    tv = 0.5 * sum(abs(counts[s] / n - law[s]) for s in law)
    return tv, 0.5 * math.sqrt(len(law) / n) + 0.035
