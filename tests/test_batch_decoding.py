"""Batched decoding (drafting/batch.py): every sequence's greedy output equals its own target-only greedy output and
its own single-sequence `generate`, over tree shapes, ragged prompts and ragged finishing; every row's caches equal
a fresh prefill of its committed tokens after every cycle; one target forward per cycle for the whole batch."""

import pytest
import torch

from specpilot.drafting import SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.batch import BatchSession
from specpilot.drafting.batch_ar import autoregressive_generate_batch
from specpilot.drafting.cache import new_cache
from specpilot.drafting.cycle import Session, run_cycle
from specpilot.policies import FixedController
from specpilot.drafting import ModelPair
from tiny import noisy_copy, outputs_tv, target_law, tiny_model, tiny_pair

PROMPTS = [[7], [1, 2, 3, 4, 5], list(range(10, 43)), [9, 9]]
BUDGETS = [40, 25, 33, 12]  # ragged finishing by length (EOS ends some rows earlier)


@pytest.fixture(scope="module", params=[0.0, 0.3, 1.5], ids=["same", "close", "far"])
def pair_refs(request):
    pair = tiny_pair(noise=request.param)
    refs = [autoregressive_generate(pair, p, max_new_tokens=m) for p, m in zip(PROMPTS, BUDGETS)]
    return pair, refs


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("depth,size", [(0, 0), (1, 1), (2, 3), (4, 8),
                                        pytest.param(6, 40, marks=pytest.mark.slow)])
def test_batch_greedy_identical_to_autoregressive(pair_refs, width, depth, size):
    pair, refs = pair_refs
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=6, max_size=64))
    outs = decoder.generate_batch(PROMPTS, controller=FixedController(depth, size), max_new_tokens=BUDGETS)
    assert len(outs) == len(PROMPTS)
    for prompt, budget, out, ref in zip(PROMPTS, BUDGETS, outs, refs):
        assert out.tokens == ref.tokens, (prompt, width, depth, size)
        assert out.finished_by == ref.finished_by and out.prompt_len == len(prompt)
        assert sum(c.emitted for c in out.cycles) == len(out.tokens) == len(out.token_times)
        for c in out.cycles:
            assert c.depth == depth and 1 <= c.emitted <= c.accepted + 1 and c.accepted <= c.depth
        if depth and width == 2:  # the same tokens as this sequence's own single-sequence speculative generate
            single = decoder.generate(prompt, controller=FixedController(depth, size), max_new_tokens=budget)
            assert single.tokens == out.tokens


def test_ragged_finishing_by_eos():
    """A token that one sequence emits mid-way becomes EOS: that row stops there, the others go on exactly."""
    pair = tiny_pair(noise=0.3, eos=None)
    free = [autoregressive_generate(pair, p, max_new_tokens=30).tokens for p in PROMPTS]
    eos = free[1][7]
    pair.target.generation_config.eos_token_id = eos
    refs = [autoregressive_generate(pair, p, max_new_tokens=30) for p in PROMPTS]
    assert refs[1].finished_by == "eos" and len(refs[1].tokens) <= 8
    outs = SpeculativeDecoder(pair, TreeConfig(width=3, max_depth=8)).generate_batch(
        PROMPTS, controller=FixedController(5, 20), max_new_tokens=30)
    for out, ref in zip(outs, refs):
        assert out.tokens == ref.tokens and out.finished_by == ref.finished_by


@pytest.mark.parametrize("max_new_tokens", [1, 2, 17])
def test_max_new_tokens_is_exact_per_row(max_new_tokens):
    pair = tiny_pair(noise=0.0, eos=None)  # identical draft: every cycle would overshoot the budget
    outs = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=8)).generate_batch(
        PROMPTS, controller=FixedController(8, 16), max_new_tokens=max_new_tokens)
    for prompt, out in zip(PROMPTS, outs):
        assert out.tokens == autoregressive_generate(pair, prompt, max_new_tokens=max_new_tokens).tokens
        assert len(out.tokens) == max_new_tokens and out.finished_by == "length"


def _prefill_entries(model, tokens):
    cache = new_cache(model)
    if tokens:
        with torch.inference_mode():
            model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers if layer.keys is not None]


