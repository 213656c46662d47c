"""Sampled speculative output follows the target's law: exact math on the seed article's example, Monte Carlo
on the decoder (total-variation distance against the enumerated target law, with a concentration bound)."""
import pytest
import torch

from specpilot.drafting import SpeculativeDecoder, TreeConfig
from specpilot.drafting.sampling import (accept_or_correct, naive_resample_law, residual_distribution,
                                         sampling_probs, speculative_law)
from specpilot.policies import FixedController
from tiny import noisy_copy, outputs_tv, sampled_tv, target_law, target_law_until_end, tiny_model
from specpilot.drafting import ModelPair

P, Q = [0.5, 0.3, 0.2], [0.2, 0.5, 0.3]


def test_article_example_correct_rule_reproduces_target():
    assert speculative_law(P, Q) == pytest.approx(P, abs=1e-12)


def test_article_example_naive_rule_is_wrong():
    assert naive_resample_law(P, Q) == pytest.approx([0.35, 0.39, 0.26], abs=1e-12)


def test_accept_or_correct_monte_carlo_matches_target():
    p, q = torch.tensor(P), torch.tensor(Q)
    gen = torch.Generator().manual_seed(20260923)
    counts = [0, 0, 0]
    n = 60000
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=gen))
        ok, correction = accept_or_correct(p, q, x, gen)
        counts[x if ok else correction] += 1
    freq = [c / n for c in counts]
    # marginal standard error <= sqrt(.25/n) = 0.002; 5 sigma
    assert freq == pytest.approx(P, abs=0.011)


def test_residual_never_formed_when_p_equals_q():
    p = torch.tensor(P)
    assert residual_distribution(p, p) is None
    gen = torch.Generator().manual_seed(0)
    assert all(accept_or_correct(p, p, x, gen) == (True, None) for x in range(3))


def test_sampling_probs_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert sampling_probs(logits, 1.0, top_k=2).tolist() == pytest.approx([2 / 3, 1 / 3, 0, 0])
    assert sampling_probs(logits, 1.0, top_p=0.7).tolist() == pytest.approx([2 / 3, 1 / 3, 0, 0])
    assert sampling_probs(logits, 1.0, top_p=0.5).tolist() == pytest.approx([1, 0, 0, 0])


@pytest.mark.parametrize("temperature", [1e-40, 5e-324])
def test_a_tiny_temperature_is_the_greedy_limit_not_nan(temperature):
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5], [0.0, -1.0, 4.0, -float("inf")]])
    for top_k, top_p in [(0, 1.0), (2, 0.9)]:
        probs = sampling_probs(logits, temperature, top_k=top_k, top_p=top_p)
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
    from specpilot.drafting import autoregressive_generate
    from specpilot.drafting.batch_ar import autoregressive_generate_batch

    target = tiny_model(vocab=16, hidden=16, layers=1, eos=None, seed=3)
    pair = ModelPair(target, noisy_copy(target, 0.5, seed=4))
    prompts = [[1, 2], [3]]
    greedy = [autoregressive_generate(pair, p, max_new_tokens=6).tokens for p in prompts]
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=3, max_size=6))
    assert [o.tokens for o in decoder.generate_batch(prompts, controller=FixedController(3, 6), max_new_tokens=6,
                                                     temperature=temperature, seed=1)] == greedy
    assert decoder.generate(prompts[0], controller=FixedController(3, 6), max_new_tokens=6,
                            temperature=temperature, seed=1).tokens == greedy[0]
    assert [o.tokens for o in autoregressive_generate_batch(pair, prompts, max_new_tokens=6, temperature=temperature,
                                                            seed=1)] == greedy


class _AlternateSkip(FixedController):
    """Skips drafting every other cycle: plain target steps interleaved with speculative ones."""

    def reset(self):
        self.turn = 0

    def skip_drafting(self, state):
        self.turn += 1
        return self.turn % 2 == 1


def _tv_against_target_law(width, depth, size, sampling, *, controller=None, n=3000, steps=2, sampled=True):
    """(total-variation distance of n sampled continuations from the exact target law, its concentration bound)."""
    vocab = 6
    # a peaked target and a poor draft (first-token TV(p, q) ~ 0.3): many rejections, so the correction matters;
    # the naive rule's law is ~0.13 away in TV at the first token alone
    target = tiny_model(vocab=vocab, hidden=16, layers=1, eos=None, sharpness=4.0, seed=3)
    pair = ModelPair(target, noisy_copy(target, 2.0, seed=4))
    prompt = [1, 2]
    law = target_law(target, prompt, steps, sampling)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=depth, max_size=size,
                                                  sampled_children=sampled))
    return sampled_tv(decoder, prompt, law, controller or FixedController(depth, size), sampling, n)


@pytest.mark.heavy
@pytest.mark.parametrize("width,depth,size,sampling,sampled", [
    (1, 3, 3, (1.0, 0, 1.0), True),     # sampled chain (Leviathan's rule)
    (3, 3, 12, (1.0, 0, 1.0), True),    # sampled children, recursive rejection sampling
    (2, 3, 8, (0.7, 4, 0.9), False),    # deterministic top-W children, temperature, top-k and top-p
    pytest.param(2, 3, 5, (0.7, 4, 0.9), True, marks=pytest.mark.slow),   # sampled tree, top-k/top-p, partial V
    pytest.param(3, 2, 6, (1.0, 0, 1.0), False, marks=pytest.mark.slow),  # deterministic tree
    pytest.param(1, 2, 2, (1.3, 0, 0.8), True, marks=pytest.mark.slow),   # chain with top-p
])
def test_decoder_samples_target_law(width, depth, size, sampling, sampled):
    tv, bound = _tv_against_target_law(width, depth, size, sampling, sampled=sampled)
    assert tv < bound, f"TV {tv:.4f} >= {bound:.4f}"


