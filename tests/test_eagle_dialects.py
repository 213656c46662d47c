"""EAGLE-3 heads as other publishers write them (ModelOpt, speculators, sharded files, transformers 5 RoPE fields,
shared lm_head, own embedding) load into the same head, or are refused naming what is wrong."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_eagle_head import DRAFT_VOCAB, HIDDEN, LAYERS, VOCAB, random_head
from tiny import tiny_model

from specpilot.drafting.eagle import Eagle3Config, Eagle3Head, EagleHeadError, default_aux_layer_ids


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS)


def draft_logits(head: Eagle3Head, target) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        feats = head.fuse(target(input_ids=ids, output_hidden_states=True).hidden_states)
        return head(ids, feats, position_ids=torch.arange(10)[None])[0]


def saved(tmp_path, target, *, draft_vocab: int = DRAFT_VOCAB, aux=None) -> tuple[Eagle3Head, dict, dict]:
    """A random head saved in the released layout: (head, config.json, tensors)."""
    head = random_head(target, draft_vocab=draft_vocab)
    if aux is not None:
        head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=draft_vocab, aux_layer_ids=aux),
                          target)
        head.load_state_dict(random_head(target, draft_vocab=draft_vocab).state_dict())
    head.save_pretrained(tmp_path / "released")
    return (head, json.loads((tmp_path / "released" / "config.json").read_text()),
            load_file(str(tmp_path / "released" / "model.safetensors")))


def write(folder, config: dict, tensors: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def test_modelopt_export_loads_with_its_layer_convention_and_no_t2d(tmp_path, target):
    """ModelOpt writes its feature layers (layer outputs: 1, L//2-1, L-4) only inside eagle_config and no t2d."""
    head, cfg, tensors = saved(tmp_path, target)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, LAYERS // 2 - 1, LAYERS - 4],
                           "use_aux_hidden_state": True}
    tensors.pop("t2d")
    write(tmp_path / "modelopt", cfg, tensors)
    loaded = Eagle3Head.from_pretrained(tmp_path / "modelopt", target)
    assert loaded.aux_layer_ids == default_aux_layer_ids(LAYERS)
    assert torch.equal(loaded.t2d, head.t2d)
    assert torch.equal(draft_logits(loaded, target), draft_logits(head, target))


def test_own_non_default_layers_survive_a_config_that_keeps_only_eagle_config(tmp_path, target):
    head, cfg, tensors = saved(tmp_path, target, aux=(2, 4, 5))
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    cfg.pop("eagle_aux_hidden_state_layer_ids")  # what an SGLang-only config keeps
    write(tmp_path / "sglang_only", cfg, tensors)
    assert Eagle3Head.from_pretrained(tmp_path / "sglang_only", target).aux_layer_ids == (2, 4, 5)


def test_disagreeing_feature_layer_fields_warn_and_the_top_level_ones_are_used(tmp_path, target, recwarn):
    head, cfg, tensors = saved(tmp_path, target, aux=(2, 4, 5))
    write(tmp_path / "agree", cfg, tensors)          # specpilot's own writing: eagle_config's ids are outputs (-1)
    Eagle3Head.from_pretrained(tmp_path / "agree", target)
    assert not [w for w in recwarn if "disagree" in str(w.message)]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]   # the same numbers: SGLang reads 3, 5, 6
    write(tmp_path / "disagree", cfg, tensors)
    with pytest.warns(UserWarning, match=r"disagree: top-level .*\[2, 4, 5\].*\[3, 5, 6\]"):
        loaded = Eagle3Head.from_pretrained(tmp_path / "disagree", target)
    assert loaded.aux_layer_ids == (2, 4, 5)


