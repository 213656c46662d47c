"""--dtype and `auto` (resolve_dtype: CPU features, a cached micro-benchmark), and the greedy near-tie guard: off in
fp32 by default, and wherever it fires the output is still the target's greedy output (at an infinite width every
token is decided by a one-token forward, so even bf16 output equals bf16 AR bit for bit)."""
from __future__ import annotations

import argparse

import pytest
import torch

import specpilot.drafting.pair as pair_mod
from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.cliargs import dtype as dtype_arg
from specpilot.drafting.cycle import run_generation
from specpilot.drafting.eagle import Eagle3Config, Eagle3Head
from specpilot.drafting.errors import NonFiniteLogitsError
from specpilot.drafting.sampling import draw, sampling_probs
from specpilot.drafting.verify import near_tie_cut
from specpilot.policies import FixedController
from tiny import noisy_copy, tiny_model

PROMPTS = [[7], [1, 2, 3, 4, 5], list(range(10, 43))]


@pytest.mark.parametrize("text,expected", [("bfloat16", "bfloat16"), ("BF16", "bf16"), ("float16", "float16"),
                                           ("fp32", "fp32"), (" auto ", "auto")])
def test_dtype_option_accepts_names_and_auto(text, expected):
    assert dtype_arg(text) == expected


@pytest.mark.parametrize("text", ["int8", "float64", "", "half"])
def test_dtype_option_refuses_others_naming_the_choices(text):
    with pytest.raises(argparse.ArgumentTypeError, match="bfloat16, float16, float32, auto"):
        dtype_arg(text)


@pytest.fixture
def flags(monkeypatch):
    """Set the CPU's /proc/cpuinfo flags and clear auto's per-process cache."""
    monkeypatch.setattr(pair_mod, "_AUTO_MEASURED", {})

    def set_flags(*names):
        monkeypatch.setattr(pair_mod, "_CPU_FLAGS", set(names))
    return set_flags


