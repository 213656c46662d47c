"""The degeneracy measure on known looping and non-looping texts, the group marks, and the exclusion of flagged
prompts from the verdicts (shown apart in the report)."""
import re

import pytest

from specpilot.eval.degeneracy import (MIN_TOKENS, compression_ratio, degeneracy_report, greedy_outputs, measure,
                                       repeated_ngram_share)
from specpilot.eval.metrics import RunRecord
from specpilot.eval.suites import Prompt

LOOPING = {
    "a comment loop": "# 'a' is a 'a' is a 'a' is a 'a' is a 'a' is a 'a' is a 'a' is a 'a' is a 'a' is a 'a' "
                      "is a 'a' is a 'a' is a 'a' is a 'a' is a 'a'",
    "a repeated line": "        self.assertEqual(x, 0)\n" * 8,
    "a hex dump": "#  0x5 -> 0x5\n" * 10,
}
NOT_LOOPING = {
    "a function": '''    if not values:
        raise ValueError("percentile of an empty list")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)''',
    "a class": '''    def __init__(self, owner: str, balance: float = 0.0) -> None:
        self.owner = owner
        self.balance = balance
        self.history: list[tuple[str, float]] = []

    def deposit(self, amount: float) -> None:
        if amount <= 0:
            raise ValueError("deposit must be positive")''',
    "prose": "The sky looks blue because air molecules scatter short wavelengths of sunlight more strongly than "
             "long ones, so blue light reaches our eyes from every direction of the sky.",
}


def _tokens(text: str) -> list[int]:
    """Word-and-punctuation ids: close enough to a BPE tokenizer for n-gram repetition."""
    vocab: dict[str, int] = {}
    return [vocab.setdefault(piece, len(vocab)) for piece in re.findall(r"\w+|[^\w\s]|\n", text)]


@pytest.mark.parametrize("name", LOOPING)
def test_looping_text_is_flagged(name):
    text = LOOPING[name]
    m = measure(_tokens(text), text)
    assert m.degenerate and m.reason, (name, m)
    assert m.repeated_ngram_share >= 0.5 and m.compression_ratio < 0.4


@pytest.mark.parametrize("name", NOT_LOOPING)
def test_ordinary_code_and_prose_are_not_flagged(name):
    text = NOT_LOOPING[name]
    m = measure(_tokens(text), text)
    assert not m.degenerate and m.reason == "", (name, m)
    assert m.repeated_ngram_share < 0.2 and m.compression_ratio > 0.4


def test_short_outputs_are_never_judged():
    m = measure([7] * (MIN_TOKENS - 1))
    assert m.repeated_ngram_share > 0.9 and not m.degenerate
    assert measure([7] * MIN_TOKENS).degenerate  # without text the ids are compressed


def test_measures_at_their_extremes():
    assert repeated_ngram_share([1, 2, 3]) == 0.0 and repeated_ngram_share(list(range(40))) == 0.0
    assert repeated_ngram_share([1, 2] * 20) == pytest.approx(1 - 2 / 37)
    assert compression_ratio(b"") == 1.0 and compression_ratio(b"ab" * 500) < 0.05


def _prompts():
    return [Prompt(f"{task}-{i}", task, "en", "heldout", "x") for task in ("prose", "code") for i in range(3)]


def _records(prompt_id: str, tokens: list[int], rounds: int = 2, ltd_s: float = 1.0) -> list[RunRecord]:
    out = []
    for r in range(rounds):
        out.append(RunRecord(prompt_id, "ar", tokens, 2.0, repeat=r))
        out.append(RunRecord(prompt_id, "grid", tokens, 1.0, repeat=r, cycles=[(3, 5, 4)]))
        out.append(RunRecord(prompt_id, "ltd", tokens, ltd_s, repeat=r, cycles=[(6, 9, 6)]))
    return out


def test_report_flags_prompts_and_groups():
    outputs = {"prose-0": [1, 2] * 20, "prose-1": [3, 4, 5] * 12, "prose-2": list(range(40)),
               "code-0": list(range(40)), "code-1": list(range(50, 90))}  # code-2 has no greedy output
    rep = degeneracy_report(outputs, _prompts())
    assert rep["flagged"] == ["prose-0", "prose-1"] and rep["n_measured"] == 5 and rep["n_prompts"] == 6
    groups = {g["task"]: g for g in rep["groups"]}
    assert groups["prose"]["degenerate"] and groups["prose"]["n_flagged"] == 2
    assert not groups["code"]["degenerate"] and groups["code"]["n_measured"] == 2


