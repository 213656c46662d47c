"""Task suites: bundled splits are well formed, user suites load from a path, bad files fail clearly."""
import json

import pytest

from specpilot.eval.suites import BUNDLED_SUITES, SuiteError, load_suite, prompt_mix


@pytest.mark.parametrize("name", BUNDLED_SUITES)
def test_bundled_suite_loads_with_its_split(name):
    prompts = load_suite(name)
    split = "heldout" if name.startswith("heldout") else name  # heldout_code: held out like heldout
    assert prompts and all(p.split == split for p in prompts)
    assert all(p.prompt.strip() for p in prompts)


def test_heldout_has_enough_prompts_per_task_and_language_group():
    """Every task x language group has the prompts a group-level interval needs (MIN_PROMPTS_TO_CONCLUDE)."""
    from specpilot.eval.stats import MIN_PROMPTS_TO_CONCLUDE

    prompts = load_suite("heldout")
    mix = prompt_mix(prompts)
    assert mix["by_task"]["code"] >= 12
    for task in ("instruction", "qa", "math", "conversation"):
        for lang in ("en", "it", "es", "zh"):
            assert mix["by_task_language"].get(f"{task}/{lang}", 0) >= MIN_PROMPTS_TO_CONCLUDE, (task, lang)


def test_heldout_prompts_are_distinct_and_ids_name_their_group():
    prompts = load_suite("heldout")
    assert len({p.prompt for p in prompts}) == len(prompts)
    for p in prompts:
        if p.task != "code":
            assert p.id.startswith(f"heldout-{p.task}-") and p.id.endswith(f"-{p.language}"), p.id


def test_splits_are_disjoint():
    texts = {name: {p.prompt for p in load_suite(name)} for name in BUNDLED_SUITES}
    assert not texts["train"] & texts["heldout"]
    assert not texts["validation"] & texts["heldout"]
    assert not texts["train"] & texts["validation"]
    assert not (texts["train"] | texts["validation"] | texts["heldout"]) & texts["heldout_code"]


def test_user_jsonl_suite_needs_only_prompt(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "def f(x):"}) + "\n\n"
                    + json.dumps({"id": "b", "task": "sql", "language": "en", "prompt": "SELECT"}) + "\n")
    prompts = load_suite(path)
    assert [p.prompt for p in prompts] == ["def f(x):", "SELECT"]
    assert prompts[0].task == "mine" and prompts[1].task == "sql" and prompts[1].id == "b"


