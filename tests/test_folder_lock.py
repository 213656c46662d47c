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
from specpilot.drafting.folder_lock import (LOCK_FILE, FolderInUseError, check_not_in_use, grant, held_folders,
                                            holds_output, output_lock)

HOLDER = """
import sys, time
from pathlib import Path
from specpilot.drafting.folder_lock import output_lock
with output_lock(sys.argv[1], kind=sys.argv[3] if len(sys.argv) > 3 else "dir"):
    Path(sys.argv[2]).write_text("held")
    time.sleep(60)
"""


def start_holder(path: Path, ready: Path, kind: str = "dir") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(ready), kind])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the holder did not start"
        time.sleep(0.05)
    return proc


@pytest.fixture
def held(tmp_path):
    """A folder held by another process (its pid), released (killed) after the test."""
    folder = tmp_path / "run"
    proc = start_holder(folder, tmp_path / "ready")
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
    folder = tmp_path / "new" / "deeper" / "run"
    with output_lock(folder):
        assert (folder / LOCK_FILE).is_file()
        assert held_folders() == {str(folder.resolve()): os.getpid()}
        with output_lock(folder), output_lock(folder / "eval"), output_lock(folder / "grid.json", kind="file"):
            check_not_in_use(folder / "eval" / "report.json", kind="file")
    assert not (tmp_path / "new").exists()  # made by the lock and left empty (a refused or failed run): removed
    assert held_folders() == {}
    folder.mkdir(parents=True)
    with output_lock(folder):
        (folder / "result.json").write_text("{}")
    assert sorted(p.name for p in folder.iterdir()) == ["result.json"]


def test_holding_a_folder_inside_refuses_a_run_on_the_folder_above(tmp_path):
    """`eval --out RUN/eval` running, then `demo --out RUN`: the demo would reuse or replace the eval's report."""
    proc = start_holder(tmp_path / "run" / "eval", tmp_path / "ready")
    try:
        with pytest.raises(FolderInUseError, match="run contains .*run/eval, which is being written by another"):
            with output_lock(tmp_path / "run"):
                pass
        with output_lock(tmp_path / "run" / "traces"):  # a sibling is free
            pass
    finally:
        proc.kill()
        proc.wait()


def test_a_file_is_held_beside_itself_and_its_siblings_stay_free(tmp_path):
    proc = start_holder(tmp_path / "runs" / "grid.json", tmp_path / "ready", kind="file")
    try:
        assert (tmp_path / "runs" / ".grid.json.specpilot.lock").is_file()
        with pytest.raises(FolderInUseError, match="grid.json is being written by another specpilot run"):
            with output_lock(tmp_path / "runs" / "grid.json", kind="file"):
                pass
        with output_lock(tmp_path / "runs" / "other.json", kind="file"):
            pass
        with pytest.raises(FolderInUseError, match="contains .*grid.json"):  # the folder: something inside is written
            with output_lock(tmp_path / "runs"):
                pass
    finally:
        proc.kill()
        proc.wait()


def _granted_child_holds(held: dict, path: str) -> str:
    grant(held)
    with output_lock(Path(path) / "seed1"):
        return "ok"


def _ungranted_child_holds(path: str) -> str:
    try:
        with output_lock(Path(path) / "seed1"):
            return "ok"
    except FolderInUseError:
        return "refused"


def test_a_worker_writes_inside_its_parents_folder_only_when_granted(tmp_path):
    # `train all --seeds N --seed-workers K` trains each seed in a spawned process inside the run the parent holds;
    # any other child (a notebook starting `specpilot record --out RUN`) is refused like any other process
    with output_lock(tmp_path / "run"):
        context = multiprocessing.get_context("spawn")
        with context.Pool(1) as pool:
            assert pool.apply(_granted_child_holds, (held_folders(), str(tmp_path / "run"))) == "ok"
        with context.Pool(1) as pool:
            assert pool.apply(_ungranted_child_holds, (str(tmp_path / "run"),)) == "refused"


def test_a_grant_lapses_when_the_granting_process_is_gone(held):
    folder, proc = held
    grant({str(folder.resolve()): proc.pid + 1})  # not the pid that holds it
    with pytest.raises(FolderInUseError):
        with output_lock(folder / "seed0"):
            pass


def test_an_orphaned_seed_worker_exits():
    code = "from specpilot.train.rl import seeds; import time; seeds._watch_parent(-1, 0.01); time.sleep(30)"
    result = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 1  # os._exit(1) from the watch, long before the sleep ends


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
                                  ["eval", "--limit", "1", "--out", "{}/eval"],
                                  ["eval", "--limit", "1", "--replay-dir", "{}/rd", "--out", "{}/../ev"],
                                  ["prompts", "--from", "{}/..", "--out", "{}/p.jsonl"]])
def test_cli_refuses_in_one_line(held, capsys, argv):
    folder, proc = held
    code = main([a.replace("{}", str(folder)) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and f"being written by another specpilot run (pid {proc.pid}" in err[0], err


def test_a_reader_is_told_who_writes_what_it_reads(held, tmp_path):
    from specpilot.drafting.folder_lock import being_written

    folder, proc = held
    assert being_written(folder).startswith(f"pid {proc.pid}: `")
    assert being_written(folder / "stage1") is not None and being_written(tmp_path / "other") is None


@pytest.mark.parametrize("held_as, asked_as", [("swapped", "dir"), ("dir", "swapped")])
def test_a_folder_held_as_a_whole_and_as_a_folder_conflict(tmp_path, held_as, asked_as):
    """`export --out X` (X replaced as a whole, locked beside it) against `eval --out X` (locked inside it)."""
    proc = start_holder(tmp_path / "x", tmp_path / "ready", kind=held_as)
    try:
        for path, kind in ((tmp_path / "x", asked_as), (tmp_path / "x" / "eval", "dir"),
                           (tmp_path / "x" / "grid.json", "file")):
            with pytest.raises(FolderInUseError, match=f"pid {proc.pid}"):
                with output_lock(path, kind=kind):
                    pass
    finally:
        proc.kill()
        proc.wait()


def test_two_runs_that_passed_the_check_together_are_caught_once_held(tmp_path, monkeypatch):
    """The check runs before the lock is taken: a run on RUN and one on RUN/eval started together can both pass
    it; checked again once held, at least one sees the other."""
    from specpilot.drafting import folder_lock

    proc = start_holder(tmp_path / "run" / "eval", tmp_path / "ready")
    try:
        monkeypatch.setattr(folder_lock, "check_not_in_use", lambda *a, **k: None)  # passed before the other held
        with pytest.raises(FolderInUseError, match="contains .*eval"):
            with output_lock(tmp_path / "run"):
                pytest.fail("not held")
        assert not (tmp_path / "run" / LOCK_FILE).exists() and folder_lock._held == {}
    finally:
        proc.kill()
        proc.wait()


def test_a_failed_write_of_the_holders_line_leaves_nothing_held(tmp_path, monkeypatch):
    from specpilot.drafting import folder_lock

    def full_disk(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(folder_lock.os, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        with output_lock(tmp_path / "run"):
            pass
    monkeypatch.undo()
    assert folder_lock._held == {} and not (tmp_path / "run").exists()
    with output_lock(tmp_path / "run"):  # not refused as "another run": nothing of the failed hold is left
        pass


def test_probing_a_held_lock_does_not_wait(held, monkeypatch):
    from specpilot.drafting import folder_lock

    folder, _ = held
    monkeypatch.setattr(folder_lock.time, "sleep", lambda s: pytest.fail("a probe waited"))
    assert folder_lock._locked_by_other(folder / LOCK_FILE)
