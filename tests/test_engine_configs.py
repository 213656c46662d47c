"""Engine configs in the form the engines read them: transformers uses the exported K (counted on the assistant's
candidates), SGLang's adaptive config is keyed by batch size and written only for EAGLE/EAGLE3 with topk 1 (its
candidate_steps hold the static num_steps), SGLang's --config YAML has dashed keys, vLLM gets method eagle3 for a
head; an EAGLE-3 pair exports and reloads with its drafter."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_eagle_decoder import random_head
from test_export import SIZE_ACTIONS, make_policy
from tiny import noisy_copy, tiny_model

from specpilot.drafting import ModelPair, SpeculativeDecoder, autoregressive_generate
from specpilot.policies.engine_configs import write_engine_configs
from specpilot.policies.observation import ObservationSpec
from specpilot.train.export.writer import export_run
from specpilot.train.rl.ppo import update_manifest, write_policies_index

yaml = pytest.importorskip("yaml")


def _choices(depths):
    return {"depths": depths, "sizes": [4] * len(depths), "stop_top_probs": [0.9, 0.01] * 3,
            "stops": [False, True] * 3}


def _write(tmp_path, drafter, width, depths=(3, 3, 5, 2, 3)):
    pair = {"name": "p", "target": "/models/target", "draft": "/models/drafter", "drafter": drafter}
    return write_engine_configs(tmp_path, pair=pair, width=width, grid_best=None, choices=_choices(list(depths)),
                                fallback=(4, 12), tokenizer="/models/tokenizer")


def _sglang_accepts_adaptive(path, num_steps: int) -> list[int]:
    """SGLang 0.5.23's checks of --speculative-adaptive-config (adaptive_spec_params._load_adaptive_config and
    server_args): a JSON object, integer-string batch-size keys, candidate_steps lists of non-negative ints, and
    the static num_steps among their union. Returns that union."""
    cfg = json.loads(path.read_text())
    assert isinstance(cfg, dict)
    slots = {k: v for k, v in cfg.items() if k.isdigit()}
    assert slots, "at least one batch-size key"
    steps = set()
    for entry in slots.values():
        assert isinstance(entry["candidate_steps"], list) and entry["candidate_steps"]
        assert all(isinstance(s, int) and s >= 0 for s in entry["candidate_steps"])
        steps.update(entry["candidate_steps"])
    assert num_steps in steps
    return sorted(steps)


def test_eagle3_chain_gets_the_adaptive_config_keyed_by_batch_size(tmp_path):
    eng = _write(tmp_path, "eagle3", width=1)
    sgl = json.loads((tmp_path / eng["files"]["sglang"]).read_text())
    assert sgl["speculative_algorithm"] == "EAGLE3" and sgl["speculative_draft_model_path"] == "/models/drafter"
    assert sgl["speculative_eagle_topk"] == 1
    assert sgl["speculative_num_draft_tokens"] == sgl["speculative_num_steps"] + 1  # a chain: all drafted + root
    steps = _sglang_accepts_adaptive(tmp_path / eng["files"]["sglang_adaptive"], sgl["speculative_num_steps"])
    assert {2, 3, 5} <= set(steps)  # the depth policy's most frequent depths
    config = yaml.safe_load((tmp_path / eng["files"]["sglang_config"]).read_text())
    assert all("_" not in key for key in config), "SGLang's --config turns each key into --key: dashes only"
    assert config["speculative-algorithm"] == "EAGLE3" and config["model-path"] == "/models/target"
    assert config["speculative-adaptive"] is True
    assert config["speculative-adaptive-config"] == str((tmp_path / eng["files"]["sglang_adaptive"]).resolve())
    assert config["tokenizer-path"] == "/models/tokenizer"
    vllm = json.loads((tmp_path / eng["files"]["vllm"]).read_text())
    assert vllm == {"method": "eagle3", "model": "/models/drafter", "num_speculative_tokens": 3}
    assert "hf" not in eng["files"] and "EAGLE-3" in eng["skipped"]["hf"]


@pytest.mark.parametrize("drafter, width, reason", [("eagle3", 2, "topk 2"), ("draft_lm", 1, "STANDALONE"),
                                                    ("draft_lm", 4, "STANDALONE")])
def test_no_adaptive_config_where_sglang_ignores_it(tmp_path, drafter, width, reason):
    eng = _write(tmp_path, drafter, width)
    assert "sglang_adaptive" not in eng["files"] and reason in eng["skipped"]["sglang_adaptive"]
    assert not (tmp_path / "engines" / "sglang" / "sglang_adaptive.json").exists()
    config = yaml.safe_load((tmp_path / eng["files"]["sglang_config"]).read_text())
    assert "speculative-adaptive" not in config and all("_" not in key for key in config)
    assert config["speculative-algorithm"] == ("EAGLE3" if drafter == "eagle3" else "STANDALONE")


def test_an_export_over_an_older_one_leaves_no_stale_file(tmp_path):
    _write(tmp_path, "eagle3", width=1)
    assert (tmp_path / "engines" / "sglang" / "sglang_adaptive.json").exists()
    _write(tmp_path, "draft_lm", width=1)
    assert not (tmp_path / "engines" / "sglang" / "sglang_adaptive.json").exists()


def test_readme_documents_tokenizer_and_local_paths(tmp_path):
    _write(tmp_path, "draft_lm", width=2)
    readme = (tmp_path / "engines" / "README.md").read_text()
    assert "--tokenizer /models/tokenizer" in readme and "local to the machine" in readme
    assert "GenerationConfig.from_pretrained" in readme and "--config" in readme
    assert "scikit-learn" in readme and "re-fits `assistant_confidence_threshold`" in readme


# ---------------------------------------------------------------------------------------------------------------
# transformers really uses the exported K


def _confident_pair():
    """A target whose greedy choices are confident (top probability 0.6-1.0, above the assistant's confidence
    threshold) and a draft identical to it: every drafting round can run to the full K."""
    target = tiny_model(vocab=96, eos=None, sharpness=6.0)
    with torch.no_grad():
        target.lm_head.weight.mul_(40.0)
    return target, noisy_copy(target, 0.0)


def _candidate_lengths(monkeypatch):
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    lengths = []
    original = AssistedCandidateGenerator.get_candidates

    def counting(self, input_ids, **kwargs):
        candidates, logits = original(self, input_ids, **kwargs)
        lengths.append(candidates.shape[-1] - input_ids.shape[-1])
        return candidates, logits

    monkeypatch.setattr(AssistedCandidateGenerator, "get_candidates", counting)
    return lengths


@pytest.mark.parametrize("how", ["copied into the draft folder", "GenerationConfig.from_pretrained"])
def test_transformers_drafts_the_exported_number_of_tokens(tmp_path, monkeypatch, how):
    from transformers import AutoModelForCausalLM, GenerationConfig

    target, draft = _confident_pair()
    draft.save_pretrained(tmp_path / "draft")
    eng = write_engine_configs(tmp_path / "export", pair={"target": "t", "draft": str(tmp_path / "draft"),
                                                          "drafter": "draft_lm"},
                               width=2, grid_best=None, choices=_choices([3, 3, 3, 2, 5]), fallback=(4, 12),
                               draft_generation_config=draft.generation_config.to_diff_dict())
    exported = tmp_path / "export" / eng["files"]["hf"]
    k = json.loads(exported.read_text())["num_assistant_tokens"]
    assert k == 3 and eng["chain_depth"]["value"] == 3
    if how.startswith("copied"):
        shutil.copy(exported, tmp_path / "draft" / "generation_config.json")
        assistant = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").eval()
    else:
        assistant = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").eval()
        assistant.generation_config = GenerationConfig.from_pretrained(exported.parent)
    lengths = _candidate_lengths(monkeypatch)
    ids = torch.tensor([[5, 17, 3, 42]])
    with torch.inference_mode():
        out = target.generate(ids, assistant_model=assistant, max_new_tokens=30, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
    assert out.shape[-1] == 4 + 30
    assert lengths and max(lengths) == k and all(n <= k for n in lengths), lengths


def test_generate_keyword_does_not_reach_the_assistant(tmp_path, monkeypatch):
    """Why the export writes the assistant's own config: generate(num_assistant_tokens=K) leaves the assistant at
    transformers' default (20), so K never takes effect that way."""
    target, assistant = _confident_pair()
    lengths = _candidate_lengths(monkeypatch)
    with torch.inference_mode():
        target.generate(torch.tensor([[5, 17, 3, 42]]), assistant_model=assistant, max_new_tokens=30,
                        do_sample=False, pad_token_id=0, eos_token_id=None, num_assistant_tokens=3)
    assert max(lengths) > 3


