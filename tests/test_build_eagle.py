"""EAGLE-3 head training: the training-time-test mask is the one inference sees, metric definitions on hand-made
inputs, deterministic step-budgeted training, and the quick build's --eagle / --eagle-only stages."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_model

from specpilot.drafting.eagle import Eagle3Config, Eagle3Head
from specpilot.train.models.build_eagle import choose_draft_vocab, ttt_mask, unroll
from specpilot.train.models.eagle_metrics import _tau, calibration

VOCAB, HIDDEN, LAYERS = 96, 32, 6


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS)


@pytest.fixture(scope="module")
def head(target):
    torch.manual_seed(0)
    return Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=VOCAB), target).eval()


def test_ttt_mask_layout():
    m = ttt_mask(3, 3)[0, 0].int().tolist()
    assert m == [[1, 0, 0, 1, 0, 0, 1, 0, 0],
                 [1, 1, 0, 0, 1, 0, 0, 1, 0],
                 [1, 1, 1, 0, 0, 1, 0, 0, 1]]
    assert ttt_mask(4, 1)[0, 0].equal(torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("root", [0, 3, 6])
def test_unroll_equals_a_chain_drafted_with_a_cache(target, head, root):
    """Step k of the unroll at entry j == the k-th head call of a chain rooted at committed position j, run the
    way a drafter runs it: prefill the committed entries 0..j, then one call per draft step on its own output."""
    g = torch.Generator().manual_seed(root)
    n, steps = 8, 3
    tokens = torch.randint(0, VOCAB, (1, n + steps), generator=g)
    fused = torch.randn(1, n, HIDDEN, generator=g)
    with torch.inference_mode():
        unrolled = unroll(head, fused, tokens, steps=steps)
        cache = head.new_cache()
        logits, out = head(tokens[:, 1:root + 2], fused[:, :root + 1], position_ids=torch.arange(root + 1)[None],
                           cache=cache)
        chain = [logits[:, -1]]
        hidden = out[:, -1:]
        for k in range(2, steps + 1):
            logits, hidden = head(tokens[:, root + k:root + k + 1], hidden,
                                  position_ids=torch.tensor([[root + k - 1]]), cache=cache)
            chain.append(logits[:, -1])
    for k in range(steps):
        assert torch.allclose(unrolled[k][:, root], chain[k], atol=1e-5), f"step {k + 1}"


def test_tau_counts_leading_hits():
    hits = torch.tensor([[1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out = _tau(hits)
    assert out["step1_agreement"] == round(2 / 3, 4)
    assert out["tau"] == {"2": round(1 + (2 + 0 + 2) / 3, 4), "3": round(1 + (2 + 0 + 3) / 3, 4),
                          "4": round(1 + (2 + 0 + 4) / 3, 4), "6": round(1 + (2 + 0 + 6) / 3, 4)}


def test_calibration_bins():
    conf = torch.tensor([0.05, 0.05, 0.95, 0.95])
    hit = torch.tensor([False, False, True, False])
    out = calibration(conf, hit)
    assert [b["count"] for b in out["bins"]] == [2, 2]
    assert [b["agreement"] for b in out["bins"]] == [0.0, 0.5]
    assert out["ece"] == pytest.approx((2 * 0.05 + 2 * 0.45) / 4, abs=1e-4)


def test_draft_vocab_is_the_most_predicted_tokens(target):
    stream = torch.randint(0, VOCAB, (4000,), generator=torch.Generator().manual_seed(0))
    pool = torch.randint(0, VOCAB, (4, 40), generator=torch.Generator().manual_seed(1))
    ids, stats = choose_draft_vocab(target, stream, pool, size=10, windows=8, seq=32, seed=0, device="cpu")
    assert ids.shape == (10,) and torch.equal(ids, ids.sort().values) and ids.unique().numel() == 10
    with torch.inference_mode():
        arg = target(input_ids=pool).logits.argmax(-1).reshape(-1)
    top = torch.bincount(arg, minlength=VOCAB).argmax()
    assert top in ids  # the token the target predicts most on the pool is draftable
    assert 0.0 < stats["argmax_coverage"] <= 1.0


def test_train_target_is_deterministic():
    from specpilot.train.models.build_pair import train_target

    stream = torch.randint(0, 64, (5000,), generator=torch.Generator().manual_seed(0))
    weights = []
    for _ in range(2):
        model = tiny_model(vocab=64, hidden=32, layers=2, eos=0)
        stats = train_target(model, stream, tokens=4 * 2 * 32, seed=3, device="cpu", batch=2, seq=32)
        weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert stats["steps"] == stats["steps_planned"] == 4
    assert torch.equal(weights[0], weights[1])


def _digest(path: Path) -> bytes:
    return path.read_bytes()


def test_quick_build_with_eagle_then_eagle_only(tmp_path: Path):
    from specpilot.train.models.build_pair import build_pair

    metrics = build_pair(tmp_path, quick=True, eagle=True)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(tmp_path / "target"))
    head = Eagle3Head.from_pretrained(tmp_path / "eagle", target)
    assert head.config.draft_vocab_size == metrics["eagle"]["vocabulary"]["draft_vocab_size"]
    cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    for name in ("test", "idlelib"):
        greedy = metrics["eagle"]["target_greedy"][name]
        assert set(greedy["head"]["tau"]) == set(greedy["draft"]["tau"]) == {"2", "3", "4", "6"}
        assert 0.0 <= metrics["eagle"]["teacher_forced"][name]["head"]["agreement"] <= 1.0
    assert metrics["eagle"]["step_cost"]["threads_1"]["ratio"] > 0
    kept = {n: _digest(tmp_path / n / "model.safetensors") for n in ("target", "draft")}
    again = build_pair(tmp_path, quick=True, eagle_only=True)
    assert {n: _digest(tmp_path / n / "model.safetensors") for n in ("target", "draft")} == kept
    assert again["target"]["train"]["reused_from_previous_build"]
    assert again["eagle"]["train"]["steps"] == metrics["eagle"]["train"]["steps"]
    head_bytes = _digest(tmp_path / "eagle" / "model.safetensors")
    redraft = build_pair(tmp_path, quick=True, reuse_target=True)  # new draft; the head is kept and re-measured
    assert _digest(tmp_path / "eagle" / "model.safetensors") == head_bytes
    assert redraft["eagle"]["reused_from_previous_build"] and "target_greedy" in redraft["eagle"]


def test_init_from_target_copies_the_draft_vocabulary_rows(target):
    from specpilot.train.models.build_eagle import init_from_target

    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=5), target)
    head.set_draft_vocab(torch.tensor([7, 1, 30, 2, 95]))
    init_from_target(head, target)
    assert torch.equal(head.lm_head.weight, target.get_output_embeddings().weight[[1, 2, 7, 30, 95]])
    assert torch.equal(head.norm.weight, target.model.norm.weight)


@pytest.mark.parametrize("layers, expected", [(1, (1, 0, 0)), (2, (2, 1, 0)), (3, (2, 1, 0)), (8, (2, 4, 5))])
def test_a_new_head_takes_feature_layers_its_target_has(layers, expected):
    # the engines' defaults (2, L//2, L-3) name layers a target of fewer than 3 layers does not have
    shallow = tiny_model(vocab=VOCAB, hidden=HIDDEN, layers=layers)
    config = Eagle3Config.for_target(shallow.config, draft_vocab_size=VOCAB)
    assert config.aux_layer_ids == expected
    Eagle3Head(config, shallow)  # builds: the ids are checked against the target
