"""Decoding with an EAGLE-3 head: greedy output identical to the target's, caches equal a fresh prefill after every
cycle, the sampled law, and loading a head saved in the released layout through ModelPair."""
from __future__ import annotations


import pytest
import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.cache import new_cache
from specpilot.drafting.cycle import run_cycle
from specpilot.drafting.eagle import Eagle3Config, Eagle3Head, WEIGHT_FILES
from specpilot.policies import FixedController
from tiny import sampled_tv, target_law, tiny_model

VOCAB, HIDDEN, LAYERS = 96, 32, 4
PROMPTS = [[7], [1, 2, 3, 4, 5], list(range(10, 43))]


def random_head(target, draft_vocab: int = 48, seed: int = 0, sharpness: float = 3.0) -> Eagle3Head:
    """A random head with a reduced vocabulary (evenly spaced target ids) and peaked outputs."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=draft_vocab), target)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(sharpness)
    head.set_draft_vocab(torch.arange(draft_vocab) * (target.config.vocab_size // draft_vocab))
    return head.eval()


@pytest.fixture(scope="module", params=[0, 1], ids=["head0", "head1"])
def pair(request):
    target = tiny_model(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, seed=request.param)
    return ModelPair(target, eagle=random_head(target, seed=request.param))


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("depth,size", [(1, 1), (2, 3), (4, 8), (6, 40)])
def test_greedy_identical_to_target_alone(pair, width, depth, size):
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=6, max_size=64))
    for prompt in PROMPTS:
        ref = autoregressive_generate(pair, prompt, max_new_tokens=30)
        out = decoder.generate(prompt, controller=FixedController(depth, size), max_new_tokens=30)
        assert out.tokens == ref.tokens, (prompt, width, depth, size)
        assert out.finished_by == ref.finished_by
        for c in out.cycles:
            assert 1 <= c.emitted <= c.accepted + 1 and c.accepted <= c.depth


def _fresh_target_keys(pair, tokens):
    cache = new_cache(pair.target)
    with torch.inference_mode():
        out = pair.target(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True, output_hidden_states=True)
    return [layer.keys.clone() for layer in cache.layers], out.hidden_states


def _fresh_head_keys(pair, tokens, hidden_states):
    """The head's cache after feeding entries (feature of c_{m-1}, c_m) for m = 1..len(tokens)-1."""
    head = pair.eagle
    cache = head.new_cache()
    n = len(tokens) - 1
    with torch.inference_mode():
        feats = head.fuse(hidden_states)[:, :n]
        head(torch.tensor([tokens[1:]]), feats, position_ids=torch.arange(n)[None], cache=cache)
    return [layer.keys.clone() for layer in cache.layers]


def test_caches_equal_a_fresh_prefill_after_every_cycle(pair):
    decoder = SpeculativeDecoder(pair, TreeConfig(width=3, max_depth=5, max_size=20))
    session = decoder.start([3, 1, 4, 1, 5], max_new_tokens=30)
    cycles = 0
    while not session.done:
        run_cycle(session, FixedController(4, 9))
        committed = session.committed
        # the target holds committed[:-1]; the head holds one entry per committed token after the first up to
        # the last token it was fed (it catches up on the emitted ones in the next cycle's first forward)
        target_keys, hidden_states = _fresh_target_keys(pair, committed[:-1])
        for got, want in zip(session.target_cache.layers, target_keys):
            torch.testing.assert_close(got.keys, want, atol=1e-5, rtol=1e-4)
        fed = session.drafter.committed
        head_keys = _fresh_head_keys(pair, committed[:fed], hidden_states)
        for got, want in zip(session.drafter.cache.layers, head_keys):
            torch.testing.assert_close(got.keys, want, atol=1e-5, rtol=1e-4)
        cycles += 1
    assert cycles > 3


def test_single_token_prompt_starts_with_a_plain_step(pair):
    out = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=3)).generate([9], controller=FixedController(3, 6),
                                                                           max_new_tokens=8)
    assert out.cycles[0].depth == 0 and all(c.depth == 3 for c in out.cycles[1:])
    assert out.tokens == autoregressive_generate(pair, [9], max_new_tokens=8).tokens


