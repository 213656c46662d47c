"""`specpilot prompts` / eval/code_prompts.py: code-completion suites cut out of the user's own source."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from specpilot.cli import main
from specpilot.eval.code_prompts import extract_code_prompts, prompts_from_source, write_suite
from specpilot.eval.suites import SuiteError, load_suite

SOURCE = textwrap.dedent('''\
    """A module."""


    def public_with_doc(path: str, limit: int = 3) -> list[str]:
        """Read `path` and return its first `limit` non-empty lines, stripped."""
        out = []
        with open(path) as handle:
            for line in handle:
                out.append(line.strip())
        return out[:limit]


    def _private(x):
        """Private helpers are not prompts, whatever their docstring says."""
        return x


    def no_docstring(x):
        return x + 1


    class Box:
        def volume(self, scale: float = 1.0) -> float:
            """The volume of the box, scaled by `scale` in every dimension."""
            total = self.w * self.h * self.d
            return total * scale ** 3
    ''')


def _tree(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize("form", ["signature", "body"])
def test_each_public_documented_function_gives_one_prompt_in_the_form_asked(form):
    import random

    got = prompts_from_source(SOURCE, origin="m", rng=random.Random(0), forms=(form,))
    assert [pid for pid, _, _ in got] == ["m:public_with_doc", "m:volume"]
    for _, got_form, text in got:
        assert got_form == form
        assert text.startswith("def ") and not text.endswith("\n")
    method = got[1][2]
    assert method.startswith("def volume(self")  # dedented: a method reads like a function
    if form == "signature":
        assert method.endswith('in every dimension."""')
    else:
        assert method.endswith("total = self.w * self.h * self.d")


def test_a_file_that_does_not_parse_gives_no_prompt():
    import random

    assert prompts_from_source("def broken(:\n    pass\n", origin="m", rng=random.Random(0)) == []


def test_extraction_is_deterministic_capped_and_loads_as_a_suite(tmp_path):
    src = _tree(tmp_path / "src", {f"pkg{i}/mod{j}.py": SOURCE.replace("public_with_doc", f"f{i}_{j}")
                                   for i in range(3) for j in range(4)})
    a = extract_code_prompts([src], seed=1, per_file=1, per_folder=2)
    b = extract_code_prompts([src], seed=1, per_file=1, per_folder=2)
    assert [p.prompt for p in a] == [p.prompt for p in b]
    assert len(a) == 6  # 3 folders x 2
    assert len(extract_code_prompts([src], seed=1, limit=4)) == 4
    out = write_suite(a, tmp_path / "suite.jsonl")
    loaded = load_suite(out)
    assert [p.prompt for p in loaded] == [p.prompt for p in a]
    assert {p.split for p in loaded} == {"train"} and {p.language for p in loaded} == {"python"}


def test_prompts_overlapping_an_excluded_suite_are_dropped(tmp_path):
    by_name = tmp_path / "by_name.jsonl"  # same function name as the method `volume`
    by_name.write_text(json.dumps({"id": "h-volume", "prompt": "def volume(x):\n    pass"}) + "\n")
    by_line = tmp_path / "by_line.jsonl"  # shares public_with_doc's docstring line (30+ characters)
    by_line.write_text(json.dumps({"id": "h-2", "prompt": 'def other():\n    """Read `path` and return its first '
                                                         '`limit` non-empty lines, stripped."""'}) + "\n")
    src = _tree(tmp_path / "src", {"m.py": SOURCE})
    assert len(extract_code_prompts([src])) == 2
    kept = extract_code_prompts([src], exclude=[by_name])
    assert [p.id.split(":")[1].rsplit("-", 1)[0] for p in kept] == ["public_with_doc"]
    kept = extract_code_prompts([src], exclude=[by_line])
    assert [p.id.split(":")[1].rsplit("-", 1)[0] for p in kept] == ["volume"]
    with pytest.raises(SuiteError, match="all 2 usable function\\(s\\) under .* overlap the excluded suites"):
        extract_code_prompts([src], exclude=[by_name, by_line])


@pytest.mark.parametrize("kwargs, match", [
    ({"paths": ["missing-folder"]}, "no such file or folder"),
    ({"forms": ("prose",)}, "unknown prompt form"),
    ({"limit": 0}, "positive number"),
])
def test_bad_requests_are_refused_clearly(tmp_path, kwargs, match):
    paths = kwargs.pop("paths", [_tree(tmp_path / "src", {"m.py": SOURCE})])
    with pytest.raises(SuiteError, match=match):
        extract_code_prompts(paths, **kwargs)


