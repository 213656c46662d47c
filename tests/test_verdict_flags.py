"""Verdicts never hide a measured cost: the verdict comes from the paired interval alone, and "same decisions" is a
flag beside it that says where a difference comes from (decision time, timing noise), in report.json, report.md and
the console summary."""
import numpy as np
import pytest

from specpilot.eval.compare import compare, describe, group_comparisons, unit_records
from specpilot.eval.metrics import RunRecord
from specpilot.eval.report import write_report
from specpilot.eval.suites import Prompt
from specpilot.eval.summary import format_summary_lines, summarise_report

CYCLES = [(2, 8, 3), (3, 8, 4), (2, 8, 1)]
EXTRA_S = 0.02  # ltd's constant extra decision time per generation


def _records(*, extra_policy_s: float, extra_other_s: float = 0.0, ltd_noise: float = 0.0, n_prompts: int = 6,
             rounds: int = 2, ltd_cycles=CYCLES) -> list[RunRecord]:
    """ltd and grid decide identically (unless `ltd_cycles` differs); ltd pays `extra_policy_s` more controller
    time per generation (charged in policy_s, as run_cycle charges it), `extra_other_s` of time nobody charges,
    and +-`ltd_noise` of relative timing noise of its own."""
    rng = np.random.default_rng(3)
    out = []
    for p in range(n_prompts):
        for r in range(rounds):
            base = rng.uniform(0.5, 1.5)
            grid_wall = base * rng.uniform(0.99, 1.01)
            ltd_wall = grid_wall * rng.uniform(1 - ltd_noise, 1 + ltd_noise) + extra_policy_s + extra_other_s
            out += [RunRecord(f"p{p}", "ar", list(range(12)), wall_s=2 * base, repeat=r, temperature=1.0),
                    RunRecord(f"p{p}", "grid", list(range(12)), wall_s=grid_wall, cycles=list(CYCLES),
                              policy_s=0.001, repeat=r, temperature=1.0),
                    RunRecord(f"p{p}", "ltd", list(range(12)), cycles=list(ltd_cycles), repeat=r, temperature=1.0,
                              wall_s=ltd_wall, policy_s=0.001 + extra_policy_s)]
    return out


def _decide(records) -> dict:
    return compare(unit_records(records, temperature=1.0), "ltd", "grid", temperature=1.0)


def test_same_decisions_with_a_constant_extra_cost_is_slower_with_the_flag():
    c = _decide(_records(extra_policy_s=EXTRA_S))
    assert c["verdict"] == "slower" and c["ci"][1] < 1.0 and c["ratio"] < 1.0
    assert c["same_decisions"] is True and c["flags"] == ["same decisions"]
    assert c["cause"] == "decision time"
    ms = c["decision_ms_per_generation"]
    assert ms["difference"] == pytest.approx(1e3 * EXTRA_S) and ms["baseline"] == pytest.approx(1.0)
    assert c["without_decision"]["ratio"] == pytest.approx(1.0)
    line = describe(c)
    assert "ltd vs grid (T=1): 0.9" in line and "slower" in line and "%" in line
    assert "flag: same decisions on every cycle: the difference is decision time" in line
    assert "ltd 21.00 vs grid 1.00 ms deciding per generation" in line


def test_cost_nobody_charged_is_not_called_decision_time():
    c = _decide(_records(extra_policy_s=0.0, extra_other_s=EXTRA_S))
    assert c["verdict"] == "slower" and c["flags"] == ["same decisions"]
    assert c["cause"] == "timing beyond decision time"


def test_same_decisions_and_same_time_is_indistinguishable_timing_noise():
    c = _decide(_records(extra_policy_s=0.0, ltd_noise=0.05))
    assert c["verdict"] == "indistinguishable" and c["ci"][0] < 1.0 < c["ci"][1]
    assert c["cause"] == "timing noise" and "within timing noise" in describe(c)


def test_different_decisions_carry_no_flag():
    c = _decide(_records(extra_policy_s=EXTRA_S, ltd_cycles=[(4, 8, 3)]))
    assert c["verdict"] == "slower" and c["flags"] == [] and "cause" not in c and "flag" not in describe(c)


def test_a_legacy_same_decisions_verdict_is_read_from_its_interval():
    legacy = {"method": "ltd", "baseline": "grid", "temperature": 0.0, "ratio": 0.96, "ci": [0.95, 0.97],
              "same_decisions": True, "verdict": "same decisions", "n_units": 8}
    assert describe(legacy) == ("ltd vs grid (T=0): 0.960x (-4.0%) [0.950, 0.970], slower, 8 units; "
                                "flag: same decisions on every cycle")


