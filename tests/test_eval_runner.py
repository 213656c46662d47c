"""`evaluate()` and `write_report()` on a tiny random Llama pair: schema, losslessness of every greedy method,
skipped methods, concurrency rows, report files. Tests never assert wall-clock numbers."""
import json
import math

import pytest
import torch

from specpilot.drafting import ModelPair, TreeConfig
from specpilot.eval.report import REQUIRED_ROW_KEYS, write_report
from specpilot.eval.runner import METHODS, evaluate
from specpilot.eval.suites import Prompt

VOCAB = 96
GREEDY_METHODS = ["fixed", "grid", "ddd", "svip", "confidence", "hf_heuristic", "hf_generate", "hf_assisted"]


def _model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()  # decoding-ready, as from_pretrained returns it


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the test machine's cores are shared; one thread avoids oversubscription stalls
    target = _model(0)
    draft = _model(0)
    with torch.no_grad():  # a perturbed copy: accepts often but not always, so both paths are exercised
        for p in draft.parameters():
            p.add_(0.005 * torch.randn_like(p))
    yield ModelPair(target, draft)
    torch.set_num_threads(threads)


def _encode(text: str) -> list[int]:
    return [3 + b % (VOCAB - 3) for b in text.encode()][:24]  # avoid the default eos id 2


PROMPTS = [Prompt("c1", "code", "python", "heldout", "def add(a, b):\n    return"),
           Prompt("q1", "qa", "it", "heldout", "Domanda: perché il cielo è blu?\nRisposta:")]


@pytest.fixture(scope="module")
def greedy(pair, tmp_path_factory):
    grid = tmp_path_factory.mktemp("grid") / "grid.json"
    grid.write_text(json.dumps({"best": {"depth": 3, "size": 5, "width": 2}}))
    return evaluate(PROMPTS, pair=pair, methods=GREEDY_METHODS + ["ltd"], temperatures=(0.0,),
                    max_new_tokens=16, repeats=1, warmup=1, tree=TreeConfig(width=2, max_depth=4, max_size=8),
                    grid=grid, encode=_encode)


def test_rows_have_the_report_schema(greedy):
    assert greedy.results
    for row in greedy.results:
        assert set(REQUIRED_ROW_KEYS) <= set(row), set(REQUIRED_ROW_KEYS) - set(row)
        assert row["n_prompts"] == 1 and row["n_tokens"] > 0
    methods = {r["method"] for r in greedy.results}
    assert methods == {"ar", *GREEDY_METHODS}


@pytest.mark.parametrize("method", ["ar"] + GREEDY_METHODS)
def test_every_greedy_method_is_identical_to_ar(greedy, method):
    rows = [r for r in greedy.results if r["method"] == method]
    assert len(rows) == len(PROMPTS)
    assert all(r["identical_to_ar"] is True for r in rows)


def test_speculative_rows_record_cycles(greedy):
    fixed = [r for r in greedy.results if r["method"] == "fixed"]
    assert all(r["tau"] >= 1.0 and r["depth_dist"] for r in fixed)
    assert any(r["tau"] > 1.0 for r in fixed), "the near-copy draft should get some tokens accepted"
    ar = [r for r in greedy.results if r["method"] == "ar"]
    assert all(r["speedup"] == pytest.approx(1.0) and r["tau"] == pytest.approx(1.0) for r in ar)


def test_unavailable_method_skipped_with_reason(greedy):
    assert "ltd" in greedy.meta["skipped"] and "--run" in greedy.meta["skipped"]["ltd"]
    assert not any(r["method"] == "ltd" for r in greedy.results)


def test_meta_labels_the_measurement(greedy):
    meta = greedy.meta
    for key in ("models", "dtype", "device", "cpu", "versions", "sampling", "prompt_mix", "date", "tree"):
        assert key in meta
    assert meta["models"]["target_hash"] and meta["versions"]["torch"]
    assert meta["prompt_mix"]["by_task_language"] == {"code/python": 1, "qa/it": 1}


