"""The docs match the commands: the README's CLI table is the one `cli_reference()` renders from the parser, every
option of every (sub-)command has help text that shows its default, and the README's demo stage table lists files
the demo writes (checked against a real run in tests/test_demo.py via `readme_demo_paths`)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from specpilot.cli import build_parser, cli_reference

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_table() -> str:
    text = README.read_text()
    match = re.search(r"<!-- cli-table:start -->\n(.*?)\n<!-- cli-table:end -->", text, re.S)
    assert match, "README.md lacks the <!-- cli-table:start/end --> markers"
    return match.group(1)


def test_readme_cli_table_is_generated_from_the_parser():
    assert _readme_table() == cli_reference(), (
        "README.md's CLI table differs from the parser: regenerate it with "
        "`python -c \"from specpilot.cli import cli_reference; print(cli_reference())\"` between the cli-table markers")


def _parsers(parser: argparse.ArgumentParser, name: str = "specpilot"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


PARSERS = dict(_parsers(build_parser()))


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_option_has_help_that_shows_its_default(name):
    parser = PARSERS[name]
    assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter), name
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest}: no help text"
        shown = formatter._get_help_string(action)
        if action.option_strings:
            text = shown.lower()  # a default stated as one ("(default ...", "default: ..."), not "the dtype's default"
            ok = "required" in text if action.required else ("(default" in text or "default:" in text)
            said = "required" if action.required else "default"
            assert ok, f"{name} {action.option_strings}: help does not show the {said}"


def test_help_renders_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--help"])
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # help text wraps with the terminal's width
    assert "(default: 128)" in flat and "(default: the held-out suite that matches the pair" in flat
    assert "(default: 0,1)" in flat  # a list default as the comma list the option takes, not "(0.0, 1.0)"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["agreement", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    assert "auto (the dtype's default) (default: auto)" in flat and "NEAR_TIE_ON, 2)" in flat


def readme_demo_paths() -> list[str]:
    """The concrete paths of the README's demo stage table ("(unless ...)" entries and "(then ...)" notes skipped)."""
    text = README.read_text()
    table = text[text.index("| stage | what | files |"):]
    table = table[: table.index("\n\n")]
    paths = []
    for row in table.splitlines()[2:]:
        files = row.split("|")[3]
        optional = set(re.findall(r"`([^`]+)` \(unless", files))   # "`wandb/` (unless `--wandb disabled`)"
        files = re.sub(r"\([^)]*\)", "", files)                    # notes such as "(then `co2_depth/`, ...)"
        paths += [path for path in re.findall(r"`([^`]+)`", files) if path not in optional]
    return paths


def test_readme_demo_table_parses():
    paths = readme_demo_paths()
    assert "grid.json" in paths and "eval/report.json" in paths and "seed0/bc_size/" in paths
    assert not any(p.startswith("--") for p in paths)