@pytest.mark.parametrize("norm_before_residual", [None, False, True])
def test_speculators_format_loads_as_the_released_head(tmp_path, target, norm_before_residual):
    """speculators: layer shapes nested in transformer_layer_config, keys under layers.0., norm_before_residual
    True unless set (vLLM's `update_eagle3`)."""
    head, cfg, tensors = saved(tmp_path, target)
    layer = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_theta")}
    spec = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": None,
            "transformer_layer_config": {**layer, "model_type": "llama", "num_hidden_layers": 1}}
    if norm_before_residual is not None:
        spec["norm_before_residual"] = norm_before_residual
    write(tmp_path / "spec", spec, {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()})
    loaded = Eagle3Head.from_pretrained(tmp_path / "spec", target)
    expect_norm = norm_before_residual is not False
    assert loaded.config.norm_before_residual == expect_norm
    same = torch.equal(draft_logits(loaded, target), draft_logits(head, target))
    assert same == (not expect_norm)


def test_norm_before_residual_takes_the_normed_hidden_as_residual(tmp_path, target):
    head, cfg, tensors = saved(tmp_path, target)
    write(tmp_path / "nbr", {**cfg, "norm_before_residual": True}, tensors)
    loaded = Eagle3Head.from_pretrained(tmp_path / "nbr", target)
    ids, hidden = torch.randint(0, VOCAB, (1, 4)), torch.randn(1, 4, HIDDEN)
    pos = torch.arange(4)[None]
    with torch.inference_mode():
        got = loaded(ids, hidden, position_ids=pos)[1]
        layer = loaded.midlayer  # vLLM's _norm_before_residual: residual = hidden_norm(h)
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(target.get_input_embeddings()(ids)), normed], dim=-1)
        cos, sin = loaded.rotary_emb(x, pos)
        h = normed + layer.self_attn(x, cos, sin, Eagle3Head._mask(None, 1, 4, 0, "cpu"), None)
        expected = h + layer.mlp(layer.post_attention_layernorm(h))
        assert torch.allclose(got, expected, atol=1e-6)
        assert not torch.allclose(head(ids, hidden, position_ids=pos)[1], expected, atol=1e-3)
    loaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["norm_before_residual"] is True


@pytest.mark.parametrize("field", ["norm_before_fc", "fc_norm", "norm_output"])
def test_unimplemented_variant_switches_are_refused(tmp_path, target, field):
    _, cfg, tensors = saved(tmp_path, target)
    write(tmp_path / "v", {**cfg, field: True}, tensors)
    with pytest.raises(EagleHeadError, match=f"{field}=true: a variant of EAGLE-3"):
        Eagle3Head.from_pretrained(tmp_path / "v", target)


def test_speculators_of_another_kind_or_without_its_layer_config_is_refused(tmp_path, target):
    _, cfg, tensors = saved(tmp_path, target)
    write(tmp_path / "a", {"speculators_model_type": "dflash", "transformer_layer_config": cfg}, tensors)
    with pytest.raises(EagleHeadError, match="speculators_model_type 'dflash' is not an EAGLE-3 head"):
        Eagle3Head.from_pretrained(tmp_path / "a", target)
    write(tmp_path / "b", {"speculators_model_type": "eagle3"}, tensors)
    with pytest.raises(EagleHeadError, match="needs 'transformer_layer_config'"):
        Eagle3Head.from_pretrained(tmp_path / "b", target)