@pytest.mark.parametrize("asked,expected", [(None, torch.float32), ("bf16", torch.bfloat16),
                                            ("float16", torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_resolve_dtype_takes_names_as_asked(asked, expected, flags):
    flags()
    chosen, why = pair_mod.resolve_dtype(asked, "cpu")
    assert chosen == expected and why


def test_auto_on_a_cpu_without_bf16_instructions_is_fp32_and_says_why(flags):
    flags("avx2", "fma")
    chosen, why = pair_mod.resolve_dtype("auto", "cpu", model=tiny_model())
    assert chosen == torch.float32
    assert "amx_bf16" in why and "avx512_bf16" in why
    assert pair_mod.half_support(torch.bfloat16, "cpu")[0] == "emulated"
    assert pair_mod.check_dtype("auto", "cpu") == torch.float32


@pytest.mark.parametrize("bf16_ms,expected", [(1.0, torch.bfloat16), (100.0, torch.float32)])
def test_auto_with_amx_takes_bf16_only_where_it_measures_faster(bf16_ms, expected, flags, monkeypatch):
    flags("amx_bf16", "avx512_bf16")
    calls = []

    def fake_measure(model, dtype=torch.bfloat16):
        calls.append(1)
        return {"float32": {1: 5.0, 16: 10.0}, "bfloat16": {1: bf16_ms, 16: bf16_ms}, "ratio": 2 * bf16_ms / 15.0}

    monkeypatch.setattr(pair_mod, "measure_half", fake_measure)
    model = tiny_model()
    assert pair_mod.half_support(torch.bfloat16, "cpu")[0] == "native"
    assert pair_mod.resolve_dtype("auto", "cpu")[0] == torch.float32  # nothing to measure: fp32
    chosen, why = pair_mod.resolve_dtype("auto", "cpu", model=model)
    assert chosen == expected and "16 tok" in why
    assert pair_mod.resolve_dtype("auto", "cpu", model=model) == (chosen, why) and len(calls) == 1  # cached


def test_measure_half_times_both_dtypes_on_a_real_model():
    ms = pair_mod.measure_half(tiny_model(), torch.bfloat16, repeats=3)
    assert set(ms) == {"float32", "bfloat16", "ratio"} and ms["ratio"] > 0
    assert all(v > 0 for name in ("float32", "bfloat16") for v in ms[name].values())


@pytest.mark.parametrize("ratio,expected", [(0.5, torch.bfloat16), (0.9, torch.bfloat16), (0.95, torch.float32),
                                            (1.2, torch.float32)])
def test_auto_takes_bf16_only_when_clearly_faster(ratio, expected, flags, monkeypatch):
    """A near tie stays fp32: a coin flip between runs on a shared machine would change the text with the rounding."""
    flags("avx512_bf16")
    monkeypatch.setattr(pair_mod, "measure_half", lambda model, dtype=torch.bfloat16: {
        "float32": {1: 1.0, 16: 1.0}, "bfloat16": {1: ratio, 16: ratio}, "ratio": ratio})
    chosen, why = pair_mod.resolve_dtype("auto", "cpu", model=tiny_model())
    assert chosen == expected and f"bf16/fp32 {ratio:.2f}" in why and "interleaved" in why and "fastest of" in why


def test_auto_loads_its_choice_as_transformers_loads_that_dtype(tmp_path, flags, monkeypatch):
    """bf16 chosen by auto is the model from_pretrained(dtype=bf16) gives (RoPE buffers kept in fp32), not .to()'s."""
    flags("avx512_bf16")
    monkeypatch.setattr(pair_mod, "measure_half", lambda model, dtype=torch.bfloat16: {
        "float32": {1: 2.0, 16: 2.0}, "bfloat16": {1: 1.0, 16: 1.0}, "ratio": 0.5})
    for name, seed in (("target", 0), ("draft", 1)):
        tiny_model(seed=seed).save_pretrained(tmp_path / name)
    auto = ModelPair.from_pretrained(tmp_path / "target", tmp_path / "draft", dtype="auto")
    asked = ModelPair.from_pretrained(tmp_path / "target", tmp_path / "draft", dtype="bf16")
    assert auto.dtype == asked.dtype == torch.bfloat16
    buffers = dict(auto.target.named_buffers())
    assert buffers and all(b.dtype == dict(asked.target.named_buffers())[n].dtype for n, b in buffers.items())
    ids = torch.tensor([list(range(1, 90))])
    with torch.inference_mode():
        assert torch.equal(auto.target(ids).logits, asked.target(ids).logits)


@pytest.mark.parametrize("stored,asked,note", [(torch.float16, None, "the checkpoint stores float16"),
                                               (torch.bfloat16, "fp32", "the checkpoint stores bfloat16"),
                                               (torch.bfloat16, "bf16", None)])
def test_the_reason_says_when_the_checkpoint_stores_another_dtype(stored, asked, note, tmp_path, flags):
    flags()
    for name, seed in (("target", 0), ("draft", 1)):
        tiny_model(seed=seed).to(stored).save_pretrained(tmp_path / name)
    pair = ModelPair.from_pretrained(tmp_path / "target", tmp_path / "draft", dtype=asked)
    if note is None:
        assert "checkpoint" not in pair.dtype_reason
    else:
        assert note in pair.dtype_reason and "converted on loading" in pair.dtype_reason


def test_the_reason_follows_the_pair_in_memory_and_through_to():
    pair = ModelPair(tiny_model(), noisy_copy(tiny_model(), 0.01))
    assert pair.dtype_reason == "float32: the models as given"
    pair.to(dtype=torch.bfloat16)
    assert pair.dtype_reason == "bfloat16: converted with ModelPair.to"


def test_a_drafter_in_another_dtype_is_named():
    """Mixed dtypes decode exactly (the target verifies), but the reports' dtype must not hide the drafter's."""
    pair = ModelPair(tiny_model(), noisy_copy(tiny_model(), 0.01).to(torch.bfloat16))
    assert (pair.dtype, pair.drafter_dtype) == (torch.float32, torch.bfloat16)
    assert pair.dtype_reason == "float32: the models as given (the draft LM in bfloat16)"
    pair.to(dtype=torch.float32)  # the target already is: the draft's conversion is still said
    assert pair.drafter_dtype == torch.float32 and pair.dtype_reason == "float32: converted with ModelPair.to"


def test_the_reason_says_when_the_drafters_checkpoint_stores_another_dtype(tmp_path, flags):
    flags()
    tiny_model(seed=0).save_pretrained(tmp_path / "target")
    tiny_model(seed=1).to(torch.float16).save_pretrained(tmp_path / "draft")
    pair = ModelPair.from_pretrained(tmp_path / "target", tmp_path / "draft")
    assert pair.drafter_dtype == torch.float32
    assert pair.dtype_reason.endswith("; the draft LM's checkpoint stores float16, converted on loading")
    assert "; the checkpoint stores" not in pair.dtype_reason  # the target's is stored as it runs

    target = tiny_model(seed=0, layers=4)
    target.save_pretrained(tmp_path / "deeper")
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=48), target).to(torch.bfloat16)
    head.save_pretrained(tmp_path / "head")
    pair = ModelPair.from_pretrained(tmp_path / "deeper", eagle=tmp_path / "head")
    assert pair.drafter_dtype == torch.float32
    assert pair.dtype_reason.endswith("; the EAGLE-3 head's checkpoint stores bfloat16, converted on loading")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.complex64])