@pytest.mark.heavy
def test_plain_steps_interleaved_keep_the_target_law():
    tv, bound = _tv_against_target_law(1, 3, 3, (1.0, 0, 1.0), controller=_AlternateSkip(3, 3), steps=3, n=4000)
    assert tv < bound, f"TV {tv:.4f} >= {bound:.4f}"


@pytest.mark.heavy
def test_negative_control_the_naive_rule_fails_the_same_check(monkeypatch):
    """The check can fail: with "resample from p on rejection" the same TV test must reject the decoder."""
    import specpilot.drafting.verify as verify

    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)  # keep p on rejection: the naive rule
    tv, bound = _tv_against_target_law(1, 3, 3, (1.0, 0, 1.0))
    assert tv >= bound, f"the naive rule passed: TV {tv:.4f} < {bound:.4f}"


def _rrs_law(p, q, k):
    """Exact output law of recursive rejection sampling with k children drawn from q without replacement,
    by enumerating every ordered draw (the rule as drafting/verify.py implements it)."""
    vocab = len(p)
    law = [0.0] * vocab

    def walk(prefix, prob, p_cur, q_cur):
        if len(prefix) == k or sum(q_cur) <= 0:
            for y in range(vocab):
                law[y] += prob * p_cur[y]
            return
        for x in range(vocab):
            if q_cur[x] <= 0:
                continue
            draw = prob * q_cur[x]
            accept = min(1.0, p_cur[x] / q_cur[x])
            law[x] += draw * accept
            residual = [max(a - b, 0.0) for a, b in zip(p_cur, q_cur)]
            mass = sum(residual)
            p_next = [r / mass for r in residual] if mass > 1e-15 else p_cur
            q_next = [0.0 if i == x else v for i, v in enumerate(q_cur)]
            total = sum(q_next)
            q_next = [v / total for v in q_next] if total > 0 else q_next
            walk(prefix + [x], draw * (1 - accept), p_next, q_next)

    walk([], 1.0, list(p), list(q))
    return law


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("p,q", [([0.5, 0.3, 0.2, 0.0], [0.2, 0.5, 0.3, 0.0]),
                                 ([0.1, 0.1, 0.1, 0.7], [0.6, 0.2, 0.15, 0.05]),
                                 ([0.25, 0.25, 0.25, 0.25], [0.97, 0.01, 0.01, 0.01])])
def test_recursive_rejection_rule_reproduces_the_target_law_exactly(p, q, k):
    assert _rrs_law(p, q, k) == pytest.approx(p, abs=1e-12)


@pytest.mark.heavy
@pytest.mark.parametrize("k", [1, 3])
def test_recursive_rejection_implementation_matches_its_law(k):
    """accept_tree_recursive at one node (k children drawn by Gumbel-top-k, as the drafter draws them)."""
    from specpilot.drafting.verify import Block, accept_tree_recursive

    p, q = torch.tensor([0.1, 0.1, 0.1, 0.7]), torch.tensor([0.6, 0.2, 0.15, 0.05])

    class OneNode:
        def q_of_children(self, node):
            return q

    gen = torch.Generator().manual_seed(7)
    counts, n = [0, 0, 0, 0], 40000
    logits = torch.log(p)[None].expand(k + 1, 4)
    for _ in range(n):
        keys = torch.log(q) - torch.log(-torch.log(torch.rand(4, generator=gen).clamp_(1e-20, 1.0)))
        drawn = torch.topk(keys, k).indices.tolist()
        block = Block(node_ids=torch.arange(k), tokens=[0] + drawn, parents=[-1] + [0] * k)
        path, bonus = accept_tree_recursive(block, logits, OneNode(), (1.0, 0, 1.0), gen)
        counts[block.tokens[path[0]] if path else bonus] += 1
    assert [c / n for c in counts] == pytest.approx(p.tolist(), abs=0.012)  # 5 sigma at n = 40000


@pytest.mark.heavy
@pytest.mark.parametrize("width,depth,size,sampling,sampled,n", [
    (3, 3, 9, (1.0, 0, 1.0), True, 2000),  # sampled children: the end token among siblings
    pytest.param(1, 3, 3, (1.0, 0, 1.0), True, 4000, marks=pytest.mark.slow),   # chain
    pytest.param(2, 3, 6, (0.7, 3, 0.9), False, 4000, marks=pytest.mark.slow),  # top-W children, top-k, top-p
])
def test_end_token_inside_the_tree_and_a_budget_cut_keep_the_target_law(width, depth, size, sampling, sampled, n):
    """Generation stops at the end token wherever it is accepted (first position, mid-tree, bonus) and at
    max_new_tokens=3, which a depth-3 cycle overshoots (up to 4 tokens): the sequences stopped either way follow
    the law of the target sampled until its end token. A token after the end would be a sequence outside the law."""
    vocab, end = 4, 1
    target = tiny_model(vocab=vocab, hidden=16, layers=1, eos=end, sharpness=4.0, seed=5)
    pair = ModelPair(target, noisy_copy(target, 2.0, seed=6))
    prompt = [2, 3]
    law = target_law_until_end(target, prompt, 3, sampling, end)
    assert 0.1 < sum(p for s, p in law.items() if s[-1] == end) < 0.9   # ends are common, not certain
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=depth, max_size=size,
                                                  sampled_children=sampled))
    temperature, top_k, top_p = sampling
    outs = [decoder.generate(prompt, controller=FixedController(depth, size), max_new_tokens=3,
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed) for seed in range(n)]
    assert all(tuple(o.tokens) in law for o in outs)
    tv, bound = outputs_tv(outs, law)
    assert tv < bound, f"TV {tv:.4f} >= {bound:.4f}"
