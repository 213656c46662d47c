"""One writer per output folder (`specpilot.drafting.folder_lock`): a second run given a folder another live process is
writing is refused at once, in one line naming the first; the lock goes with its process however it ends."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specpilot.cli import main
from specpilot.drafting.folder_lock import (HELD_ENV, LOCK_FILE, FolderInUseError, check_not_in_use, holds_output,
                                            output_lock)

HOLDER = """
import sys, time
from pathlib import Path
from specpilot.drafting.folder_lock import output_lock
with output_lock(sys.argv[1]):
    Path(sys.argv[2]).write_text("held")
    time.sleep(60)
"""


@pytest.fixture
def held(tmp_path):
    """A folder held by another process (its pid), released (killed) after the test."""
    folder, ready = tmp_path / "run", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the holder did not start"
        time.sleep(0.05)
    yield folder, proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("inside", ["", "eval", "traces/train"])
def test_a_held_folder_and_folders_inside_it_are_refused(held, inside):
    folder, proc = held
    with pytest.raises(FolderInUseError, match=f"another specpilot run \\(pid {proc.pid}: .*since") as err:
        with output_lock(folder / inside):
            pass
    assert "wait for it to end, or give another --out" in str(err.value)
    assert not (folder / inside / LOCK_FILE).exists() or not inside


def test_a_file_in_a_held_folder_is_refused(held):
    folder, _ = held
    with pytest.raises(FolderInUseError, match="is inside .*run, which is being written"):
        check_not_in_use(folder / "grid.json", what="--out")


def test_the_lock_goes_with_its_process_even_on_kill_9(held):
    folder, proc = held
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (folder / LOCK_FILE).exists()  # left behind by the killed holder: not a lock any more
    with output_lock(folder):
        assert (folder / LOCK_FILE).read_text().startswith(f'{{"pid": {os.getpid()}')
    assert not (folder / LOCK_FILE).exists()


def test_holding_is_reentrant_and_leaves_nothing_behind(tmp_path):
    folder = tmp_path / "new" / "run"
    with output_lock(folder):
        assert (folder / LOCK_FILE).is_file()
        assert str(folder) in os.environ[HELD_ENV].split(os.pathsep)
        with output_lock(folder), output_lock(folder / "eval"):  # a stage writing inside its own run
            check_not_in_use(folder / "eval" / "report.json")
    assert not folder.exists()  # made by the lock and left empty (a refused or failed run): removed
    assert HELD_ENV not in os.environ
    folder.mkdir(parents=True)
    with output_lock(folder):
        (folder / "result.json").write_text("{}")
    assert sorted(p.name for p in folder.iterdir()) == ["result.json"]


def _child_holds(path: str) -> str:
    with output_lock(Path(path) / "seed1"):
        return "ok"


def test_a_spawned_worker_writes_inside_its_parents_folder(tmp_path):
    # `train all --seeds N --seed-workers K` trains each seed in a spawned process inside the run the parent holds
    with output_lock(tmp_path / "run"):
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            assert pool.apply(_child_holds, (str(tmp_path / "run"),)) == "ok"


def test_a_symlink_to_a_held_folder_is_the_same_folder(held, tmp_path):
    folder, _ = held
    (tmp_path / "alias").symlink_to(folder)
    with pytest.raises(FolderInUseError):
        with output_lock(tmp_path / "alias"):
            pass


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_holds_output_decorator(held, kind):
    folder, _ = held
    calls = []

    @holds_output("out", what="report folder", kind=kind)
    def write(prompts, *, out=None):
        calls.append(out)

    target = folder / ("eval" if kind == "dir" else "grid.json")
    with pytest.raises(FolderInUseError, match="^report folder "):
        write([], out=target)
    write([], out=None)  # no output: nothing to hold
    assert calls == [None]


@pytest.mark.parametrize("argv", [["record", "--suite", "train", "--limit", "1", "--out", "{}"],
                                  ["eval", "--limit", "1", "--out", "{}/eval"]])
def test_cli_refuses_in_one_line(held, capsys, argv):
    folder, proc = held
    code = main([a.replace("{}", str(folder)) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and f"being written by another specpilot run (pid {proc.pid}" in err[0], err
