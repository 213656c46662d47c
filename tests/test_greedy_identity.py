"""Why greedy output differs from target-only output, said the same way everywhere (`specpilot.eval.exactness`):
half-precision rounding (expected, labelled) or, in fp32, a bug (a WARNING); and why the pair runs in its dtype
(`pair.dtype_reason`) in generate's and eval's output."""
import json

import pytest

from specpilot.eval.exactness import greedy_identity, identity_line
from specpilot.eval.report import batch_lines, write_report
from specpilot.eval.summary import format_summary_lines, summarise_report

ROUNDING_NOTE = "expected in half precision, not a bug"
BUG_WARNING = "this is a bug, please report it"


@pytest.mark.parametrize("dtype,identical,cause,expected,line", [
    ("bfloat16", {"ar": True, "fixed": False}, "rounding", True, "note: greedy output of fixed differs from ar in "
                                                                 "bfloat16, " + ROUNDING_NOTE),
    ("float16", {"ar": True, "fixed": False}, "rounding", True, "in float16, " + ROUNDING_NOTE),
    ("float32", {"ar": True, "fixed": False}, "bug", False, "WARNING: greedy output of fixed differs from ar in "
                                                            "float32: " + BUG_WARNING),
    ("bfloat16", {"ar": True, "fixed": True}, None, None, None),
])
def test_greedy_identity_names_the_cause(dtype, identical, cause, expected, line):
    block = greedy_identity(identical, dtype)
    assert (block["cause"], block["expected"]) == (cause, expected)
    assert block["differing"] == ([] if cause is None else ["fixed"])
    assert (block["note"] is None) if line is None else (line in block["note"] == identity_line(block))


def test_nothing_greedy_compared_is_no_block():
    assert greedy_identity({"ar": None, "fixed": None}, "float32") is None


def _row(method, identical):
    return {"task": "code", "language": "python", "split": "heldout", "method": method, "temperature": 0.0,
            "speedup": 1.0, "tau": 1.0, "tokens_per_s": 10.0, "ttft_s": 0.1, "itl_p50_s": 0.1, "itl_p90_s": 0.1,
            "itl_p99_s": 0.1, "peak_mem_mb": 1.0, "policy_overhead": 0.0, "draft_frac": 0.0,
            "identical_to_ar": identical, "n_prompts": 1, "n_tokens": 10, "speedup_ci": [0.9, 1.1], "n_units": 2}


def _meta(dtype):
    return {"models": {"name": "tiny", "target_hash": "t", "draft_hash": "d"}, "dtype": dtype, "device": "cpu",
            "dtype_reason": f"auto: {dtype}, measured", "sampling": {"temperatures": [0.0]}}


@pytest.mark.parametrize("dtype,cell,console,line", [
    ("bfloat16", "| no (bfloat16 rounding) |", "False (bfloat16 rounding)", ROUNDING_NOTE),
    ("float32", "| NO |", "False", "**WARNING: greedy output of fixed differs from ar in float32: " + BUG_WARNING),
])
def test_report_and_console_say_why_greedy_output_differs(tmp_path, dtype, cell, console, line):
    rows = [_row("ar", True), _row("fixed", False)]
    summary = [{k: r[k] for k in ("method", "temperature", "speedup", "speedup_ci", "tau", "identical_to_ar",
                                  "n_units")} for r in rows]
    write_report(rows, _meta(dtype), tmp_path, plots=False, analysis={"summary": summary})
    md = (tmp_path / "report.md").read_text()
    report = json.loads((tmp_path / "report.json").read_text())
    assert cell in md and line in md
    assert report["greedy_identity"]["cause"] == ("rounding" if dtype == "bfloat16" else "bug")
    assert f"**Precision:** dtype auto: {dtype}, measured" in md
    printed = format_summary_lines(summarise_report(report))
    fixed = next(x for x in printed if x.startswith("fixed "))
    assert fixed.endswith(f"  {console}")
    assert any(line.strip("*") in x for x in printed) and f"dtype auto: {dtype}, measured" in printed


