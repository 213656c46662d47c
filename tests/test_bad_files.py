"""Truncated, garbage or incomplete files raise an error that names the file (never a bare BadZipFile,
JSONDecodeError, EOFError or KeyError): traces, latency profiles, grid results, policies indexes, run manifests and
exported decoders, through the library and through the command line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny import tiny_pair

from specpilot.cli import main
from specpilot.drafting.errors import InputFileError, is_user_error
from specpilot.drafting.types import TreeConfig
from specpilot.envs.profile import LatencyProfile
from specpilot.envs.record import Trace, record_task
from specpilot.eval.inputs import read_grid_best
from specpilot.policies.ppo import PolicyLoadError, load_run_controllers


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A real recorded trace + profile of a tiny pair (2 prompts, W=2, D=3)."""
    out = tmp_path_factory.mktemp("trace")
    record_task(tiny_pair(), TreeConfig(width=2, max_depth=3, max_size=6), [[5, 17, 3, 42], [60, 2, 2, 9]], out,
                max_new_tokens=8)
    return out


def _copy(recorded, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(recorded, dst)
    return dst


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


BREAK_TRACE = {
    "truncated npz": ("trace.npz", _truncate),
    "garbage npz": ("trace.npz", lambda p: p.write_bytes(b"\x00\xffnot a zip file at all" * 10)),
    "empty npz": ("trace.npz", lambda p: p.write_bytes(b"")),
    "truncated header": ("trace.json", _truncate),
    "binary header": ("trace.json", lambda p: p.write_bytes(b"\xff\xfe\x00garbage")),
    "header is a list": ("trace.json", lambda p: p.write_text("[1, 2]")),
    "header without tree": ("trace.json", lambda p: _edit_json(p, lambda h: h.pop("tree"))),
    "header of another tree": ("trace.json", lambda p: _edit_json(p, lambda h: h["tree"].update(width=3))),
    "header version": ("trace.json", lambda p: _edit_json(p, lambda h: h.update(version=99))),
}


@pytest.mark.parametrize("breakage", list(BREAK_TRACE))
def test_broken_trace_names_the_file(recorded, tmp_path, breakage):
    d = _copy(recorded, tmp_path)
    name, breaker = BREAK_TRACE[breakage]
    breaker(d / name)
    with pytest.raises(InputFileError) as info:
        Trace.load(d)
    assert str(d / name) in str(info.value) or str(d) in str(info.value)
    assert is_user_error(info.value)


BREAK_PROFILE = {
    "truncated": _truncate,
    "garbage": lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00"),
    "empty": lambda p: p.write_text(""),
    "not an object": lambda p: p.write_text("3"),
    "missing curve": lambda p: _edit_json(p, lambda d: d.pop("levels")),
    "malformed curve": lambda p: _edit_json(p, lambda d: d.update(verify_size=[1, 2])),
}


@pytest.mark.parametrize("breakage", list(BREAK_PROFILE))
def test_broken_profile_names_the_file(recorded, tmp_path, breakage):
    d = _copy(recorded, tmp_path)
    BREAK_PROFILE[breakage](d / "profile.json")
    with pytest.raises(InputFileError, match="profile.json"):
        LatencyProfile.load(d / "profile.json")


@pytest.mark.parametrize("content, fragment", [
    ('{"best": {"depth": 3', "grid-search result"),
    ("\x00\x01", "grid-search result"),
    ('{"table": []}', "no best"),
    ('{"best": {"depth": "deep", "size": 4}}', "integer"),
    ("[]", "JSON list"),
])
def test_broken_grid_result_names_the_file(tmp_path, content, fragment):
    path = tmp_path / "grid.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=fragment) as info:
        read_grid_best(path)
    assert str(path) in str(info.value) and is_user_error(info.value)


@pytest.mark.parametrize("content", ['{"depth": {"path": "x.zip"', "\xff\xfe", "[1]"])
def test_broken_policies_index_names_the_file(tmp_path, content):
    (tmp_path / "policies.json").write_text(content, encoding="latin-1")
    with pytest.raises((PolicyLoadError, InputFileError)) as info:
        load_run_controllers(tmp_path)
    assert str(tmp_path / "policies.json") in str(info.value)


def test_cli_reports_a_truncated_trace_in_one_line(recorded, tmp_path, capsys):
    d = _copy(recorded, tmp_path)
    _truncate(d / "trace.npz")
    code = main(["grid", "--traces", str(d), "--out", str(tmp_path / "grid.json"), "--live-top", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "Traceback" not in err
    assert str(d / "trace.npz") in err and "truncated or corrupted" in err
    assert not (tmp_path / "grid.json").exists()


def test_cli_reports_a_garbage_profile_in_one_line(recorded, tmp_path, capsys):
    d = _copy(recorded, tmp_path)
    (d / "profile.json").write_text("{\"version\": 1, ")
    code = main(["grid", "--traces", str(d), "--out", str(tmp_path / "grid.json"), "--live-top", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and str(d / "profile.json") in err


def test_cli_grid_on_a_good_trace_writes_atomically(recorded, tmp_path, capsys):
    out = tmp_path / "g" / "grid.json"
    assert main(["grid", "--traces", str(recorded), "--out", str(out), "--live-top", "0"]) == 0
    assert json.loads(out.read_text())["best"]["source"] == "replay"
    assert sorted(p.name for p in out.parent.iterdir()) == ["grid.json", "grid.png"]  # no temporary left behind
