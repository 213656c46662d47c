"""`specpilot export` round trip: exported actors decide exactly like the SB3 policies (>= 10,000 observations per
policy), the exported decoder is lossless, loading needs neither stable_baselines3 nor pickle, and every way an
export can be broken gives a clear error naming the file."""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from stable_baselines3 import PPO
from tiny import tiny_pair

from specpilot.cli import main as cli_main
from specpilot.drafting import SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.pair import model_digest
from specpilot.envs.spaces import observation_space
from specpilot.policies.observation import ObservationSpec
from specpilot.policies.engine_configs import fit_confidence_threshold, sglang_adaptive_config, sglang_args
from specpilot.train.export.writer import export_run
from specpilot.train.export.checks import RecordingController, sb3_actions, synthetic_states
from specpilot.policies.exported import ExportedConfigError, ExportedController, load_exported
from specpilot.policies.ppo import PPOController, load_sb3_policy
from specpilot.train.rl.ppo import update_manifest, write_policies_index

WIDTH, MAX_DEPTH = 2, 5
SIZE_ACTIONS = [1, 2, 4, 6, 8]
PROMPTS = [[5, 17, 3, 42, 8, 11], [60, 2, 2, 9]]


class SpaceEnv(gym.Env):
    """Only carries the spaces: the policies are built, not trained (random init decides fine for round trips)."""

    def __init__(self, spec: ObservationSpec, n_actions: int) -> None:
        self.observation_space = observation_space(spec)
        self.action_space = gym.spaces.Discrete(n_actions)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, True, False, {}


def make_policy(spec: ObservationSpec, n_actions: int, pi: list[int], seed: int, activation=None) -> PPO:
    kwargs = dict(net_arch=dict(pi=pi, vf=[32]))
    if activation is not None:
        kwargs["activation_fn"] = activation
    model = PPO("MlpPolicy", SpaceEnv(spec, n_actions), policy_kwargs=kwargs, n_steps=16, batch_size=16, seed=seed,
                device="cpu")
    # SB3 initialises the action head with gain 0.01 (near-uniform, near-tied logits): redraw every actor layer so
    # decisions vary with the observation, as a trained policy's do
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in [*model.policy.mlp_extractor.policy_net, model.policy.action_net]:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 3.0 / layer.in_features ** 0.5)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen) * 0.5)
    return model


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def write_run(run: Path, pair, depth_model: PPO | None = None) -> Path:
    """A run directory in train/rl/ppo.py's layout: <stage>/best.zip + policies.json + manifest.json."""
    run.mkdir(parents=True, exist_ok=True)
    depth_spec = ObservationSpec.for_depth(WIDTH, MAX_DEPTH)
    size_spec = ObservationSpec.for_size(WIDTH, MAX_DEPTH, SIZE_ACTIONS)
    (run / "depth_s0").mkdir()
    (run / "size_s0").mkdir()
    (depth_model or make_policy(depth_spec, 2, [64], seed=0)).save(run / "depth_s0" / "best.zip")
    make_policy(size_spec, len(SIZE_ACTIONS), [64, 16], seed=1, activation=torch.nn.ReLU).save(
        run / "size_s0" / "best.zip")
    write_policies_index(run, run / "depth_s0" / "best.zip", run / "size_s0" / "best.zip", depth_spec=depth_spec,
                         size_spec=size_spec, size_actions=SIZE_ACTIONS, fallback_depth=3, fallback_size=4)
    update_manifest(run, pair=pair.identity())
    return run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, pair):
    return write_run(tmp_path_factory.mktemp("run"), pair)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, run_dir, pair):
    out = tmp_path_factory.mktemp("export")
    export_run(run_dir, out, pair=pair, num_prompts=2, max_new_tokens=16, num_random=2000, log=lambda *a: None)
    return out


