"""A controller that never drafts (depth 0: speculation switched off) gets a target-only session
(`Controller.may_draft`, `SpeculativeDecoder.start(drafting=False)`): no drafter prefill, no EAGLE features, every
cycle a plain step, the tokens of target-only decoding (greedy and sampled with the same seed); in a batch too."""
import pytest

from specpilot.drafting import SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.control import DecisionLog, FixedController, as_controller
from specpilot.drafting.cycle import run_generation
from specpilot.drafting.eagle import Eagle3Config, Eagle3Head
from specpilot.drafting.pair import ModelPair
from specpilot.drafting.tree import TreeDrafter

from tiny import tiny_model, tiny_pair

TREE = TreeConfig(width=2, max_depth=4, max_size=8)
PROMPT = [5, 17, 33, 2, 41, 7, 19, 60]


def _eagle_pair() -> ModelPair:
    target = tiny_model(vocab=96, eos=None, layers=4, seed=0)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=96), target).eval()
    return ModelPair(target, eagle=head)


PAIRS = {"draft_lm": lambda: tiny_pair(noise=0.3, eos=None), "eagle3": _eagle_pair}


@pytest.mark.parametrize("kind", list(PAIRS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_steps_never_touch_the_drafter_and_equal_target_only_decoding(kind, temperature, monkeypatch):
    pair = PAIRS[kind]()
    fed = []
    original = TreeDrafter.feed
    monkeypatch.setattr(TreeDrafter, "feed", lambda self, tokens, *a, **k: fed.append(len(tokens)) or
                        original(self, tokens, *a, **k))
    out = SpeculativeDecoder(pair, TREE).generate(PROMPT, controller=FixedController(0, 0), max_new_tokens=12,
                                                  temperature=temperature, seed=3)
    ar = autoregressive_generate(pair, PROMPT, max_new_tokens=12, temperature=temperature, seed=3)
    assert fed == [] and out.tokens == ar.tokens and all(c.depth == 0 for c in out.cycles)


@pytest.mark.parametrize("kind", list(PAIRS))
@pytest.mark.parametrize("config", [(1, 1), (3, 6)])
def test_a_target_only_session_takes_plain_steps_whatever_the_controller_asks(kind, config):
    pair = PAIRS[kind]()
    session = SpeculativeDecoder(pair, TREE).start(PROMPT, max_new_tokens=16, drafting=False)
    assert not session.can_draft and session.drafter.committed == 0 and not session.needs_features
    with pytest.raises(RuntimeError, match="drafting=False"):
        session.draft_level()
    run_generation(session, FixedController(*config))
    out = session.output()
    assert out.tokens == autoregressive_generate(pair, PROMPT, max_new_tokens=16).tokens
    assert {c.depth for c in out.cycles} == {0} and session.drafter.committed == 0


@pytest.mark.parametrize("kind", list(PAIRS))
@pytest.mark.parametrize("config", [(0, 0), (1, 1), (3, 6)])
def test_drafting_configs_still_prefill_the_drafter(kind, config):
    pair = PAIRS[kind]()
    session = SpeculativeDecoder(pair, TREE).start(PROMPT, max_new_tokens=16)
    assert session.drafter.committed == len(PROMPT) - 1 and session.can_draft
    out = SpeculativeDecoder(pair, TREE).generate(PROMPT, controller=FixedController(*config), max_new_tokens=16)
    assert out.tokens == autoregressive_generate(pair, PROMPT, max_new_tokens=16).tokens
    assert {c.depth for c in out.cycles} == ({0} if config == (0, 0) else {config[0]})


class _Duck:
    def __init__(self, may: bool | None) -> None:
        if may is not None:
            self.may_draft = lambda: may

    def should_stop(self, state):
        return True

    def choose_size(self, state):
        return 1


@pytest.mark.parametrize(("controller", "expected"), [
    (FixedController(0, 0), False), (FixedController(2, 4), True), (DecisionLog(FixedController(0, 0)), False),
    (DecisionLog(FixedController(1, 1)), True), (as_controller(_Duck(None)), True),
    (as_controller(_Duck(False)), False)])
def test_may_draft(controller, expected):
    assert controller.may_draft() is expected


BATCH = [PROMPT, [3, 9, 27, 81, 50], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.mark.parametrize("kind", list(PAIRS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_batch_that_never_drafts_is_target_only_and_equals_batched_ar(kind, temperature):
    from specpilot.drafting.batch import BatchSession
    from specpilot.drafting.batch_ar import autoregressive_generate_batch

    pair = PAIRS[kind]()
    decoder = SpeculativeDecoder(pair, TREE)
    outs = decoder.generate_batch(BATCH, controller=FixedController(0, 0), max_new_tokens=10,
                                  temperature=temperature, seed=[1, 2, 3])
    ars = autoregressive_generate_batch(pair, BATCH, max_new_tokens=10, temperature=temperature, seed=[1, 2, 3])
    assert [o.tokens for o in outs] == [a.tokens for a in ars]
    session = BatchSession(decoder, BATCH, max_new_tokens=10, drafting=False)
    assert not session.can_draft and not session.needs_features
    with pytest.raises(RuntimeError, match="drafting=False"):
        session.draft_level()
