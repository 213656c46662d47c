"""Batched decoding with an EAGLE-3 head (drafting/batch.py): every sequence's greedy output equals its own
target-only greedy output over tree shapes, ragged prompts, ragged finishing and refills; every row's target and head
caches (and its cycles) equal a single-sequence session's driven with the same decisions, after every cycle; the
sampled law per sequence; deferred head prefill; the embedded default pair decodes batched."""

import pytest
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.batch import BatchSession
from specpilot.drafting.batch_ar import autoregressive_generate_batch
from specpilot.drafting.cycle import run_cycle
from specpilot.policies import FixedController
from test_batch_decoding import _Alternate, _assert_cache, assert_batch_follows_law, assert_depth0_is_batched_ar
from test_eagle_decoder import random_head
from tiny import tiny_model

PROMPTS = [[7], [1, 2, 3, 4, 5], list(range(1, 12)) * 3, [9, 9]]
BUDGETS = [40, 25, 33, 12]
LONG = [[7, 3], [1, 2, 3, 4, 5], list(range(1, 12)) * 3, [5, 6]]  # no one-token prompt: every cycle drafts


def eagle_pair(seed: int, eos: int | None = None) -> ModelPair:
    """A small-vocabulary target and a random head that agrees with it often enough for ragged acceptance."""
    target = tiny_model(vocab=16, hidden=32, layers=4, eos=eos, seed=seed, sharpness=2.0)
    return ModelPair(target, eagle=random_head(target, draft_vocab=8, sharpness=2.0, seed=seed))


@pytest.fixture(scope="module", params=[5, 0], ids=["seed5", "seed0"])
def pair_refs(request):
    pair = eagle_pair(request.param, eos=13)
    refs = [autoregressive_generate(pair, p, max_new_tokens=m) for p, m in zip(PROMPTS, BUDGETS)]
    return pair, refs


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("depth,size", [(0, 0), (1, 1), (2, 3), (4, 8), pytest.param(6, 40, marks=pytest.mark.slow)])
def test_batch_greedy_identical_to_autoregressive(pair_refs, width, depth, size):
    pair, refs = pair_refs
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=6, max_size=64))
    outs = decoder.generate_batch(PROMPTS, controller=FixedController(depth, size), max_new_tokens=BUDGETS)
    for prompt, out, ref in zip(PROMPTS, outs, refs):
        assert out.tokens == ref.tokens, (prompt, width, depth, size)
        assert out.finished_by == ref.finished_by and out.prompt_len == len(prompt)
        assert sum(c.emitted for c in out.cycles) == len(out.tokens) == len(out.token_times)
        for c in out.cycles[1:]:  # the first cycle is a plain step (the one-token prompt has no feature yet)
            assert c.depth == depth and 1 <= c.emitted <= c.accepted + 1 and c.accepted <= c.depth
    assert outs[0].cycles[0].depth == 0


def _single_head_entries(session):
    return [(layer.keys[0], layer.values[0]) for layer in session.drafter.cache.layers if layer.keys is not None]


def _single_target_entries(session):
    return [(layer.keys[0], layer.values[0]) for layer in session.target_cache.layers if layer.keys is not None]


def _assert_same(got, want):
    assert len(got) == len(want)
    for (k, v), (k_ref, v_ref) in zip(got, want):
        assert k.shape == k_ref.shape
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", [5, 0])
@pytest.mark.parametrize("width,depth,size", [(1, 4, 4), (3, 4, 12), (4, 3, 20)])
def test_caches_and_cycles_equal_single_sessions_after_every_cycle(seed, width, depth, size):
    """The batch and one DecodingSession per prompt, driven with the same decisions (every third cycle a plain step,
    so the heads fall behind by ragged amounts and catch up): after every cycle each row's committed tokens, cycle
    record, target cache and head cache (hole-stripped) equal its own session's."""
    pair = eagle_pair(seed, eos=13)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=6))
    budgets = [30, 8, 30, 14]
    batch = BatchSession(decoder, LONG, max_new_tokens=budgets)
    batch.prefill_draft()  # the single sessions prefill their heads eagerly
    singles = [decoder.start(p, max_new_tokens=m) for p, m in zip(LONG, budgets)]
    controllers = [_Alternate(depth, size) for _ in range(len(LONG) + 1)]
    for c in controllers:
        c.reset()
    rows = list(batch.rows)
    cycles = 0
    while not batch.done:
        run_cycle(batch, controllers[-1])
        for session, controller in zip(singles, controllers):
            if not session.done:
                run_cycle(session, controller)
        cycles += 1
        for row, session in zip(rows, singles):
            assert row.committed == session.committed
            c, s = row.cycles[-1], session.cycles[-1]
            assert (c.depth, c.size, c.accepted, c.emitted, c.fed) == (s.depth, s.size, s.accepted, s.emitted, s.fed)
        for b, row in enumerate(batch.active):
            session = singles[row.index]
            _assert_same(batch.target.row_entries(b), _single_target_entries(session))
            assert row.draft_committed == session.drafter.committed
            _assert_same(batch.draft.row_entries(b), _single_head_entries(session))
    assert cycles > 3 and any(c.accepted for r in rows for c in r.cycles)
    assert len({sum(c.accepted for c in r.cycles[:6]) for r in rows}) > 1  # acceptance was ragged across rows