@pytest.mark.parametrize("dtype,cell", [("bfloat16", "| no (2 sequences, bfloat16 rounding) |"),
                                        ("float32", "| NO (2 sequences) |")])
def test_batch_tables_label_the_difference(dtype, cell):
    row = {"method": "fixed", "tokens_per_s": 1.0, "per_token_ms": 1.0, "speedup": 1.0, "speedup_ci": [0.9, 1.1],
           "verdict": None, "depth_mean": None, "size_mean": None, "identical_to_ar": False,
           "mismatched_sequences": 2}
    section = {"batch_size": 2, "temperature": 0.0, "units": 1, "rounds": {"rounds": 1}, "methods": [row],
               "comparisons": []}
    assert cell in "\n".join(batch_lines([section], dtype))


def _force_fixed_to_differ(monkeypatch):
    """Every `fixed` run's last greedy token is changed: a difference from ar whatever the dtype."""
    from specpilot.eval import rounds

    real = rounds.timed

    def timed(method, *args, **kwargs):
        rec = real(method, *args, **kwargs)
        if rec.method == "fixed":
            if hasattr(rec, "sequences"):
                rec.sequences = [[*s[:-1], s[-1] + 1] for s in rec.sequences]
            else:
                rec.tokens = [*rec.tokens[:-1], rec.tokens[-1] + 1]
        return rec

    monkeypatch.setattr(rounds, "timed", timed)


@pytest.mark.parametrize("batch_sizes", [None, "1,2"])
@pytest.mark.parametrize("dtype,said", [("bfloat16", ROUNDING_NOTE), ("float32", BUG_WARNING)])
def test_eval_says_why_greedy_output_differs(saved_pair, tmp_path, capsys, monkeypatch, batch_sizes, dtype, said):
    """One rule on both paths (one sequence at a time and batched): console and report.json agree."""
    from specpilot.cli import main

    _force_fixed_to_differ(monkeypatch)
    suite = tmp_path / "mine.txt"
    suite.write_text("def f(x):\nreturn x + 1\n")
    out = tmp_path / "out"
    argv = ["--threads", "1", "eval", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
            "--device", "cpu", "--dtype", dtype, "--suite", str(suite), "--methods", "fixed", "--decide", "fixed,ar",
            "--temperatures", "0", "--max-new-tokens", "6", "--rounds", "1", "--warmup", "0", "--width", "2",
            "--max-depth", "3", "--max-size", "6", "--no-plots", "--wandb", "disabled", "--out", str(out)]
    assert main(argv + (["--batch-sizes", batch_sizes] if batch_sizes else [])) == 0
    printed = "".join(capsys.readouterr())
    identity = json.loads((out / "report.json").read_text())["greedy_identity"]
    assert identity["differing"] == ["fixed"] and identity["expected"] == (dtype == "bfloat16")
    assert said in printed and said in identity["note"]
    assert f"dtype {dtype}: asked for" in printed


@pytest.mark.parametrize("dtype,reason", [("float32", "dtype float32: asked for"),
                                          ("bfloat16", "dtype bfloat16: asked for"),
                                          ("auto", "dtype auto: ")])
def test_generate_says_why_its_dtype(saved_pair, capsys, dtype, reason):
    """The reason is one line on stderr; stdout keeps the text and the summary line scripts parse."""
    from specpilot.cli import main

    code = main(["--threads", "1", "generate", "--prompt", "def f(x):", "--target", str(saved_pair / "target"),
                 "--draft", str(saved_pair / "draft"), "--dtype", dtype, "--max-new-tokens", "4"])
    captured = capsys.readouterr()
    assert code == 0
    assert sum(line.startswith(reason) for line in captured.err.splitlines()) == 1
    assert captured.out.splitlines()[-1].startswith("[4 tokens, ")
