"""Speculative decoding stays exact on other architectures: absolute positions (GPT-2, OPT), parallel blocks (GPT-NeoX,
Phi, GPT-J), eager attention, MLA caches (DeepSeek-V3: keys and values of other head dims), and sliding windows the
sequences outgrow (Mistral, Gemma 2's mixed layers); models that cannot take tree masks (BLOOM's ALiBi), windows the
masks cannot model (GPT-Neo's local layers, Doge's kept keys) are refused, and LongRoPE pairs decode only within
their original context. References are transformers' own generate()."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specpilot.drafting import ModelPair, SpeculativeDecoder
from specpilot.drafting.attention import (MaskLayout, TreeAttentionError, check_tree_attention, layer_windows,
                                          model_mask)
from specpilot.drafting.control import FixedController
from specpilot.drafting.decoder import autoregressive_generate
from specpilot.drafting.types import TreeConfig
from test_eagle_decoder import random_head

VOCAB, WINDOW = 64, 8
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=128)
ARCHS = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=128),
    "gpt_neox": SMALL,
    "phi": SMALL,
    "qwen2": dict(SMALL, num_key_value_heads=1),
    "llama_eager": dict(SMALL, attn_implementation="eager"),
    "mistral_window": dict(SMALL, num_key_value_heads=1, sliding_window=WINDOW),
    "gemma2_mixed_window": dict(SMALL, num_key_value_heads=1, head_dim=16, sliding_window=WINDOW),
    # more families as transformers 5 builds them: learned positions (OPT, GPT-BigCode: multi-query), rotary on part
    # of the head (GPT-J), QK norms (Qwen3), fused projections (Phi-3, Falcon), MoE routing (Mixtral), sliding
    # windows on every layer with a local rope base (Gemma 3)
    "opt": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64, max_position_embeddings=128,
                word_embed_proj_dim=32),
    "gpt_bigcode": dict(n_embd=32, n_layer=2, n_head=2, n_positions=128),
    "gptj": dict(n_embd=32, n_layer=2, n_head=2, n_positions=128, rotary_dim=8),
    "qwen3": dict(SMALL, num_key_value_heads=1, head_dim=16),
    "phi3": dict(SMALL, num_key_value_heads=1),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, alibi=False,
                   new_decoder_architecture=False, max_position_embeddings=128),
    "starcoder2": SMALL,
    "mixtral": dict(SMALL, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2),
    "gemma3_text_window": dict(SMALL, num_key_value_heads=1, head_dim=16, sliding_window=WINDOW),
    # MLA: keys (nope + rope head dims) and values (v_head_dim) differ in head dim; a small MoE
    "deepseek_v3": dict(SMALL, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, n_group=1,
                        topk_group=1),
}
PROMPTS = [list(range(3, 15)), [5, 9], list(range(20, 41))]  # 12, 2 and 21 tokens; 30 new tokens outgrow WINDOW


def build(name: str, *, layers: int | None = None, seed: int = 0):
    kwargs = dict(ARCHS[name])
    attn = kwargs.pop("attn_implementation", None)
    if layers is not None:
        kwargs["n_layer" if "n_layer" in kwargs else "num_hidden_layers"] = layers
    model_type = name.split("_window")[0].split("_mixed")[0].replace("llama_eager", "llama")
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=None, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, **({"attn_implementation": attn} if attn else {}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)  # peaked next-token distributions, like a trained LM's
    return model.eval()


def noisy(model, noise: float = 0.2, seed: int = 1):
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen) * p.std())
    return draft


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=None)
def pair_and_refs(name: str):
    target = build(name)
    return name, ModelPair(target, noisy(target)), [hf_greedy(target, p, 30) for p in PROMPTS]


@pytest.fixture(params=list(ARCHS))
def arch_pair(request):
    return pair_and_refs(request.param)


def test_windows_are_read_as_transformers_masks_them(arch_pair):
    name, pair, _ = arch_pair
    windows = layer_windows(pair.target.config)
    if name == "mistral_window":
        assert windows == {"sliding_attention": WINDOW}
    elif name == "gemma2_mixed_window":
        assert windows == {"full_attention": None, "sliding_attention": WINDOW}
    elif name == "gemma3_text_window":
        assert windows == {"sliding_attention": WINDOW}
    else:
        assert set(windows.values()) == {None}


@pytest.mark.parametrize("width,depth,size", [(1, 3, 3), (2, 4, 8)])
def test_greedy_identical_to_transformers_generate(arch_pair, width, depth, size):
    name, pair, refs = arch_pair
    decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=4, max_size=16))
    accepted = 0
    for prompt, ref in zip(PROMPTS, refs):
        out = decoder.generate(prompt, controller=FixedController(depth, size), max_new_tokens=30)
        assert out.tokens == ref, (name, prompt)
        accepted += sum(c.accepted for c in out.cycles)
        assert autoregressive_generate(pair, prompt, max_new_tokens=30).tokens == ref
    assert accepted >= 10, "the draft hardly ever agreed: the check would prove little"


# batched masks differ from the single-sequence ones in holes, format and windows: these architectures cover them
@pytest.mark.parametrize("name", ["gpt2", "llama_eager", "mistral_window", "gemma2_mixed_window", "deepseek_v3"])
def test_batched_greedy_identical_to_transformers_generate(name):
    name, pair, refs = pair_and_refs(name)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4, max_size=16))
    outs = decoder.generate_batch(PROMPTS, controller=FixedController(3, 6), max_new_tokens=30)
    assert [o.tokens for o in outs] == refs, name


@pytest.mark.parametrize("name", ["gpt2", "mistral_window", "gemma2_mixed_window"])
def test_eagle_head_on_other_targets_is_exact(name):
    target = build(name, layers=4)
    pair = ModelPair(target, eagle=random_head(target, draft_vocab=32, sharpness=2.0, seed=0))
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4, max_size=16))
    for prompt in PROMPTS:
        out = decoder.generate(prompt, controller=FixedController(3, 6), max_new_tokens=30)
        assert out.tokens == hf_greedy(target, prompt, 30), (name, prompt)


def test_alibi_model_is_refused_with_the_reason():
    config = AutoConfig.for_model("bloom", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=2)
    target = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(TreeAttentionError, match=r"BloomForCausalLM.*not supported"):
        ModelPair(target, noisy(target))


@pytest.mark.parametrize("impl", ["flex_attention", "flash_attention_2"])
def test_kernels_without_tree_masks_are_refused_naming_the_fix(impl):
    target = build("qwen2")
    target.config._attn_implementation = impl  # as loading with attn_implementation=impl sets it
    with pytest.raises(TreeAttentionError, match=f"attn_implementation='{impl}'.*load it with "
                                                 "attn_implementation='sdpa'"):
        check_tree_attention(target, "target")
    target.config._attn_implementation = "sdpa"


def test_a_model_that_ignores_the_mask_is_refused():
    target = build("qwen2")

    class IgnoresMasks(torch.nn.Module):  # what a remote-code model dropping attention_mask would do
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
            return self.inner(input_ids=input_ids, **kwargs)

    with pytest.raises(TreeAttentionError, match="ignores 4-D attention masks"):
        check_tree_attention(IgnoresMasks(target), "target")


def test_model_mask_narrows_only_the_committed_prefix_and_skips_holes():
    layout = MaskLayout({"full_attention": None, "sliding_attention": 3})
    mask = torch.ones(1, 1, 2, 7, dtype=torch.bool)            # 5 prefix columns (one a hole) + 2 tree nodes
    mask[..., 2] = False                                         # the hole
    prefix = torch.tensor([[True, True, False, True, True]])     # committed positions 0, 1, 2, 3
    out = model_mask(layout, mask, torch.tensor([[4, 5]]), prefix)
    assert set(out) == {"full_attention", "sliding_attention"}
    assert torch.equal(out["full_attention"], mask)
    sliding = out["sliding_attention"][0, 0]
    # query at 4 sees positions 2..3 (columns 3, 4); at 5 sees position 3 (column 4); tree columns untouched
    assert sliding.tolist() == [[False, False, False, True, True, True, True],
                                [False, False, False, False, True, True, True]]
    assert model_mask(layout, mask, torch.tensor([[1, 2]]), prefix) is mask  # no window binds yet
    additive = model_mask(MaskLayout({"full_attention": None}, torch.float32), mask, torch.tensor([[4, 5]]), 5)
    assert additive.dtype == torch.float32 and float(additive[0, 0, 0, 2]) == torch.finfo(torch.float32).min
    assert float(additive[0, 0, 0, 0]) == 0.0


def test_unknown_layer_types_are_refused():
    config = AutoConfig.for_model("qwen2", vocab_size=VOCAB, **dict(SMALL, num_key_value_heads=1))
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(TreeAttentionError, match="chunked_attention"):
        layer_windows(config)


@pytest.mark.parametrize("model_type, fields, refused", [
    ("gpt_neo", dict(attention_types=[[["global", "local"], 1]], window_size=8), "window_size=8"),  # by cache slot
    ("gpt_neo", dict(attention_types=[[["global"], 2]], window_size=8), None),         # no local layer: never binds
    ("gpt_neo", dict(attention_types=[[["global", "local"], 1]], window_size=128), None),  # as long as positions
    ("doge", dict(keep_window_size=8), "keep_window_size=8"),
    ("doge", dict(keep_window_size=128), None),
])
def test_windows_the_masks_cannot_model_are_refused_where_they_bind(model_type, fields, refused):
    sizes = (dict(hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=128) if model_type == "gpt_neo"
             else dict(SMALL, num_key_value_heads=1))
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, **sizes, **fields)
    if refused:
        with pytest.raises(TreeAttentionError, match=refused + r".*not supported"):
            layer_windows(config)
    else:
        assert layer_windows(config)


@pytest.mark.parametrize("model_type, rope, limit", [
    ("phi3", {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [8.0] * 8,
              "original_max_position_embeddings": 24}, 24),  # past 24 every rotary factor switches: not cache-exact
    ("llama", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}, 128),  # dynamic NTK stays exact
    ("phi3", None, 128),
])
def test_longrope_pairs_decode_only_within_the_original_context(model_type, rope, limit):
    from specpilot.drafting.attention import context_limit

    extra = dict(rope_parameters=rope, original_max_position_embeddings=24) if rope else {}
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=None, **dict(SMALL, num_key_value_heads=1), **extra)
    assert context_limit(config) == limit
    target = AutoModelForCausalLM.from_config(config).eval()
    pair = ModelPair(target, noisy(target))
    assert pair.max_context == limit
    if limit < 128:
        with pytest.raises(ValueError, match="LongRoPE: exact only within original_max_position_embeddings=24"):
            SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=3, max_size=6)).generate(
                list(range(3, 15)), controller=FixedController(2, 4), max_new_tokens=30)


def test_cli_refuses_an_alibi_pair_in_one_line(saved_pair, tmp_path, capsys):
    from transformers import AutoTokenizer

    from specpilot.cli import main

    tokenizer = AutoTokenizer.from_pretrained(saved_pair / "target")
    config = AutoConfig.for_model("bloom", vocab_size=len(tokenizer), hidden_size=32, n_layer=2, n_head=2)
    model = AutoModelForCausalLM.from_config(config)
    for name in ("target", "draft"):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    capsys.readouterr()  # the save's progress bars
    code = main(["generate", "--prompt", "def f(x):", "--target", str(tmp_path / "target"),
                 "--draft", str(tmp_path / "draft"), "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "BloomForCausalLM" in err[0] and "Traceback" not in err[0], err