def _assert_cache(ragged, row, model, tokens):
    got, want = ragged.row_entries(row), _prefill_entries(model, tokens)
    if not tokens:
        assert all(k.shape[1] == 0 for k, _ in got)
        return
    for (k, v), (k_ref, v_ref) in zip(got, want):
        assert k.shape == k_ref.shape
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-4)


class _Alternate(FixedController):
    """Skips drafting every third cycle: the drafts fall behind by ragged amounts and catch up exactly."""

    def reset(self):
        self.turn = 0

    def skip_drafting(self, state):
        self.turn += 1
        return self.turn % 3 == 0


@pytest.mark.parametrize("width,depth,size", [(1, 4, 4), (3, 4, 12), (4, 3, 20)])
def test_caches_equal_fresh_prefill_after_each_cycle(width, depth, size):
    pair = tiny_pair(noise=0.3)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=6))
    session = BatchSession(decoder, PROMPTS, max_new_tokens=[30, 8, 30, 14])
    assert isinstance(session, Session)
    controller = _Alternate(depth, size)
    controller.reset()
    cycles = 0
    while not session.done:
        run_cycle(session, controller)
        cycles += 1
        for b, row in enumerate(session.active):
            _assert_cache(session.target, b, pair.target, row.committed[:-1])
            _assert_cache(session.draft, b, pair.draft, row.committed[: row.draft_committed])
    assert cycles > 3 and all(r.finished_by for r in session.rows)
    for prompt, out, budget in zip(PROMPTS, session.outputs(), [30, 8, 30, 14]):
        assert out.tokens == autoregressive_generate(pair, prompt, max_new_tokens=budget).tokens


@pytest.mark.parametrize("noise", [0.3])
def test_autoregressive_batch_equals_autoregressive(noise):
    """The target-only batched loop: each row equals its own autoregressive_generate (ragged prompts, budgets, EOS)."""
    pair = tiny_pair(noise=noise)
    outs = autoregressive_generate_batch(pair, PROMPTS, max_new_tokens=BUDGETS)
    for prompt, budget, out in zip(PROMPTS, BUDGETS, outs):
        ref = autoregressive_generate(pair, prompt, max_new_tokens=budget)
        assert out.tokens == ref.tokens and out.finished_by == ref.finished_by
        assert len(out.token_times) == len(out.tokens)


def test_one_target_forward_per_cycle():
    """The whole batch is verified in one target forward per cycle (plus one prefill forward)."""
    pair = tiny_pair(noise=0.3, eos=None)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4))
    calls = []
    handle = pair.target.register_forward_hook(lambda module, args, kwargs_out: calls.append(1))
    try:
        outs = decoder.generate_batch(PROMPTS, controller=FixedController(3, 6), max_new_tokens=10)
    finally:
        handle.remove()
    assert len(calls) == 1 + max(len(o.cycles) for o in outs)


