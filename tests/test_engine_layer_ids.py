"""The EAGLE-3 head's config.json read the way vLLM and SGLang read it: both engines must capture the target layers
the head was trained on (HF `hidden_states` indices, the state entering layer i).

The few lines below re-implement each engine's loader (paths relative to the engines' repositories):
  vLLM   vllm/v1/worker/gpu_model_runner.py `_get_eagle3_aux_layers_from_config` (with and without the
         `eagle_config` fallback some versions have) and vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
         `get_eagle3_aux_layers_from_config`; default `get_eagle3_default_aux_hidden_state_layers` = (2, L//2, L-3);
         the model captures `hidden_states + residual` before running layer i (models/interfaces.py
         `_maybe_add_hidden_state`): HF hidden_states[i].
  SGLang python/sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py
         `_resolve_eagle_aux_hidden_state` (ids from `eagle_config` only, None on any error) and
         python/sglang/srt/models/llama.py `set_eagle3_layers_to_capture` (None -> [2, L//2, L-3], else id + 1;
         after PR #25454 + 1 only when the first id is 1); `LlamaModel.forward` captures before running layer i.
"""
from __future__ import annotations

import json

import pytest
from tiny import tiny_model

from specpilot.drafting.eagle import (DEFAULT_HEAD_DIR, Eagle3Config, Eagle3Head, default_aux_layer_ids,
                                      engine_layer_fields)


def vllm_layers(cfg: dict, num_layers: int, *, eagle_config_key: str | None) -> tuple[int, ...]:
    """eagle_config_key: the `eagle_config` entry a version falls back to (None: no fallback)."""
    layer_ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not layer_ids and eagle_config_key:
        eagle_config = cfg.get("eagle_config")
        if eagle_config and isinstance(eagle_config, dict):
            layer_ids = eagle_config.get(eagle_config_key)
    if layer_ids and isinstance(layer_ids, (list, tuple)):
        return tuple(layer_ids)
    return (2, num_layers // 2, num_layers - 3)


def sglang_layers(cfg: dict, num_layers: int, *, shift_only_first_one: bool) -> tuple[int, ...]:
    use_aux = True
    try:
        eagle_config = cfg.get("eagle_config")
        use_aux = eagle_config.get("use_aux_hidden_state", True)
        layer_ids = eagle_config["eagle_aux_hidden_state_layer_ids"]
    except Exception:  # SGLang: "if there is no aux layer, set to None"
        layer_ids = None
    assert use_aux, "SGLang would not capture the target's features at all"
    if layer_ids is None:
        return (2, num_layers // 2, num_layers - 3)
    if shift_only_first_one and layer_ids[0] != 1:
        return tuple(layer_ids)
    return tuple(v + 1 for v in layer_ids)


def engine_captures(cfg: dict, num_layers: int) -> dict[str, tuple[int, ...]]:
    return {"vllm v1": vllm_layers(cfg, num_layers, eagle_config_key=None),
            "vllm v1 (eagle_config fallback)": vllm_layers(cfg, num_layers,
                                                           eagle_config_key="eagle_aux_hidden_state_layer_ids"),
            "vllm v2": vllm_layers(cfg, num_layers, eagle_config_key="layer_ids"),
            "sglang 0.5": sglang_layers(cfg, num_layers, shift_only_first_one=False),
            "sglang after #25454": sglang_layers(cfg, num_layers, shift_only_first_one=True)}


@pytest.mark.skipif(not (DEFAULT_HEAD_DIR / "config.json").exists(), reason="embedded EAGLE-3 head not built")
def test_shipped_head_config_makes_both_engines_capture_its_layers():
    cfg = json.loads((DEFAULT_HEAD_DIR / "config.json").read_text())
    layers = json.loads((DEFAULT_HEAD_DIR.parent / "target" / "config.json").read_text())["num_hidden_layers"]
    trained = Eagle3Config.from_dict(cfg, num_target_layers=layers).aux_layer_ids  # what specpilot feeds the head
    assert trained == default_aux_layer_ids(layers)
    assert engine_captures(cfg, layers) == dict.fromkeys(engine_captures(cfg, layers), trained)


@pytest.mark.parametrize("aux", [None, (2, 4, 5), (2, 3, 4)])
def test_saved_head_config_makes_both_engines_capture_its_layers(tmp_path, aux):
    """Default layers are left unnamed; other layers (first one 2) are named for each engine."""
    layers = 6
    target = tiny_model(layers=layers)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=40, aux_layer_ids=aux), target)
    head.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    want = head.aux_layer_ids
    assert engine_captures(cfg, layers) == dict.fromkeys(engine_captures(cfg, layers), want)
    assert Eagle3Head.from_pretrained(tmp_path, target).aux_layer_ids == want  # specpilot reads back the same
    assert ("eagle_aux_hidden_state_layer_ids" in cfg) == (want != default_aux_layer_ids(layers))


def test_unknown_target_depth_names_the_layers_for_each_engine():
    fields = engine_layer_fields((2, 12, 20))
    assert fields["eagle_aux_hidden_state_layer_ids"] == [2, 12, 20]
    assert fields["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 11, 19]
    assert set(engine_captures(fields, 32).values()) == {(2, 12, 20)}
    assert engine_layer_fields((2, 16, 29), 32) == {"eagle_config": {"use_aux_hidden_state": True}}
