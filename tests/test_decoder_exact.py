"""Greedy speculative output equals target-only greedy output, token for token, across tree shapes and edges."""
import copy

import numpy as np
import pytest
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.cache import new_cache
from specpilot.drafting.types import DraftState
from specpilot.policies import Controller, FixedController
from tiny import tiny_pair

PROMPTS = [[7], [1, 2, 3, 4, 5], list(range(10, 43))]


@pytest.fixture(scope="module", params=[0.0, 0.3, 1.5], ids=["same", "close", "far"])
def pair(request):
    return tiny_pair(noise=request.param)


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("depth,size", [(1, 1), (2, 3), (4, 8), (6, 40)])
def test_greedy_identical_to_autoregressive(pair, width, depth, size):
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=6, max_size=64))
    for prompt in PROMPTS:
        ref = autoregressive_generate(pair, prompt, max_new_tokens=40)
        out = decoder.generate(prompt, controller=FixedController(depth, size), max_new_tokens=40)
        assert out.tokens == ref.tokens, (prompt, width, depth, size)
        assert out.finished_by == ref.finished_by
        assert sum(c.emitted for c in out.cycles) == len(out.tokens)
        for c in out.cycles:
            assert 1 <= c.emitted <= c.accepted + 1 and c.accepted <= c.depth and c.size <= size


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 17])
def test_max_new_tokens_is_exact(max_new_tokens):
    pair = tiny_pair(noise=0.0, eos=None)  # identical draft: every cycle would overshoot the budget
    out = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=8)).generate(
        [3, 4], controller=FixedController(8, 16), max_new_tokens=max_new_tokens)
    ref = autoregressive_generate(pair, [3, 4], max_new_tokens=max_new_tokens)
    assert out.tokens == ref.tokens and len(out.tokens) == max_new_tokens and out.finished_by == "length"


def test_stops_exactly_at_eos():
    pair = tiny_pair(noise=0.0, eos=None)
    free = autoregressive_generate(pair, [5, 6, 7], max_new_tokens=30).tokens
    eos = free[9]  # a token the target emits mid-sequence becomes EOS
    first = free.index(eos)
    pair.target.generation_config.eos_token_id = eos
    ref = autoregressive_generate(pair, [5, 6, 7], max_new_tokens=30)
    out = SpeculativeDecoder(pair, TreeConfig(width=3, max_depth=8)).generate(
        [5, 6, 7], controller=FixedController(8, 30), max_new_tokens=30)
    assert ref.tokens == free[: first + 1] and out.tokens == ref.tokens
    assert out.finished_by == "eos" and out.tokens[-1] == eos


def _prefill_keys(model, tokens):
    cache = new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
    return [layer.keys.clone() for layer in cache.layers], [layer.values.clone() for layer in cache.layers]