def test_report_and_summary_show_the_ratio_and_the_flag(tmp_path):
    records = _records(extra_policy_s=EXTRA_S)
    c = {**_decide(records), "baseline_role": "decide"}
    prompts = [Prompt(f"p{i}", "qa", "en", "heldout", "x") for i in range(6)]
    groups = group_comparisons(records, prompts, temperature=1.0)
    rows = [{"task": "qa", "language": "en", "split": "heldout", "method": m, "temperature": 1.0, "speedup": 1.0,
             "tau": 1.0, "tokens_per_s": 10.0, "ttft_s": 0.1, "itl_p50_s": 0.1, "itl_p90_s": 0.1, "itl_p99_s": 0.1,
             "peak_mem_mb": 1.0, "policy_overhead": 0.0, "draft_frac": 0.0, "identical_to_ar": None, "n_prompts": 6,
             "n_tokens": 12} for m in ("ar", "ltd", "grid")]
    write_report(rows, {}, tmp_path, plots=False, analysis={"comparisons": [c], "groups": groups})
    md = (tmp_path / "report.md").read_text()
    assert f"- {describe(c)}" in md and "slower" in md and "no difference to report" not in md
    assert "slower; flag: same decisions (decision time)" in md  # the task-group table
    import json

    report = json.loads((tmp_path / "report.json").read_text())
    saved = report["comparisons"][0]
    assert saved["verdict"] == "slower" and saved["flags"] == ["same decisions"]
    assert saved["decision_ms_per_generation"]["difference"] == pytest.approx(1e3 * EXTRA_S)
    lines = format_summary_lines(summarise_report(report, temperature=1.0))
    decide = next(line for line in lines if "ltd vs grid" in line)
    assert "slower" in decide and "flag: same decisions" in decide and "decision time" in decide
    assert summarise_report(report, temperature=1.0)["ltd_vs_grid"]["verdict"] == "slower"


def _live(ratio, ci, temperature=0.0, flags=()):
    return {"method": "ltd", "baseline": "grid", "temperature": temperature, "ratio": ratio, "ci": list(ci),
            "verdict": "faster", "flags": list(flags), "n_units": 54, "same_decisions": "same decisions" in flags}


@pytest.mark.parametrize("replay_ratio, flagged", [
    (1.072, True),    # demo X: live 1.133x [1.091, 1.178], replay 1.072x
    (1.094, False),   # inside the live interval
    (1.200, True),    # above it
    (float("nan"), False),
])
def test_a_live_interval_that_leaves_out_replay_is_flagged_not_changed(replay_ratio, flagged):
    from specpilot.eval.compare import REPLAY_OUTSIDE, flag_replay_outside

    live = [_live(1.133, (1.091, 1.178)), _live(1.01, (0.98, 1.03), temperature=1.0)]
    replayed = [{"method": "ltd", "baseline": "grid", "temperature": 0.0, "ratio": replay_ratio,
                 "ci": [replay_ratio - 0.02, replay_ratio + 0.02], "flags": [], "n_units": 27}]
    flag_replay_outside(live, replayed)
    flag_replay_outside(live, replayed)  # idempotent
    assert live[0]["verdict"] == "faster" and live[0]["ratio"] == 1.133  # the verdict stands as measured
    assert live[0]["flags"] == ([REPLAY_OUTSIDE] if flagged else [])
    if np.isfinite(replay_ratio):  # one schema, flagged or not (report keys must not depend on timing)
        assert live[0]["replay"] == {"ratio": replay_ratio, "ci": [replay_ratio - 0.02, replay_ratio + 0.02],
                                     "inside": not flagged}
    assert live[1]["flags"] == []  # sampled comparisons have no replay
    line = describe(live[0])
    assert ("flag: exact replay of these prompts gives" in line) is flagged
    if flagged:
        assert f"{replay_ratio:.3f}x" in line and "measure again" in line


def test_the_replay_clause_follows_the_same_decisions_clause():
    from specpilot.eval.compare import flag_replay_outside

    live = [_live(0.99, (0.98, 0.995), flags=["same decisions"])]
    flag_replay_outside(live, [{"method": "ltd", "baseline": "grid", "temperature": 0.0, "ratio": 1.0,
                                "ci": [0.99, 1.01]}])
    line = describe(live[0])
    assert "flag: same decisions on every cycle; exact replay of these prompts gives 1.000x" in line