def test_outputs_too_short_to_judge_are_counted_apart_not_called_clean(tmp_path):
    """An output under MIN_TOKENS (a small budget, an early stop) is not judged: the report says so instead of
    "not degenerate on any of N measured prompts", and a group's share is taken over its judged prompts."""
    from specpilot.eval.report import _degeneracy_lines, _excluded_note
    from specpilot.eval.summary import _suite_lines

    outputs = {"prose-0": [1, 2] * 4, "prose-1": [3, 4, 5] * 12, "prose-2": list(range(8)),
               "code-0": list(range(40)), "code-1": list(range(50, 58))}
    rep = degeneracy_report(outputs, _prompts())
    assert rep["too_short"] == ["prose-0", "prose-2", "code-1"] and rep["n_too_short"] == 3
    assert rep["n_judged"] == 2 and rep["n_measured"] == 5
    groups = {g["task"]: g for g in rep["groups"]}
    assert groups["prose"]["n_judged"] == 1 and groups["prose"]["degenerate"]  # prose-1 loops: 1 of 1 judged
    assert "left out** of the verdicts" in _excluded_note(rep)[0]
    assert "3 too short to judge (< 16 new tokens, kept in the verdicts)" in _excluded_note(rep)[0]
    clean = degeneracy_report({"code-0": list(range(40)), "code-1": [1, 2]}, _prompts())
    assert _excluded_note(clean)[0] == ("No prompt left out: the target's greedy output is not degenerate on any of "
                                        "1 judged prompts; 1 too short to judge (< 16 new tokens, kept in the "
                                        "verdicts).")
    assert "2 of 6 prompts, 1 judged: 0 flagged; 1 too short" in "\n".join(_degeneracy_lines(clean))
    from specpilot.eval.summary import summarise_report

    line = next(x for x in _suite_lines(summarise_report({"meta": {}, "degeneracy": clean}))
                if x.startswith("degenerate output"))
    assert line == ("degenerate output: none of 1 judged prompts (all in the verdicts); 1 too short to judge "
                    "(< 16 new tokens, kept in the verdicts)")
    short_only = degeneracy_report({"code-0": [1, 2], "code-1": [3]}, _prompts())
    assert _excluded_note(short_only)[0] == ("No prompt left out: no output long enough to judge: all 2 are under 16 "
                                             "new tokens (kept in the verdicts).")
    line = next(x for x in _suite_lines(summarise_report({"meta": {}, "degeneracy": short_only}))
                if x.startswith("degenerate output"))
    assert line.endswith("all 2 are under 16 new tokens (kept in the verdicts)")


def test_greedy_outputs_are_ar_at_temperature_zero_from_the_first_round():
    recs = [RunRecord("p", "ar", [9], 1.0, repeat=1), RunRecord("p", "ar", [1, 2], 1.0, repeat=0),
            RunRecord("p", "ltd", [5], 1.0), RunRecord("q", "ar", [3], 1.0, temperature=1.0)]
    assert greedy_outputs(recs) == {"p": [1, 2]}


def test_flagged_prompts_leave_the_verdicts_and_are_shown_apart(tmp_path):
    """ltd is much faster than grid only on the looping prompts: the headline (non-flagged) comparison does not
    see it, the degeneracy block does, and report.md says how many prompts were left out."""
    from specpilot.eval.report import write_report
    from specpilot.eval.runner import EvalResult, _analyse

    prompts = _prompts()
    records = []
    for p in prompts:
        loop = p.task == "prose"
        records += _records(p.id, [1, 2] * 20 if loop else list(range(40)), ltd_s=0.5 if loop else 1.0)
    result = EvalResult(results=[], meta={}, records=records)
    result.degeneracy = degeneracy_report(greedy_outputs(records), prompts)
    _analyse(result, prompts, (0.0,), ("ltd", "grid"), seed=0)
    head = next(c for c in result.comparisons if c["baseline_role"] == "decide")
    apart = next(c for c in result.degeneracy["comparisons"] if c["baseline_role"] == "decide")
    assert head["n_prompts"] == 3 and head["ratio"] == pytest.approx(1.0)
    assert apart["n_prompts"] == 3 and apart["ratio"] == pytest.approx(2.0)
    summary = {s["method"]: s for s in result.summary}
    assert summary["ltd"]["n_prompts"] == 3 and summary["ltd"]["identical_to_ar"] is True
    md = open(write_report([], {}, tmp_path, plots=False, analysis=result.analysis())["md"]).read()
    assert "3 of 6 judged prompts left out" in md and "## Degenerate output" in md and "prose-0" in md