@pytest.mark.parametrize("width,depth,size", [(1, 4, 4), (3, 4, 12), (4, 3, 20)])
def test_caches_equal_fresh_prefill_after_each_cycle(width, depth, size):
    pair = tiny_pair(noise=0.3)
    session = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=6)).start([1, 2, 3, 4], max_new_tokens=30)
    for _ in range(4):
        for _ in range(depth):
            session.draft_level()
        session.verify(size)
        committed = session.committed
        keys, values = _prefill_keys(pair.target, committed[:-1])
        for layer, k, v in zip(session.target_cache.layers, keys, values):
            assert layer.keys.shape == k.shape
            torch.testing.assert_close(layer.keys, k, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(layer.values, v, atol=1e-5, rtol=1e-4)
        dkeys, _ = _prefill_keys(pair.draft, committed[: session.drafter.committed])
        for layer, k in zip(session.drafter.cache.layers, dkeys):
            torch.testing.assert_close(layer.keys, k, atol=1e-5, rtol=1e-4)


class _BadSize(Controller):
    def __init__(self, value):
        self.value = value

    def should_stop(self, state):
        return True

    def choose_size(self, state):
        return self.value


@pytest.mark.parametrize("value", [0, -3, 2.5, "8", None, True])
def test_invalid_controller_size_raises(value):
    decoder = SpeculativeDecoder(tiny_pair(), TreeConfig(width=2, max_depth=4))
    with pytest.raises(ValueError, match="choose_size"):
        decoder.generate([1, 2], controller=_BadSize(value), max_new_tokens=5)


def test_invalid_session_calls_raise():
    session = SpeculativeDecoder(tiny_pair(), TreeConfig(width=2, max_depth=2)).start([1, 2], max_new_tokens=5)
    with pytest.raises(RuntimeError, match="draft_level"):
        session.verify(3)
    session.draft_level()
    session.draft_level()
    with pytest.raises(RuntimeError, match="max_depth"):
        session.draft_level()
    with pytest.raises(ValueError, match=">= 1"):
        session.verify(0)  # size 0 is a plain step: only without a drafted tree
    with pytest.raises(TypeError):
        session.verify("3")


@pytest.mark.parametrize("kwargs,match", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k")])
def test_invalid_sampling_arguments_raise(kwargs, match):
    decoder = SpeculativeDecoder(tiny_pair())
    with pytest.raises(ValueError, match=match):
        decoder.generate([1, 2], **kwargs)


def test_prompt_longer_than_context_raises():
    pair = tiny_pair(context=64)
    with pytest.raises(ValueError, match="context"):
        SpeculativeDecoder(pair).generate(list(range(60)), max_new_tokens=16)
    with pytest.raises(ValueError, match="context"):
        autoregressive_generate(pair, list(range(60)), max_new_tokens=16)
    with pytest.raises(ValueError, match="empty"):
        autoregressive_generate(pair, [], max_new_tokens=4)


def test_cycle_records_time_and_default_controller():
    out = SpeculativeDecoder(tiny_pair()).generate([1, 2, 3], max_new_tokens=12)
    assert out.cycles and all(c.draft_s > 0 and c.verify_s > 0 and c.policy_s >= 0 for c in out.cycles)
    assert len(out.token_times) == len(out.tokens) and out.token_times == sorted(out.token_times)


class _Probe(Controller):
    """Checks, at every question, that the lazily built state equals one built eagerly from the tree's arrays."""

    def __init__(self, session, depth: int, size: int) -> None:
        self.session, self.depth, self.size, self.checked = session, depth, size, 0

    def _check(self, state) -> None:
        tree = self.session.drafter.tree
        if state.depth == 0:
            assert tree is None and state.num_candidates == 0 and state.level_scores.size == 0
            return
        scores = tree.scores[: tree.size].numpy().copy()
        width = self.session.tree_config.width
        start = 0 if state.depth == 1 else width + (state.depth - 2) * width * width
        eager = DraftState(depth=state.depth, max_depth=state.max_depth, width=width, context_len=state.context_len,
                           scores=scores, level_start=start)
        np.testing.assert_array_equal(state.level_scores, scores[start:])          # drafting order, no sort
        np.testing.assert_array_equal(state.frontier_scores, eager.frontier_scores)
        np.testing.assert_array_equal(state.candidate_scores, eager.candidate_scores)  # the ranking's sort
        # a CPU tree hands the size policy the ranking's own memory as numpy (no torch -> numpy conversion)
        assert np.shares_memory(state.candidate_scores, tree.ranking()[0].numpy())
        np.testing.assert_array_equal(state.detached().candidate_scores, eager.candidate_scores)
        self.checked += 1

    def skip_drafting(self, state):
        self._check(state)
        return False

    def should_stop(self, state):
        self._check(state)
        return state.depth >= self.depth

    def choose_size(self, state):
        self._check(state)
        return self.size


def test_lazy_draft_states_equal_eager_ones():
    from specpilot.drafting.cycle import run_cycle

    decoder = SpeculativeDecoder(tiny_pair(noise=0.5), TreeConfig(width=3, max_depth=4, max_size=20))
    session = decoder.start([1, 2, 3], max_new_tokens=24)
    probe = _Probe(session, depth=3, size=7)
    while not session.done:
        run_cycle(session, probe)
    assert probe.checked > 10


def test_plain_steps_interleaved_with_speculation_stay_exact():
    """A controller that skips drafting every other cycle: the drafter falls behind and catches up exactly."""

    class Alternate(FixedController):
        def reset(self):
            self.turn = 0

        def skip_drafting(self, state):
            self.turn += 1
            return self.turn % 2 == 0

    pair = tiny_pair(noise=0.3)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4))
    for prompt in PROMPTS:
        ref = autoregressive_generate(pair, prompt, max_new_tokens=30)
        out = decoder.generate(prompt, controller=Alternate(3, 6), max_new_tokens=30)
        assert out.tokens == ref.tokens
        depths = [c.depth for c in out.cycles]
        assert 0 in depths and max(depths) == 3
        assert all(c.emitted == 1 and c.size == 0 and c.draft_s == 0 for c in out.cycles if c.depth == 0)
        fed = [c.fed for c in out.cycles if c.depth]
        assert max(fed) > 1  # after a plain step the drafter catches up on more than the bonus token


def _gpt2_pair(context: int):
    """A pair with absolute position embeddings: feeding a position past `context` fails (IndexError)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    target = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=context, n_embd=32, n_layer=2, n_head=2,
                                        eos_token_id=None, bos_token_id=None)).eval()
    target.generation_config.eos_token_id = None
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.2 * torch.randn_like(p) * p.std())
    return ModelPair(target, draft)


@pytest.mark.parametrize("width,depth,new", [(1, 3, 1), (2, 4, 5), (4, 6, 9), (2, 40, 6)])
def test_a_request_that_fills_the_context_exactly_decodes_as_generate(width, depth, new):
    """The context rule is exact and the same as target-only decoding's: the prompt and every new token but the last
    fill the window (`check_context`); speculative sessions draft shallower where the context ends (vLLM trims its
    speculative tokens at max_model_len), never past it. One position more is refused."""
    from specpilot.drafting.batch_ar import autoregressive_generate_batch

    context = 32
    pair = _gpt2_pair(context)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=depth, max_size=16))
    outputs = []

    def single(p):
        outputs.append(decoder.generate(p, controller=FixedController(depth, 16), max_new_tokens=new))
        return outputs[-1].tokens

    def batch(p):
        outputs.extend(decoder.generate_batch([p, p[1:]], controller=FixedController(depth, 16), max_new_tokens=new))
        return outputs[-2].tokens

    runs = (single, batch, lambda p: autoregressive_generate(pair, p, max_new_tokens=new).tokens,
            lambda p: autoregressive_generate_batch(pair, [p, p[2:]], max_new_tokens=new)[0].tokens)
    prompt = torch.randint(0, 64, (context + 1 - new,)).tolist()
    expected = pair.target.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                                    do_sample=False)[0, len(prompt):].tolist()
    for run in runs:
        assert run(prompt) == expected
        with pytest.raises(ValueError, match="context"):
            run([0, *prompt])
    for out in outputs:  # every cycle's draft ends inside the window; the last ones drafted shallower
        assert all(c.context_len + c.depth <= context for c in out.cycles)
        assert out.cycles[0].depth == min(depth, context - len(prompt))  # a batch drafts for its longest row