def test_batch_of_one_equals_generate():
    pair = tiny_pair(noise=0.3)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4))
    single = decoder.generate([1, 2, 3], controller=FixedController(3, 6), max_new_tokens=20)
    (batched,) = decoder.generate_batch([[1, 2, 3]], controller=FixedController(3, 6), max_new_tokens=20)
    assert batched.tokens == single.tokens
    assert [(c.depth, c.size, c.accepted, c.emitted) for c in batched.cycles] == \
        [(c.depth, c.size, c.accepted, c.emitted) for c in single.cycles]


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.5}, "temperature"),
    ({"max_new_tokens": [5, 5]}, "2 entries for 4 prompts"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_bad_batch_arguments_raise(kwargs, match):
    decoder = SpeculativeDecoder(tiny_pair(noise=0.3), TreeConfig(width=2, max_depth=4))
    with pytest.raises(ValueError, match=match):
        decoder.generate_batch(PROMPTS, **kwargs)


@pytest.mark.parametrize("prompts", [[], [[1, 2], []]])
def test_empty_prompts_raise(prompts):
    decoder = SpeculativeDecoder(tiny_pair(noise=0.3), TreeConfig(width=2, max_depth=4))
    with pytest.raises(ValueError, match="empty"):
        decoder.generate_batch(prompts)


@pytest.mark.parametrize("width,depth,size,sampling,alternate,max_batch", [
    (1, 3, 3, (1.0, 0, 1.0), False, None),    # a chain
    (3, 3, 12, (0.7, 4, 0.9), True, None),    # a tree, temperature, top-k and top-p, plain sampled steps interleaved
    (3, 3, 12, (0.7, 4, 0.9), True, 257),     # the same through a prompt queue (rows refilled as they finish)
])
def test_sampled_law_per_sequence(width, depth, size, sampling, alternate, max_batch):
    """At temperature > 0 each row follows the target's law: two ragged prompts alternate over the batch rows, each
    row's 2-token continuation is counted against its own prompt's enumerated law (TV with a concentration bound,
    as tiny.sampled_tv)."""
    target = tiny_model(vocab=6, hidden=16, layers=1, eos=None, sharpness=4.0, seed=3)
    pair = ModelPair(target, noisy_copy(target, 2.0, seed=4))  # a poor draft: many rejections
    assert_batch_follows_law(pair, TreeConfig(width=width, max_depth=depth, max_size=size), sampling,
                             _Alternate(depth, size) if alternate else FixedController(depth, size), max_batch, seed=7)


def assert_batch_follows_law(pair, tree: TreeConfig, sampling, controller, max_batch, *, seed: int) -> None:
    """Two ragged prompts alternate over 3000 batch rows; each row's 2-token continuation is counted against its own
    prompt's enumerated law under `sampling` (tiny vocabularies only)."""
    prompts, steps, n = [[1, 2], [4, 3, 5, 1, 1]], 2, 1500
    laws = [target_law(pair.target, p, steps, sampling) for p in prompts]
    temperature, top_k, top_p = sampling
    outs = SpeculativeDecoder(pair, tree).generate_batch(
        [prompts[i % 2] for i in range(2 * n)], controller=controller, max_new_tokens=steps, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed, max_batch=max_batch)
    for k, law in enumerate(laws):
        tv, bound = outputs_tv(outs[k::2], law)
        assert tv < bound, (k, tv)


@pytest.mark.parametrize("sampling", [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_sampled_autoregressive_batch_law_per_sequence(sampling):
    """Batched AR at temperature > 0 with per-sequence seeds (the batched evaluation's baseline) follows the
    target's law per row: two ragged prompts alternating over the rows, each row's 2-token continuation counted
    against its own prompt's enumerated law (TV with a concentration bound, as above)."""
    target = tiny_model(vocab=6, hidden=16, layers=1, eos=None, sharpness=4.0, seed=3)
    pair = ModelPair(target, noisy_copy(target, 2.0, seed=4))
    prompts, steps, n = [[1, 2], [4, 3, 5, 1, 1]], 2, 1500
    laws = [target_law(target, p, steps, sampling) for p in prompts]
    temperature, top_k, top_p = sampling
    outs = autoregressive_generate_batch(pair, [prompts[i % 2] for i in range(2 * n)], max_new_tokens=steps,
                                         temperature=temperature, top_k=top_k, top_p=top_p,
                                         seed=[1000 + i for i in range(2 * n)])
    for k, law in enumerate(laws):
        tv, bound = outputs_tv(outs[k::2], law)
        assert tv < bound, (k, tv)


@pytest.mark.parametrize("method", ["ar", "speculative"])
def test_per_sequence_seeds_do_not_depend_on_batchmates(method):
    """seed=[one per prompt]: a sequence draws from its own generator, so its sampled output is the same whatever
    the other rows of its batch are (and an int seed still reproduces the whole batch)."""
    pair = tiny_pair(noise=0.3)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=3, max_size=6))

    def run(prompts, seed):
        if method == "ar":
            return autoregressive_generate_batch(pair, prompts, max_new_tokens=12, temperature=0.9, seed=seed)
        return decoder.generate_batch(prompts, controller=FixedController(2, 4), max_new_tokens=12,
                                      temperature=0.9, seed=seed)

    a = run([PROMPTS[0], PROMPTS[1], PROMPTS[3]], [11, 12, 13])
    b = run([PROMPTS[2], PROMPTS[1]], [99, 12])
    assert a[1].tokens == b[1].tokens
    assert [o.tokens for o in run(PROMPTS, 5)] == [o.tokens for o in run(PROMPTS, 5)]


@pytest.mark.parametrize("prompts,max_new_tokens,error,match", [
    ({(1, 2), (3,)}, 4, TypeError, "list or tuple \\(outputs come back in its order\\), got a set"),
    ([[1, 2], []], 4, ValueError, "prompt 1 of 2: the prompt is empty"),
    ([[1, 2], [3, 1.5]], 4, TypeError, "prompt 1 of 2: prompt token id at position 1"),
    ([[1, 2], [3]], [4, 0], ValueError, "prompt 1 of 2: max_new_tokens must be an integer >= 1"),
    ([[1, 2], [3] * 600], 4, ValueError, "prompt 1 of 2: prompt of 600 tokens"),
])
def test_a_bad_prompt_in_a_batch_is_named(prompts, max_new_tokens, error, match):
    pair = tiny_pair(noise=0.3)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4))
    with pytest.raises(error, match=match):
        decoder.generate_batch(prompts, max_new_tokens=max_new_tokens)
    with pytest.raises(error, match=match):
        autoregressive_generate_batch(pair, prompts, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("temperature", [1.0, 0.0])   # checked greedy too, where no seed is drawn from
@pytest.mark.parametrize("seed,match", [([1, 2], "2 per-sequence seeds for 4 prompts"), ([1, 2, 3, 1.5], "seed"),
                                        ("x", "seed must be an integer"), (2 ** 70, "seed must be an integer in"),
                                        ([1, 2, 3, 2 ** 64], "seed must be an integer in")])
def test_bad_per_sequence_seeds_raise(seed, match, temperature):
    decoder = SpeculativeDecoder(tiny_pair(noise=0.3), TreeConfig(width=2, max_depth=4))
    with pytest.raises((TypeError, ValueError), match=match):
        decoder.generate_batch(PROMPTS, temperature=temperature, seed=seed)
    with pytest.raises((TypeError, ValueError), match=match):
        autoregressive_generate_batch(decoder.pair, PROMPTS, temperature=temperature, seed=seed)
    if not isinstance(seed, list):
        with pytest.raises((TypeError, ValueError), match=match):
            decoder.generate(PROMPTS[0], temperature=temperature, seed=seed)


def test_seeds_at_torch_range_ends_are_taken():
    decoder = SpeculativeDecoder(tiny_pair(noise=0.3), TreeConfig(width=2, max_depth=4))
    outs = decoder.generate_batch(PROMPTS[:2], temperature=1.0, seed=[-2 ** 63, 2 ** 64 - 1], max_new_tokens=3)
    assert [len(o.tokens) for o in outs] == [3, 3]


def assert_depth0_is_batched_ar(pair, drafter, prompts=PROMPTS, budgets=BUDGETS) -> None:
    """"Don't speculate" through generate_batch costs what batched AR costs: `drafter` (the draft LM or the head)
    never runs (its prefill waits for the first cycle that drafts) and the target runs exactly the forwards
    autoregressive_generate_batch runs, with the same shapes, and the outputs are equal."""
    drafter_calls, target_shapes = [], []
    hooks = [drafter.register_forward_hook(lambda module, args, out: drafter_calls.append(1)),
             pair.target.register_forward_hook(
                 lambda module, args, kwargs, out: target_shapes.append(tuple(kwargs["input_ids"].shape)),
                 with_kwargs=True)]
    try:
        outs = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4)).generate_batch(
            prompts, controller=FixedController(0, 0), max_new_tokens=budgets)
        batch_shapes, target_shapes[:] = list(target_shapes), []
        refs = autoregressive_generate_batch(pair, prompts, max_new_tokens=budgets)
    finally:
        for h in hooks:
            h.remove()
    assert drafter_calls == [] and batch_shapes == target_shapes
    assert [o.tokens for o in outs] == [r.tokens for r in refs]


