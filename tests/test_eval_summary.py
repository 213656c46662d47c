"""The verdict-first summary (demo and `specpilot eval`) and the report's markdown: what is printed for each
verdict, and that "same decisions" is a flag beside the ratio and its interval, never a verdict instead of them."""
import re

import pytest

from specpilot.eval.report import write_report
from specpilot.eval.summary import format_summary_lines, summarise_report


def _comparison(method, baseline, verdict, ratio=1.0, ci=(0.98, 1.02), role="decide", same=False, **extra):
    return {"method": method, "baseline": baseline, "temperature": 0.0, "ratio": ratio, "ci": list(ci),
            "same_decisions": same, "verdict": verdict, "flags": ["same decisions"] if same else [], "n_units": 24,
            "n_prompts": 12, "baseline_role": role, **extra}


REPORT = {
    "meta": {"rounds": {"mode": "auto", "by_temperature": {"0": {"rounds": 2, "units": 24, "stopped_by":
                                                                 "same decisions", "decide_half_width": 0.02}}}},
    "summary": [{"method": m, "temperature": 0.0, "speedup": sp, "speedup_ci": [sp - 0.05, sp + 0.05], "tau": 2.5,
                 "policy_overhead": 0.01, "identical_to_ar": True, "n_units": 24} for m, sp in
                [("ar", 1.0), ("grid", 1.19), ("ltd", 1.2), ("svip", 1.1)]],
    "comparisons": [_comparison("ltd", "grid", "slower", ratio=0.981, ci=(0.970, 0.992), same=True,
                                cause="decision time", decision_share=0.019,
                                decision_ms_per_generation={"method": 0.61, "baseline": 0.19, "difference": 0.42},
                                without_decision={"ratio": 1.001, "ci": [0.990, 1.012]}),
                    _comparison("ltd", "svip", "faster", 1.09, (1.04, 1.14), role="best heuristic")],
    "groups": [{"task": "qa", "language": "en", "temperature": 0.0, "too_small": True, "ratio": 1.1,
                "ci": [0.9, 1.3], "verdict": "indistinguishable", "same_decisions": False, "n_prompts": 1,
                "n_units": 2, "method": "ltd", "baseline": "grid"}],
    "cost_check": {"fresh": {"stale": False, "max_abs_error": 0.08, "age_s": 60.0, "tolerance": 0.25,
                             "title": "fresh profile"},
                   "moving": {"stale": False, "max_abs_error": 0.36, "worst_spread": 0.18, "age_s": 372.0,
                              "tolerance": 0.25, "title": "moving machine"}},
}


def test_same_decisions_is_a_flag_beside_the_ratio():
    lines = format_summary_lines(summarise_report(REPORT))
    decide = next(line for line in lines if "ltd vs grid" in line)
    assert "0.981x (-1.9%) [0.970, 0.992], slower, 24 units" in decide
    assert ("flag: same decisions on every cycle: the difference is decision time (ltd 0.61 vs grid 0.19 ms "
            "deciding per generation, +1.9% of ltd's time; without decision time 1.001x [0.990, 1.012])") in decide
    heuristic = next(line for line in lines if "ltd vs svip" in line)
    assert "+9.0%" in heuristic and "[1.040, 1.140]" in heuristic and "faster" in heuristic
    assert "best heuristic" in heuristic


def test_summary_names_rounds_groups_and_the_cost_model():
    text = "\n".join(format_summary_lines(summarise_report(REPORT)))
    assert "2 rounds, 24 units, stopped: same decisions" in text
    assert "task groups: 1, 1 too small to conclude" in text
    assert "cost model (fresh profile): within tolerance (max error 8%; stale past 25%, profile age 1.0 min)" in text
    # a large error within tolerance says why (the live rounds themselves moved that much) and what the rule allows
    assert ("cost model (moving machine): within tolerance (max error 36% where the live rounds spread +-18%; stale "
            "past that spread + 25%, profile age 6.2 min)") in text
    assert re.search(r"ltd\s+1\.20x \[1\.15, 1\.25\]", text)


def test_markdown_leads_with_verdicts(tmp_path):
    rows = [{"task": "qa", "language": "en", "split": "heldout", "method": m, "temperature": 0.0, "speedup": 1.0,
             "tau": 1.0, "tokens_per_s": 10.0, "ttft_s": 0.1, "itl_p50_s": 0.1, "itl_p90_s": 0.1, "itl_p99_s": 0.1,
             "peak_mem_mb": 1.0, "policy_overhead": 0.0, "draft_frac": 0.0, "identical_to_ar": True, "n_prompts": 1,
             "n_tokens": 10, "speedup_ci": [0.9, 1.1], "n_units": 2} for m in ("ar", "ltd", "grid")]
    analysis = {k: REPORT[k] for k in ("summary", "comparisons", "groups")}
    write_report(rows, REPORT["meta"], tmp_path, plots=False, analysis=analysis)
    md = (tmp_path / "report.md").read_text()
    assert md.index("## Verdicts") < md.index("speedup over ar (pooled") < md.index("by task group")
    assert "ltd vs grid (T=0): 0.981x (-1.9%) [0.970, 0.992], slower, 24 units; flag: same decisions" in md
    assert "too small to conclude" in md and "1.00 [0.90, 1.10]" in md