def test_user_text_suite_one_prompt_per_line(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("first prompt\n\n   \nsecond\\nline two\n")
    prompts = load_suite(str(path))
    assert [p.prompt for p in prompts] == ["first prompt", "second\nline two"]
    assert len({p.id for p in prompts}) == 2


def test_split_filter(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(json.dumps({"id": str(i), "prompt": "p", "split": s})
                              for i, s in enumerate(["a", "b", "a"])))
    assert len(load_suite(path, split="a")) == 2
    with pytest.raises(SuiteError, match="no prompts with split 'c'"):
        load_suite(path, split="c")


@pytest.mark.parametrize("name, content, message", [
    ("bad.json", '[{"prompt": "x"}, 3]', r"bad\.json: item 2: expected a JSON object"),
    ("bad.json", '[{"prompt": "x"}, {"id": 1}]', r"bad\.json: item 2: missing field\(s\) prompt"),
    ("bad.json", '[{"prompt": "x"},', r"bad\.json: invalid JSON .*one array like"),
    ("bad.json", "[]", r"no prompts found"),
    ("bad.json", '[{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}]', r"duplicate id\(s\) a"),
] + [("bad.jsonl", *case) for case in [
    ('{"prompt": "ok"}\n{"prompt": "oops",\n', r"bad\.jsonl:2: invalid JSON"),
    ('{"prompt": "oops}\n', r"bad\.jsonl:1: invalid JSON \(Unterminated string starting at column 12\)"),
    ('{"id": "x"}\n', r"bad\.jsonl:1: missing field\(s\) prompt"),
    ('{"prompt": "   "}\n', r"bad\.jsonl:1: empty prompt"),
    ('["a list"]\n', r"bad\.jsonl:1: expected a JSON object"),
    ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', r"duplicate id\(s\) a"),
    ("\n\n", r"no prompts found"),
    ('{"prompt": "ok"}\n{"prompt": "a\\ud800b"}\n', r"bad\.jsonl:2: field \"prompt\" holds a lone surrogate"),
    ('{"id": "\\udfff", "prompt": "x"}\n', r"bad\.jsonl:1: field \"id\" holds a lone surrogate"),
]])
def test_bad_suites_rejected_with_file_and_line_or_item(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(SuiteError, match=message):
        load_suite(path)


def test_unknown_name_rejected():
    with pytest.raises(SuiteError, match="unknown suite 'nope'.*bundled suite"):
        load_suite("nope")


def _long_lines(prompts, min_chars: int = 30) -> set[str]:
    return {line.strip() for p in prompts for line in p.prompt.splitlines() if len(line.strip()) >= min_chars}


def test_train_and_validation_share_no_long_line_with_the_heldout_suites():
    """Selection and training never see a held-out line of 30+ characters (short idioms such as `import os` may
    recur), nor a line of each other."""
    held = _long_lines(load_suite("heldout") + load_suite("heldout_code"))
    train, val = load_suite("train"), load_suite("validation")
    assert not _long_lines(train) & held and not _long_lines(val) & held
    assert not _long_lines(train) & _long_lines(val)


@pytest.mark.parametrize("name, at_least", [("train", 60), ("validation", 16)])
def test_train_and_validation_code_prompts_end_at_the_cursor(name, at_least):
    """Like heldout_code's: a prompt ending in a bare newline asks the embedded model for a column-0 line (junk)."""
    prompts = load_suite(name)
    assert len(prompts) >= at_least and len({p.prompt for p in prompts}) == len(prompts)
    assert not [p.id for p in prompts if p.prompt.endswith("\n")]


@pytest.mark.parametrize("suffix", [".csv", ".TSV", ".parquet"])
def test_a_table_is_refused_not_read_as_text(tmp_path, suffix):
    path = tmp_path / f"prompts{suffix}"
    path.write_text("id,prompt\na,def f(x):\n")
    with pytest.raises(SuiteError, match="table is not a suite; write JSON lines"):
        load_suite(path)


@pytest.mark.parametrize("name, content", [
    ("mine.json", '[{"id": "a", "prompt": "def f(x):"},\n {"prompt": "def g():", "task": "t"}]\n'),
    ("mine.json", '[\n  "def f(x):",\n  "def g():"\n]'),
    ("mine.json", '{"id": "a", "prompt": "def f(x):"}\n{"prompt": "def g():"}\n'),  # JSON lines named .json
    ("mine.json", '{\n  "prompts": [\n    {"prompt": "def f(x):"},\n    "def g():"\n  ]\n}\n'),
    ("mine.jsonl", '"def f(x):"\n{"prompt": "def g():"}\n'),  # a bare string line is a prompt
    ("mine.ndjson", '{"prompt": "def f(x):"}\n{"prompt": "def g():"}\n'),
    ("mine", "def f(x):\ndef g():\n"),  # no extension: plain text
    ("mine.prompts", "def f(x):\ndef g():\n"),
])
def test_user_suite_forms(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    assert [p.prompt for p in load_suite(path)] == ["def f(x):", "def g():"]


@pytest.mark.parametrize("name", ["mine.jsonl", "mine.json", "mine.txt"])
def test_only_lf_crlf_and_cr_end_a_suite_line(tmp_path, name):
    """U+2028, U+2029, U+0085 and a form feed are characters inside a line (json.dumps(..., ensure_ascii=False)
    writes the first three raw in strings): str.splitlines would cut the line there, refusing valid JSON or
    splitting a text prompt in two."""
    texts = ["x = 1\u2028y", "c\u0085d \u2029", "a = 1\x0cb = 2", "tail"]
    if name.endswith(".txt"):
        content = "\r\n".join(texts[:3]) + "\r" + texts[3] + "\n"
    elif name.endswith(".jsonl"):
        content = "".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in texts)
    else:
        content = json.dumps(texts, ensure_ascii=False, indent=1)
    path = tmp_path / name
    path.write_bytes(content.encode())
    assert [p.prompt for p in load_suite(path)] == texts


@pytest.mark.parametrize("name, match", [
    ("prompts.yaml", r"a \.yaml file is not a suite format; write JSON lines"),
    ("prompts.TOML", r"a \.TOML file is not a suite format"),
    ("module.py", r"a \.py file is not a suite format.*run `specpilot prompts`"),
])
def test_unknown_extension_refused_not_read_as_text(tmp_path, name, match):
    path = tmp_path / name
    path.write_text("- prompt: def f(x):\n")
    with pytest.raises(SuiteError, match=match):
        load_suite(path)


@pytest.mark.parametrize("line, match", [
    ('{"prompt": "x", "n": ' + "9" * 4301 + "}", "JSON this loader cannot read \\(ValueError: Exceeds the limit"),
    ('{"prompt": "x", "n": ' + "[" * 5000 + "]" * 5000 + "}", "JSON this loader cannot read \\(RecursionError"),
])
def test_json_the_parser_cannot_hold_is_a_suite_error_naming_the_line(tmp_path, line, match):
    path = tmp_path / "mine.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(SuiteError, match=f"mine.jsonl:1: {match}"):
        load_suite(path)


def test_a_text_suite_line_of_escaped_newlines_only_is_an_empty_prompt(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("def f(x):\\n    return\n\\n\\n\n")
    with pytest.raises(SuiteError, match="mine.txt:2: empty prompt"):
        load_suite(path)


def test_fields_a_suite_does_not_read_are_named_once_with_a_likely_typo(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"id": "a", "prompt": "def f(x):", "langauge": "python", "test": "assert f(1)"}\n'
                    '{"id": "b", "prompt": "def g():", "test": "assert g()"}\n')
    with pytest.warns(UserWarning, match=r"field\(s\) langauge, test are not read .*'langauge' \(did you mean "
                                         r"'language'\?\)") as caught:
        prompts = load_suite(path)
    assert len(caught) == 1 and [p.language for p in prompts] == ["unknown", "unknown"]
    array = tmp_path / "mine.json"
    array.write_text('[{"prompt": "def f(x):", "entry_point": "f"}]')
    with pytest.warns(UserWarning, match="field\\(s\\) entry_point are not read"):
        load_suite(array)


def test_the_cli_prints_a_library_warning_as_one_note_line(tmp_path, capsys):
    from specpilot.cli import main

    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "def f(x):", "tset": 1}\n')
    # the suite loads (its note), then --chat-template on is refused: the embedded tokenizer has no template
    code = main(["eval", "--suite", str(path), "--chat-template", "on", "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 2, err
    assert err[0].startswith("specpilot eval: note: ") and "field(s) tset are not read" in err[0]
    assert "did you mean 'test'" not in err[0] and "--chat-template on" in err[1]