def _fresh_head_entries(pair, tokens):
    """The head's entries after a fresh prefill of `tokens`: (feature of c_{m-1}, c_m) at position m - 1."""
    head = pair.eagle
    if len(tokens) < 2:
        return []
    cache = head.new_cache()
    with torch.inference_mode():
        hidden_states = pair.target(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
        n = len(tokens) - 1
        head(torch.tensor([tokens[1:]]), head.fuse(hidden_states)[:, :n], position_ids=torch.arange(n)[None],
             cache=cache)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


QUEUE = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [11], list(range(2, 14)), [2, 7, 1, 8]]
QUEUE_BUDGETS = [40, 3, 25, 12, 7, 30, 1, 18]


@pytest.mark.parametrize("max_batch", [1, 3])
@pytest.mark.parametrize("depth,size,alternate", [(0, 0, False), (3, 6, False), (4, 10, True)])
def test_continuous_batching_and_deferred_prefill_exact(max_batch, depth, size, alternate):
    """A prompt queue (one-token prompts included) decoded max_batch at a time, the head's prefill deferred to the
    first drafting cycle and newcomers' heads prefilled on admission: every output equals its own target greedy
    output and every row's head holds exactly a fresh prefill of what it has accounted for, after every cycle."""
    pair = eagle_pair(5, eos=13)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=6))
    session = BatchSession(decoder, QUEUE, max_new_tokens=QUEUE_BUDGETS, max_batch=max_batch)
    assert session.draft.length == 0
    controller = _Alternate(depth, size) if alternate else FixedController(depth, size)
    controller.reset()
    while not session.done:
        assert len(session.active) == max_batch or not session.queue
        run_cycle(session, controller)
        for b, row in enumerate(session.active):
            _assert_cache(session.target, b, pair.target, row.committed[:-1])
            _assert_same(session.draft.row_entries(b) if row.draft_committed > 1 else [],
                         _fresh_head_entries(pair, row.committed[: row.draft_committed]))
    for prompt, budget, out in zip(QUEUE, QUEUE_BUDGETS, session.outputs()):
        ref = autoregressive_generate(pair, prompt, max_new_tokens=budget)
        assert out.tokens == ref.tokens and out.finished_by == ref.finished_by
    if depth == 0:
        assert session.draft.length == 0  # "don't speculate" never ran the head


def test_depth0_batch_is_batched_ar_op_for_op():
    """Depth 0 with a head: the head never runs and the target runs exactly batched AR's forwards."""
    pair = eagle_pair(5, eos=13)
    assert_depth0_is_batched_ar(pair, pair.eagle, PROMPTS, BUDGETS)


def test_batch_of_one_equals_generate():
    pair = eagle_pair(5)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4))
    for prompt in ([9], [1, 2, 3]):
        single = decoder.generate(prompt, controller=FixedController(3, 6), max_new_tokens=20)
        (batched,) = decoder.generate_batch([prompt], controller=FixedController(3, 6), max_new_tokens=20)
        assert batched.tokens == single.tokens
        assert [(c.depth, c.size, c.accepted, c.emitted) for c in batched.cycles] == \
            [(c.depth, c.size, c.accepted, c.emitted) for c in single.cycles]


