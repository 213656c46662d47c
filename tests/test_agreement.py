"""`specpilot agreement`: first-divergence bookkeeping, the report's fields on tiny pairs (fp32: identical by the
exactness law; bf16 with the guard at infinite width: identical too), and the command's one-line refusal where the
machine has no native half precision."""
from __future__ import annotations

import json

import pytest
import torch

import specpilot.drafting.pair as pair_mod
from specpilot.cli import main
from specpilot.drafting import ModelPair
from specpilot.eval.agreement import agreement_report, first_divergence
from tiny import noisy_copy, tiny_model

FIELDS = ("dtype", "guard", "n_prompts", "identical_share", "identical_share_vs_fp32_ar",
          "ar_identical_share_vs_fp32_ar", "first_divergence", "margin_at_divergence", "logprob_fp32", "cost",
          "prompts")
PROMPTS = [[7], [1, 2, 3, 4, 5], list(range(10, 30))]


@pytest.mark.parametrize("a,b,expected", [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 5, 3], 1),
                                          ([1, 2], [1, 2, 3], 2), ([], [4], 0), ([4], [5], 0)])
def test_first_divergence(a, b, expected):
    assert first_divergence(a, b) == expected


def _pair(dtype=torch.float32):
    target = tiny_model(vocab=96, hidden=32, layers=2, sharpness=2.0)
    return ModelPair(target, noisy_copy(target, 0.3)).to(dtype=dtype)


def test_fp32_report_is_identical_everywhere():
    report = agreement_report(_pair(), PROMPTS, max_new_tokens=16, depth=3, size=8)
    assert all(k in report for k in FIELDS)
    assert report["dtype"] == "float32" and report["guard"] == "off" and report["n_prompts"] == 3
    assert report["identical_share"] == report["identical_share_vs_fp32_ar"] == 1.0
    assert [r["first_divergence"] for r in report["prompts"]] == [None] * 3
    json.dumps(report)  # writable as agreement.json


@pytest.mark.parametrize("near_tie,guard", [(0.0, "off"), (1e9, "on")])
def test_bf16_report_against_the_fp32_reference(near_tie, guard):
    reference = _pair()
    half = ModelPair(tiny_model(vocab=96, hidden=32, layers=2, sharpness=2.0),
                     noisy_copy(reference.target, 0.3)).to(dtype=torch.bfloat16)
    report = agreement_report(half, PROMPTS, reference=reference, near_tie=near_tie, max_new_tokens=16, depth=3,
                              size=8)
    assert report["dtype"] == "bfloat16" and report["guard"] == guard
    assert 0.0 <= report["identical_share"] <= 1.0
    for row in report["prompts"]:
        assert row["first_divergence"] is None or 0 <= row["first_divergence"] <= 16
        if "margin_half" in row:  # a divergence: its margin and both continuations' fp32 log-probs are there
            assert row["margin_half"] >= 0 and row["logprob_spec"] <= 0 and row["logprob_ar"] <= 0
    if near_tie == 1e9:  # every token from a one-token forward: bf16 AR exactly
        assert report["identical_share"] == 1.0
        assert report["cost"]["near_ties"] > 0 and report["cost"]["target_forwards_per_token"] > 1.0


def test_reference_must_be_fp32():
    with pytest.raises(ValueError, match="fp32"):
        agreement_report(_pair(), PROMPTS, reference=_pair(torch.bfloat16))


def _cli(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cli_says_in_one_line_when_the_cpu_lacks_half_precision(dtype, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(pair_mod, "_CPU_FLAGS", {"avx2"})
    code, _, err = _cli(["agreement", "--dtype", dtype, "--device", "cpu", "--out", str(tmp_path / "a")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("specpilot agreement: no native") and "--allow-emulated" in err
    assert not (tmp_path / "a" / "agreement.json").exists()


def test_cli_writes_agreement_json(saved_pair, tmp_path, capsys):
    suite = tmp_path / "suite.txt"
    suite.write_text("def f(x):\nreturn x\n")
    out = tmp_path / "out"
    code, stdout, err = _cli(["agreement", "--target", str(saved_pair / "target"), "--draft",
                              str(saved_pair / "draft"), "--device", "cpu", "--dtype", "bf16", "--allow-emulated",
                              "--suite", str(suite), "--guard", "on", "--max-new-tokens", "8", "--out", str(out)],
                             capsys)
    assert code == 0, err
    report = json.loads((out / "agreement.json").read_text())
    assert all(k in report for k in FIELDS)
    assert report["dtype"] == "bfloat16" and report["guard"] == "on" and report["n_prompts"] == 2
    assert "identical to bfloat16 AR" in stdout


def test_cli_refuses_a_prompt_too_long_before_decoding_any(saved_pair, tmp_path, capsys):
    suite = tmp_path / "suite.jsonl"
    context = ModelPair.from_pretrained(saved_pair / "target", saved_pair / "draft").max_context
    suite.write_text(json.dumps({"id": "short", "prompt": "def f(x):"}) + "\n"
                     + json.dumps({"id": "long", "prompt": "x " * (2 * context)}) + "\n")
    out = tmp_path / "out"
    code, stdout, err = _cli(["agreement", "--target", str(saved_pair / "target"), "--draft",
                              str(saved_pair / "draft"), "--device", "cpu", "--dtype", "float32", "--suite",
                              str(suite), "--max-new-tokens", "8", "--out", str(out)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("specpilot agreement: prompt 'long' is") and "--max-new-tokens" in err
    assert not out.exists() and "agreement of" not in err  # refused before the first prompt was decoded


def test_cli_picks_the_held_out_suite_that_matches_the_pair_and_names_it(saved_pair, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = _cli(["agreement", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
                         "--device", "cpu", "--dtype", "float32", "--limit", "1", "--max-new-tokens", "4",
                         "--out", str(out)], capsys)
    assert code == 0, err
    report = json.loads((out / "agreement.json").read_text())
    # a target whose name marks no code model gets the general held-out suite, as `eval` would pick it
    assert report["suite"] == "heldout" and report["suite_chosen_by"].startswith("default for target")
    assert "prompts of suite heldout (default for target" in err


def test_cli_names_the_suites_tasks_when_the_task_has_none(saved_pair, tmp_path, capsys):
    code, _, err = _cli(["agreement", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
                         "--device", "cpu", "--suite", "heldout_code", "--task", "code", "--out", str(tmp_path)],
                        capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "suite 'heldout_code' has no prompts of task 'code' (its tasks: classes, datastruct" in err