def real_states(pair, controller, n_prompts: int = 3) -> list:
    """DraftStates a tiny decoder actually produces (every level of every cycle)."""
    recorder = RecordingController(controller, max(SIZE_ACTIONS), keep=100_000)
    decoder = SpeculativeDecoder(pair, TreeConfig(width=WIDTH, max_depth=MAX_DEPTH, max_size=max(SIZE_ACTIONS)))
    for i in range(n_prompts):
        decoder.generate(PROMPTS[i % len(PROMPTS)] + [i], controller=recorder, max_new_tokens=40)
    return recorder.states


def test_exported_policies_choose_the_same_actions_as_sb3(run_dir, export_dir, pair):
    exported, tree, meta = load_exported(export_dir, load_pair=False)
    sb3 = PPOController(load_sb3_policy(run_dir / "depth_s0" / "best.zip"),
                        load_sb3_policy(run_dir / "size_s0" / "best.zip"),
                        ObservationSpec.from_dict(meta["policies"]["depth"]["spec"]),
                        ObservationSpec.from_dict(meta["policies"]["size"]["spec"]), SIZE_ACTIONS)
    states = real_states(pair, sb3) + synthetic_states(tree, 3000, seed=3, max_new_tokens=64)
    assert len(states) > 3000
    # through the Controller interface (features + actor), state by state
    stops = [exported.should_stop(s) for s in states]
    sizes = [exported.choose_size(s) for s in states]
    assert stops == [sb3.should_stop(s) for s in states]
    assert sizes == [sb3.choose_size(s) for s in states]
    assert len(set(stops)) == 2 and len(set(sizes)) >= 2, "degenerate policies would make the check vacuous"
    # plus random observations anywhere in the space: >= 10,000 per policy in all
    for kind, actor, policy in (("depth", exported.depth_actor, sb3.depth_policy),
                                ("size", exported.size_actor, sb3.size_policy)):
        space = observation_space(ObservationSpec.from_dict(meta["policies"][kind]["spec"]))
        space.seed(7)
        obs = np.stack([space.sample() for _ in range(10_000 - len(states) + 1000)])
        assert len(obs) + len(states) >= 10_000
        np.testing.assert_array_equal(actor.act_batch(obs), sb3_actions(policy, obs))
    # the export's own self-check agreed too
    for kind in ("depth", "size"):
        for counts in meta["measured"]["agreement"][kind].values():
            assert counts["same"] == counts["n"]


def test_exported_decoder_is_lossless(export_dir, pair):
    decoder = SpeculativeDecoder.from_config(export_dir, pair=pair)
    assert isinstance(decoder.default_controller, ExportedController)
    assert decoder.tree == TreeConfig(width=WIDTH, max_depth=MAX_DEPTH, max_size=max(SIZE_ACTIONS))
    for prompt in PROMPTS:
        out = decoder.generate(prompt, controller=decoder.default_controller, max_new_tokens=48)
        ref = autoregressive_generate(pair, prompt, max_new_tokens=48)
        assert out.tokens == ref.tokens
        assert len(out.cycles) < len(out.tokens)  # it did speculate


def test_exported_decoder_can_choose_depth_zero(tmp_path, pair):
    """A depth policy that answers "stop" before drafting exports to a decoder that runs plain target steps (depth 0,
    one token a cycle), still token-identical to target-only decoding."""
    depth_model = make_policy(ObservationSpec.for_depth(WIDTH, MAX_DEPTH), 2, [64], seed=0)
    with torch.no_grad():
        depth_model.policy.action_net.weight.zero_()
        depth_model.policy.action_net.bias.copy_(torch.tensor([-10.0, 10.0]))  # action 1 = stop, everywhere
    run = write_run(tmp_path / "run", pair, depth_model)
    export_run(run, tmp_path / "export", pair=pair, num_prompts=1, max_new_tokens=8, num_random=200,
               log=lambda *a: None)
    decoder = SpeculativeDecoder.from_config(tmp_path / "export", pair=pair)
    out = decoder.generate(PROMPTS[0], controller=decoder.default_controller, max_new_tokens=24)
    assert out.tokens == autoregressive_generate(pair, PROMPTS[0], max_new_tokens=24).tokens
    assert [c.depth for c in out.cycles] == [0] * 24 and all(c.emitted == 1 for c in out.cycles)