def test_every_prompt_flagged_leaves_no_headline(tmp_path):
    from specpilot.eval.runner import EvalResult, _analyse
    from specpilot.eval.summary import format_summary_lines, summarise_report

    prompts = [p for p in _prompts() if p.task == "prose"]
    records = [r for p in prompts for r in _records(p.id, [1, 2] * 20)]
    result = EvalResult(results=[], meta={"suite": {"name": "heldout", "chosen_by": "--suite"}}, records=records)
    result.degeneracy = degeneracy_report(greedy_outputs(records), prompts)
    _analyse(result, prompts, (0.0,), ("ltd", "grid"), seed=0)
    assert result.comparisons == [] and result.summary == []
    report = {"meta": result.meta, **result.analysis()}
    lines = format_summary_lines(summarise_report(report))
    assert lines[0] == "suite: heldout (--suite)"
    assert "degenerate output: 3 of 3 judged prompts left out of the verdicts and speedups; degenerate groups: " \
        "prose/en" in lines
    assert any(line.startswith("  on those prompts only (not a verdict): ltd vs grid") for line in lines)
    assert any(line.startswith("no verdict:") for line in lines)


def test_a_task_in_several_languages_gets_an_all_languages_mark():
    prompts = [Prompt(f"qa-{lang}", "qa", lang, "heldout", "x") for lang in ("it", "zh")]
    rep = degeneracy_report({"qa-it": [1, 2] * 20, "qa-zh": [3, 4] * 20}, prompts)
    groups = {(g["task"], g["language"]): g for g in rep["groups"]}
    assert groups[("qa", "all")]["degenerate"] and groups[("qa", "all")]["n_flagged"] == 2


def test_a_group_interval_leaves_its_flagged_prompts_out(tmp_path):
    """One looping prompt inside a task group: the group's interval is over the others (as the headline and replay
    are), and report.md says how many it left out."""
    from specpilot.eval.report import write_report
    from specpilot.eval.runner import EvalResult, _analyse

    prompts = [Prompt(f"num-{i}", "numerics", "python", "heldout", "x") for i in range(4)]
    records = []
    for i, p in enumerate(prompts):
        loop = i == 0
        records += _records(p.id, [1, 2] * 20 if loop else list(range(40)), ltd_s=0.5 if loop else 1.0)
    result = EvalResult(results=[], meta={}, records=records)
    result.degeneracy = degeneracy_report(greedy_outputs(records), prompts)
    _analyse(result, prompts, (0.0,), ("ltd", "grid"), seed=0)
    (group,) = result.groups
    assert group["n_prompts"] == 3 and group["ratio"] == pytest.approx(1.0)
    md = open(write_report([], {}, tmp_path, plots=False, analysis=result.analysis())["md"]).read()
    assert "(1 degenerate prompt(s) left out)" in md


def test_the_stopping_rule_leaves_flagged_prompts_out():
    """Rounds stop on the deciding interval over the prompts the verdict keeps (`Measurer.flagged`)."""
    import torch

    from specpilot.eval.rounds import Measurer, RoundPlan, _decided

    records = _records("loop", [1, 2] * 20, ltd_s=0.5) + _records("code", list(range(40)))
    measurer = Measurer({}, [], [], torch.device("cpu"), None, 0, {}, records,
                        degenerate=lambda tokens: measure(tokens).degenerate)
    assert measurer.flagged() == {"loop"}
    decided = _decided(measurer, RoundPlan.make(2), 0.0)
    assert decided["n_prompts"] == 1 and decided["ratio"] == pytest.approx(1.0)
    measurer.degenerate = None
    assert _decided(measurer, RoundPlan.make(2), 0.0)["n_prompts"] == 2