@pytest.mark.parametrize("width,depth,size,sampling,alternate,max_batch", [
    (1, 3, 3, (1.0, 0, 1.0), False, None),    # a chain
    (3, 3, 12, (0.7, 4, 0.9), True, 257),     # a tree, top-k / top-p, plain steps interleaved, a prompt queue
])
def test_sampled_law_per_sequence(width, depth, size, sampling, alternate, max_batch):
    """At temperature > 0 each row follows the target's law (two ragged prompts alternating over the rows, each
    row's 2-token continuation counted against its own prompt's enumerated law; TV bound as tiny.sampled_tv)."""
    target = tiny_model(vocab=6, hidden=16, layers=4, eos=None, sharpness=4.0, seed=3)
    pair = ModelPair(target, eagle=random_head(target, draft_vocab=4, seed=5))
    assert_batch_follows_law(pair, TreeConfig(width=width, max_depth=depth, max_size=size), sampling,
                             _Alternate(depth, size) if alternate else FixedController(depth, size), max_batch, seed=11)


def test_embedded_default_pair_decodes_batched():
    """The package's main configuration (the embedded target + its EAGLE-3 head) through generate_batch."""
    pair = ModelPair.from_pretrained(device="cpu")
    assert pair.drafter_kind == "eagle3"
    prompts = ["def add(a, b):\n    return", "import os\n", "class Stack:\n    def push(self, x):\n"]
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4, max_size=16))
    outs = decoder.generate_batch(prompts, controller=FixedController(2, 4), max_new_tokens=[12, 6, 9])
    refs = autoregressive_generate_batch(pair, prompts, max_new_tokens=[12, 6, 9])
    assert [o.tokens for o in outs] == [r.tokens for r in refs]
    assert any(c.accepted for o in outs for c in o.cycles)


def test_evaluate_batches_with_a_head():
    """`eval --batch-sizes` (evaluate_batches) measures an EAGLE-3 pair: every method's rows equal batched AR's."""
    from specpilot.eval.batched import evaluate_batches
    from specpilot.policies import BatchTableController

    result = evaluate_batches(PROMPTS, pair=eagle_pair(5, eos=13), batch_sizes=[1, 4],
                              tree=TreeConfig(width=2, max_depth=4, max_size=16), methods=["fixed"],
                              max_new_tokens=8, warmup=0,
                              controllers={"table": BatchTableController({1: (3, 6), 4: (0, 0)})})
    for section in result["batch_sizes"]:
        rows = {r["method"]: r for r in section["methods"]}
        assert set(rows) == {"ar", "fixed", "table"} and all(r["identical_to_ar"] for r in rows.values())


def test_batch_replay_and_batch_profile_with_a_head():
    """Batch replay of an EAGLE-3 pair's single-sequence traces takes the live batched decoder's decisions and each
    row accepts the same lengths (a one-token prompt included: both start with a plain step); the batched latency
    profile measures with the head."""
    from specpilot.envs.profile import collect_batch_samples
    from specpilot.envs.record import record_trace
    from test_batch_replay import TREE, assert_batch_replay_is_live

    pair = eagle_pair(5)
    prompts = [[7], [1, 2, 3, 4, 5], [3, 1, 4, 1, 5, 9], [9, 9]]
    trace = record_trace(pair, TREE, prompts, max_new_tokens=10)
    assert_batch_replay_is_live(pair, prompts, trace)
    samples = collect_batch_samples(pair, TREE, prompts[1:], [1, 2], max_new_tokens=8, rng=0, warmup_cycles=1)
    assert set(samples) == {1, 2} and all(s.verify for s in samples.values())


def test_a_head_drafts_shallower_where_the_context_ends():
    """An EAGLE-3 head, single and batched, on requests that fill a 32-position context: exact, and no cycle drafts
    past the window (`DecodingSession.max_depth` / `BatchSession.max_depth`)."""
    context, new = 32, 6
    target = tiny_model(vocab=16, hidden=32, layers=4, eos=None, seed=5, sharpness=2.0, context=context)
    pair = ModelPair(target, eagle=random_head(target, draft_vocab=8, sharpness=2.0, seed=5))
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=8, max_size=16))
    prompts = [(list(range(1, 16)) * 2)[: context + 1 - new], [3, 4, 5, 6] * 4]
    refs = [autoregressive_generate(pair, p, max_new_tokens=new).tokens for p in prompts]
    outs = [decoder.generate(p, controller=FixedController(8, 16), max_new_tokens=new) for p in prompts]
    outs += decoder.generate_batch(prompts, controller=FixedController(8, 16), max_new_tokens=new)
    assert [o.tokens for o in outs] == refs + refs
    for out in outs:
        assert all(c.context_len + c.depth <= context for c in out.cycles)
    assert outs[0].cycles[-1].depth < 8  # the full prompt's last cycles were cut by the window
