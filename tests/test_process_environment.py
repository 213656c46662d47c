"""The process around the commands: locales that are not UTF-8, paths of odd bytes or dangling links, closed or narrow
stdio, SIGTERM, environment variables that libraries read on import, CPU affinity. Each must end in one clear line or
in a result, never in a traceback or in results lost after the work."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from specpilot.cli import main
from specpilot.drafting.cliargs import output_dir, run_folder, usable_cores, utf8_text
from specpilot.drafting.errors import NotEnoughMemoryError, OutputPathError, is_user_error
from specpilot.drafting.files import _damaged, atomic_write_text, check_writable, path_text_problem

SPECPILOT = [sys.executable, "-m", "specpilot"]


def run_cli(args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([*SPECPILOT, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@pytest.mark.parametrize("where", ["leaf", "parent", "loop"])
def test_a_dangling_link_on_the_output_path_is_refused_before_the_work(tmp_path, where):
    if where == "loop":
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        path = tmp_path / "a" / "grid.json"
    else:
        (tmp_path / "link").symlink_to(tmp_path / "nowhere")
        path = tmp_path / "link" / ("grid.json" if where == "parent" else "")
    with pytest.raises(OutputPathError, match="symbolic link that leads nowhere"):
        check_writable(path, kind="file" if path.name == "grid.json" else "dir", what="--out")


def test_an_os_error_on_the_way_to_an_output_is_one_line(tmp_path, capsys):
    too_long = tmp_path / ("a" * 300) / "s.jsonl"
    with pytest.raises(OutputPathError, match="File name too long"):
        check_writable(too_long, kind="file", what="--out")
    for argv in (["prompts", "--from", str(tmp_path), "--out", str(too_long)],
                 ["eval", "--run", str(tmp_path / ("r" * 300))]):
        with pytest.raises(SystemExit) as exit_info:  # refused by the parser: one line, exit 2
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and "File name too long" in err[0]


def test_paths_that_cannot_be_passed_on_as_utf8_are_refused():
    undecodable = os.fsdecode(b"run\xff")
    assert path_text_problem("runs/caf\u00e9") is None
    assert "not UTF-8 text" in path_text_problem(undecodable)
    with pytest.raises(OutputPathError, match=r"run\\xff cannot be used: its name holds bytes"):
        check_writable(undecodable, what="--out")


def test_a_non_ascii_path_under_an_ascii_locale_names_the_locale(tmp_path):
    result = run_cli(["grid", "--traces", "x", "--out", str(tmp_path / "caf\u00e9" / "g.json")],
                     LC_ALL="C", PYTHONUTF8="0", PYTHONIOENCODING="")
    assert result.returncode == 2
    assert "reads file names as ascii (its locale)" in result.stderr and "LC_ALL=C.UTF-8" in result.stderr


def test_utf8_text_from_an_ascii_locale_argv_is_decoded_again():
    # LC_ALL=C with PYTHONUTF8=0: Python decodes argv as ASCII, UTF-8 bytes arrive as surrogates
    as_ascii = b"def caf\xc3\xa9(\xc3\xbc):".decode("ascii", "surrogateescape")
    assert utf8_text(as_ascii) == "def caf\u00e9(\u00fc):"
    with pytest.raises(Exception, match="is not valid UTF-8"):
        utf8_text(b"caf\xff".decode("ascii", "surrogateescape"))


def test_tilde_is_expanded_in_what_is_checked_and_what_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert output_dir("~/runs") == str(tmp_path / "runs")
    (tmp_path / "run").mkdir()
    assert run_folder("~/run") == str(tmp_path / "run")


def test_writing_through_a_symlinked_output_file_keeps_the_link(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "grid.json").write_text('{"old": true}')
    (tmp_path / "grid.json").symlink_to(tmp_path / "shared" / "grid.json")
    atomic_write_text(tmp_path / "grid.json", '{"new": true}')
    assert (tmp_path / "grid.json").is_symlink()
    assert json.loads((tmp_path / "shared" / "grid.json").read_text()) == {"new": True}


def test_a_report_quoting_an_undecodable_path_is_written(tmp_path):
    suite = os.fsdecode(b"d\xff/s.jsonl")
    atomic_write_text(tmp_path / "report.md", f"suite {suite}")
    assert (tmp_path / "report.md").read_bytes() == b"suite d\\udcff/s.jsonl"  # escaped: the file stays UTF-8


def test_out_of_memory_while_mapping_weights_is_not_called_damage(tmp_path):
    err = _damaged(tmp_path / "model.safetensors", "target model", "rebuild it",
                   OSError(errno.ENOMEM, "Cannot allocate memory"))
    assert isinstance(err, NotEnoughMemoryError) and is_user_error(err)
    assert "not enough memory" in str(err) and "ulimit -v" in str(err) and "rebuild" not in str(err)


def test_a_note_made_an_error_by_pythonwarnings_is_one_line(tmp_path, capsys):
    suite = tmp_path / "s.jsonl"
    suite.write_text(json.dumps({"id": "a", "prompt": "def f(x):\n", "bogus_field": 1}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code = main(["record", "--suite", str(suite), "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "bogus_field are not read" in err[0]


def test_text_stdout_cannot_encode_is_escaped_not_lost():
    code = "from specpilot.cli import _printable_stdio; _printable_stdio(); print('caf\\u00e9 \\u0392')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0 and result.stdout.strip() == "caf\\xe9 \\u0392"


def test_generate_with_stdout_closed_says_so():
    result = subprocess.run(["bash", "-c", f"{sys.executable} -m specpilot generate --prompt 'def f(x):' >&-"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "stdout is closed" in result.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_generate_into_a_full_stdout_says_stdout_failed(saved_pair):
    """A full disk behind `> out.txt` (here /dev/full): one line naming stdout, not a bare Errno 28, and no
    'Exception ignored' from the interpreter's last flush."""
    pair = f"--target {saved_pair / 'target'} --draft {saved_pair / 'draft'} --width 2 --max-new-tokens 6"
    result = subprocess.run(["bash", "-c", f"{sys.executable} -m specpilot generate --prompt 'def f(x):' {pair} "
                             ">/dev/full"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "generate:" in line]
    assert len(lines) == 1 and "to stdout" in lines[0] and "No space left" in lines[0]
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr


def test_an_os_error_elsewhere_is_not_blamed_on_stdout(monkeypatch, capsys):
    """stdout still flushing: the error came from somewhere else and is reported as it is."""
    from specpilot.drafting import cli as generate_cli

    def full_disk(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/out.json")

    monkeypatch.setattr(generate_cli, "run", full_disk)
    assert main(["generate", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "stdout" not in err and "/data/out.json" in err


def test_an_unusable_mplbackend_does_not_fail_the_figures(tmp_path):
    code = ("from specpilot.eval.plots import pyplot; plt = pyplot(); fig, ax = plt.subplots(); "
            f"fig.savefig({str(tmp_path / 'f.png')!r}); print(plt.get_backend())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "MPLBACKEND": "garbage"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().lower() == "agg" and (tmp_path / "f.png").is_file()


def test_python_dash_m_specpilot_is_the_cli():
    result = subprocess.run([*SPECPILOT, "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("usage: specpilot")


def test_usable_cores_follow_the_affinity(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert usable_cores() == 1


@pytest.mark.heavy
def test_sigterm_stops_a_command_as_ctrl_c_does_and_exits_143(tmp_path):
    """`kill`, `timeout` or a scheduler's preemption: record keeps its finished shards and says how to resume."""
    out = tmp_path / "traces"
    proc = subprocess.Popen([*SPECPILOT, "--threads", "1", "record", "--suite", "train", "--limit", "40",
                             "--max-new-tokens", "16", "--profile-cycles", "0", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not list(out.glob("shards/*/done.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "interrupted" in err and "run the same command again to resume" in err and "Traceback" not in err
    assert not list(tmp_path.rglob(".*.tmp-*")) and not (out / ".specpilot.lock").exists()


def test_the_wandb_service_keeps_its_logs_off_stderr_without_a_home(tmp_path):
    code = ("from specpilot.train.rl.logging import RunLogger\n"
            f"with RunLogger({str(tmp_path / 'run')!r}, {{'command': 'x'}}, mode='offline') as log:\n"
            "    log.log({'a/b': 1.0}, step=1)\n"
            "import os; print(os.environ.get('XDG_CACHE_HOME'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_CACHE_HOME")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "" and result.stdout.strip() == "None"
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_a_library_callers_non_ascii_path_under_an_ascii_locale_is_one_clear_error(tmp_path):
    code = (f"from specpilot.drafting.files import check_writable; check_writable({str(tmp_path)!r} + '/caf\\u00e9')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": "utf-8"})
    assert "OutputPathError" in result.stderr and "reads file names as ascii" in result.stderr
    assert "UnicodeEncodeError" not in result.stderr


def test_a_json_report_quoting_an_undecodable_path_reads_back():
    import tempfile

    from specpilot.drafting.files import atomic_write_json, read_json

    name = os.fsdecode(b"d\xff/s.jsonl")
    with tempfile.TemporaryDirectory() as folder:
        atomic_write_json(Path(folder) / "report.json", {"suite": {"name": name}}, ensure_ascii=False)
        assert read_json(Path(folder) / "report.json", what="report", fix="-")["suite"]["name"] == name


def test_a_new_models_build_folder_is_not_refused_for_its_own_lock(tmp_path):
    from specpilot.drafting.folder_lock import output_lock
    from specpilot.train.models.build_pair import check_build_folder

    with output_lock(tmp_path / "pair"):
        check_build_folder(tmp_path / "pair", quick=True)  # holds only its own lock: new
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "model.safetensors").write_text("x")
    with pytest.raises(ValueError, match="holds files but is not an earlier"):
        check_build_folder(tmp_path / "theirs")


def test_the_wandb_service_cache_is_absolute_for_a_relative_run(tmp_path, monkeypatch):
    code = ("from specpilot.train.rl.logging import RunLogger\n"
            "with RunLogger('run', {'command': 'x'}, mode='offline') as log:\n"
            "    log.log({'a/b': 1.0}, step=1)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_CACHE_HOME")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ""
