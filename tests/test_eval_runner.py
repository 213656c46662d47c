"""`evaluate()` and `write_report()` on a tiny random Llama pair: schema, losslessness of every greedy method,
skipped methods, concurrency rows, report files. Tests never assert wall-clock numbers."""
import json

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
    return LlamaForCausalLM(cfg)


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
    paths = write_report(greedy.results, greedy.meta, tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) >= {"results", "meta", "summary"} and len(report["results"]) == len(greedy.results)
    md = (tmp_path / "report.md").read_text()
    assert "Speedup over ar" in md and "Held-out summary" in md
    assert (tmp_path / "speedup_T0.png").stat().st_size > 0
    assert (tmp_path / "time_split_T0.png").exists() and (tmp_path / "choices_T0.png").exists()
    assert paths["json"].endswith("report.json")


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
