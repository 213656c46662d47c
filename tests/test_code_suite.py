"""The held-out code suite (`heldout_code`) and the choice of held-out suite by pair: the embedded pair and code
models get code, general-purpose targets the multilingual mix; `specpilot eval` names the suite it ran."""
import argparse
import json
from collections import Counter

import pytest

from specpilot.eval.stats import MIN_PROMPTS_TO_CONCLUDE
from specpilot.eval.suites import choose_suite, default_heldout_suite, is_code_model, load_suite

GROUPS = ("numerics", "text", "datastruct", "io_parsing", "tests", "classes")
FORMS = ("signature", "docstring", "body")


def _records():
    from specpilot.eval.suites import SUITES_DIR

    return [json.loads(line) for line in (SUITES_DIR / "heldout_code.jsonl").read_text().splitlines() if line]


def test_code_suite_has_sixty_prompts_over_six_groups_and_three_forms():
    prompts = load_suite("heldout_code")
    assert len(prompts) >= 60 and {p.language for p in prompts} == {"python"}
    by_group = Counter(p.task for p in prompts)
    assert set(by_group) == set(GROUPS)
    assert min(by_group.values()) >= MIN_PROMPTS_TO_CONCLUDE  # every group can be concluded on
    forms = Counter((r["task"], r["form"]) for r in _records())
    assert {f for _, f in forms} == set(FORMS)
    assert all(sum(forms[(g, f)] for f in FORMS) == by_group[g] and len({f for t, f in forms if t == g}) >= 2
               for g in GROUPS)


def test_code_suite_shares_no_prompt_or_long_line_with_train_and_validation():
    code = load_suite("heldout_code")
    seen = [p for name in ("train", "validation") for p in load_suite(name)]
    # long lines only: idioms such as "def __init__(self, capacity: int) -> None:" may recur
    lines = {line.strip() for p in seen for line in p.prompt.splitlines() if len(line.strip()) > 50}
    assert not {p.prompt for p in code} & {p.prompt for p in seen}
    assert not {line.strip() for p in code for line in p.prompt.splitlines()} & lines
    assert all(p.id.startswith(f"heldout-code-{p.task}-") for p in code)


@pytest.mark.parametrize("target, suite", [
    (None, "heldout_code"),                                   # the embedded pair: trained on the stdlib only
    ("Qwen/Qwen2.5-Coder-0.5B", "heldout_code"),
    ("bigcode/starcoder2-3b", "heldout_code"),
    ("codellama/CodeLlama-7b-hf", "heldout_code"),
    ("/models/granite-3b-code-base", "heldout_code"),
    ("Qwen/Qwen3-0.6B", "heldout"),
    ("meta-llama/Llama-3.2-1B", "heldout"),
    ("/models/my-decoder", "heldout"),                        # "decoder" is no code model
    ("ise-uiuc/Magicoder-S-DS-6.7B", "heldout_code"),
    ("facebook/incoder-1B", "heldout_code"),
    ("microsoft/phi-1", "heldout_code"),
    ("microsoft/phi-1_5", "heldout"),
    ("embedded", "heldout_code"),
])
def test_default_suite_matches_the_pair(target, suite):
    assert default_heldout_suite(target) == suite
    assert is_code_model(target) == (suite == "heldout_code")
    chosen = choose_suite(None, target)
    assert chosen["name"] == suite and chosen["chosen_by"].startswith("default for")


def test_a_pair_models_build_made_is_a_code_model_by_its_folder(tmp_path):
    """The embedded target given by its path, or any pair `specpilot models build` wrote (corpus_manifest.json beside
    target/), is trained on Python source: it gets the code suite whatever its folder is called."""
    from specpilot.drafting.pair import DEFAULT_PAIR_DIR

    assert choose_suite(None, str(DEFAULT_PAIR_DIR / "target"))["name"] == "heldout_code"
    (tmp_path / "mine" / "target").mkdir(parents=True)
    assert choose_suite(None, str(tmp_path / "mine" / "target"))["name"] == "heldout"
    (tmp_path / "mine" / "corpus_manifest.json").write_text("{}")
    chosen = choose_suite(None, str(tmp_path / "mine" / "target"))
    assert chosen["name"] == "heldout_code" and "specpilot models build" in chosen["chosen_by"]


def test_suite_flag_overrides_the_default():
    assert choose_suite("heldout", None) == {"name": "heldout", "chosen_by": "--suite"}
    assert choose_suite("heldout_code", "Qwen/Qwen3-0.6B")["name"] == "heldout_code"


@pytest.mark.parametrize("argv, suite, n", [([], "heldout_code", 66), (["--suite", "heldout"], "heldout", 96),
                                            (["--target", "Qwen/Qwen3-0.6B", "--draft", "x"], "heldout", 96)])
def test_eval_prepare_picks_the_suite_of_the_pair(argv, suite, n):
    from specpilot.eval import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    plan = cli.prepare(parser.parse_args(argv + ["--methods", "fixed"]))
    assert plan.suite["name"] == suite and len(plan.prompts) == n


def test_demo_takes_a_suite_flag_and_its_budget_covers_every_code_group():
    from specpilot import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert parser.parse_args([]).suite is None and parser.parse_args(["--suite", "heldout"]).suite == "heldout"
    picked = demo._limit(load_suite("heldout_code"), demo.DemoBudget().heldout_prompts)
    assert {p.task for p in picked} == set(GROUPS)


def test_code_prompts_end_at_the_cursor_not_after_a_bare_newline():
    """The embedded tokenizer merges a newline with the next line's indentation: a prompt ending in a lone newline
    token asks for a column-0 line, and the code model answers with a new top-level def or a "#" loop."""
    assert not [p.id for p in load_suite("heldout_code") if p.prompt.endswith("\n")]