def test_depth0_batch_is_batched_ar_op_for_op():
    pair = tiny_pair(noise=0.3)
    assert_depth0_is_batched_ar(pair, pair.draft)


def test_draft_prefill_deferred_to_first_drafting_cycle():
    """Plain cycles first, drafting later: the first drafting cycle's catch-up feed prefills the draft exactly."""
    pair = tiny_pair(noise=0.3)

    class Late(FixedController):
        def reset(self):
            self.turn = 0

        def skip_drafting(self, state):
            self.turn += 1
            return self.turn <= 3

    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4))
    eager = BatchSession(decoder, PROMPTS, max_new_tokens=BUDGETS)
    eager.prefill_draft()  # the eager form (envs/profile.py): committed[:-1] cached, as a fresh prefill
    for b, row in enumerate(eager.active):
        assert row.draft_committed == len(row.committed) - 1
        _assert_cache(eager.draft, b, pair.draft, row.committed[:-1])
    session = BatchSession(decoder, PROMPTS, max_new_tokens=BUDGETS)
    assert session.draft.length == 0
    controller = Late(3, 6)
    controller.reset()
    while not session.done:
        run_cycle(session, controller)
        for b, row in enumerate(session.active):
            _assert_cache(session.draft, b, pair.draft, row.committed[: row.draft_committed])
    for prompt, budget, out in zip(PROMPTS, BUDGETS, session.outputs()):
        assert out.tokens == autoregressive_generate(pair, prompt, max_new_tokens=budget).tokens


