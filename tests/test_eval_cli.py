"""`specpilot eval` argument parsing and its clear failures (no model is loaded here)."""
import argparse

import pytest

from specpilot.eval import cli


def _parse(argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_and_lists():
    args = _parse(["--temperatures", "0,0.7", "--methods", "fixed,ddd", "--concurrency", "4"])
    assert args.suite is None and args.temperatures == (0.0, 0.7) and args.concurrency == 4
    assert _parse([]).temperatures == (0.0, 1.0)


def test_repeats_is_only_another_name_for_a_fixed_rounds():
    assert _parse([]).rounds == "auto" and _parse(["--repeats", "3"]).rounds == 3
    assert not hasattr(_parse(["--rounds", "2"]), "repeats")


@pytest.mark.parametrize("argv, message", [
    (["--suite", "no_such_suite"], "unknown suite"),
    (["--methods", "fixed,warp"], "unknown method(s) warp"),
])
def test_bad_input_exits_2_with_message(argv, message, capsys, tmp_path):
    """Through the one CLI error path (specpilot.cli.main): exit code 2 and the message, nothing measured."""
    from specpilot.cli import main

    try:
        code = main(["eval", "--out", str(tmp_path / "out"), *argv])
    except SystemExit as exit_info:  # refused by the argument parser
        code = exit_info.code
    assert code == 2
    assert message in capsys.readouterr().err


class _ByteTokenizer:
    """Just enough tokenizer for ModelPair.encode/decode on a tiny model."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + b % 61 for b in text.encode()][-20:]}

    def decode(self, tokens, skip_special_tokens=False):
        return " ".join(map(str, tokens))


def test_run_writes_a_report(tmp_path, monkeypatch):
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specpilot.drafting.pair import ModelPair

    def tiny(seed):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=2, intermediate_size=64,
                                            max_position_embeddings=256)).eval()

    monkeypatch.setattr(ModelPair, "from_pretrained",
                        classmethod(lambda cls, *a, **k: cls(tiny(0), tiny(1), _ByteTokenizer(), name="tiny")))
    suite = tmp_path / "mine.txt"
    suite.write_text("def f(x):\nhello world\n")
    out = tmp_path / "out"
    args = _parse(["--suite", str(suite), "--methods", "fixed", "--temperatures", "0", "--max-new-tokens", "4",
                   "--warmup", "0", "--width", "2", "--max-depth", "3", "--max-size", "6", "--no-plots",
                   "--out", str(out)])
    from specpilot.train.rl.logging import RunLogger

    logged, summarize = {}, RunLogger.summarize

    def keep(self, values):
        summarize(self, values)
        logged["run"] = {"summary": dict(self.wandb_run.summary), "config": dict(self.wandb_run.config)}

    monkeypatch.setattr(RunLogger, "summarize", keep)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # shared test machine: avoid oversubscription stalls
    try:
        assert cli.run(args) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((out / "report.json").read_text())
    assert {r["method"] for r in report["results"]} == {"ar", "fixed"}
    assert report["meta"]["models"]["name"] == "tiny" and (out / "report.md").exists()
    assert report["meta"]["suite"] == {"name": str(suite), "chosen_by": "--suite",  # the report names the suite
                                       "chat_template": {"mode": "auto", "applied": 0, "of": 2}}
    assert f"suite {suite}" in (out / "report.md").read_text()
    # the evaluation's wandb run (offline): every option as its config, the report's numbers as its summary
    assert list((out / "wandb").glob("offline-run-*"))
    run = logged["run"]
    fixed = next(r for r in report["summary"] if r["method"] == "fixed")
    assert run["summary"]["T=0/methods/fixed/speedup"] == pytest.approx(fixed["speedup"])
    assert run["summary"]["T=0/methods/fixed/speedup_low"] == pytest.approx(fixed["speedup_ci"][0])
    assert run["summary"]["suite"] == str(suite) and run["summary"]["models"] == "tiny"
    assert run["config"]["command"] == "eval" and run["config"]["max_depth"] == 3 and run["config"]["methods"] == \
        ["fixed"]