# ---------------------------------------------------------------------------------------------------------------
# an EAGLE-3 pair through export and back


WIDTH, MAX_DEPTH = 2, 5


@pytest.fixture(scope="module")
def eagle_pair():
    target = tiny_model(vocab=96, hidden=32, layers=4, seed=3)
    return ModelPair(target, eagle=random_head(target, seed=3))


@pytest.fixture(scope="module")
def eagle_run(tmp_path_factory, eagle_pair):
    run = tmp_path_factory.mktemp("eagle_run")
    depth_spec = ObservationSpec.for_depth(WIDTH, MAX_DEPTH)
    size_spec = ObservationSpec.for_size(WIDTH, MAX_DEPTH, SIZE_ACTIONS)
    for name in ("depth_s0", "size_s0"):
        (run / name).mkdir()
    make_policy(depth_spec, 2, [32], seed=0).save(run / "depth_s0" / "best.zip")
    make_policy(size_spec, len(SIZE_ACTIONS), [32], seed=1).save(run / "size_s0" / "best.zip")
    write_policies_index(run, run / "depth_s0" / "best.zip", run / "size_s0" / "best.zip", depth_spec=depth_spec,
                         size_spec=size_spec, size_actions=SIZE_ACTIONS, fallback_depth=3, fallback_size=4)
    update_manifest(run, pair=eagle_pair.identity())
    return run


