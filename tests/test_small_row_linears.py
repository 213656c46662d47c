"""Small-row linears (`drafting/linear_kernels.py`): the turned product, padded or not, equals F.linear up to
round-off, only plain CPU nn.Linear layers are turned (and back), the row plan is measured once per (layer shapes,
dtype, threads) and only ever pads upwards, ModelPair turns its models unless told not to, and speculative decoding
through turned layers stays exact (greedy = target-only greedy)."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from specpilot.drafting import SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting import linear_kernels
from specpilot.drafting.control import FixedController
from specpilot.drafting.eagle import Eagle3Config, Eagle3Head
from specpilot.drafting.linear_kernels import (MAX_ROWS, SmallRowLinear, describe, disable_small_row_linears,
                                               enable_small_row_linears, measure, probe_shapes, row_plan,
                                               shapes_key)
from specpilot.drafting.pair import ModelPair

from tiny import noisy_copy, tiny_model

PROMPTS = [[5, 17, 33, 2, 41, 7, 19, 60], [3, 9], list(range(20, 41))]


PLANS = {"unpadded": {r: r for r in range(1, MAX_ROWS + 1)},
         "padded": {r: -(-r // 8) * 8 for r in range(1, MAX_ROWS + 1)}}  # to the next multiple of 8 (9 -> 16)


@pytest.fixture(params=sorted(PLANS))
def every_row_turned(request, monkeypatch):
    """Every layer turned and every row count 1..MAX_ROWS taken as W @ x^T, unpadded or padded."""
    monkeypatch.setattr(linear_kernels, "MIN_WEIGHT_ELEMENTS", 0)
    monkeypatch.setattr(linear_kernels, "measure", lambda *a, **k: {"widths": PLANS[request.param]})


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 33])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(), (1,), (2,)])
def test_turned_product_equals_f_linear(rows, bias, lead, every_row_turned):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(*lead, rows, 48)
    want = F.linear(x, layer.weight, layer.bias)
    enable_small_row_linears(layer)
    assert type(layer) is SmallRowLinear
    got = layer(x)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_plain_cpu_linears_large_enough_are_turned_and_back():
    class Custom(torch.nn.Linear):  # a quantised or otherwise custom layer keeps its own forward
        pass

    model = torch.nn.Sequential(torch.nn.Linear(512, 256), Custom(512, 256), torch.nn.Linear(8, 8))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert enable_small_row_linears(model) == 1
    assert [type(m) for m in model] == [SmallRowLinear, Custom, torch.nn.Linear]
    assert enable_small_row_linears(model) == 1  # idempotent
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    copied = pickle.loads(pickle.dumps(model[0]))
    assert type(copy.deepcopy(model)[0]) is SmallRowLinear and type(copied) is SmallRowLinear
    assert disable_small_row_linears(model) == 1 and type(model[0]) is torch.nn.Linear
    assert not hasattr(model[0], "probe_key")


def test_one_thread_takes_no_rows_and_plans_are_kept_per_shapes_dtype_and_threads():
    small = shapes_key([(256, 512), (512, 256)])
    assert row_plan(torch.float32, threads=1, key=small) == {}
    assert row_plan(torch.float64, threads=2, key=small) == {}  # dtypes it does not measure: torch's linear
    first = measure(torch.float32, threads=2, key=small)
    assert measure(torch.float32, threads=2, key=small) is first  # measured once
    assert measure(torch.float32, threads=2, key=shapes_key([(256, 512)])) is not first
    assert first["layers"] == 2 and first["rows"] == [r for r, _ in first["plan"]] and 0 < first["ratio"] <= 1.0
    for rows, width in first["plan"]:  # pads upwards only, within the probed range
        assert 1 <= rows <= width <= MAX_ROWS and first["widths"][rows] == width


def test_probe_shapes_are_the_turnable_layers_in_module_order_up_to_the_cap(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Linear(8, 8), torch.nn.Linear(256, 1024),
                                torch.nn.Linear(1024, 512))
    monkeypatch.setattr(linear_kernels, "PROBE_MIN_BYTES", 1)
    assert probe_shapes(model) == "256x512,1024x256,512x1024"
    monkeypatch.setattr(linear_kernels, "PROBE_BYTES", 4 * 256 * 512 + 1)  # the cap stops after the layer past it
    assert probe_shapes(model) == "256x512,1024x256"
    monkeypatch.setattr(linear_kernels, "PROBE_MIN_BYTES", 4 * 256 * 512 * 7)  # 1.5 MB repeated to the 3.5 MB floor
    assert probe_shapes(model) == ",".join(["256x512,1024x256"] * 3)
    assert probe_shapes(torch.nn.Sequential(torch.nn.Linear(8, 8))) == linear_kernels.DEFAULT_KEY
    monkeypatch.setattr(linear_kernels, "PROBE_MIN_BYTES", 1)
    enable_small_row_linears(model)
    assert {m.probe_key for m in model.modules() if type(m) is SmallRowLinear} == {"256x512,1024x256"}
    assert pickle.loads(pickle.dumps(model[0])).probe_key == "256x512,1024x256"  # a worker re-measures it


def test_a_layer_keeps_its_plan_per_thread_count_and_a_copy_measures_its_own(monkeypatch):
    calls = []

    def fake_plan(dtype=torch.float32, threads=None, key=linear_kernels.DEFAULT_KEY):
        calls.append((dtype, threads))
        return {2: 2} if threads > 1 else {}

    layer = torch.nn.Linear(512, 256)
    enable_small_row_linears(layer)
    monkeypatch.setattr(linear_kernels, "row_plan", fake_plan)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        x = torch.randn(2, 512)
        want = F.linear(x, layer.weight, layer.bias)
        for _ in range(3):
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        assert calls == [(torch.float32, 2)]  # looked up once, then kept
        torch.set_num_threads(1)
        layer(x)
        assert calls[-1] == (torch.float32, 1)
        for copied in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
            assert "_plan" not in copied.__dict__ and copied.probe_key == layer.probe_key
    finally:
        torch.set_num_threads(before)


def test_describe_says_what_reports_record():
    layer = torch.nn.Linear(512, 256)
    assert describe([layer, None]) == {"enabled": False}
    enable_small_row_linears(layer)
    got = describe([None, layer])
    assert got["enabled"] and got["measured"][0]["dtype"] == "float32" and "widths" not in got["measured"][0]
    assert got["measured"][0]["threads"] == torch.get_num_threads() and got["measured"][0]["layers"] == -(-linear_kernels.PROBE_MIN_BYTES // (4 * 512 * 256))
    assert {"ratio", "rows", "plan"} <= set(got["measured"][0])


@pytest.mark.parametrize("asked,env,turned", [(None, None, True), (None, "0", False), (False, None, False),
                                               (True, "0", True)])
def test_model_pair_turns_its_models_unless_told_not_to(asked, env, turned, monkeypatch):
    monkeypatch.setattr(linear_kernels, "MIN_WEIGHT_ELEMENTS", 0)
    if env is None:
        monkeypatch.delenv(linear_kernels.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(linear_kernels.ENV_SWITCH, env)
    target = tiny_model(eos=None)
    pair = ModelPair(target, noisy_copy(target, 0.3), small_row_linears=asked)
    kinds = {type(m) for model in (pair.target, pair.draft) for m in model.modules()
             if isinstance(m, torch.nn.Linear)}
    assert kinds == ({SmallRowLinear} if turned else {torch.nn.Linear}) and pair.small_row_linears is turned


def _pairs():
    target = tiny_model(vocab=96, hidden=64, layers=3, eos=None, seed=1)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=96), target).eval()
    return {"draft_lm": (target, dict(draft=noisy_copy(target, 0.2))), "eagle3": (target, dict(eagle=head))}


def _hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["draft_lm", "eagle3"])
def test_greedy_decoding_through_turned_layers_equals_transformers_generate(kind, every_row_turned):
    target, drafter = _pairs()[kind]
    refs = [_hf_greedy(target, p, 24) for p in PROMPTS]  # before turning: the untouched model's greedy text
    pair = ModelPair(target, **drafter)
    assert any(type(m) is SmallRowLinear for m in pair.target.modules())
    decoder = SpeculativeDecoder(pair, TreeConfig(width=2, max_depth=4, max_size=8))
    for prompt, ref in zip(PROMPTS, refs):
        for config in ((1, 1), (3, 6)):
            assert decoder.generate(prompt, controller=FixedController(*config), max_new_tokens=24).tokens == ref
        assert autoregressive_generate(pair, prompt, max_new_tokens=24).tokens == ref
    outs = decoder.generate_batch(PROMPTS, controller=FixedController(3, 6), max_new_tokens=24)
    assert [o.tokens for o in outs] == refs
