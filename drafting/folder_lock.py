"""One writer per output folder: two specpilot runs given the same --out (two terminals, a job started twice) would
interleave their stages, shards and reports in it. The first holds the folder; the second is refused at once, in one
line naming the first (its pid, command and start time), before it loads a model or writes a file.

    output_lock(folder, what="--out")     context manager: hold FOLDER/.specpilot.lock (an fcntl.flock) while
                                          writing there; the lock file is removed on release (and the folder too
                                          when the lock made it and nothing else was written in it)
    check_not_in_use(path, what="--out")  FolderInUseError when another process holds `path` or a folder above it
    holds_output(param, what=...)         decorator: the function's `param` folder is held while it runs (a file
                                          output: only checked, as atomic writes keep a file whole)

The kernel releases a flock when its process ends, however it ends (Ctrl-C, kill -9, a crash), so no stale lock ever
needs deleting by hand. Holding is per process and re-entrant: the demo holds its run folder and its stages write
inside it. Processes this one starts (spawned seed trainers) inherit the folders it holds (SPECPILOT_HELD_FOLDERS).
Where flock is missing (Windows) or refused by the filesystem, writing goes on unlocked, as before.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specpilot.drafting.errors import OutputPathError

try:
    import fcntl
except ImportError:  # not on POSIX: no locking
    fcntl = None

LOCK_FILE = ".specpilot.lock"
HELD_ENV = "SPECPILOT_HELD_FOLDERS"  # folders held by this process's parent (os.pathsep-separated)
_held: dict[Path, int] = {}  # folder -> the lock file descriptor, for the folders this process holds
_BUSY_TRIES = 5  # a prober's momentary lock (check_not_in_use of another process) is not a holder: retry briefly


class FolderInUseError(OutputPathError):
    """Another live process is writing the output folder (or a folder above it)."""


def _real(path: str | Path) -> Path:
    # realpath: a symlink to the folder and the folder itself are one folder
    return Path(os.path.realpath(Path(path).expanduser()))


def _inherited() -> list[Path]:
    return [Path(p) for p in os.environ.get(HELD_ENV, "").split(os.pathsep) if p]


def _held_here(folder: Path) -> Path | None:
    """The folder held by this process (or its parent) that contains `folder` (or is it), if any."""
    for held in (*_held, *_inherited()):
        if folder == held or held in folder.parents:
            return held
    return None


def _holder(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text(encoding="utf-8"))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["started"])))
        return f"pid {int(info['pid'])}: `{info['command']}`, since {since}"
    except (OSError, ValueError, KeyError, TypeError):  # written a moment ago, not yet filled in
        return "a process that is starting"


def _command() -> str:
    """This process's command line as typed: `specpilot ...` for the console script and `python -m specpilot`."""
    if Path(sys.argv[0]).name in ("specpilot", "__main__.py"):
        return " ".join(["specpilot", *sys.argv[1:]])
    return " ".join(sys.argv) or "python"


def _try_lock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: this filesystem has no flock."""
    for attempt in range(_BUSY_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.02 * (attempt + 1))
        except OSError:  # ENOLCK / EOPNOTSUPP (some network filesystems)
            return None
    return False


def _locked_by_other(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:  # no lock file (the usual case), or unreadable: nobody we can see holds it
        return False
    try:
        taken = _try_lock(fd)
        if taken:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return taken is False
    finally:
        os.close(fd)


def _refusal(path: Path, folder: Path, what: str, lock: Path) -> FolderInUseError:
    label = f"{what} {path}" if what else str(path)
    where = "is" if folder == path else f"is inside {folder}, which is"
    return FolderInUseError(f"{label} {where} being written by another specpilot run ({_holder(lock)}): wait for it "
                            f"to end, or give another {what or 'folder'}")


def check_not_in_use(path: str | Path, *, what: str = "--out") -> None:
    """FolderInUseError when another process holds `path` (a folder or a file) or a folder above it, up to a folder
    this process holds (its own writes)."""
    if fcntl is None:
        return
    real = _real(path)
    for folder in (real, *real.parents):
        if folder in _held or folder in _inherited():
            return
        lock = folder / LOCK_FILE
        if _locked_by_other(lock):
            raise _refusal(Path(path), folder, what, lock)


@contextmanager
def output_lock(folder: str | Path, *, what: str = "--out") -> Iterator[Path]:
    """Hold `folder` (created if missing) for the block; FolderInUseError, before anything is written, when another
    process holds it or a folder above it. Re-entrant in this process."""
    from specpilot.drafting.files import check_writable

    real = _real(folder)
    check_not_in_use(folder, what=what)
    if fcntl is None or _held_here(real) is not None:
        yield Path(folder)
        return
    check_writable(folder, kind="dir", what=what)
    made = not real.exists()
    real.mkdir(parents=True, exist_ok=True)
    lock = real / LOCK_FILE
    while True:  # the file locked must still be the one at `lock` (a holder removes it when it lets go)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        taken = _try_lock(fd)
        if taken is None:  # no flock here: write unlocked, as before
            os.close(fd)
            yield Path(folder)
            return
        if taken is False:
            os.close(fd)
            raise _refusal(Path(folder), real, what, lock)
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "command": _command(), "started": time.time()}).encode())
    _held[real] = fd
    inherited = os.environ.get(HELD_ENV)
    os.environ[HELD_ENV] = os.pathsep.join(str(p) for p in (*_inherited(), real))
    try:
        yield Path(folder)
    finally:
        del _held[real]
        if inherited is None:
            os.environ.pop(HELD_ENV, None)
        else:
            os.environ[HELD_ENV] = inherited
        try:
            lock.unlink(missing_ok=True)  # removed while still held: a waiting opener re-checks the inode above
            if made and not any(real.iterdir()):  # refused or failed before writing: leave no empty folder
                real.rmdir()
        except OSError:
            pass
        finally:
            os.close(fd)  # closing releases the flock


def holds_output(param: str, *, what: str = "--out", kind: str = "dir"):
    """Decorator: while the function runs, its argument `param` (a folder; None: nothing) is held (`output_lock`);
    with kind="file" the file's folder is only checked (`check_not_in_use`)."""
    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            path = bound.arguments.get(param)
            if path is None:
                return fn(*args, **kwargs)
            if kind == "file":
                check_not_in_use(path, what=what)
                return fn(*args, **kwargs)
            with output_lock(path, what=what):
                return fn(*args, **kwargs)

        return inner

    return wrap