def test_write_report_files(greedy, tmp_path):
    paths = write_report(greedy.results, greedy.meta, tmp_path, analysis=greedy.analysis())
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) >= {"results", "meta", "summary", "comparisons", "groups", "decisions"}
    assert len(report["results"]) == len(greedy.results)
    md = (tmp_path / "report.md").read_text()
    assert "Speedup over ar" in md and "Held-out speedup over ar" in md and "## Decisions" in md
    for name in ("forest_speedup_T0", "decisions_T0", "time_split_T0", "choices_T0"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0, name
    assert not (tmp_path / "speedup_T0.png").exists()
    assert paths["json"].endswith("report.json")


def test_write_report_without_analysis_keeps_the_rows(greedy, tmp_path):
    write_report(greedy.results, greedy.meta, tmp_path, plots=False)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"][0]["mean_speedup"] is not None and report["comparisons"] is None


def test_sampling_and_concurrency_rows(pair):
    res = evaluate(PROMPTS, pair=pair, methods=["fixed"], temperatures=(1.0,), top_k=20, max_new_tokens=6,
                   warmup=0, concurrency=2, tree=TreeConfig(width=2, max_depth=3, max_size=6), encode=_encode)
    assert {(r["method"], r["concurrency"]) for r in res.results} == {("ar", 1), ("fixed", 1), ("ar", 2),
                                                                      ("fixed", 2)}
    assert all(r["identical_to_ar"] is None for r in res.results)


def test_sampled_methods_limit_the_sampled_runs(pair):
    res = evaluate(PROMPTS[:2], pair=pair, methods=["fixed", "svip"], temperatures=(0.0, 1.0), max_new_tokens=6,
                   sampled_methods=["fixed"], encode=_encode)
    ran = {(r["method"], r["temperature"]) for r in res.results}
    assert ran == {("ar", 0.0), ("fixed", 0.0), ("svip", 0.0), ("ar", 1.0), ("fixed", 1.0)}
    assert res.meta["sampled_methods"] == ["ar", "fixed"]


def test_unknown_method_rejected(pair):
    with pytest.raises(ValueError, match="unknown method"):
        evaluate(PROMPTS, pair=pair, methods=["warp_drive"], encode=_encode)


def test_registry_covers_the_issue_methods():
    assert set(METHODS) >= {"ar", "hf_generate", "hf_assisted", "fixed", "grid", "ddd", "svip", "confidence",
                            "hf_heuristic", "ltd", "depth_only", "size_only"}


# ---- paired intervals, adaptive rounds, arbitrary controllers --------------------------------------------------
TREE = TreeConfig(width=2, max_depth=4, max_size=8)


@pytest.fixture(scope="module")
def grid_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("grid2") / "grid.json"
    path.write_text(json.dumps({"best": {"depth": 3, "size": 5, "width": 2}}))
    return path


def _adaptive(pair, grid_file, ltd, **kwargs):
    from specpilot.policies import FixedController

    return evaluate(PROMPTS, pair=pair, methods=["grid", "fixed"], controllers={"ltd": FixedController(*ltd)},
                    temperatures=(0.0,), max_new_tokens=8, warmup=0, tree=TREE, grid=grid_file, encode=_encode,
                    **kwargs)


def test_zero_budget_stops_after_the_minimum_rounds(pair, grid_file):
    res = _adaptive(pair, grid_file, (2, 4), rounds="auto", min_rounds=2, time_budget_s=0.0,
                    target_half_width=1e-9, full_rounds=1)
    info = res.meta["rounds"]["by_temperature"]["0"]
    assert info["rounds"] == 2 and info["units"] == 2 * len(PROMPTS) and info["stopped_by"] == "time budget"
    units = {(r.method, r.repeat) for r in res.records}
    assert ("fixed", 1) not in units and {("ltd", 1), ("grid", 1), ("ar", 1)} <= units  # full_rounds=1


def test_same_decisions_stop_and_verdict(pair, grid_file):
    res = _adaptive(pair, grid_file, (3, 5), rounds="auto", min_rounds=2, max_rounds=6)
    assert res.meta["rounds"]["by_temperature"]["0"]["stopped_by"] != "same decisions"  # a flag, never a stop
    decide = next(c for c in res.comparisons if (c["method"], c["baseline"]) == ("ltd", "grid"))
    assert decide["same_decisions"] is True and decide["flags"] == ["same decisions"]
    assert decide["verdict"] in ("faster", "slower", "indistinguishable") and "decision_ms_per_generation" in decide


def test_rows_and_summary_carry_paired_intervals(pair, grid_file):
    res = _adaptive(pair, grid_file, (2, 4), rounds=3)
    info = res.meta["rounds"]["by_temperature"]["0"]
    assert info["stopped_by"] == "fixed" and info["rounds"] == 3
    for row in res.results:  # intervals resample prompts: a group of one prompt has none
        low, high = row["speedup_ci"]
        assert row["n_units"] == 3 and (math.isnan(low) or low <= row["speedup"] <= high)
    summary = {s["method"]: s for s in res.summary}
    assert all(s["speedup_ci"][0] <= s["speedup"] <= s["speedup_ci"][1] for s in res.summary)
    assert summary["ltd"]["n_units"] == 3 * len(PROMPTS) and summary["ar"]["speedup"] == pytest.approx(1.0)
    assert {(c["method"], c["baseline"]) for c in res.comparisons} >= {("ltd", "grid")}
    assert {c["verdict"] for c in res.comparisons} <= {"faster", "slower", "indistinguishable"}
    assert res.decisions["0"]["ltd"]["differs_from_reference"] == 1.0
    assert res.decisions["0"]["grid"]["reference_config"] == [3, 5]


def test_controllers_run_with_the_same_loop_and_return_copies(pair):
    from specpilot.policies import FixedController

    res = evaluate(PROMPTS[:1], pair=pair, controllers={"d1": FixedController(1, 2), "d3": FixedController(3, 6)},
                   temperatures=(0.0,), max_new_tokens=6, warmup=0, tree=TREE, encode=_encode, rounds=2)
    assert {r["method"] for r in res.results} == {"ar", "d1", "d3"}
    assert all(r["identical_to_ar"] for r in res.results)
    controller, tree = res.controllers["d3"]
    assert isinstance(controller, FixedController) and controller.depth == 3 and tree == TREE


@pytest.mark.parametrize("controllers, error, message", [
    ({"ar": "x"}, ValueError, "clash with method names"),
    ({"mine": object()}, TypeError, "not a specpilot.policies.Controller"),
])
def test_bad_controllers_rejected(pair, controllers, error, message):
    with pytest.raises(error, match=message):
        evaluate(PROMPTS, pair=pair, controllers=controllers, temperatures=(0.0,), encode=_encode)


def test_replay_beside_live_and_the_cost_check(pair, grid_file, tmp_path):
    from specpilot.eval.costcheck import check_records
    from specpilot.eval.full import measure_with_ar
    from specpilot.eval.replay_eval import heldout_trace, replay_evaluation

    res = _adaptive(pair, grid_file, (2, 4), rounds=2)
    ids = [_encode(p.prompt) for p in PROMPTS]
    trace = heldout_trace(pair, TREE, ids, tmp_path / "trace", max_new_tokens=8)
    assert heldout_trace(pair, TREE, ids, tmp_path / "trace", max_new_tokens=8).path == trace.path  # reused
    assert len(heldout_trace(pair, TREE, ids[:1], tmp_path / "trace", max_new_tokens=8).header["prompts"]) == 1
    trace = heldout_trace(pair, TREE, ids, tmp_path / "trace", max_new_tokens=8)  # its own cache: re-recorded
    profile = measure_with_ar(pair, TREE, ids, max_new_tokens=8)
    assert profile.meta["ar_seconds_per_token"] > 0 and profile.meta["cycles"] > 0
    replay = replay_evaluation(res, trace, profile, prompts=PROMPTS)
    assert replay["ar_source"] == "measured with the profile, interleaved"
    by = {m["method"]: m for m in replay["methods"]}
    assert set(by) == {"ltd", "grid", "fixed"}
    assert by["grid"]["tau"] == pytest.approx(next(s["tau"] for s in res.summary if s["method"] == "grid"))
    decide = replay["comparisons"][0]
    assert (decide["method"], decide["baseline"]) == ("ltd", "grid") and decide["same_decisions"] is False
    # deciding costs what the profile's probe policy took: a policy network pays it, fixed configs do not
    assert set(replay["decision_us"]) == {"skip", "stop", "size"} and min(replay["decision_us"].values()) > 0
    assert all(m["decision_share"] == 0 for m in replay["methods"])  # (this "ltd" is a fixed config)
    from specpilot.policies.learned import probe_controller
    learned = probe_controller(TREE.width, TREE.max_depth, [1, 2, 4])
    charged = replay_evaluation(res, trace, profile, prompts=PROMPTS, replay_only={"net": (learned, TREE)})
    assert next(m for m in charged["methods"] if m["method"] == "net")["decision_share"] > 0
    assert replay["oracle"]["speedup"] >= max(m["speedup"] for m in replay["methods"]) * (1 - 1e-9)
    o = replay["oracle"]  # the share of the oracle's gain over AR, on the AR reference the speedups use
    for m in replay["methods"]:
        speedup = m["tokens_per_s"] * replay["ar_seconds_per_token"]
        want = (speedup - 1) / (o["speedup"] - 1) if o["speedup"] > 1 else None  # (a tiny pair may not gain)
        assert o["gain_share"][m["method"]] == (want if want is None else pytest.approx(want))
    # controllers not run live are replayed beside the others (built without a pair)
    from specpilot.eval.methods import EvalContext, replay_controllers
    from specpilot.policies import FixedController
    extra, skipped = replay_controllers(["fixed", "hf_generate"], EvalContext(pair=None, tree=TREE))
    assert set(extra) == {"fixed"} and "not a controller" in skipped["hf_generate"]
    plus = replay_evaluation(res, trace, profile, prompts=PROMPTS,
                             replay_only={"shallow": (FixedController(1, 2), TREE)})
    assert plus["replay_only"] == ["shallow"] and replay["replay_only"] == []
    assert next(m for m in plus["methods"] if m["method"] == "shallow")["live_speedup"] is None
    # prompts whose target output is degenerate are left out of replay, as of the live verdicts
    assert replay["n_prompts"] == len(PROMPTS) and replay["n_degenerate_left_out"] == 0
    res.degeneracy = {"flagged": [PROMPTS[0].id]}
    kept = replay_evaluation(res, trace, profile, prompts=PROMPTS)
    assert kept["n_prompts"] == len(PROMPTS) - 1 and kept["prompts_kept"] == list(range(1, len(PROMPTS)))
    assert kept["n_degenerate_left_out"] == 1 and kept["comparisons"][0]["n_units"] == len(PROMPTS) - 1
    assert all(m["n_prompts"] == len(PROMPTS) - 1 for m in kept["methods"])
    res.degeneracy = {"flagged": [p.id for p in PROMPTS]}
    with pytest.raises(ValueError, match="every prompt is flagged degenerate"):
        replay_evaluation(res, trace, profile, prompts=PROMPTS)
    res.degeneracy = None
    ar_s = profile.meta.pop("ar_seconds_per_token")  # without it: the run's live ar is the reference
    again = replay_evaluation(res, trace, profile, prompts=PROMPTS)
    assert again["ar_source"].startswith("this run's live ar")
    scale = ar_s / again["ar_seconds_per_token"]
    assert again["methods"][0]["speedup"] == pytest.approx(replay["methods"][0]["speedup"] / scale)
    check = check_records(trace, profile, res.records, {"grid": (3, 5)}, {p.id: i for i, p in enumerate(PROMPTS)})
    rows = {c["method"]: c for c in check["configs"]}
    assert rows["grid"]["measured_tokens_per_s"] > 0
    assert rows["ar"]["config"] == "d0_s0" and rows["ar"]["measured_tokens_per_s"] > 0  # the plain step vs live ar
    assert isinstance(check["stale"], bool)


@pytest.mark.parametrize("tps, oracle, ar, share", [
    (150.0, 200.0, 100.0, 0.5),   # half the oracle's gain
    (200.0, 200.0, 100.0, 1.0),   # as fast as the oracle
    (100.0, 200.0, 100.0, 0.0),   # no faster than AR
    (90.0, 200.0, 100.0, -0.1),   # slower than AR
    (120.0, 100.0, 100.0, None),  # an oracle no faster than AR: no gain to share
])
def test_gain_share(tps, oracle, ar, share):
    from specpilot.eval.replay_eval import gain_share

    got = gain_share(tps, oracle, ar)
    assert got == (None if share is None else pytest.approx(share))