# the chain (width 1) runs the same acceptance code as the tree with one child per node; the draft-LM chain has
# its own default-run law test (test_sampling_law.py), so this one's chain case runs with -m slow
@pytest.mark.heavy
@pytest.mark.parametrize("width", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_sampled_output_follows_the_target_law(width):
    vocab, steps, n = 6, 2, 2000
    target = tiny_model(vocab=vocab, hidden=16, layers=4, eos=None, sharpness=4.0, seed=3)
    pair = ModelPair(target, eagle=random_head(target, draft_vocab=4, seed=5))
    prompt, sampling = [1, 2], (1.0, 0, 1.0)
    law = target_law(target, prompt, steps, sampling)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=3, max_size=12))
    tv, bound = sampled_tv(decoder, prompt, law, FixedController(3, 12), sampling, n)
    assert tv < bound, (width, tv)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_model_pair_loads_a_released_head(tmp_path, fmt):
    target = tiny_model(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, seed=2)
    target.save_pretrained(tmp_path / "target")
    head = random_head(target, seed=2)
    head.save_pretrained(tmp_path / "head", format=fmt)
    assert (tmp_path / "head" / WEIGHT_FILES[fmt]).exists() and (tmp_path / "head" / "config.json").exists()
    pair = ModelPair.from_pretrained(tmp_path / "target", eagle=tmp_path / "head", device="cpu")
    assert pair.drafter_kind == "eagle3" and pair.draft is None
    assert pair.identity()["drafter"] == "eagle3"
    in_memory = ModelPair(target, eagle=head)
    prompt = [4, 8, 15, 16, 23]
    tree = TreeConfig(width=4, max_depth=4, max_size=16)
    a = SpeculativeDecoder(pair, tree).generate(prompt, controller=FixedController(4, 16), max_new_tokens=20)
    b = SpeculativeDecoder(in_memory, tree).generate(prompt, controller=FixedController(4, 16), max_new_tokens=20)
    assert a.tokens == b.tokens and [c.accepted for c in a.cycles] == [c.accepted for c in b.cycles]


def test_model_pair_refuses_two_drafters_and_a_missing_path(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        ModelPair.from_pretrained(tmp_path, draft=tmp_path, eagle=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelPair.from_pretrained(tmp_path / "nowhere" / "target", eagle=tmp_path / "head")


def test_recorded_trace_replays_the_live_cycles(pair, tmp_path):
    """Recording drives the same drafter with the target's features: replayed cycles equal live ones."""
    from specpilot.envs.oracle import replay_controller
    from specpilot.envs.profile import LatencyProfile
    from specpilot.envs.record import record_trace

    tree = TreeConfig(width=3, max_depth=4, max_size=16)
    prompts = [[5], [3, 1, 4, 1, 5, 9], list(range(20, 31))]
    trace = record_trace(pair, tree, prompts, max_new_tokens=24)
    assert trace.header["pair"]["drafter"] == "eagle3"
    verify = [(v, c, 1e-3 * (1 + v)) for v in range(0, 17) for c in (5, 40)]
    profile = LatencyProfile.from_samples({n: [1e-3] for n in range(1, 6)}, {2: [1e-3], 3: [1e-3], 4: [1e-3]},
                                          verify, max_depth=4, width=3)

    class Tally(FixedController):
        def reset(self):
            super().reset()

        def observe(self, record):
            self.seen.append((record.depth, record.size, record.accepted, record.emitted))

    decoder = SpeculativeDecoder(pair, tree)
    for depth, size in ((2, 4), (4, 16)):
        live, replay = Tally(depth, size), Tally(depth, size)
        live.seen, replay.seen = [], []
        for prompt in prompts:
            decoder.generate(prompt, controller=live, max_new_tokens=24)
        replay_controller(trace, profile, replay)
        assert live.seen == replay.seen