def test_loading_needs_neither_sb3_nor_pickle(export_dir):
    script = textwrap.dedent(f"""
        import pickle, sys, torch
        sys.modules["stable_baselines3"] = None          # any import of SB3 now raises ImportError
        def refuse(*a, **k):
            raise AssertionError("unpickling attempted")
        pickle.load = pickle.loads = torch.load = refuse
        torch.set_num_threads(1)
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from tiny import tiny_pair
        from specpilot.drafting import SpeculativeDecoder, autoregressive_generate
        pair = tiny_pair()
        decoder = SpeculativeDecoder.from_config({str(export_dir)!r}, pair=pair)
        out = decoder.generate([5, 17, 3, 42], controller=decoder.default_controller, max_new_tokens=12)
        assert out.tokens == autoregressive_generate(pair, [5, 17, 3, 42], max_new_tokens=12).tokens
        assert sys.modules.get("stable_baselines3") is None
        print("ok", len(out.cycles))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


def test_decoder_json_and_engine_configs(export_dir, pair):
    meta = json.loads((export_dir / "decoder.json").read_text())
    assert meta["format"] == "specpilot-decoder" and meta["format_version"] == 2
    assert meta["tree"] == {"width": WIDTH, "max_depth": MAX_DEPTH, "max_size": 8, "size_actions": SIZE_ACTIONS}
    assert meta["pair"]["target_hash"] == pair.identity()["target_hash"]
    assert meta["policies"]["depth"]["actions"] == ["continue", "stop"]
    assert [layer["kind"] for layer in meta["policies"]["size"]["layers"]] == [
        "linear", "activation", "linear", "activation", "linear"]
    assert meta["policies"]["size"]["layers"][1]["name"] == "relu"
    assert {"torch", "safetensors", "numpy"} <= set(meta["versions"])
    lat = meta["measured"]["latency_us"]
    assert lat["exported"]["depth"]["mean_us"] > 0 and lat["sb3"]["size"]["mean_us"] > 0
    assert "live generations" in meta["measured"]["choices_source"]
    eng = meta["engine_configs"]
    hf = json.loads((export_dir / eng["files"]["hf"]).read_text())
    assert hf["num_assistant_tokens"] == eng["choices"]["depth"]["median"]
    assert hf["num_assistant_tokens_schedule"] == "constant" and 0 < hf["assistant_confidence_threshold"] < 1
    vllm = json.loads((export_dir / eng["files"]["vllm"]).read_text())
    assert vllm["method"] == "draft_model" and vllm["num_speculative_tokens"] == hf["num_assistant_tokens"]
    sgl = json.loads((export_dir / eng["files"]["sglang"]).read_text())
    shape = eng["tree_shape"]
    assert sgl["speculative_num_steps"] == shape["depth"] and sgl["speculative_eagle_topk"] == WIDTH
    assert sgl["speculative_num_draft_tokens"] == min(shape["size"], WIDTH + (shape["depth"] - 1) * WIDTH ** 2) + 1
    assert sgl["speculative_algorithm"] == "STANDALONE"
    # SGLang ignores the adaptive config for a separate draft LM (STANDALONE): it is not written
    assert "sglang_adaptive" not in eng["files"] and "STANDALONE" in eng["skipped"]["sglang_adaptive"]
    assert not (export_dir / "engines" / "sglang" / "sglang_adaptive.json").exists()
    assert "cannot run per-token" in eng["note"]


def test_engine_config_helpers():
    assert sglang_args("d", depth=3, width=2, size=100)["speculative_num_draft_tokens"] == 2 + 2 * 4 + 1
    assert sglang_args("d", depth=4, width=1, size=10)["speculative_num_draft_tokens"] == 5
    # keyed by batch size; the static num_steps is always a candidate
    assert sglang_adaptive_config({"1": 5, "3": 9, "5": 2, "7": 1}, 3)["1"]["candidate_steps"] == [1, 3, 5]
    assert sglang_adaptive_config({"1": 5, "3": 9, "5": 2, "7": 1}, 7)["1"]["candidate_steps"] == [1, 3, 5, 7]
    t, agree = fit_confidence_threshold([0.1, 0.2, 0.8, 0.9], [True, True, False, False])
    assert agree == 1.0 and 0.2 < t <= 0.8
    assert fit_confidence_threshold([], []) == (0.4, None)


def test_cli_export_with_trace_and_grid(run_dir, pair, tmp_path, capsys):
    """Pair identity from the run's manifest, the policies' choices from replaying the run's recorded validation
    trace (RUN/traces/validation, found by itself), the tree engines' shape from RUN/grid.json."""
    record = pytest.importorskip("specpilot.envs.record")
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    record.record_task(pair, TreeConfig(WIDTH, MAX_DEPTH, max(SIZE_ACTIONS)), PROMPTS, run / "traces" / "validation",
                       max_new_tokens=24)
    per_batch = [{"batch_size": 1, "width": 2, "depth": 3, "size": 6}, {"batch_size": 8, "width": 2, "depth": 1,
                                                                         "size": 2},
                 {"batch_size": 16, "width": 2, "depth": 0, "size": 0}]  # `specpilot grid --batch-sizes`
    (run / "grid.json").write_text(json.dumps({"best": {"width": 2, "depth": 3, "size": 6, "source": "replay"},
                                               "per_batch_size": per_batch}))
    rc = cli_main(["export", "--run", str(run), "--out", str(tmp_path / "x"), "--onnx"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "decision latency: exported" in out and "vs SB3 actor" in out and "replay of trace" in out
    meta = json.loads((tmp_path / "x" / "decoder.json").read_text())
    depths = meta["engine_configs"]["choices"]["depth"]
    assert depths["n"] >= 10 and meta["engine_configs"]["chain_depth"]["source"].startswith("policies")
    try:
        import onnx  # noqa: F401
        assert (tmp_path / "x" / "depth.onnx").is_file()
    except ImportError:
        assert out.count("--onnx skipped") == 1  # once, not once per policy
    sgl = json.loads((tmp_path / "x" / "engines" / "sglang" / "sglang_args.json").read_text())
    shape = (sgl["speculative_num_steps"], sgl["speculative_eagle_topk"], sgl["speculative_num_draft_tokens"])
    assert shape == (3, 2, 7)  # grid best D=3, W=2, V=6 (+ the root)
    vllm = json.loads((tmp_path / "x" / "engines" / "vllm" / "speculative_config.json").read_text())
    assert vllm["num_speculative_tokens_per_batch_size"] == [[1, 7, 3], [8, 15, 1], [16, 16, 0]]
    assert vllm["num_speculative_tokens"] == 3
    load_exported(tmp_path / "x", load_pair=False)


# ---------------------------------------------------------------------------------------------------------------
# broken exports


def _copy(export_dir, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(export_dir, dst)
    return dst


def _edit_json(path: Path, fn) -> None:
    meta = json.loads(path.read_text())
    fn(meta)
    path.write_text(json.dumps(meta))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _drop_sha(meta):
    meta["policies"]["depth"].pop("sha256")


def _rehash(d: Path) -> None:
    """decoder.json records the (damaged) depth weights' own sha256: the read itself must fail clearly."""
    from specpilot.policies.exported import file_sha256

    _edit_json(d / "decoder.json",
               lambda m: m["policies"]["depth"].update(sha256=file_sha256(d / "depth.safetensors")))


def _bad_num_scores(meta):
    meta["policies"]["size"]["spec"]["num_scores"] = 6


def _bad_probe(meta):
    meta["policies"]["depth"]["probe"]["observation"][0] += 0.5


def _bad_tree(meta):
    meta["tree"]["width"] = 3


BREAKAGES = {
    "missing decoder.json": (lambda d: (d / "decoder.json").unlink(), "decoder.json not found"),
    "bad json": (lambda d: (d / "decoder.json").write_text("{not json"), "decoder.json is not valid JSON"),
    "unknown format version": (lambda d: _edit_json(d / "decoder.json", lambda m: m.update(format_version=99)),
                               "format_version 99"),
    "missing weights": (lambda d: (d / "size.safetensors").unlink(),
                        "size.safetensors named in decoder.json is missing"),
    "truncated weights (sha)": (lambda d: _truncate(d / "depth.safetensors"),
                                "depth.safetensors does not match the sha256"),
    "truncated weights (parse)": (lambda d: (_truncate(d / "depth.safetensors"), _rehash(d)),
                                  "depth.safetensors is not a readable safetensors"),
    "missing sha256": (lambda d: _edit_json(d / "decoder.json", _drop_sha), "the entry lacks 'sha256'"),
    "spec mismatch": (lambda d: _edit_json(d / "decoder.json", _bad_num_scores), "observation-spec mismatch"),
    "feature drift": (lambda d: _edit_json(d / "decoder.json", _bad_probe), "observation-spec mismatch"),
    "tree/spec mismatch": (lambda d: _edit_json(d / "decoder.json", _bad_tree), "observation-spec mismatch"),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_broken_exports_fail_clearly(export_dir, tmp_path, breakage):
    d = _copy(export_dir, tmp_path)
    breaker, message = BREAKAGES[breakage]
    breaker(d)
    with pytest.raises(ExportedConfigError, match=message.replace(".", r"\.")) as info:
        load_exported(d, load_pair=False)
    assert str(d) in str(info.value) or "decoder.json" in str(info.value)


def test_pair_hash_mismatch_and_escape_hatch(export_dir):
    other = tiny_pair(noise=0.5)  # same target, another draft
    with pytest.raises(ExportedConfigError, match="draft_hash.*allow_pair_mismatch=True"):
        SpeculativeDecoder.from_config(export_dir, pair=other)
    decoder = SpeculativeDecoder.from_config(export_dir, pair=other, allow_pair_mismatch=True)
    out = decoder.generate(PROMPTS[0], controller=decoder.default_controller, max_new_tokens=16)
    assert out.tokens == autoregressive_generate(other, PROMPTS[0], max_new_tokens=16).tokens


def test_pair_none_loads_recorded_paths_or_says_what_to_do(export_dir, pair, tmp_path):
    with pytest.raises(ExportedConfigError, match="pass pair="):
        SpeculativeDecoder.from_config(export_dir)  # the tiny pair lives in memory only
    d = _copy(export_dir, tmp_path)
    pair.target.save_pretrained(tmp_path / "target")
    pair.draft.save_pretrained(tmp_path / "draft")

    def paths(meta):
        meta["pair"].update(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"))

    _edit_json(d / "decoder.json", paths)
    decoder = SpeculativeDecoder.from_config(d, device="cpu", dtype=torch.float32)
    assert decoder.pair.identity()["draft_hash"] == pair.identity()["draft_hash"]
    out = decoder.generate(PROMPTS[1], controller=decoder.default_controller, max_new_tokens=16)
    assert out.tokens == autoregressive_generate(pair, PROMPTS[1], max_new_tokens=16).tokens


@pytest.mark.parametrize("cpu_flags,asked,expected,note", [
    (("avx512_bf16",), None, torch.bfloat16, None),                # tuned in bf16, runs natively: bf16
    ((), None, torch.float32, "does not run natively"),            # no bf16 instructions: fp32, and why
    (("avx512_bf16",), "float32", torch.float32, "tuned in bfloat16"),  # asked for fp32: as asked, and a note
])
def test_exported_decoder_loads_in_the_dtype_its_policies_were_tuned_in(export_dir, pair, tmp_path, monkeypatch,
                                                                         cpu_flags, asked, expected, note):
    import specpilot.drafting.pair as pair_mod

    recorded = json.loads((export_dir / "decoder.json").read_text())
    assert (recorded["dtype"], recorded["device"]) == ("float32", "cpu")  # the run's (fp32, CPU) pair
    monkeypatch.setattr(pair_mod, "_CPU_FLAGS", set(cpu_flags))
    d = _copy(export_dir, tmp_path)
    # weights that bf16 holds exactly (as the embedded pair's): one content hash in either dtype
    target, draft = (copy.deepcopy(m).to(torch.bfloat16).to(torch.float32) for m in (pair.target, pair.draft))
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")

    def bf16_run(meta):
        meta["pair"].update(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"),
                            target_hash=model_digest(target), draft_hash=model_digest(draft))
        meta["dtype"] = "bfloat16"

    _edit_json(d / "decoder.json", bf16_run)
    decoder = SpeculativeDecoder.from_config(d, device="cpu", dtype=asked)
    assert decoder.pair.dtype == expected
    assert decoder.dtype_note is None if note is None else note in decoder.dtype_note
    out = decoder.generate(PROMPTS[1], max_new_tokens=8)
    assert out.tokens == autoregressive_generate(decoder.pair, PROMPTS[1], max_new_tokens=8).tokens


def test_observation_normalisation_stats_are_exported_and_applied(tmp_path):
    """train/rl/ppo.py normalises rewards only, but a run trained with VecNormalize(norm_obs=True) must export its
    statistics, and the exported actor must then see what the SB3 policy saw in training."""
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    from specpilot.policies.actor import Actor
    from specpilot.train.export.writer import _obs_norm

    spec = ObservationSpec.for_depth(WIDTH, MAX_DEPTH)
    model = make_policy(spec, 2, [32], seed=4)
    vec = VecNormalize(DummyVecEnv([lambda: SpaceEnv(spec, 2)]), norm_obs=True, norm_reward=False)
    vec.obs_rms.mean = np.linspace(-0.5, 0.5, spec.dim)
    vec.obs_rms.var = np.linspace(0.05, 2.0, spec.dim)
    ckpt = tmp_path / "stage" / "checkpoints"
    ckpt.mkdir(parents=True)
    vec.save(str(ckpt / "step_0000000016_vecnormalize.pkl"))
    (ckpt / "progress.json").write_text(json.dumps({"vecnormalize": "step_0000000016_vecnormalize.pkl"}))
    norm, stats = _obs_norm(tmp_path / "stage", "depth")
    layers, tensors = Actor.from_sb3(model.policy).to_layers("depth")
    actor = Actor.from_layers(layers, {**tensors, **stats}, obs_norm=norm)
    space = observation_space(spec)
    space.seed(0)
    obs = np.stack([space.sample() for _ in range(2000)])
    np.testing.assert_array_equal(actor.act_batch(obs), sb3_actions(model.policy, vec.normalize_obs(obs)))


def test_generate_cli_with_exported_config(run_dir, tmp_path, capsys):
    """`specpilot generate --config DIR` on a pair saved to disk: decoder.json names its paths, so the CLI loads
    it by itself, checks its hashes and decodes losslessly with the exported policies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from specpilot.drafting import ModelPair
    from tiny import noisy_copy, tiny_model

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    target = tiny_model(vocab=len(fast), eos=fast.eos_token_id)
    for name, model in (("target", target), ("draft", noisy_copy(target, 0.3))):
        model.save_pretrained(tmp_path / name)
        fast.save_pretrained(tmp_path / name)
    disk_pair = ModelPair.from_pretrained(tmp_path / "target", tmp_path / "draft", device="cpu")
    disk_run = write_run(tmp_path / "disk_run", disk_pair)  # a run of this pair: the run contract refuses another
    export_run(disk_run, tmp_path / "export", pair=disk_pair, num_prompts=1, max_new_tokens=8, num_random=0,
               log=lambda *a: None)
    meta = json.loads((tmp_path / "export" / "decoder.json").read_text())
    assert "validation prompts" in meta["measured"]["choices_source"]
    hf = json.loads((tmp_path / "export" / "engines" / "hf" / "generation_config.json").read_text())
    assert hf["eos_token_id"] == fast.eos_token_id  # the draft's own generation config is kept
    code = cli_main(["generate", "--config", str(tmp_path / "export"), "--prompt", "def f(x):",
                     "--max-new-tokens", "12", "--compare"])
    assert code == 0
    assert "identical to target-only" in capsys.readouterr().out
    noisy_copy(target, 0.6).save_pretrained(tmp_path / "other")  # another draft: the CLI names its escape hatch
    fast.save_pretrained(tmp_path / "other")
    other = ["generate", "--config", str(tmp_path / "export"), "--prompt", "def f(x):", "--max-new-tokens", "12",
             "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "other"), "--compare"]
    assert cli_main(other) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "draft_hash" in err[0] and "--allow-pair-mismatch" in err[0]
    assert cli_main([*other, "--allow-pair-mismatch"]) == 0
    assert "identical to target-only" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# all or nothing


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _fail_half_way(monkeypatch):
    """Break the export after the policies' weights are written (the engine configs come last)."""
    import specpilot.train.export.writer as export_module

    def broken(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(export_module, "write_engine_configs", broken)


def _quiet_export(run, out, pair):
    return export_run(run, out, pair=pair, num_prompts=1, max_new_tokens=8, num_random=200, log=lambda *a: None)


@pytest.mark.parametrize("failure", ["writer raises", "policy zip missing"])
def test_a_failed_export_leaves_the_earlier_one_byte_identical(run_dir, export_dir, pair, tmp_path, monkeypatch,
                                                               failure):
    out = _copy(export_dir, tmp_path)
    before = _snapshot(out)
    run = run_dir
    if failure == "writer raises":
        _fail_half_way(monkeypatch)
        expected = OSError
    else:
        run = tmp_path / "run"
        shutil.copytree(run_dir, run)
        (run / "size_s0" / "best.zip").unlink()  # the depth policy exports first, then this one is missing
        expected = Exception
    with pytest.raises(expected):
        _quiet_export(run, out, pair)
    assert _snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left
    load_exported(out, load_pair=False)


def test_a_failed_export_into_a_new_folder_leaves_nothing(run_dir, pair, tmp_path, monkeypatch):
    _fail_half_way(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        _quiet_export(run_dir, tmp_path / "new" / "export", pair)
    assert not (tmp_path / "new" / "export").exists()
    assert not (tmp_path / "new").exists()  # made for the export's lock, and empty: removed with it


def test_a_folder_of_other_files_is_not_replaced(run_dir, pair, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(Exception, match="holds files but no decoder.json"):
        _quiet_export(run_dir, tmp_path / "mine", pair)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("foreign", ["NOTES.md", "sub/important", "engines/vllm/mine.json"])
def test_an_earlier_export_with_other_files_is_not_replaced(run_dir, export_dir, pair, tmp_path, foreign):
    out = _copy(export_dir, tmp_path)
    (out / foreign).parent.mkdir(parents=True, exist_ok=True)
    (out / foreign).write_text("keep me")
    before = _snapshot(out)
    with pytest.raises(Exception, match=f"earlier export that also holds files an export does not write \\({foreign}"):
        _quiet_export(run_dir, out, pair)
    assert _snapshot(out) == before


def test_a_second_export_replaces_the_first_and_modes_follow_the_umask(run_dir, export_dir, pair, tmp_path):
    out = _copy(export_dir, tmp_path)
    (out / "depth.onnx").write_bytes(b"stale")  # a file the new export does not write is not kept
    _quiet_export(run_dir, out, pair)
    assert not (out / "depth.onnx").exists()
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert set(modes.values()) == {0o666 & ~umask}, modes
    load_exported(out, load_pair=False)


def test_from_config_decoders_use_their_policies_by_default(export_dir, pair):
    decoder = SpeculativeDecoder.from_config(export_dir, pair=pair)
    plain = decoder.generate(PROMPTS[0], max_new_tokens=24)
    steered = decoder.generate(PROMPTS[0], controller=decoder.default_controller, max_new_tokens=24)
    assert [(c.depth, c.size) for c in plain.cycles] == [(c.depth, c.size) for c in steered.cycles]
    assert plain.tokens == autoregressive_generate(pair, PROMPTS[0], max_new_tokens=24).tokens
