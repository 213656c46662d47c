"""Reading EAGLE-3 head folders as publishers write them, into the released layout `eagle.Eagle3Head` loads.

Dialects (each checked against the loader that reads it):
- SafeAILab/EAGLE and NVIDIA ModelOpt (`hf_spec_export.py`): config.json with `"architectures":
  ["LlamaForCausalLMEagle3"]`, keys `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`. ModelOpt
  writes no `t2d` (vLLM and SGLang skip it too): it is derived from `d2t`.
- speculators (vLLM `transformers_utils/configs/speculators/algos.py` `update_eagle3`): `"speculators_model_type":
  "eagle3"`, the layer's shapes nested in `transformer_layer_config`, `norm_before_residual` defaulting to True, keys
  under `layers.0.` instead of `midlayer.`. Flattened here into the released layout.
- Weights in `model.safetensors`, `pytorch_model.bin`, or shards named by `model.safetensors.index.json` /
  `pytorch_model.bin.index.json`.
"""
from __future__ import annotations

from pathlib import Path

from specpilot.drafting.files import load_weights, model_files_fix, read_json

WEIGHT_FILES = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}
# vLLM's speculators adapter flattens the layer config and keeps these EAGLE-3 fields from the top level.
SPECULATORS_FIELDS = ("draft_vocab_size", "target_hidden_size", "norm_before_fc", "eagle_aux_hidden_state_layer_ids")


class EagleHeadError(ValueError):
    """An EAGLE-3 head's files are incomplete, malformed, or do not fit the target model."""


def is_speculators(cfg: dict) -> bool:
    return "speculators_model_type" in cfg


def released_config(cfg: dict, *, where: Path) -> dict:
    """config.json in the released layout: a speculators config flattened as vLLM flattens it (the layer's fields,
    then the EAGLE-3 fields, `norm_before_residual` True unless set); a released config unchanged."""
    if not is_speculators(cfg):
        return cfg
    kind = cfg.get("speculators_model_type")
    if kind != "eagle3":
        raise EagleHeadError(f"{where / 'config.json'}: speculators_model_type {kind!r} is not an EAGLE-3 head "
                               "(this loader reads 'eagle3')")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise EagleHeadError(f"{where / 'config.json'}: a speculators config needs 'transformer_layer_config' "
                               "(the draft layer's shapes); it is missing or not an object")
    flat = {**layer, "architectures": ["LlamaForCausalLMEagle3"],
            "norm_before_residual": cfg.get("norm_before_residual", True)}
    flat.update({key: cfg[key] for key in SPECULATORS_FIELDS if cfg.get(key) is not None})
    return flat


def released_key(key: str, *, speculators: bool) -> str:
    """A weight's name in the released layout (speculators' `layers.0.` is the released `midlayer.`)."""
    return "midlayer." + key.removeprefix("layers.0.") if speculators and key.startswith("layers.0.") else key


def read_weights(root: Path, *, speculators: bool = False) -> dict:
    """The head's tensors under their released names: one weights file (safetensors first) or the shards an index
    names. A truncated, empty or garbage file is an InputFileError naming it."""
    fix = model_files_fix(root)
    for name in (WEIGHT_FILES["safetensors"], WEIGHT_FILES["bin"]):
        if (root / name).exists():
            state = load_weights(root / name, what="EAGLE-3 head", fix=fix)
            break
        if (root / f"{name}.index.json").exists():
            state = _read_shards(root, root / f"{name}.index.json", fix)
            break
    else:
        shards = sorted(p.name for p in root.glob("*.safetensors")) + sorted(p.name for p in root.glob("*.bin"))
        found = f"; found {shards[:4]} without model.safetensors.index.json naming them" if shards else ""
        raise EagleHeadError(f"no weights under {root}: expected {WEIGHT_FILES['safetensors']}, "
                               f"{WEIGHT_FILES['bin']} or an index of shards{found}")
    return {released_key(k, speculators=speculators): v for k, v in state.items()}


def _read_shards(root: Path, index_path: Path, fix: str) -> dict:
    index = read_json(index_path, what="weights index", fix=fix)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise EagleHeadError(f"{index_path}: no 'weight_map' naming the shards")
    state: dict = {}
    for shard in sorted(set(weight_map.values())):
        path = root / str(shard)
        if not path.exists():
            raise EagleHeadError(f"{index_path} names the shard {shard}, which is not in {root}")
        state.update(load_weights(path, what="EAGLE-3 head shard", fix=fix))
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise EagleHeadError(f"{index_path} lists {len(missing)} tensors its shards lack, e.g. {missing[:3]}")
    return state