QUEUE = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [11], list(range(50, 62)), [2, 7, 1, 8]]
QUEUE_BUDGETS = [40, 3, 25, 12, 7, 30, 1, 18]  # ragged: rows finish at different cycles and are refilled


@pytest.mark.parametrize("max_batch", [1, 2, 3])
@pytest.mark.parametrize("depth,size,alternate", [(0, 0, False), (3, 6, False), (4, 10, True)])
def test_continuous_batching_refills_exactly(max_batch, depth, size, alternate):
    """A prompt queue decoded max_batch at a time, finished rows refilled: every prompt's output (in prompt order)
    equals its own target greedy output, and the batch stays full while the queue lasts."""
    pair = tiny_pair(noise=0.3)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=6))
    session = BatchSession(decoder, QUEUE, max_new_tokens=QUEUE_BUDGETS, max_batch=max_batch)
    controller = _Alternate(depth, size) if alternate else FixedController(depth, size)
    controller.reset()
    while not session.done:
        assert len(session.active) == max_batch or not session.queue
        run_cycle(session, controller)
        for b, row in enumerate(session.active):
            _assert_cache(session.target, b, pair.target, row.committed[:-1])
            _assert_cache(session.draft, b, pair.draft, row.committed[: row.draft_committed])
    outs = session.outputs()
    for prompt, budget, out in zip(QUEUE, QUEUE_BUDGETS, outs):
        ref = autoregressive_generate(pair, prompt, max_new_tokens=budget)
        assert out.tokens == ref.tokens and out.finished_by == ref.finished_by and out.prompt_len == len(prompt)
        assert len(out.token_times) == len(out.tokens) and sum(c.emitted for c in out.cycles) == len(out.tokens)
    via_api = decoder.generate_batch(QUEUE, controller=FixedController(depth, size), max_new_tokens=QUEUE_BUDGETS,
                                     max_batch=max_batch)
    assert [o.tokens for o in via_api] == [o.tokens for o in outs] or alternate
    ar = autoregressive_generate_batch(pair, QUEUE, max_new_tokens=QUEUE_BUDGETS, max_batch=max_batch)
    assert [o.tokens for o in ar] == [o.tokens for o in outs]


def test_bad_max_batch_raises():
    decoder = SpeculativeDecoder(tiny_pair(noise=0.3), TreeConfig(width=2, max_depth=4))
    with pytest.raises(ValueError, match="max_batch"):
        decoder.generate_batch(PROMPTS, max_batch=0)


def test_compact_keeps_every_row_exact():
    """RaggedCache.compact moves each row's entries to the front (holes dropped): the rows still equal a fresh
    prefill, and decoding goes on exactly."""
    pair = tiny_pair(noise=0.3)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4))
    session = BatchSession(decoder, PROMPTS, max_new_tokens=BUDGETS)
    controller = FixedController(3, 6)
    controller.reset()
    compacted = 0
    while not session.done:
        run_cycle(session, controller)
        compacted += session.target.compact(min_holes=0.0) + session.draft.compact(min_holes=0.0)
        for b, row in enumerate(session.active):
            assert int(session.target.valid[b].sum()) == len(row.committed) - 1
            _assert_cache(session.target, b, pair.target, row.committed[:-1])
            _assert_cache(session.draft, b, pair.draft, row.committed[: row.draft_committed])
    assert compacted
    for prompt, budget, out in zip(PROMPTS, BUDGETS, session.outputs()):
        assert out.tokens == autoregressive_generate(pair, prompt, max_new_tokens=budget).tokens