def test_rope_parameters_scaling_is_applied_like_rope_scaling(tmp_path, target):
    _, cfg, tensors = saved(tmp_path, target)
    cfg.pop("rope_scaling", None)
    write(tmp_path / "old", {**cfg, "rope_scaling": {"type": "linear", "factor": 4.0}}, tensors)
    write(tmp_path / "new", {**cfg, "rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                        "rope_theta": cfg["rope_theta"]}}, tensors)
    old, new = (Eagle3Head.from_pretrained(tmp_path / name, target) for name in ("old", "new"))
    plain = Eagle3Head.from_pretrained(tmp_path / "released", target)
    assert torch.equal(draft_logits(old, target), draft_logits(new, target))
    assert not torch.equal(draft_logits(new, target), draft_logits(plain, target))


def test_missing_rms_norm_eps_is_llama_configs_default(tmp_path, target):
    _, cfg, tensors = saved(tmp_path, target)
    cfg.pop("rms_norm_eps")
    write(tmp_path / "eps", cfg, tensors)
    assert Eagle3Head.from_pretrained(tmp_path / "eps", target).config.rms_norm_eps == 1e-6


def test_sharded_weights_load_through_their_index(tmp_path, target):
    head, cfg, tensors = saved(tmp_path, target)
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[:5], "model-00002-of-00002.safetensors": keys[5:]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(folder / name))
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(draft_logits(Eagle3Head.from_pretrained(folder, target), target), draft_logits(head, target))
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(EagleHeadError, match="names the shard model-00002-of-00002.safetensors, which is not in"):
        Eagle3Head.from_pretrained(folder, target)
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(EagleHeadError, match="without model.safetensors.index.json naming them"):
        Eagle3Head.from_pretrained(folder, target)


@pytest.mark.parametrize("tied", [False, True])
def test_full_vocabulary_head_without_lm_head_shares_the_targets(tmp_path, target, tied):
    _, cfg, tensors = saved(tmp_path, target, draft_vocab=VOCAB)
    for key in ("lm_head.weight", "d2t", "t2d"):
        tensors.pop(key)
    write(tmp_path / "shared", {**cfg, "tie_word_embeddings": tied}, tensors)
    loaded = Eagle3Head.from_pretrained(tmp_path / "shared", target)
    source = target.get_input_embeddings() if tied else target.get_output_embeddings()
    assert loaded.lm_head.weight is source.weight


def test_reduced_vocabulary_head_without_lm_head_is_refused_naming_the_folder(tmp_path, target):
    _, cfg, tensors = saved(tmp_path, target)
    tensors.pop("lm_head.weight")
    write(tmp_path / "nolm", cfg, tensors)
    with pytest.raises(EagleHeadError, match="missing tensor 'lm_head.weight'.*nolm.*needs its own"):
        Eagle3Head.from_pretrained(tmp_path / "nolm", target)


def test_a_distinct_own_embedding_is_used_and_saved(tmp_path, target):
    """vLLM keeps a head's own embed_tokens when it differs from the target's; one equal to it is ignored."""
    head, cfg, tensors = saved(tmp_path, target)
    own = target.get_input_embeddings().weight.detach() + 0.5 * torch.randn(VOCAB, HIDDEN)
    write(tmp_path / "own", cfg, {**tensors, "embed_tokens.weight": own})
    loaded = Eagle3Head.from_pretrained(tmp_path / "own", target)
    assert torch.equal(loaded.embed_tokens.weight, own)
    assert not torch.equal(draft_logits(loaded, target), draft_logits(head, target))
    loaded.save_pretrained(tmp_path / "own_again")
    again = Eagle3Head.from_pretrained(tmp_path / "own_again", target)
    assert torch.equal(draft_logits(again, target), draft_logits(loaded, target))
    same = target.get_input_embeddings().weight.detach().to(torch.bfloat16)  # the target's, stored in bf16
    write(tmp_path / "same", cfg, {**tensors, "embed_tokens.weight": same})
    assert Eagle3Head.from_pretrained(tmp_path / "same", target).embed_tokens is target.get_input_embeddings()


def test_reduced_vocabulary_without_draft_vocab_size_names_the_field(tmp_path, target):
    _, cfg, tensors = saved(tmp_path, target)
    cfg.pop("draft_vocab_size")
    write(tmp_path / "nodv", cfg, tensors)
    with pytest.raises(EagleHeadError, match=f'has no draft_vocab_size.*add "draft_vocab_size": {DRAFT_VOCAB}'):
        Eagle3Head.from_pretrained(tmp_path / "nodv", target)
