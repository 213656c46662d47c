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
    assert args.suite == "heldout" and args.temperatures == (0.0, 0.7) and args.concurrency == 4
    assert _parse([]).temperatures == (0.0, 1.0)


@pytest.mark.parametrize("argv, message", [
    (["--suite", "no_such_suite"], "unknown suite"),
    (["--methods", "fixed,warp"], "unknown method(s) warp"),
])
def test_bad_input_exits_2_with_message(argv, message, capsys):
    assert cli.run(_parse(argv)) == 2
    assert message in capsys.readouterr().err