def test_dtypes_models_do_not_compute_in_are_refused(dtype):
    with pytest.raises(ValueError, match="not a dtype models compute in"):
        pair_mod.check_dtype(dtype, "cpu")
    assert pair_mod.check_dtype(torch.float64, "cpu") == torch.float64


def test_from_pretrained_auto_and_bf16(saved_pair, flags):
    flags()
    auto = ModelPair.from_pretrained(saved_pair / "target", saved_pair / "draft", dtype="auto")
    assert auto.dtype == torch.float32 and auto.dtype_reason.startswith("auto: float32")
    half = ModelPair.from_pretrained(saved_pair / "target", saved_pair / "draft", dtype="bf16")
    assert half.dtype == torch.bfloat16 and half.draft.dtype == torch.bfloat16
    assert half.dtype_reason.startswith("bfloat16: asked for (this CPU has no amx_bf16")  # flags(): emulated here
    assert half.dtype_reason.endswith("; the checkpoint stores float32, converted on loading; the draft LM's "
                                      "checkpoint stores float32, converted on loading")


# -- the near-tie guard ---------------------------------------------------------------------------------------------

def test_near_tie_cut_finds_the_first_row_within_rounding():
    eps = torch.finfo(torch.bfloat16).eps
    logits = torch.tensor([[5.0, 1.0, 0.0], [8.0, 8.0 - 0.5 * eps * 8, 0.0], [3.0, 3.0, 0.0]])
    assert near_tie_cut(logits, [0, 1, 2], 1.0, torch.bfloat16) == 1
    assert near_tie_cut(logits, [0, 2], 1.0, torch.bfloat16) == 1
    assert near_tie_cut(logits, [0], 1.0, torch.bfloat16) is None
    assert near_tie_cut(logits, [0, 1, 2], 0.0, torch.bfloat16) is None            # off
    assert near_tie_cut(logits, [0, 1], 1.0, torch.float32) is None               # fp32's eps is 2^16 x smaller


def test_guard_defaults_off_in_fp32_and_validates():
    assert TreeConfig().near_tie_units(torch.float32) == 0.0
    assert TreeConfig(near_tie=3).near_tie_units(torch.float32) == 3.0
    with pytest.raises(ValueError, match="near_tie"):
        TreeConfig(near_tie=-1.0)


def _eagle_pair(target):
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=48), target)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    head.set_draft_vocab(torch.arange(48) * 2)
    return ModelPair(target, eagle=head.eval())


def _pairs(dtype):
    target = tiny_model(vocab=96, hidden=32, layers=4)
    pairs = {"draft_lm": ModelPair(target, noisy_copy(target, 0.3)), "eagle3": _eagle_pair(target)}
    return {k: p.to(dtype=dtype) for k, p in pairs.items()}


def _guarded(pair, prompt, units, depth=4, size=12):
    decoder = SpeculativeDecoder(pair, TreeConfig(width=3, max_depth=4, max_size=16, near_tie=units))
    session = decoder.start(prompt, max_new_tokens=30)
    run_generation(session, FixedController(depth, size))
    return session


@pytest.mark.parametrize("kind", ["draft_lm", "eagle3"])
@pytest.mark.parametrize("units", [0.0, 2.0, 1e9])
def test_guard_keeps_fp32_greedy_exact(kind, units):
    pair = _pairs(torch.float32)[kind]
    for prompt in PROMPTS:
        session = _guarded(pair, prompt, units)
        assert session.new_tokens == autoregressive_generate(pair, prompt, max_new_tokens=30).tokens
        if units == 1e9:  # fires on every cycle: one-token forwards decide everything
            assert session.near_ties == sum(c.depth > 0 for c in session.cycles)  # (an EAGLE head's first
            # cycle is a plain step: no feature to draft from yet)
        if units == 0.0:
            assert session.near_ties == 0


@pytest.mark.parametrize("kind", ["draft_lm", "eagle3"])
def test_guard_at_infinite_width_is_bf16_ar_bit_for_bit(kind):
    """Every token decided by a one-token forward on a cache only one-token forwards wrote: AR's computation."""
    pair = _pairs(torch.bfloat16)[kind]
    for prompt in PROMPTS:
        assert _guarded(pair, prompt, 1e9).new_tokens == \
            autoregressive_generate(pair, prompt, max_new_tokens=30).tokens


