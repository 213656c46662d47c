"""EAGLE-3 head: released-format save/load, refusal of heads that do not fit, cached/tree forward, d2t mapping."""
from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_model

from specpilot.drafting.eagle import (DEFAULT_HEAD_DIR, WEIGHT_FILES, Eagle3Config, Eagle3Head, EagleHeadError,
                                      default_aux_layer_ids)

VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB = 96, 32, 6, 40


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS)


def random_head(target, *, draft_vocab: int = DRAFT_VOCAB, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=draft_vocab), target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms away from 1 so a mixed-up key would show
    head.set_draft_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:draft_vocab])
    return head.eval()


def features(target, ids: torch.Tensor, head: Eagle3Head) -> torch.Tensor:
    with torch.inference_mode():
        return head.fuse(target(input_ids=ids, output_hidden_states=True).hidden_states)


def edit_saved(path, *, config: dict | None = None, drop: str | None = None, replace: dict | None = None) -> None:
    """Rewrite a saved head folder: merge `config` into config.json, drop a tensor, or replace tensors."""
    from safetensors.torch import load_file, save_file

    if config:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config)
        (path / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(path / WEIGHT_FILES["safetensors"]))
    if drop:
        state.pop(drop)
    state.update(replace or {})
    save_file(state, str(path / WEIGHT_FILES["safetensors"]))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_save_load_round_trip(tmp_path, target, fmt):
    head = random_head(target)
    head.save_pretrained(tmp_path, format=fmt)
    assert (tmp_path / WEIGHT_FILES[fmt]).exists()
    loaded = Eagle3Head.from_pretrained(tmp_path, target)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    f = features(target, ids, head)
    pos = torch.arange(9).expand(2, 9)
    with torch.inference_mode():
        a, ha = head(ids, f, position_ids=pos)
        b, hb = loaded(ids, features(target, ids, loaded), position_ids=pos)
    assert torch.equal(a, b) and torch.equal(ha, hb)
    assert torch.equal(head.d2t, loaded.d2t) and torch.equal(head.t2d, loaded.t2d)


def test_released_layout(tmp_path, target):
    random_head(target).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (VOCAB, DRAFT_VOCAB, HIDDEN)
    # default feature layers are left unnamed: vLLM's and SGLang's defaults are exactly them (test_engine_layer_ids)
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True} and "eagle_aux_hidden_state_layer_ids" not in cfg
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert keys == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                    *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm",
                                                       "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                       "mlp.down_proj"))}


@pytest.mark.parametrize("where", ["top", "eagle_config", "absent"])
def test_aux_layer_ids_from_config(tmp_path, target, where):
    random_head(target).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    cfg.pop("eagle_config")
    if where == "top":
        cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 5]
    elif where == "eagle_config":
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 2, 5]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    head = Eagle3Head.from_pretrained(tmp_path, target)
    # eagle_config's ids name layer outputs (SGLang's and ModelOpt's reading): the states entering the next layers
    expected = {"top": (1, 2, 5), "eagle_config": (2, 3, 6), "absent": default_aux_layer_ids(LAYERS)}[where]
    assert head.aux_layer_ids == expected


@pytest.mark.parametrize("key", ["fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight",
                                 "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t"])
def test_missing_key_refused(tmp_path, target, key):
    random_head(target).save_pretrained(tmp_path)
    edit_saved(tmp_path, drop=key)
    with pytest.raises(EagleHeadError, match=f"missing tensor '{key}'"):
        Eagle3Head.from_pretrained(tmp_path, target)


@pytest.mark.parametrize("key,shape", [("fc.weight", (HIDDEN, 2 * HIDDEN)),
                                       ("midlayer.self_attn.k_proj.weight", (HIDDEN, HIDDEN)),
                                       ("lm_head.weight", (DRAFT_VOCAB + 1, HIDDEN)), ("d2t", (DRAFT_VOCAB - 1,))])
def test_wrong_shape_refused(tmp_path, target, key, shape):
    random_head(target).save_pretrained(tmp_path)
    edit_saved(tmp_path, replace={key: torch.zeros(shape, dtype=torch.long if key == "d2t" else torch.float32)})
    with pytest.raises(EagleHeadError, match=rf"'{key}' has shape \[{', '.join(map(str, shape))}\], expected"):
        Eagle3Head.from_pretrained(tmp_path, target)