def test_a_folder_without_python_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("no code here")
    with pytest.raises(SuiteError, match="no .py files"):
        extract_code_prompts([tmp_path])


def test_cli_writes_the_suite_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    src = _tree(tmp_path / "src", {"m.py": SOURCE})
    out = tmp_path / "out" / "mine.jsonl"
    assert main(["prompts", "--from", str(src), "--out", str(out), "--exclude"]) == 0
    assert len(load_suite(out)) == 2
    capsys.readouterr()
    assert main(["prompts", "--from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such file or folder" in err and "Traceback" not in err
    assert not (tmp_path / "x.jsonl").exists()


def test_a_body_prompt_holds_a_statement_else_the_function_gives_a_signature_prompt():
    import random

    source = textwrap.dedent('''\
        def spaced(values: list[float]) -> float:
            """Return the mean of `values`, or zero when the list is empty."""




            return sum(values) / len(values) if values else 0.0


        def commented(values: list[float]) -> float:
            """Return the largest of `values`, or zero when the list is empty."""
            # first comment line here
            # second comment line here
            # third comment line here
            return max(values, default=0.0)
        ''')
    # body only: neither function has a statement within the form's 3 lines, so neither gives a (mislabelled) prompt
    assert prompts_from_source(source, origin="m", rng=random.Random(0), forms=("body",), min_chars=20) == []
    got = prompts_from_source(source, origin="m", rng=random.Random(0), forms=("signature",), min_chars=20)
    assert [(pid, form) for pid, form, _ in got] == [("m:spaced", "signature"), ("m:commented", "signature")]
    assert all(text.endswith('"""') for _, _, text in got)


def test_a_method_reads_like_a_function_even_with_a_column_zero_string_inside():
    import random

    source = ('class C:\n'
              '    def method_with_text(self):\n'
              '        """A method whose body holds a multi-line string at column zero here."""\n'
              '        text = """\n'
              'first line at column zero\n'
              '"""\n'
              '        return text\n')
    [(_, form, text)] = prompts_from_source(source, origin="m", rng=random.Random(0), forms=("body",))
    assert form == "body" and text.startswith("def method_with_text(self):\n    \"\"\"A method")
    assert "\nfirst line at column zero\n" in text  # the string's own text is left as it is


@pytest.mark.parametrize("encoded", [
    b"\xef\xbb\xbf" + SOURCE.encode(),                                                    # a UTF-8 BOM
    b"# -*- coding: latin-1 -*-\n" + SOURCE.replace("stripped.", "stripped, caf\u00e9.").encode("latin-1"),
])
def test_source_decoded_as_python_decodes_it(tmp_path, encoded):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_bytes(encoded)
    kept = extract_code_prompts([tmp_path / "src"])
    assert len(kept) == 2 and not kept[0].prompt.startswith("\ufeff")


def test_files_that_cannot_be_read_are_counted_in_the_refusal(tmp_path):
    (tmp_path / "src").mkdir()
    latin1 = SOURCE.replace("stripped.", "stripped, caf\u00e9.").encode("latin-1")  # no declaration: not UTF-8
    (tmp_path / "src" / "latin1.py").write_bytes(latin1)
    (tmp_path / "src" / "deep.py").write_text("x = " + "+".join(["a"] * 3000) + "\n")  # too deep for the parser
    with pytest.raises(SuiteError, match=r"\(1 of 2 \.py file\(s\) could not be read or decoded; 1 of 2 \.py "
                                         r"file\(s\) could not be parsed \(a syntax error, NUL bytes, or nesting"):
        extract_code_prompts([tmp_path / "src"])


def test_the_command_says_what_it_left_out(tmp_path, capsys):
    src = _tree(tmp_path / "src", {"m.py": SOURCE})
    (src / "latin1.py").write_bytes(b"def f():\n    '''caf\xe9'''\n")  # not UTF-8, no declaration
    by_name = tmp_path / "by_name.jsonl"
    by_name.write_text(json.dumps({"id": "h-volume", "prompt": "def volume(x):\n    pass"}) + "\n")
    out = tmp_path / "suite.jsonl"
    assert main(["prompts", "--from", str(src), "--exclude", str(by_name), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "note: 1 of 2 .py file(s) could not be read or decoded; 1 function(s) overlapped the excluded suites" in err
    assert len(load_suite(out)) == 1


@pytest.mark.parametrize("seed", range(6))
def test_copies_of_a_file_give_each_function_once_in_either_form(tmp_path, seed):
    """Identical (or vendored) files: the draw may cut one copy as `signature` and another as `body`, a prompt that
    extends the first; each function still gives one prompt, none a prefix of another."""
    src = _tree(tmp_path / "src", {"a/m.py": SOURCE, "b/m.py": SOURCE, "c/copy.py": SOURCE})
    prompts = extract_code_prompts([src], seed=seed)
    texts = [p.prompt for p in prompts]
    assert len(texts) == 2
    assert not [a for a in texts for b in texts if a != b and b.startswith(a)]


def test_a_file_name_that_is_not_utf8_gives_ids_the_suite_loader_reads(tmp_path):
    import os

    src = tmp_path / "src"
    src.mkdir()
    try:
        (Path(os.fsdecode(bytes(src) + b"/mod\xff.py"))).write_text(SOURCE)
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses non-UTF-8 names")
    out = write_suite(extract_code_prompts([src]), tmp_path / "s.jsonl")
    ids = [p.id for p in load_suite(out)]
    assert len(ids) == 2 and all("mod\ufffd" in i for i in ids)


def test_files_that_are_not_valid_python_are_counted_and_named(tmp_path, capsys):
    src = _tree(tmp_path / "src", {"broken.py": "def broken(:\n    pass\n", "m.py": SOURCE})
    (src / "nul.py").write_bytes(b"def f():\n    '''doc'''\x00\n")
    stats: dict = {}
    assert len(extract_code_prompts([src], stats=stats)) == 2
    assert stats["unparsable"] == 2 and stats["unreadable"] == 0
    assert main(["prompts", "--from", str(src), "--out", str(tmp_path / "s.jsonl"), "--exclude"]) == 0
    assert "2 of 3 .py file(s) could not be parsed as Python" in capsys.readouterr().err
    with pytest.raises(SuiteError, match=r"under .*broken.py \(1 of 1 .py file\(s\) could not be parsed"):
        extract_code_prompts([src / "broken.py"])


def test_a_source_file_that_is_not_python_is_refused(tmp_path):
    (tmp_path / "readme.txt").write_text("def f(x):\n    '''Not code.'''\n")
    with pytest.raises(SuiteError, match="readme.txt is not a Python file"):
        extract_code_prompts([tmp_path / "readme.txt"])


def test_prompts_are_cut_on_the_lines_python_counts():
    """A form feed (a page break) or a U+2028 in a comment does not end a line for Python's parser, so it must not
    for the cut either: each function gives its own text, body statement included. Tab-indented code gives prompts
    like any other."""
    import random

    source = ('def first_function(a, b):\n    """Add two numbers together and return the sum of them."""\n'
              '    total = a + b\n    return total\n\x0c\n'
              'def second_function(text):\n    """Return the text reversed, with surrounding whitespace removed."""\n'
              '    cleaned = text.strip()\n    return cleaned[::-1]\n# a comment \u2028 with a line separator\n'
              'class Tabbed:\n\tdef third_function(self, items):\n'
              '\t\t"""Return the number of distinct items in the given iterable."""\n\t\treturn len(set(items))\n')
    got = prompts_from_source(source, origin="m", rng=random.Random(0), forms=("body",), min_chars=20)
    assert [text for _, _, text in got] == [
        'def first_function(a, b):\n    """Add two numbers together and return the sum of them."""\n    total = a + b',
        'def second_function(text):\n    """Return the text reversed, with surrounding whitespace removed."""\n'
        '    cleaned = text.strip()',
        'def third_function(self, items):\n\t"""Return the number of distinct items in the given iterable."""\n'
        '\treturn len(set(items))']


def test_a_suite_named_as_a_table_is_refused_saying_tables_are_refused(tmp_path):
    from specpilot.eval.code_prompts import check_suite_path

    with pytest.raises(ValueError, match=r"suites named \.csv are refused as tables"):
        check_suite_path(tmp_path / "x.csv")