def test_guard_never_acts_when_sampling():
    pair = _pairs(torch.bfloat16)["draft_lm"]
    decoder = SpeculativeDecoder(pair, TreeConfig(width=3, max_depth=4, max_size=16, near_tie=1e9))
    session = decoder.start([1, 2, 3], max_new_tokens=20, temperature=1.0, seed=0)
    run_generation(session, FixedController(4, 12))
    assert session.near_tie == 0.0 and session.near_ties == 0


def test_record_profile_grid_and_eval_run_in_bf16(tmp_path):
    """The pipeline's live parts take a bf16 pair unchanged: trace recording, the latency profile, the live grid
    measurement and an evaluation (no implicit fp32 casts, no numpy conversion of bf16 tensors)."""
    from specpilot.envs.profile import measure_profile
    from specpilot.envs.record import record_trace
    from specpilot.eval.runner import evaluate
    from specpilot.eval.suites import Prompt
    from specpilot.train.grid.search import measure_live

    pair = _pairs(torch.bfloat16)["draft_lm"]
    tree = TreeConfig(width=3, max_depth=3, max_size=8)
    trace = record_trace(pair, tree, [[1, 2, 3], [4, 5, 6, 7]], max_new_tokens=8)
    trace.save(tmp_path / "trace")
    profile = measure_profile(pair, tree, [[1, 2, 3]], max_new_tokens=8, sizes=[1, 4])
    assert profile is not None
    rows, ar = measure_live(pair, [{"width": 3, "depth": 2, "size": 4}], [[1, 2, 3]], max_new_tokens=8)
    assert rows
    prompts = [Prompt(id="a", task="code", language="python", split="heldout", prompt="x")]
    result = evaluate(prompts, pair=pair, methods=["ar", "fixed"], temperatures=(0.0,), max_new_tokens=8, rounds=1,
                      min_rounds=1, tree=tree, encode=lambda text: [1, 2, 3])
    assert result is not None


@pytest.mark.parametrize("recorded,cpu_flags,asked,expected,noted", [
    ("torch.bfloat16", ("avx512_bf16",), None, "bfloat16", False),   # the run's dtype, run natively
    ("torch.bfloat16", (), None, None, True),                         # not native here: the default, and a note
    ("torch.bfloat16", (), "float32", "float32", False),              # asked for: as asked
    ("torch.float32", (), None, "float32", False),
    (None, (), None, None, False),                                    # an older run: the default, no note
])
def test_eval_of_a_run_loads_the_runs_dtype_where_it_runs_natively(tmp_path, flags, recorded, cpu_flags, asked,
                                                                   expected, noted):
    from specpilot.artifacts.run import RunManifest
    from specpilot.eval.inputs import run_dtype

    flags(*cpu_flags)
    RunManifest.update(tmp_path, contract={"pair": {"target_hash": "t", "draft_hash": "d"}, "dtype": recorded})
    dtype, note = run_dtype(tmp_path, "cpu", asked)
    assert dtype == expected
    assert (note is not None) == noted
    assert run_dtype(None, "cpu", None) == (None, None)


@pytest.mark.parametrize("meta,cpu_flags,asked,expected,noted", [
    ({"dtype": "bfloat16", "device": "cpu"}, ("avx512_bf16",), None, "bfloat16", False),
    ({"dtype": "bfloat16", "device": "cpu"}, (), None, None, True),             # emulated here: default + note
    ({"dtype": "bfloat16", "device": "cuda"}, ("avx512_bf16",), None, None, True),  # tuned on another device kind
    ({"dtype": "bfloat16"}, ("amx_bf16",), None, "bfloat16", False),            # an export without a device kind
    ({"dtype": "bfloat16", "device": "cpu"}, (), "float32", "float32", False),  # asked for
    ({}, (), None, None, False),                                                # an older export: default, no note
    ({"dtype": "int4"}, (), None, None, True),                                  # unknown to this specpilot
])
def test_export_dtype_takes_the_recorded_dtype_only_where_it_runs_natively(flags, meta, cpu_flags, asked, expected,
                                                                           noted):
    from specpilot.policies.exported import export_dtype

    flags(*cpu_flags)
    dtype, note = export_dtype(meta, "cpu", asked)
    assert dtype == expected and (note is not None) == noted


# -- logits float16 cannot hold ------------------------------------------------------------------------------------