def test_the_replay_line_gives_the_share_of_the_oracles_gain():
    replay = {"methods": [{"method": m, "speedup": sp, "live_speedup": None, "gap": None} for m, sp in
                          (("ltd", 1.9), ("grid", 1.8))],
              "oracle": {"speedup": 2.5, "share": {"ltd": 0.76, "grid": 0.72},
                         "gain_share": {"ltd": 0.6, "grid": 0.5333}}}
    text = "\n".join(format_summary_lines(summarise_report({**REPORT, "replay": replay})))
    assert "hindsight oracle 2.50x (share of its gain over AR: ltd 60%, grid 53%)" in text
    per_prompt = {**replay, "oracle": {**replay["oracle"], "per_prompt_static_speedup": 1.95}}
    assert "grid 53%); each prompt at its own best static config 1.95x" in \
        "\n".join(format_summary_lines(summarise_report({**REPORT, "replay": per_prompt})))
    older = {**replay, "oracle": {"speedup": 2.5, "share": {"ltd": 0.76}}}  # a report from before gain_share
    assert "hindsight oracle 2.50x\n" in "\n".join(format_summary_lines(summarise_report({**REPORT, "replay": older})))


def test_report_metrics_names_every_number_a_run_summary_keeps():
    from specpilot.eval.summary import report_metrics

    report = {
        "meta": {"suite": {"name": "heldout_code", "chosen_by": "pair"}, "models": {"name": "tiny"}, "dtype": "bfloat16",
                 "device": "cpu", "cpu": "Xeon", "gpu": None, "sampling": {"max_new_tokens": 48}},
        "summary": [{"method": "ltd", "temperature": 0.0, "speedup": 1.5, "speedup_ci": [1.4, 1.6], "tau": 3.0},
                    {"method": "ltd", "temperature": 1.0, "speedup": 1.2, "speedup_ci": [1.1, 1.3], "tau": 2.0}],
        "comparisons": [{"method": "ltd", "baseline": "grid", "temperature": 0.0, "ratio": 1.03, "ci": [0.99, 1.07],
                         "verdict": "indistinguishable", "n_prompts": 30, "same_decisions": False}],
        "batch_sizes": [{"batch_size": 4, "temperature": 0.0,
                         "methods": [{"method": "ltd", "speedup": 1.1, "speedup_ci": [1.0, 1.2]}],
                         "comparisons": []}],
        "replay": {"methods": [{"method": "ltd", "speedup": 1.6}], "comparisons": [],
                   "oracle": {"speedup": 2.0, "gain_share": {"ltd": 0.6}}},
        "degeneracy": {"n_measured": 30, "flagged": ["p1"]},
        "greedy_identity": {"dtype": "bfloat16", "differing": ["grid", "ltd"], "cause": "rounding", "expected": True,
                            "note": "..."},
    }
    report["meta"]["dtype_reason"] = "auto: bfloat16, this CPU has avx512_bf16"
    metrics = report_metrics(report)
    assert metrics["T=0"]["methods"]["ltd"] == {"speedup": 1.5, "tau": 3.0, "policy_overhead": None,
                                                 "identical_to_ar": None, "n_units": None, "speedup_low": 1.4,
                                                 "speedup_high": 1.6}
    assert metrics["T=1"]["methods"]["ltd"]["speedup"] == 1.2
    assert metrics["T=0"]["comparisons"]["ltd_vs_grid"]["ratio_high"] == 1.07
    assert metrics["T=0"]["B=4"]["methods"]["ltd"]["speedup_low"] == 1.0
    assert metrics["replay"]["oracle"]["gain_share"]["ltd"] == 0.6
    assert metrics["degeneracy"] == {"n_measured": 30, "n_judged": 30, "n_too_short": 0, "n_flagged": 1}
    assert metrics["greedy_identity"] == {"cause": "rounding", "expected": True, "n_differing": 2}
    assert metrics["dtype_reason"].startswith("auto: bfloat16")
    assert (metrics["suite"], metrics["hardware"], metrics["dtype"], metrics["max_new_tokens"]) == \
        ("heldout_code", "Xeon", "bfloat16", 48)


@pytest.mark.parametrize("decide,running,expected", [
    (("ltd", "grid"), ["ar", "ltd", "grid", "ddd"], ["ar", "ltd", "grid"]),
    (("ltd", "grid"), ["ar", "fixed", "ddd"], ["ar", "fixed", "ddd"]),   # no deciding pair: every round is full
])
def test_rounds_after_the_full_ones_run_the_deciding_pair_or_everything(decide, running, expected):
    from specpilot.eval.rounds import RoundPlan

    plan = RoundPlan.make(3, full_rounds=1, decide=decide)
    assert plan.methods(0, running) == running and plan.methods(2, running) == expected


def test_labels_name_the_deciding_pair_the_splits_and_a_sub_ar_oracle():
    from specpilot.eval.report import _decision_lines, _summary_scope
    from specpilot.eval.summary import _replay_lines, _rounds_line

    rounds = {"by_temperature": {"0": {"rounds": 3, "units": 9, "stopped_by": "max rounds", "decide_half_width": 0.05,
                                       "decide": ["ddd", "fixed"]}}}
    assert "ddd vs fixed +-5.0%" in _rounds_line(rounds)[0]
    assert "differs from fixed" in "\n".join(_decision_lines({"0": {}}, "fixed"))
    assert _summary_scope([], {"prompt_mix": {"by_split": {"heldout": 6, "train": 2}}}) == \
        "All-prompt (splits heldout 6, train 2)"
    assert _summary_scope([], {"prompt_mix": {"by_split": {"heldout": 6}}}) == "Held-out"
    replay = {"methods": {}, "oracle": {"speedup": 0.61}}
    assert any("oracle is below AR" in line for line in _replay_lines(replay))
