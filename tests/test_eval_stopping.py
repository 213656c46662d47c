"""Stop strings, stop token ids and ignore_eos in the evaluation (`evaluate`, `evaluate_batches`, `specpilot eval`):
every method, transformers' generate() included, ends each generation on the token where target-only decoding with
the same options ends, the report says which options were given, and replay (fixed-budget traces) refuses them."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from specpilot.drafting import ModelPair, TreeConfig, autoregressive_generate
from specpilot.drafting.stopping import StopStrings, stopping_options
from specpilot.eval.batched import evaluate_batches
from specpilot.eval.hf_baselines import GeneratedTextStop
from specpilot.eval.report import measurement_label
from specpilot.eval.runner import evaluate
from specpilot.eval.summary import report_metrics
from specpilot.eval.suites import Prompt

NEW = 24
TREE = TreeConfig(width=2, max_depth=4, max_size=8)
PROMPTS = [Prompt("c1", "code", "python", "heldout", "def f(x):\n"),
           Prompt("c2", "code", "python", "heldout", "    return")]
METHODS = ["fixed", "svip", "hf_generate", "hf_assisted"]


@pytest.fixture(scope="module")
def pair(saved_pair):
    return ModelPair.from_pretrained(saved_pair / "target", saved_pair / "draft")


def _reference(pair, prompt: str, **ending) -> list[int]:
    return list(autoregressive_generate(pair, prompt, max_new_tokens=NEW, **ending).tokens)


def _tokens_by_method(result) -> dict[tuple[str, str], list[list[int]]]:
    out: dict = {}
    for rec in result.records:
        out.setdefault((rec.method, rec.prompt_id), []).append(list(rec.tokens))
    return out


def _stop_inside(pair, prompt: str) -> str:
    """Two characters from the middle of the prompt's unstopped greedy output: a stop string that ends it early."""
    text = pair.decode(_reference(pair, prompt), skip_special_tokens=True)
    assert len(text) > 6, text
    return text[len(text) // 2: len(text) // 2 + 2]


def test_every_method_ends_where_target_only_decoding_ends_with_a_stop_string(pair):
    stop = _stop_inside(pair, PROMPTS[0].prompt)
    result = evaluate(PROMPTS, pair=pair, methods=METHODS, temperatures=(0.0,), max_new_tokens=NEW, rounds=1,
                      warmup=0, tree=TREE, stop_strings=[stop])
    expected = {p.id: _reference(pair, p.prompt, stop_strings=[stop]) for p in PROMPTS}
    assert len(expected["c1"]) < NEW  # the stop string cut it
    outputs = _tokens_by_method(result)
    assert {m for m, _ in outputs} == {"ar", *METHODS}
    for (method, pid), runs in outputs.items():
        assert all(tokens == expected[pid] for tokens in runs), (method, pid)
    assert all(row["identical_to_ar"] for row in result.results)
    assert result.meta["sampling"]["stop_strings"] == [stop]
    assert result.meta["sampling"]["stop_token_ids"] == [] and result.meta["sampling"]["ignore_eos"] is False


def test_stop_token_ids_end_every_method_at_that_token(pair):
    reference = _reference(pair, PROMPTS[0].prompt)
    stop_id = reference[NEW // 2]
    result = evaluate(PROMPTS[:1], pair=pair, methods=METHODS, temperatures=(0.0,), max_new_tokens=NEW, rounds=1,
                      warmup=0, tree=TREE, stop_token_ids=[stop_id])
    expected = reference[: reference.index(stop_id) + 1]
    for (method, _), runs in _tokens_by_method(result).items():
        assert all(tokens == expected for tokens in runs), method
    assert result.meta["sampling"]["stop_token_ids"] == [stop_id]


def test_ignore_eos_decodes_every_method_to_the_budget(pair):
    # a two-token prompt whose greedy output reaches the tiny random pair's end token (found by search, as the
    # model is random): ignore_eos must decode past it
    ending = next(([a, b] for a in range(3, 60) for b in range(3, 12)
                   if autoregressive_generate(pair, [a, b], max_new_tokens=NEW).finished_by == "eos"), None)
    if ending is None:
        pytest.skip("no short prompt reaches the tiny pair's end token")
    prompts = [Prompt("e1", "code", "python", "heldout", "ends")]
    result = evaluate(prompts, pair=pair, methods=METHODS, temperatures=(0.0,), max_new_tokens=NEW, rounds=1,
                      warmup=0, tree=TREE, ignore_eos=True, encode=lambda text: list(ending))
    expected = list(autoregressive_generate(pair, ending, max_new_tokens=NEW, ignore_eos=True).tokens)
    assert len(expected) == NEW and pair.eos_token_id in expected  # it went on past the end token
    for (method, _), runs in _tokens_by_method(result).items():
        assert all(tokens == expected for tokens in runs), method
    assert result.meta["sampling"]["ignore_eos"] is True


def test_sampled_runs_end_at_the_stop_string_too(pair):
    stop = _stop_inside(pair, PROMPTS[0].prompt)
    result = evaluate(PROMPTS, pair=pair, methods=["fixed", "hf_generate"], temperatures=(1.0,), max_new_tokens=NEW,
                      rounds=1, warmup=0, tree=TREE, stop_strings=[stop])
    for rec in result.records:
        text = pair.decode(list(rec.tokens), skip_special_tokens=True)
        if stop in text:  # it ends with the token that completes the first occurrence
            assert stop not in pair.decode(list(rec.tokens[:-1]), skip_special_tokens=True), rec.method
        else:
            assert len(rec.tokens) == NEW or rec.tokens[-1] in pair.eos_token_ids, rec.method


def test_batched_evaluation_ends_each_sequence_where_it_would_alone(pair):
    stop = _stop_inside(pair, PROMPTS[0].prompt)
    ids = [pair.encode(p.prompt) for p in PROMPTS]
    result = evaluate_batches(ids, pair=pair, batch_sizes=[2], tree=TREE, methods=["fixed"], max_new_tokens=NEW,
                              warmup=0, stop_strings=[stop])
    expected = [_reference(pair, p.prompt, stop_strings=[stop]) for p in PROMPTS]
    for rec in result["records"][2]:
        assert rec.sequences == expected, rec.method
    assert all(row["identical_to_ar"] for row in result["batch_sizes"][0]["methods"])
    assert result["protocol"]["stop_strings"] == [stop]


def test_transformers_stop_strings_would_match_across_the_prompt_but_ours_does_not(pair):
    """transformers' generate(stop_strings=) matches a string begun in the prompt; the evaluation's criterion
    searches the generated text only, as our decoder (and vLLM) do, so hf_generate stays comparable with ar."""
    prompt = pair.encode("def f(x):\n")
    stops = StopStrings(["\n\n"], pair.tokenizer)
    newline = pair.encode("\n")
    criterion = GeneratedTextStop(stops, len(prompt))
    done = criterion(torch.tensor([prompt + newline]), None)
    assert not bool(done[0]) and criterion.stop_at is None
    done = criterion(torch.tensor([prompt + newline + newline]), None)
    assert bool(done[0]) and criterion.stop_at == 2 * len(newline)


def test_the_report_names_the_ending_options():
    meta = {"sampling": {"temperatures": [0.0], "top_k": 0, "top_p": 1.0, "max_new_tokens": 8, "seed": 0,
                         "stop_strings": ["\ndef "], "stop_token_ids": [7], "ignore_eos": True}}
    label = measurement_label(meta)
    assert "stop ['\\ndef ']" in label and "stop token ids [7]" in label and "ignore_eos" in label
    flat = report_metrics({"meta": meta})
    assert flat["stop_strings/0"] == "\ndef " and flat["stop_token_ids/0"] == 7 and flat["ignore_eos"] is True


@pytest.mark.parametrize("kwargs, error", [
    ({"stop_strings": [""]}, "stop_strings must be"),
    ({"stop_strings": 5}, "stop_strings must be"),
    ({"stop_token_ids": ["a"]}, "stop token id"),
    ({"ignore_eos": "yes"}, "ignore_eos must be"),
])
def test_bad_ending_options_are_refused_before_any_work(kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        stopping_options(**kwargs)
    with pytest.raises((ValueError, TypeError), match=error):
        evaluate(PROMPTS, pair=None, executor=None, **kwargs)


@pytest.mark.parametrize("bad", [300, 10 ** 30])
def test_a_stop_token_id_outside_the_vocabulary_is_refused_naming_the_vocabulary(pair, bad):
    assert stopping_options(stop_token_ids=[bad]) == {"stop_token_ids": [bad]}  # the form only: no pair yet
    with pytest.raises(ValueError, match=rf"stop token id must be an integer in 0\.\.{pair.vocab_size - 1}, got {bad}"):
        evaluate(PROMPTS, pair=pair, methods=["fixed"], temperatures=(0.0,), max_new_tokens=4, rounds=1,
                 tree=TREE, stop_token_ids=[bad])


@pytest.mark.parametrize("kwargs, named", [
    ({"stop_strings": ["x"]}, "stop_strings"),
    ({"stop_token_ids": 0}, "stop_token_ids"),  # one id, 0: given, though falsy
    ({"stop_token_ids": np.array([5, 6])}, "stop_token_ids"),
    ({"ignore_eos": True}, "ignore_eos"),
])
def test_replay_refuses_ending_options(pair, tmp_path, kwargs, named):
    from specpilot.eval.full import full_evaluation

    with pytest.raises(ValueError, match=f"replay cannot apply {named}"):
        full_evaluation(PROMPTS, pair=pair, tree=TREE, out_dir=tmp_path, replay=True, **kwargs)


def test_live_only_full_evaluation_takes_stop_ids_as_an_array(pair, tmp_path):
    from specpilot.eval.full import full_evaluation

    result, _ = full_evaluation(PROMPTS[:1], pair=pair, tree=TREE, out_dir=tmp_path, replay=False, plots=False,
                                methods=["fixed"], temperatures=(0.0,), max_new_tokens=4, rounds=1, warmup=0,
                                stop_token_ids=np.array([5, 6]))
    assert result.meta["sampling"]["stop_token_ids"] == [5, 6]


def test_cli_refuses_stop_options_with_replay_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specpilot.cli", "eval", "--limit", "1", "--stop", "\n\n",
                           "--ignore-eos", "--replay-dir", str(tmp_path / "trace"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--replay-dir cannot be combined with --stop, --ignore-eos" in proc.stderr


def test_cli_refuses_an_unknown_stop_token_id_before_touching_the_output_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "forest_speedup_T0.png").write_text("an earlier evaluation's plot")
    proc = subprocess.run([sys.executable, "-m", "specpilot.cli", "eval", "--limit", "1", "--methods", "ar",
                           "--temperatures", "0", "--max-new-tokens", "4", "--stop-token-id", "99999999",
                           "--out", str(out), "--wandb", "disabled"], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("specpilot eval: stop token id must be an integer in 0..")
    assert "Traceback" not in proc.stderr
    assert (out / "forest_speedup_T0.png").is_file()