def test_a_target_whose_float16_logits_overflow_is_refused_as_overflow_not_as_its_architecture():
    target = tiny_model()
    with torch.no_grad():
        target.lm_head.weight.mul_(1e5)  # weights within float16, logits finite in fp32 but past its 65504
    with pytest.raises(NonFiniteLogitsError, match="not finite .* in float16 .* bfloat16 or float32"):
        ModelPair(target.to(torch.float16), noisy_copy(tiny_model(), 0.01).to(torch.float16))
    ModelPair(target.to(torch.float32), noisy_copy(tiny_model(), 0.01))  # the same weights in fp32: fine


@pytest.mark.parametrize("rows", [1, 3])
def test_sampling_from_non_finite_logits_names_the_overflow(rows):
    logits = torch.zeros(rows, 8)
    logits[-1, 2] = float("inf")
    with pytest.raises(NonFiniteLogitsError, match="not finite .* bfloat16 or float32"):
        draw(sampling_probs(logits, 1.0), None)


@pytest.mark.parametrize("cpu,asked,emulated", [((), "float16", True), ((), "bf16", True),
                                                (("avx512_fp16",), "float16", False),
                                                (("avx512_bf16",), "bf16", False), ((), "fp32", False)])
def test_an_asked_dtype_this_cpu_only_emulates_says_so(cpu, asked, emulated, flags):
    flags(*cpu)
    why = pair_mod.resolve_dtype(asked, "cpu")[1]
    assert why.startswith(f"{str(pair_mod.check_dtype(asked, 'cpu')).removeprefix('torch.')}: asked for")
    assert ("emulates" in why) == emulated


def test_auto_does_not_time_a_target_whose_two_copies_would_not_fit(tmp_path, flags, monkeypatch):
    """Timing holds fp32 and bf16 copies at once (6 bytes a parameter): where that would not fit, a CPU with native
    bf16 takes bf16 by its features, loading the target once, in bf16."""
    flags("avx512_bf16")

    def no_timing(*args, **kwargs):
        raise AssertionError("timed a target too big for two copies")

    monkeypatch.setattr(pair_mod, "measure_half", no_timing)
    monkeypatch.setattr(pair_mod, "available_memory", lambda: 10_000)
    for name, seed in (("target", 0), ("draft", 1)):
        tiny_model(seed=seed).save_pretrained(tmp_path / name)
    pair = ModelPair.from_pretrained(tmp_path / "target", tmp_path / "draft", dtype="auto")
    assert pair.dtype == pair.draft.dtype == torch.bfloat16
    assert pair.dtype_reason.startswith("auto: bfloat16, this CPU has avx512_bf16; not measured: fp32 and bf16 copies")
    assert pair_mod.auto_probe_too_big(tmp_path / "target", available=10**12) is None  # fits: timed as before
    assert pair_mod.auto_probe_too_big("some/hub-id") is None  # nothing on disk to judge


def test_cuda_checks_ask_the_pairs_own_gpu(monkeypatch):
    """On a machine with mixed GPUs the current device need not be the pair's: bf16 support and the name in the
    reason are asked of `device` itself (torch's is_bf16_supported() asks the current device)."""
    gpus = {0: ("Tesla T4", False), 1: ("NVIDIA H100", True)}  # device index -> (name, native bf16)
    current = [0]

    class AsCurrent:
        def __init__(self, device):
            self.index = torch.device(device).index or 0

        def __enter__(self):
            self.before, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.before

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", AsCurrent)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: gpus[current[0]][1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpus[
        current[0] if device is None else (torch.device(device).index or 0)][0])
    assert pair_mod.half_support(torch.bfloat16, "cuda:1") == ("native", "bfloat16 on NVIDIA H100")
    assert pair_mod.half_support(torch.bfloat16, "cuda:0")[0] == "none"
    assert pair_mod.default_dtype("cuda:1") == torch.bfloat16 and pair_mod.default_dtype("cuda:0") == torch.float16
    assert current == [0]


def test_a_dtype_chosen_by_a_run_or_an_export_is_not_called_asked_for(saved_pair):
    """eval --run and an exported decoder load the pair in the recorded dtype: its reason says whose choice it was."""
    from specpilot.eval.inputs import RUN_DTYPE_SOURCE
    from specpilot.policies.exported import EXPORT_DTYPE_SOURCE

    for source in (RUN_DTYPE_SOURCE, EXPORT_DTYPE_SOURCE):
        pair = ModelPair.from_pretrained(str(saved_pair / "target"), str(saved_pair / "draft"), device="cpu",
                                         dtype="float32", dtype_source=source)
        assert pair.dtype_reason.startswith(f"float32: {source}")
    asked = ModelPair.from_pretrained(str(saved_pair / "target"), str(saved_pair / "draft"), device="cpu",
                                      dtype="float32")
    assert asked.dtype_reason.startswith("float32: asked for")