def test_full_vocabulary_head_needs_no_mapping(tmp_path, target):
    head = random_head(target, draft_vocab=VOCAB)
    head.save_pretrained(tmp_path)
    edit_saved(tmp_path, drop="d2t")
    edit_saved(tmp_path, drop="t2d")
    loaded = Eagle3Head.from_pretrained(tmp_path, target)
    assert torch.equal(loaded.to_target_ids(torch.arange(VOCAB)), torch.arange(VOCAB))
    assert bool(loaded.t2d.all())


def test_foreign_vocabulary_size_refused(tmp_path, target):
    random_head(target).save_pretrained(tmp_path)
    edit_saved(tmp_path, config={"vocab_size": VOCAB + 32})
    with pytest.raises(EagleHeadError, match=rf"vocab_size {VOCAB + 32} != target vocabulary {VOCAB}"):
        Eagle3Head.from_pretrained(tmp_path, target)


def test_d2t_outside_target_vocabulary_refused(tmp_path, target):
    head = random_head(target)
    head.save_pretrained(tmp_path)
    d2t = head.d2t.clone()
    d2t[-1] = VOCAB  # the last draft id would map to VOCAB + DRAFT_VOCAB - 1: not a target token
    edit_saved(tmp_path, replace={"d2t": d2t})
    with pytest.raises(EagleHeadError, match="outside the target vocabulary"):
        Eagle3Head.from_pretrained(tmp_path, target)


def test_t2d_disagreeing_with_d2t_refused(tmp_path, target):
    head = random_head(target)
    head.save_pretrained(tmp_path)
    edit_saved(tmp_path, replace={"t2d": ~head.t2d})
    with pytest.raises(EagleHeadError, match="t2d disagrees with d2t"):
        Eagle3Head.from_pretrained(tmp_path, target)


@pytest.mark.parametrize("field,value,message", [
    ("target_hidden_size", 48, "target_hidden_size 48 != target hidden size 32"),
    ("hidden_size", 48, "hidden_size 48 != target embedding width 32"),
    ("eagle_aux_hidden_state_layer_ids", [2, 3, 9], r"\[9\] out of range for a target with 6 layers"),
    ("architectures", ["LlamaForCausalLM"], "not an EAGLE-3 head"),
])
def test_head_that_does_not_fit_refused(tmp_path, target, field, value, message):
    random_head(target).save_pretrained(tmp_path)
    edit_saved(tmp_path, config={field: value})
    with pytest.raises(EagleHeadError, match=message):
        Eagle3Head.from_pretrained(tmp_path, target)


def test_other_targets_hidden_size_refused(tmp_path, target):
    wide = tiny_model(vocab=VOCAB, hidden=48, layers=LAYERS)
    random_head(wide).save_pretrained(tmp_path)
    with pytest.raises(EagleHeadError, match="target_hidden_size 48 != target hidden size 32"):
        Eagle3Head.from_pretrained(tmp_path, target)


@pytest.mark.parametrize("shape,ok", [((VOCAB, HIDDEN), True), ((VOCAB, HIDDEN + 1), False)])
def test_released_embedding_is_checked(tmp_path, target, shape, ok):
    random_head(target).save_pretrained(tmp_path)
    edit_saved(tmp_path, replace={"embed_tokens.weight": torch.zeros(shape)})
    if ok:
        Eagle3Head.from_pretrained(tmp_path, target)
    else:
        with pytest.raises(EagleHeadError, match="'embed_tokens.weight' has shape"):
            Eagle3Head.from_pretrained(tmp_path, target)


def test_unknown_key_refused(tmp_path, target):
    random_head(target).save_pretrained(tmp_path)
    edit_saved(tmp_path, replace={"midlayer.self_attn.q_norm.weight": torch.ones(HIDDEN)})
    with pytest.raises(EagleHeadError, match="unexpected tensor 'midlayer.self_attn.q_norm.weight'"):
        Eagle3Head.from_pretrained(tmp_path, target)


def test_no_weights_refused(tmp_path, target):
    random_head(target).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(EagleHeadError, match="no weights under"):
        Eagle3Head.from_pretrained(tmp_path, target)


def test_d2t_maps_draft_ids_to_target_ids(target):
    head = random_head(target, draft_vocab=4)
    head.set_draft_vocab(torch.tensor([90, 3, 17, 5]))
    assert head.d2t.tolist() == [3 - 0, 5 - 1, 17 - 2, 90 - 3]  # sorted ids: 3, 5, 17, 90
    assert head.to_target_ids(torch.tensor([[0, 1, 2, 3]])).tolist() == [[3, 5, 17, 90]]
    assert head.t2d.nonzero().reshape(-1).tolist() == [3, 5, 17, 90]
    with pytest.raises(EagleHeadError, match="distinct target ids"):
        head.set_draft_vocab(torch.tensor([1, 1, 2, 3]))


