"""The main job end to end: every demo stage on a tiny saved pair (fast), and `specpilot demo --quick` (slow)."""
import dataclasses
import json

import pytest

from specpilot.cli import main
from specpilot.demo import DemoBudget, run_demo

TINY = DemoBudget(train_prompts=3, val_prompts=2, heldout_prompts=3, max_new_tokens=16, width=2, max_depth=4,
                  max_size=8, size_steps=256, depth_steps=256, coadapt_steps=128, rounds=1, n_steps=128,
                  batch_size=64, n_epochs=1, live_top=1, temperatures=(0.0, 1.0), sampled_methods=("grid", "ltd"),
                  eval_budget_s=5.0, check_rounds=2, sampled_depth_steps=64, sampled_size_steps=64, seeds=2,
                  profile_cycles=200)


@pytest.mark.heavy
def test_demo_every_stage_on_tiny_pair(saved_pair, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    summary = run_demo(run, target=str(saved_pair / "target"), draft=str(saved_pair / "draft"), budget=TINY,
                       wandb="disabled")
    for path in ["traces/train/trace.npz", "grid.json", "policies.json", "eval/report.json", "eval/report.md",
                 "export/decoder.json", "summary.json", "manifest.json"]:
        assert (run / path).exists(), path
    from test_cli_docs import readme_demo_paths

    for path in readme_demo_paths():  # the README's stage table lists what the demo writes
        assert (run / path).exists(), f"README.md lists {path}, which the demo did not write"
    methods = summary["methods"]
    assert {"ar", "grid", "ltd"} <= set(methods) and not {"depth_only", "size_only", "fixed"} & set(methods)
    assert all(m["identical_to_ar"] for m in methods.values())
    assert summary["ltd_vs_grid"]["verdict"] in ("faster", "slower", "indistinguishable")
    assert summary["rounds"]["by_temperature"]["0"]["rounds"] >= 2
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["replay"]["methods"] and report["replay"]["oracle"]["speedup"] > 0
    # the ablations and the default config are replayed (exact, nearly free) instead of run live
    assert report["replay"]["replay_only"] == ["depth_only", "fixed", "size_only"]
    assert {"ltd", "grid", "depth_only", "size_only", "fixed"} <= {m["method"] for m in report["replay"]["methods"]}
    assert "Replay only (not run live" in (run / "eval" / "report.md").read_text()
    assert any("before the grid search" in entry["title"] for entry in report["cost_check"].values())
    assert (run / "traces" / "heldout" / "trace.npz").exists() and (run / "eval" / "forest_speedup_T0.png").exists()
    # sampling: the grid measured its candidates live at T=1, the run trained T=1 policies, the report has T=1 rows
    grid = json.loads((run / "grid.json").read_text())
    assert set(grid["best_by_temperature"]) == {"1"} and any(r["depth"] == 0 for r in grid["sampled_live"]["1"])
    assert (run / "sampled" / "T1" / "policies.json").is_file()
    sampled_rows = {(r["method"], r["temperature"]) for r in report["summary"]}
    assert {("ar", 1.0), ("grid", 1.0), ("ltd", 1.0)} <= sampled_rows
    assert report["meta"]["methods"]["ltd"]["by_temperature"]["1"]
    # 2 seeds trained in replay, the validation-best deployed, each reported on the held-out trace
    seeds = json.loads((run / "seeds.json").read_text())
    assert [s["seed"] for s in seeds["seeds"]] == [0, 1] and (run / "seed1" / "policies.json").is_file()
    assert [r["seed"] for r in summary["seeds"]["seeds"]] == [0, 1] and summary["seeds"]["ltd_vs_static"]["n"] == 2
    assert [r["chosen"] for r in summary["seeds"]["seeds"]] == [s["seed"] == seeds["chosen"] for s in seeds["seeds"]]
    out = capsys.readouterr().out
    assert "ltd vs grid per seed" in out and "over 2 seeds" in out
    # what the numbers were measured on (model, precision, hardware, sampling, suite, prompt mix), printed and kept
    assert " on cpu (" in summary["label"] and "prompts:" in summary["label"] and summary["label"] in out
    assert "speedup over ar [95% CI]" in out and "ltd vs grid (T=0)" in out and "cost model" in out
    # a re-run reuses every finished stage, even when "auto" would now measure the other dtype faster
    import specpilot.drafting.pair as pair_module

    first = json.loads((run / "demo_state.json").read_text())["dtype"]["dtype"]
    real = pair_module.measure_half

    def the_other_dtype_wins(model, dtype):
        ms = real(model, dtype)
        slow, fast = ("bfloat16", "float32") if first == "bfloat16" else ("float32", "bfloat16")
        ms[fast] = {n: v / 4 for n, v in ms[slow].items()}
        ms["ratio"] = 0.25 if fast == "bfloat16" else 4.0
        return ms

    monkeypatch.setattr(pair_module, "measure_half", the_other_dtype_wins)
    monkeypatch.setattr(pair_module, "_AUTO_MEASURED", {})
    again = run_demo(run, target=str(saved_pair / "target"), draft=str(saved_pair / "draft"), budget=TINY,
                     wandb="disabled")
    state = json.loads((run / "demo_state.json").read_text())
    assert set(state) == {"record", "grid", "train", "eval", "export", "dtype", "started"}
    assert again["methods"].keys() == summary["methods"].keys()
    out = capsys.readouterr().out
    assert out.count("] reused from") == 5 and again["reused_stages"] == ["record", "grid", "train", "eval", "export"]
    # the header gives this start's seconds and marks the stage times that an earlier start measured
    assert "s this start: record" in out and out.count("(earlier start, reused)") == 5
    assert again["pair"]["dtype"] == first and "kept from this run's first start" in again["pair"]["dtype_reason"]
    # a training budget change re-runs training and what follows, and reuses the recording and the grid
    changed = dataclasses.replace(TINY, size_steps=TINY.size_steps + 128)
    run_demo(run, target=str(saved_pair / "target"), draft=str(saved_pair / "draft"), budget=changed,
             wandb="disabled")
    out = capsys.readouterr().out
    assert "[record] reused" in out and "[grid] reused" in out
    assert out.count("(earlier start, reused)") == 2 and "(earlier start, reused), train" in out
    assert all(f"[{stage}] reused" not in out for stage in ("train", "eval", "export"))
    assert json.loads((run / "demo_state.json").read_text())["record"] == state["record"]
    # a finished stage whose output was damaged since is run again, not reused (and not reported as written)
    (run / "export" / "decoder.json").write_text("")
    run_demo(run, target=str(saved_pair / "target"), draft=str(saved_pair / "draft"), budget=changed,
             wandb="disabled")
    out = capsys.readouterr().out
    assert "[export] finished before, but" in out and "[train] reused" in out and "[eval] reused" in out
    assert json.loads((run / "export" / "decoder.json").read_text())["policies"]
    # the policies trained at T=1 are outputs of the train stage too: a damaged one is found, as eval would find it
    from specpilot.demo import damaged_outputs

    sampled_zip = run / "sampled" / "T1" / "size.zip"
    whole = sampled_zip.read_bytes()
    verdict = json.loads((run / "sampled" / "T1" / "policies.json").read_text())["off_switch"]
    sampled_zip.write_bytes(whole[:1000])
    assert str(sampled_zip) in damaged_outputs("train", run)
    # the train stage runs again: its finished training stages are reused, the zip is restored from them, and the
    # T=1 off-switch verdict measured for these very policies stands (measuring again could flip it with the load)
    import specpilot.train.rl.sampled as sampled_module

    measure_off_switch = sampled_module.check_off_switch
    monkeypatch.setattr(sampled_module, "check_off_switch", lambda *a, **k: pytest.fail("off-switch re-measured"))
    run_demo(run, target=str(saved_pair / "target"), draft=str(saved_pair / "draft"), budget=changed,
             wandb="disabled")
    out = capsys.readouterr().out
    assert "[train] finished before, but" in out and "[grid] reused" in out
    assert sampled_zip.read_bytes() == whole and damaged_outputs("train", run) is None
    assert json.loads((run / "sampled" / "T1" / "policies.json").read_text())["off_switch"] == verdict
    monkeypatch.setattr(sampled_module, "check_off_switch", measure_off_switch)
    # training under other settings than the folder's earlier training (a --quick folder reused by a full run):
    # its checkpoints would refuse the resume, so they move aside (kept) and training starts over
    other = dataclasses.replace(changed, n_steps=64, batch_size=32)
    run_demo(run, target=str(saved_pair / "target"), draft=str(saved_pair / "draft"), budget=other,
             wandb="disabled")
    out = capsys.readouterr().out
    assert "[train] the earlier training used other settings (cannot resume stage" in out
    [moved] = list((run / "stale").iterdir())
    assert (moved / "seed0").is_dir() and (run / "seed0").is_dir() and (run / "export" / "decoder.json").is_file()
    assert (run / "grid.json").is_file() and (run / "traces" / "train").is_dir()
    # the same models from another folder (a moved checkout): the stages' keys hold content hashes, not paths
    import shutil

    moved_pair = shutil.copytree(saved_pair, tmp_path / "moved_pair")
    again = run_demo(run, target=str(moved_pair / "target"), draft=str(moved_pair / "draft"), budget=other,
                     wandb="disabled")
    assert again["reused_stages"] == ["record", "grid", "train", "eval", "export"]


def test_full_demo_trains_three_seeds_and_quick_one():
    from specpilot.demo import STAGE_FIELDS

    assert DemoBudget().seeds == 3 and DemoBudget.quick().seeds == 1
    assert "seeds" in STAGE_FIELDS["train"]  # another seed count re-trains


@pytest.mark.slow
def test_demo_quick_cli_on_default_pair(tmp_path):
    assert main(["demo", "--quick", "--out", str(tmp_path / "demo"), "--wandb", "disabled"]) == 0
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    methods = summary["methods"]
    if summary["pair"]["dtype"] == "float32":  # exact: every method's greedy output is target-only greedy output
        assert all(m["identical_to_ar"] for m in methods.values())
    else:  # `dtype auto` chose half precision (a CPU with native bf16): identical up to rounding, which plain
        # decoding (ar, HF's generate) is not exposed to; the summary says why it chose it
        assert methods["ar"]["identical_to_ar"] and methods["hf_generate"]["identical_to_ar"]
        assert summary["pair"]["dtype_reason"]


def test_demo_refuses_prompts_too_long_for_the_context_before_any_stage(saved_pair, tmp_path, capsys):
    from test_cli_errors import assert_one_line, run_cli

    suite = tmp_path / "long.jsonl"
    suite.write_text(json.dumps({"id": "long-1", "prompt": "def f(x):\n" + "    x = x + 1\n" * 600}) + "\n")
    code, err = run_cli(["demo", "--quick", "--out", str(tmp_path / "run"), "--suite", str(suite), "--target",
                         str(saved_pair / "target"), "--draft", str(saved_pair / "draft"), "--wandb", "disabled"],
                        capsys)
    assert_one_line(code, err, "prompt 'long-1' is", "context; shorten them")
    assert not (tmp_path / "run" / "traces").exists() and not (tmp_path / "run" / "demo_state.json").exists()


@pytest.mark.parametrize("name", ["grid.json", "eval/report.json", "summary.json"])
def test_demo_refuses_a_folder_where_it_writes_a_file_before_any_work(tmp_path, capsys, name):
    from test_cli_errors import assert_one_line, run_cli

    (tmp_path / "run" / name).mkdir(parents=True)
    code, err = run_cli(["demo", "--quick", "--out", str(tmp_path / "run"), "--wandb", "disabled"], capsys)
    assert_one_line(code, err, f"{tmp_path / 'run' / name} is a folder, where this command writes a file",
                    "give another --out")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [name.split("/")[0]]


@pytest.mark.parametrize("options, advice", [
    (("--max-new-tokens", "--truncate-prompts"), "shorten them, lower --max-new-tokens, or add --truncate-prompts"),
    (("--max-new-tokens",), "shorten them, or lower --max-new-tokens"),
    ((), "context; shorten them"),
])
def test_a_prompt_refusal_offers_only_the_options_its_command_has(options, advice):
    from specpilot.drafting.checks import check_prompt_lengths
    from specpilot.eval.suites import Prompt

    prompt = Prompt(id="p", prompt="x", task="t", language="python", split="heldout")
    with pytest.raises(ValueError) as info:
        check_prompt_lengths([prompt], {"x": 100}, context=64, max_new_tokens=8, max_depth=4,
                             truncate=False, options=options)
    assert advice in str(info.value) and (options or str(info.value).endswith("shorten them"))


def test_a_bundled_suite_too_long_names_the_context_the_models_need():
    """The demo trains on bundled prompts the user cannot shorten: the refusal says what context would hold them."""
    from specpilot.drafting.checks import check_prompt_lengths
    from specpilot.eval.suites import Prompt

    prompt = Prompt(id="p", prompt="x", task="t", language="python", split="train")
    with pytest.raises(ValueError, match="the train prompts are bundled with specpilot: use models whose context "
                                         "holds at least 111 tokens"):
        check_prompt_lengths([prompt], {"x": 100}, context=64, max_new_tokens=8, max_depth=4, truncate=False,
                             options=(), bundled="train")


def test_a_resumed_stage_reports_the_time_of_its_interrupted_starts_too(tmp_path):
    from specpilot.demo import DemoState

    state = DemoState(tmp_path)
    state.start("train", "k1")
    state.interrupted("train", "k1", 30.0)   # Ctrl-C after 30 s
    state.interrupted("train", "k1", 12.0)   # and again after 12 s of the second start
    state.interrupted("grid", "other", 5.0)
    assert state.finish("train", "k1", {}, 20.0) == 62.0  # what the summary and the "done in" line show
    again = DemoState(tmp_path)
    assert again.done("train", "k1")["seconds"] == 62.0
    state.interrupted("eval", "k2", 9.0)
    state.finish("eval", "k3", {}, 4.0)      # other settings: that start's time is not this run's
    assert DemoState(tmp_path).done("eval", "k3")["seconds"] == 4.0
