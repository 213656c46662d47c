"""Sampling distributions and the lossless acceptance rules of speculative decoding.

Every comparison between target and draft uses the distributions *actually sampled*: logits -> temperature ->
top-k -> top-p -> softmax, the same transform the autoregressive sampler applies (`sampling_probs`).

Rules implemented:
- greedy: accept a drafted token iff it equals the target's argmax at its parent;
- deterministic tree children (drafted by top-W, no randomness): draw y ~ p at the node and descend iff y is a
  child; otherwise y is the emitted correction. Equivalent to sibling-wise acceptance with residual renormalisation
  and exactly the target's law, because the tree does not depend on the draws;
- sampled chain (Leviathan et al.): accept x ~ q with min(1, p(x)/q(x)); on rejection sample norm(max(0, p - q)).
  When p == q nothing is ever rejected, so the 0/0 residual is never formed.
"""
from __future__ import annotations

import torch


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities the sampler draws from, for logits [..., vocab] (float32 result). temperature must be > 0."""
    if temperature <= 0:
        raise ValueError("sampling_probs needs temperature > 0; temperature 0 means greedy (argmax)")
    # shifted by the max first (softmax and top-k/top-p do not change): a tiny temperature then gives 0 and -inf
    # (the greedy limit), where logits / 1e-40 overflow to inf - inf = nan; a temperature under float32's smallest
    # normal (5e-324 would round to 0 there: 0 / 0) divides as that one, the same limit
    logits = logits.float()
    scores = (logits - logits.amax(dim=-1, keepdim=True)) / max(float(temperature), torch.finfo(torch.float32).tiny)
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        # Same semantics as transformers' TopPLogitsWarper: drop the tail whose cumulative mass stays <= 1 - top_p,
        # always keeping the most likely token.
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return torch.softmax(scores, dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """torch.multinomial(probs, 1): one draw per row of `probs` [..., vocab]. Logits that overflowed (float16's
    inf) leave nan here, which torch refuses with a bare RuntimeError; that is the model's range, so say so."""
    try:
        return torch.multinomial(probs, 1, generator=generator)
    except RuntimeError as err:
        if "probability tensor contains" not in str(err):
            raise
        from specpilot.drafting.errors import NonFiniteLogitsError, overflow_fix

        # the probabilities are float32 whatever the model ran in: the overflow they show is float16's
        raise NonFiniteLogitsError("cannot sample: the model's logits are not finite (inf or nan)"
                                   f"{overflow_fix('float16')}") from None


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a probability vector [vocab]."""
    return int(draw(probs, generator).item())


def uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device).item())


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
    """norm(max(0, p - q)), or None when it has no mass (then p == q where it matters and no rejection can occur)."""
    residual = torch.clamp(p - q, min=0.0)
    mass = float(residual.sum())
    if mass <= 1e-12:
        return None
    return residual / mass


def accept_or_correct(p: torch.Tensor, q: torch.Tensor, token: int, generator: torch.Generator | None
                      ) -> tuple[bool, int | None]:
    """Leviathan's rule for one drafted token x ~ q: (True, None) if accepted, else (False, correction ~ residual)."""
    p_x, q_x = float(p[token]), float(q[token])
    # q_x > 0 always: token was drawn from q. The ratio test draws u only when it can reject.
    if p_x >= q_x or uniform(generator, p.device) * q_x < p_x:
        return True, None
    residual = residual_distribution(p, q)
    # A rejection with no residual mass is a floating-point artefact of p == q; p itself is then the law.
    return False, sample(residual if residual is not None else p, generator)


def speculative_law(p: list[float], q: list[float]) -> list[float]:
    """Exact output law of one Leviathan step (proposal from q, correct residual), for tests and docs."""
    accepted = [min(a, b) for a, b in zip(p, q)]
    rejected_mass = 1.0 - sum(accepted)
    if rejected_mass <= 1e-15:
        return accepted
    residual = [max(a - b, 0.0) for a, b in zip(p, q)]
    total = sum(residual)
    return [m + rejected_mass * r / total for m, r in zip(accepted, residual)]


def naive_resample_law(p: list[float], q: list[float]) -> list[float]:
    """Law of the WRONG rule "on rejection resample from p" (kept to prove the test can tell the difference)."""
    accepted = [min(a, b) for a, b in zip(p, q)]
    rejected_mass = 1.0 - sum(accepted)
    return [m + rejected_mass * a for m, a in zip(accepted, p)]
