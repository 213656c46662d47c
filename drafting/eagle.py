"""EAGLE-3 draft head: one Llama decoder layer that drafts from the target's own hidden states.

Layout (as released by SafeAILab/EAGLE and loaded by vLLM / SGLang as `LlamaForCausalLMEagle3`):

    f_j   = cat(hidden_states[a] for a in aux_layer_ids)[j]        # target features, 3 * target_hidden_size
    h     = fc(f_j)                                                # [H]  (or the head's own previous output)
    x     = cat(input_layernorm(embed_tokens(token)), hidden_norm(h))            # [2H]
    h'    = h + o_proj(attention(q/k/v_proj(x)))                   # residual is the *un-normalised* h
    h''   = h' + mlp(post_attention_layernorm(h'))                 # Llama SwiGLU MLP
    logits = lm_head(norm(h''))                                    # over the reduced draft vocabulary

`hidden_states` are the target's `output_hidden_states` (index i = the state entering decoder layer i); the
default feature layers are (2, L//2, L-3) (`engine_layer_fields`: how config.json names them for vLLM and SGLang).
`embed_tokens` is the target's own embedding module (frozen, never stored in the head's files). Draft id i means
target id i + d2t[i]; t2d[j] says whether target id j is drafted.

Sequence alignment (the contract drafters rely on): for committed tokens c_0..c_n and target features f_j (the
features the target used to predict c_{j+1}), head position j takes (h = fc(f_j), token c_{j+1}) and its output
at j predicts c_{j+2}. A drafted chain continues at position j+1 with (h = the head's output hidden at j,
token = the drafted token). The forward appends K/V to a transformers `DynamicCache` like an HF Llama layer
(`crop` works) and takes explicit position ids and 4-D boolean masks (True = may attend) for tree attention.

Files: `config.json` (`"architectures": ["LlamaForCausalLMEagle3"]`, `num_hidden_layers: 1`, `vocab_size`,
`draft_vocab_size`, `target_hidden_size`, `eagle_config`, the feature layers as `engine_layer_fields` writes them) and
`model.safetensors` or `pytorch_model.bin` with keys `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`,
`d2t`, `t2d`. Loading refuses missing or misshapen keys and heads that do not fit the target (EagleHeadError),
and truncated, empty or garbage files (InputFileError naming the file).
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

from specpilot.drafting.eagle_files import (WEIGHT_FILES, EagleHeadError, is_speculators, read_weights,
                                            released_config)
from specpilot.drafting.files import model_files_fix, read_json

ARCHITECTURE = "LlamaForCausalLMEagle3"
# The head trained for the embedded default pair's target (`specpilot models build --eagle`).
DEFAULT_HEAD_DIR = Path(__file__).resolve().parent / "default_pair" / "eagle"
# A head's own token embedding: used when it differs from the target's (vLLM keeps a distinct one), else ignored.
EMBED_KEY = "embed_tokens.weight"
# Switches of EAGLE-3 variants this head does not implement: a head trained with one on would draft from other
# features or norms than it learned, so it is refused rather than loaded wrong (vLLM / speculators field names).
UNSUPPORTED_SWITCHES = ("norm_before_fc", "fc_norm", "norm_output")


def _first_set(config, names: tuple[str, ...], default):
    """The first of these config attributes that is set (architectures name the same field differently)."""
    return next((value for value in (getattr(config, name, None) for name in names) if value), default)


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """The feature layers EAGLE-3, vLLM and SGLang use by default: states entering layers 2, L//2 and L-3."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def _fitting_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """The default feature layers of a new head, kept within 0..L: a target of fewer than 3 layers would otherwise get
    ids it does not have (2 or L-3 < 0); from 3 layers on they are the defaults. The head's config names its ids,
    so the engines read these and not their own defaults."""
    return tuple(min(max(i, 0), num_target_layers) for i in default_aux_layer_ids(num_target_layers))


def engine_layer_fields(aux_layer_ids, num_target_layers: int | None = None) -> dict:
    """The config.json fields that name the feature layers so that vLLM and SGLang both capture `aux_layer_ids`
    (HF `hidden_states` indices: the state entering layer i). The engines read them differently:

    vLLM (v1/worker/gpu_model_runner.py `_get_eagle3_aux_layers_from_config`, gpu/spec_decode/eagle/eagle3_utils.py)
        reads the top-level `eagle_aux_hidden_state_layer_ids` (some versions fall back to `eagle_config`'s) and
        captures the state entering each layer id (models/interfaces.py `_maybe_add_hidden_state`); without ids it
        uses the model's default (2, L//2, L-3).
    SGLang 0.5.x (model_runner_components/spec_aux_hidden_state.py) reads only
        `eagle_config.eagle_aux_hidden_state_layer_ids` and, for Llama (srt/models/llama.py
        `set_eagle3_layers_to_capture`), captures the state entering layer id + 1; without ids it captures the
        states entering [2, L//2, L-3] (no + 1). Later SGLang (PR #25454) adds 1 only when the first id is 1.

    So a head on the default layers names none (both engines' defaults are exactly its layers, and every SGLang
    version agrees); other layers are written top-level as they are for vLLM and shifted by -1 in `eagle_config`
    for SGLang (right for every SGLang version when the first layer is 2, EAGLE-3's usual low layer).
    `num_target_layers` None (unknown) writes the explicit form."""
    ids = [int(i) for i in aux_layer_ids]
    if num_target_layers is not None and tuple(ids) == default_aux_layer_ids(num_target_layers):
        return {"eagle_config": {"use_aux_hidden_state": True}}
    return {"eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True}}


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of an EAGLE-3 head. `vocab_size` is the target's vocabulary; `draft_vocab_size` the head's reduced
    output vocabulary; `target_hidden_size` the width of each of the three fused target features."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, int, int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    # True: the layer's residual is hidden_norm(h), not h (vLLM's `norm_before_residual`, speculators' default)
    norm_before_residual: bool = False

    @classmethod
    def for_target(cls, target_config, *, draft_vocab_size: int, intermediate_size: int | None = None,
                   aux_layer_ids: tuple[int, int, int] | None = None) -> "Eagle3Config":
        """A head shaped for `target_config`: same width, heads and RoPE. Targets whose configs do not use Llama's
        names (GPT-2, GPT-NeoX, OPT, Falcon, ...) get the head's usual defaults: a 4x MLP and RMSNorm eps 1e-6."""
        hidden = int(target_config.hidden_size)
        mlp = _first_set(target_config, ("intermediate_size", "n_inner", "ffn_dim"), 4 * hidden)
        eps = _first_set(target_config, ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"), 1e-6)
        heads = int(target_config.num_attention_heads)
        rope = getattr(target_config, "rope_parameters", None) or {}
        return cls(hidden_size=hidden, num_attention_heads=heads,
                   num_key_value_heads=int(getattr(target_config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(target_config, "head_dim", None) or hidden // heads),
                   intermediate_size=int(intermediate_size or mlp),
                   vocab_size=int(target_config.vocab_size), draft_vocab_size=int(draft_vocab_size),
                   target_hidden_size=hidden,
                   aux_layer_ids=tuple(aux_layer_ids or _fitting_aux_layer_ids(int(target_config.num_hidden_layers))),
                   rms_norm_eps=float(eps),
                   rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", None) or 10000.0)),
                   max_position_embeddings=int(getattr(target_config, "max_position_embeddings", None) or 2048))

    @classmethod
    def from_dict(cls, cfg: dict, *, num_target_layers: int) -> "Eagle3Config":
        """Read a released config.json (a speculators one flattened first: `eagle_files.released_config`).

        Feature layers, as the engines read them: the top-level `eagle_aux_hidden_state_layer_ids` name states
        entering those layers (vLLM's reading, HF `hidden_states` indices); ids found only inside `eagle_config` name
        the layers whose *output* is taken, so 1 is added (SGLang 0.5's reading for Llama, ModelOpt's export, and
        what `engine_layer_fields` writes there); no ids: the defaults for a target of `num_target_layers` layers.
        RoPE scaling comes from `rope_scaling` or transformers 5's `rope_parameters`; `rms_norm_eps` defaults to
        LlamaConfig's 1e-6, as the engines read it."""
        archs = cfg.get("architectures") or []
        if not any("eagle3" in str(a).lower() for a in archs):
            raise EagleHeadError(f"config.json architectures {archs} is not an EAGLE-3 head "
                                 f"(expected {[ARCHITECTURE]})")
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise EagleHeadError(f"config.json num_hidden_layers={cfg['num_hidden_layers']}: only one-layer "
                                 "EAGLE-3 heads are supported")
        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if key not in cfg:
                raise EagleHeadError(f"config.json lacks {key!r}")
        switched_on = [key for key in UNSUPPORTED_SWITCHES if cfg.get(key)]
        if switched_on:
            raise EagleHeadError(f"config.json sets {', '.join(f'{k}=true' for k in switched_on)}: a variant of "
                                 "EAGLE-3 this loader does not implement (it would draft from other norms than the "
                                 "head learned)")
        eagle = cfg.get("eagle_config") or {}
        if cfg.get("eagle_aux_hidden_state_layer_ids"):
            ids = tuple(int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"])
            inner = tuple(int(i) + 1 for i in eagle.get("eagle_aux_hidden_state_layer_ids") or ())
            if inner and inner != ids:  # the engines would capture different layers: a head meant for one of them
                warnings.warn(f"config.json names feature layers twice and they disagree: top-level "
                              f"eagle_aux_hidden_state_layer_ids {list(ids)} (vLLM's reading, used here) vs "
                              f"eagle_config's {list(eagle['eagle_aux_hidden_state_layer_ids'])}, layer outputs, i.e. "
                              f"{list(inner)} (SGLang 0.5's reading); a head drafts well only from the layers it was "
                              "trained on", stacklevel=2)
        elif eagle.get("eagle_aux_hidden_state_layer_ids"):
            ids = tuple(int(i) + 1 for i in eagle["eagle_aux_hidden_state_layer_ids"])
        else:
            ids = default_aux_layer_ids(num_target_layers)
        if len(ids) != 3:
            raise EagleHeadError(f"eagle_aux_hidden_state_layer_ids={list(ids)}: an EAGLE-3 head fuses exactly 3")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return cls(hidden_size=hidden, num_attention_heads=heads,
                   num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads),
                   intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                   draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
                   target_hidden_size=int(cfg.get("target_hidden_size") or hidden), aux_layer_ids=ids,
                   rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
                   rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                   max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                   rope_scaling=scaling if scaling and scaling.get("rope_type", scaling.get("type")) != "default"
                   else None, hidden_act=str(cfg.get("hidden_act", "silu")),
                   norm_before_residual=bool(cfg.get("norm_before_residual", False)))

    def to_dict(self, *, num_target_layers: int | None = None) -> dict:
        """The released config.json layout; feature layers as `engine_layer_fields(..., num_target_layers)`."""
        return {"architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim, "hidden_act": self.hidden_act, "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
                "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
                "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
                **({"norm_before_residual": True} if self.norm_before_residual else {}),
                **engine_layer_fields(self.aux_layer_ids, num_target_layers)}

    def llama_config(self) -> LlamaConfig:
        """A one-layer LlamaConfig with this head's shapes (for the RoPE module, the MLP and caches)."""
        kwargs = {"rope_scaling": dict(self.rope_scaling, rope_theta=self.rope_theta)} if self.rope_scaling else {}
        return LlamaConfig(vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           hidden_act=self.hidden_act, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           max_position_embeddings=self.max_position_embeddings,
                           # no special ids: LlamaConfig's defaults (eos 2) fall outside a tiny draft vocabulary
                           bos_token_id=None, eos_token_id=None, pad_token_id=None, **kwargs)


class _Attention(nn.Module):
    """Llama self-attention whose q/k/v read the 2H-wide cat(embedding, hidden) input."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: DynamicCache | None) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)        # [b, heads, n, d]
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)     # [b, kv, n, d]
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, 0)                                                 # [b, kv, past+n, d]
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)                   # [b, heads, n, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class _MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config, llama: LlamaConfig) -> None:
        super().__init__()
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.mlp = LlamaMLP(llama)


class Eagle3Head(nn.Module):
    """An EAGLE-3 head bound to its target's token embedding (see the module docstring for the maths).

    Construct with `Eagle3Head(config, target)` (random weights, identity vocabulary mapping unless
    `set_draft_vocab` is called) or load with `Eagle3Head.from_pretrained(path, target)`."""

    def __init__(self, config: Eagle3Config, target: nn.Module) -> None:
        super().__init__()
        check_fits_target(config, target)
        self.config = config
        self.num_target_layers = int(target.config.num_hidden_layers)
        self._llama = config.llama_config()
        object.__setattr__(self, "_embed", target.get_input_embeddings())  # a reference, not a submodule
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = _MidLayer(config, self._llama)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self._llama)  # inv_freq is a non-persistent buffer
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.set_draft_vocab(torch.arange(config.draft_vocab_size))

    @property
    def embed_tokens(self) -> nn.Module:
        """The target's embedding module (shared, frozen, excluded from this head's state_dict and files), or the
        head's own (`use_own_embedding`)."""
        return self._embed

    @property
    def aux_layer_ids(self) -> tuple[int, int, int]:
        return self.config.aux_layer_ids

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Use the ascending target ids `target_ids` ([draft_vocab_size], unique) as the draft vocabulary."""
        ids = torch.as_tensor(target_ids, dtype=torch.long, device=self.d2t.device).reshape(-1)
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise EagleHeadError(f"a draft vocabulary needs {self.config.draft_vocab_size} distinct target ids, "
                                 f"got {ids.numel()} ({ids.unique().numel()} distinct)")
        ids = ids.sort().values
        if int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
            raise EagleHeadError(f"draft vocabulary ids must lie in [0, {self.config.vocab_size})")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def fuse(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """HF `output_hidden_states` tuple (L+1 tensors [b, n, target_hidden]) -> fc(features) [b, n, H]."""
        feats = torch.cat([hidden_states[i] for i in self.config.aux_layer_ids], dim=-1)
        return self.fc(feats.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, *, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: DynamicCache | None = None,
                logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [b, n], hidden [b, n, H] (fused target features or the head's own outputs),
        position_ids [b, n]; attention_mask 4-D bool [b|1, 1, n, past + n] (True = may attend) or None for
        causal attention after the cached prefix. Appends n positions to `cache`.
        Returns (float draft logits [b, n, draft_vocab_size], output hidden [b, n, H]); logits_to_keep k > 0: the
        logits of the last k positions only (a catch-up feed reads its last; the lm_head skips the rest)."""
        b, n = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        mask = self._mask(attention_mask, b, n, past, input_ids.device)
        dtype = self.fc.weight.dtype
        layer = self.midlayer
        emb = self.embed_tokens(input_ids).detach().to(dtype)  # [b, n, H]; frozen: no gradient into the target
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)     # [b, n, 2H]
        cos, sin = self.rotary_emb(x, position_ids)
        residual = x[..., self.config.hidden_size:] if self.config.norm_before_residual else hidden
        h = residual + layer.self_attn(x, cos, sin, mask, cache)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        kept = h[:, -logits_to_keep:] if logits_to_keep else h
        return self.lm_head(self.norm(kept)).float(), h

    @staticmethod
    def _mask(mask: torch.Tensor | None, b: int, n: int, past: int, device) -> torch.Tensor | None:
        if mask is None:
            if n == 1:
                return None  # one new query sees the whole cache
            causal = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)
            return causal[None, None]
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, b) \
                or tuple(mask.shape[2:]) != (n, past + n):
            raise ValueError(f"attention_mask must be a bool tensor [{b} or 1, 1, {n}, {past + n}] (queries x "
                             f"cached+new keys, True = attend); got {mask.dtype} {tuple(mask.shape)}")
        return mask

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (id + d2t[id])."""
        return draft_ids + self.d2t[draft_ids]

    def new_cache(self) -> DynamicCache:
        """An empty KV cache for this head's one layer."""
        return DynamicCache(config=self._llama)

    def released_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors of the released layout: the state_dict (the target's embedding is not a submodule, RoPE
        frequencies are non-persistent buffers recomputed from the config); an own embedding as `embed_tokens`."""
        state = dict(self.state_dict())
        if "own_embedding.weight" in state:
            state[EMBED_KEY] = state.pop("own_embedding.weight")
        return state

    def save_pretrained(self, path: str | Path, *, format: str = "safetensors") -> None:
        """Write config.json and the weights (`model.safetensors` or `pytorch_model.bin`) to `path`."""
        if format not in WEIGHT_FILES:
            raise ValueError(f"format must be one of {sorted(WEIGHT_FILES)}, got {format!r}")
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        cfg = dict(self.config.to_dict(num_target_layers=self.num_target_layers),
                   torch_dtype=str(self.fc.weight.dtype).removeprefix("torch."))
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.released_state_dict().items()}
        for other in WEIGHT_FILES.values():
            (out / other).unlink(missing_ok=True)  # never leave a stale file of the other format behind
        if format == "safetensors":
            from safetensors.torch import save_file

            save_file(tensors, str(out / WEIGHT_FILES[format]), metadata={"format": "pt"})
        else:
            torch.save(tensors, out / WEIGHT_FILES[format])

    @classmethod
    def from_pretrained(cls, path: str | Path, target: nn.Module) -> "Eagle3Head":
        """Load a head for `target` (an HF causal LM) from a folder in any dialect `eagle_files` reads. Refuses
        heads that do not fit the target and files with missing, misshapen or unknown tensors (EagleHeadError naming
        the key and the shapes). As vLLM does, a full-vocabulary head without `lm_head.weight` shares the target's
        (its input embedding when the config ties them), and a head whose own `embed_tokens.weight` differs from the
        target's drafts with its own."""
        root = Path(path)
        if not (root / "config.json").exists():
            raise EagleHeadError(f"no config.json under {root}: not an EAGLE-3 head folder")
        # a truncated or garbage config.json is an InputFileError naming it, like the head's damaged weights
        raw = read_json(root / "config.json", what="EAGLE-3 head config", fix=model_files_fix(root))
        config = released_config(raw, where=root)
        cfg = Eagle3Config.from_dict(config, num_target_layers=int(target.config.num_hidden_layers))
        head = cls(cfg, target)
        state = read_weights(root, speculators=is_speculators(raw))
        if "d2t" in state and "draft_vocab_size" not in config and state["d2t"].numel() != cfg.vocab_size:
            raise EagleHeadError(f"{root / 'config.json'} has no draft_vocab_size, so the head is read as drafting "
                                 f"its full vocabulary of {cfg.vocab_size}, but d2t maps {state['d2t'].numel()} "
                                 f"draft ids: add \"draft_vocab_size\": {state['d2t'].numel()}")
        _check_state(head, state, target, root)
        head.load_state_dict({k: state[k] for k in head.released_state_dict() if k in state}, strict=False)
        if "t2d" not in state:
            head.t2d.zero_()
            head.t2d[torch.arange(cfg.draft_vocab_size) + head.d2t] = True
        check_vocab_mapping(head)
        if "lm_head.weight" not in state:
            head.lm_head.weight = _shared_lm_head(target, tied=bool(config.get("tie_word_embeddings")), root=root)
        own = state.get(EMBED_KEY)
        if own is not None and not _same_embedding(own, target.get_input_embeddings().weight.detach()):
            head.use_own_embedding(own)
        dtype = next(target.parameters()).dtype
        return head.to(device=next(target.parameters()).device, dtype=dtype).eval()

    @torch.no_grad()
    def use_own_embedding(self, weight: torch.Tensor) -> None:
        """Draft with this token embedding (frozen, saved as `embed_tokens.weight`) instead of the target's: a head
        trained with an embedding of its own drafts from that one (vLLM keeps it; SGLang takes the target's)."""
        if tuple(weight.shape) != tuple(self._embed.weight.shape):
            raise EagleHeadError(f"{EMBED_KEY} has shape {list(weight.shape)}, but the target's embedding is "
                                 f"{list(self._embed.weight.shape)}")
        self.own_embedding = nn.Embedding.from_pretrained(weight.detach().clone(), freeze=True)
        object.__setattr__(self, "_embed", self.own_embedding)


def _same_embedding(own: torch.Tensor, target: torch.Tensor) -> bool:
    """The head's stored embedding is the target's, compared in the coarser of the two dtypes (a head storing the
    fp32 original of a bf16 target's embedding, or the bf16 copy of an fp32 one, holds the target's own)."""
    coarse = own.dtype if own.element_size() < target.element_size() else target.dtype
    return torch.equal(own.to(coarse), target.to("cpu", coarse))


def _shared_lm_head(target: nn.Module, *, tied: bool, root: Path) -> nn.Parameter:
    """The target's output projection (or input embedding when `tied`) for a full-vocabulary head stored without
    its own `lm_head.weight` (vLLM: "Sharing target model lm_head weights"; SGLang ties it to the embedding)."""
    source = target.get_input_embeddings() if tied else (target.get_output_embeddings()
                                                         or target.get_input_embeddings())
    if getattr(source, "bias", None) is not None:
        raise EagleHeadError(f"the head under {root} has no lm_head.weight and the target's output layer has a bias "
                             "this head's lm_head cannot share; save the head with its own lm_head.weight")
    return source.weight

def check_fits_target(cfg: Eagle3Config, target: nn.Module) -> None:
    """Raise EagleHeadError unless the head's widths, vocabulary and feature layers fit `target`."""
    emb = target.get_input_embeddings().weight
    t_vocab, t_hidden = int(emb.shape[0]), int(emb.shape[1])
    layers = int(target.config.num_hidden_layers)
    if cfg.vocab_size != t_vocab:
        raise EagleHeadError(f"head vocab_size {cfg.vocab_size} != target vocabulary {t_vocab}: the head was "
                             "trained for another tokenizer")
    if cfg.target_hidden_size != t_hidden:
        raise EagleHeadError(f"head target_hidden_size {cfg.target_hidden_size} != target hidden size {t_hidden}: "
                             "the head was trained on another model's features")
    if cfg.hidden_size != t_hidden:
        raise EagleHeadError(f"head hidden_size {cfg.hidden_size} != target embedding width {t_hidden}: the head "
                             "reads the target's token embeddings, so the widths must match")
    if cfg.draft_vocab_size > cfg.vocab_size or cfg.draft_vocab_size < 1:
        raise EagleHeadError(f"draft_vocab_size {cfg.draft_vocab_size} must be in [1, vocab_size={cfg.vocab_size}]")
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i <= layers]
    if bad:
        raise EagleHeadError(f"aux layer ids {list(cfg.aux_layer_ids)}: {bad} out of range for a target with "
                             f"{layers} layers (valid hidden_states indices 0..{layers})")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise EagleHeadError(f"num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {cfg.num_key_value_heads}")


def check_vocab_mapping(head: Eagle3Head) -> None:
    """d2t must map every draft id into the target vocabulary, injectively, and agree with t2d."""
    ids = torch.arange(head.config.draft_vocab_size, device=head.d2t.device) + head.d2t
    v = head.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= v:
        raise EagleHeadError(f"d2t maps draft ids to target ids in [{int(ids.min())}, {int(ids.max())}], outside "
                             f"the target vocabulary [0, {v}): the head was built for another vocabulary")
    if ids.unique().numel() != ids.numel():
        raise EagleHeadError("d2t maps two draft ids to the same target id")
    expected = torch.zeros(v, dtype=torch.bool, device=ids.device)
    expected[ids] = True
    if not torch.equal(head.t2d.to(torch.bool), expected):
        raise EagleHeadError("t2d disagrees with d2t (t2d must be True exactly at the target ids d2t maps to)")


def _check_state(head: Eagle3Head, state: dict[str, torch.Tensor], target: nn.Module, root: Path) -> None:
    """Every released key present with its shape; d2t/t2d/lm_head optional only for a full draft vocabulary, t2d
    also when d2t is there."""
    expected = {k: tuple(v.shape) for k, v in head.released_state_dict().items()}
    identity = head.config.draft_vocab_size == head.config.vocab_size
    for key, shape in expected.items():
        if key not in state:
            if key in ("d2t", "t2d") and identity or key == "t2d" and "d2t" in state:
                continue  # full vocabulary: identity mapping (already set); t2d is derived from d2t
            if key == "lm_head.weight" and identity:
                continue  # shares the target's (from_pretrained)
            why = " (a head with a reduced draft vocabulary needs its own)" if key == "lm_head.weight" else ""
            raise EagleHeadError(f"missing tensor {key!r} (expected shape {list(shape)}) in the weights under "
                                 f"{root}{why}")
        if tuple(state[key].shape) != shape:
            raise EagleHeadError(f"tensor {key!r} has shape {list(state[key].shape)}, expected {list(shape)}")
    emb_shape = tuple(target.get_input_embeddings().weight.shape)
    for key in sorted(set(state) - set(expected)):
        if key == EMBED_KEY:
            if tuple(state[key].shape) != emb_shape:
                raise EagleHeadError(f"tensor {key!r} has shape {list(state[key].shape)}, but the target's "
                                     f"embedding is {list(emb_shape)}: the head belongs to another model")
            continue
        raise EagleHeadError(f"unexpected tensor {key!r} {list(state[key].shape)} in the head's weights: not part "
                             "of the EAGLE-3 layout this loader knows")