@pytest.mark.parametrize("prefix", [1, 5])
def test_cached_tree_forward_equals_full_forward(target, prefix):
    """Prefill, then a tree-masked extension (node a at depth 1; b and c both children of a), then crop the tree
    and extend along a->b without a mask: every output equals the full causal forward on the same positions."""
    head = random_head(target)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, prefix + 3), generator=g)          # prefix, a, b, c
    hid = torch.randn(1, prefix + 3, HIDDEN, generator=g)
    chain_b = [*range(prefix), prefix, prefix + 1]                       # prefix, a, b
    chain_c = [*range(prefix), prefix, prefix + 2]                       # prefix, a, c

    def full(idx):
        n = len(idx)
        return head(ids[:, idx], hid[:, idx], position_ids=torch.arange(n)[None])

    with torch.inference_mode():
        ref_b, ref_c = full(chain_b), full(chain_c)
        cache = head.new_cache()
        pre = head(ids[:, :prefix], hid[:, :prefix], position_ids=torch.arange(prefix)[None], cache=cache)
        assert torch.allclose(pre[0], ref_b[0][:, :prefix], atol=1e-5)
        tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)   # a; b <- a; c <- a
        mask = torch.cat([torch.ones(3, prefix, dtype=torch.bool), tree], dim=1)[None, None]
        pos = torch.tensor([[prefix, prefix + 1, prefix + 1]])
        logits, out = head(ids[:, prefix:], hid[:, prefix:], position_ids=pos, attention_mask=mask, cache=cache)
        assert cache.get_seq_length() == prefix + 3
        for node, ref, at in ((0, ref_b, prefix), (1, ref_b, prefix + 1), (2, ref_c, prefix + 1)):
            assert torch.allclose(logits[:, node], ref[0][:, at], atol=1e-5)
            assert torch.allclose(out[:, node], ref[1][:, at], atol=1e-5)
        cache.crop(-3)
        chain, _ = head(ids[:, prefix:prefix + 2], hid[:, prefix:prefix + 2],
                        position_ids=torch.tensor([[prefix, prefix + 1]]), cache=cache)
        assert torch.allclose(chain, ref_b[0][:, prefix:], atol=1e-5)


def test_bad_mask_is_a_clear_error(target):
    head = random_head(target)
    ids, hid = torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, HIDDEN)
    with pytest.raises(ValueError, match=r"attention_mask must be a bool tensor \[1 or 1, 1, 3, 3\]"):
        head(ids, hid, position_ids=torch.arange(3)[None], attention_mask=torch.ones(1, 1, 3, 3))


def test_embedding_is_the_targets_and_not_saved(target):
    head = random_head(target)
    assert head.embed_tokens is target.get_input_embeddings()
    assert not any("embed" in k for k in head.state_dict())
    assert all(p is not target.get_input_embeddings().weight for p in head.parameters())


EMBEDDED_HEAD = (DEFAULT_HEAD_DIR / "config.json").exists()
CODE = '''def read_config(path):
    """Read a JSON configuration file and return it as a dictionary."""
    import json
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object, got {type(data).__name__}")
    return data


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key, n=1):
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]
'''


@pytest.mark.skipif(not EMBEDDED_HEAD, reason="embedded EAGLE-3 head not built")
def test_embedded_head_loads_and_agrees_with_its_target():
    """The shipped head loads against the embedded target and predicts the target's next token far more often
    than chance on code it never saw (teacher-forced, as in the build's metrics)."""
    from specpilot.drafting.pair import ModelPair

    pair = ModelPair.from_pretrained(device="cpu")
    head = Eagle3Head.from_pretrained(DEFAULT_HEAD_DIR, pair.target)
    assert head.embed_tokens is pair.target.get_input_embeddings()
    ids = torch.tensor([pair.encode(CODE)])
    n = ids.shape[1]
    with torch.inference_mode():
        out = pair.target(input_ids=ids, output_hidden_states=True)
        logits, _ = head(ids[:, 1:], head.fuse(out.hidden_states)[:, :-1], position_ids=torch.arange(n - 1)[None])
    agree = (head.to_target_ids(logits.argmax(-1)) == out.logits.argmax(-1)[:, 1:]).float().mean().item()
    assert agree > 0.35, agree