def test_eagle_pair_exports_and_reloads_with_its_head(eagle_run, eagle_pair, tmp_path):
    out = tmp_path / "export"
    meta = export_run(eagle_run, out, pair=eagle_pair, num_prompts=1, max_new_tokens=12, num_random=200,
                      log=lambda *a: None)
    assert meta["pair"]["drafter"] == "eagle3"
    eng = meta["engine_configs"]
    vllm = json.loads((out / eng["files"]["vllm"]).read_text())
    assert vllm["method"] == "eagle3" and vllm["num_speculative_tokens"] >= 1
    assert json.loads((out / eng["files"]["sglang"]).read_text())["speculative_algorithm"] == "EAGLE3"
    assert "hf" not in eng["files"]

    decoder = SpeculativeDecoder.from_config(out, pair=eagle_pair)
    prompt = [5, 17, 3, 42]
    assert decoder.generate(prompt, controller=decoder.default_controller, max_new_tokens=16).tokens == \
        autoregressive_generate(eagle_pair, prompt, max_new_tokens=16).tokens

    # decoder.json names the target and head paths: without pair= they are loaded (head included) and hash-checked
    eagle_pair.target.save_pretrained(tmp_path / "target")
    eagle_pair.eagle.save_pretrained(tmp_path / "head")
    config = json.loads((out / "decoder.json").read_text())
    config["pair"].update(target=str(tmp_path / "target"), draft=str(tmp_path / "head"))
    (out / "decoder.json").write_text(json.dumps(config))
    reloaded = SpeculativeDecoder.from_config(out, device="cpu", dtype=torch.float32)
    assert reloaded.pair.drafter_kind == "eagle3" and reloaded.pair.draft is None
    assert reloaded.pair.identity()["draft_hash"] == eagle_pair.identity()["draft_hash"]


def test_generate_cli_takes_eagle_paths(saved_pair, tmp_path, capsys):
    """`--target T --eagle HEAD` decodes with the head, losslessly."""
    from transformers import AutoTokenizer

    from specpilot.cli import main

    tok = AutoTokenizer.from_pretrained(saved_pair / "target")
    target = tiny_model(vocab=len(tok), hidden=32, layers=4, eos=tok.eos_token_id, seed=5)
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    random_head(target, draft_vocab=48, seed=5).save_pretrained(tmp_path / "head")
    code = main(["generate", "--prompt", "def f(x):", "--target", str(tmp_path / "target"), "--eagle",
                 str(tmp_path / "head"), "--width", "2", "--depth", "3", "--size", "4", "--max-new-tokens", "10",
                 "--device", "cpu", "--compare"])
    assert code == 0, capsys.readouterr().err
    assert "identical to target-only" in capsys.readouterr().out
