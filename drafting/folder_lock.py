"""One writer per output: two specpilot runs given the same --out (two terminals, a job started twice) would
interleave their stages, shards and reports. The first holds the output; a second is refused at once, in one line
naming the first (its pid, command and start time), before it loads a model or writes a file.

    output_lock(path, what="--out", kind="dir")  context manager: hold a folder (FOLDER/.specpilot.lock) or a file
                                          (.NAME.specpilot.lock beside it) while writing it; released, the lock file
                                          is removed, and so are the folders the lock made if nothing else was
                                          written in them
    check_not_in_use(path, what=..., kind=...)   FolderInUseError when another process holds `path`, a folder above
                                          it, or (a folder) anything below it
    being_written(path)                   who else writes a path a command only reads (for a note), or None
    holds_output(param, what=..., kind=...)      decorator: the function's `param` path is held while it runs
    held_folders() / grant(held)          a worker process this one starts (spawned seed trainers) is granted the
                                          folders it holds, explicitly: other children are not, and a grant lapses
                                          when the granting process no longer holds the folder (it died)

A flock goes with its process however it ends (Ctrl-C, kill -9, a crash), so no stale lock ever needs deleting by
hand. Holding is re-entrant: the demo holds its run folder and its stages write inside it. Where flock is missing
(Windows) or refused by the filesystem, writing goes on unlocked, as before.
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
LOCK_SUFFIX = ".specpilot.lock"  # a file output's lock: .NAME.specpilot.lock beside it
_SCAN_DEPTH, _SCAN_FOLDERS = 3, 5000  # how far below a folder held locks are looked for (run folders nest 2 deep)
_BUSY_TRIES = 5  # a prober's momentary lock (check_not_in_use of another process) is not a holder: retry briefly
_held: dict[Path, tuple[Path, str, int]] = {}  # lock file -> (path held, kind, descriptor), this process's holds
_granted: dict[Path, int] = {}  # folder -> pid of the process that holds it and granted it to this worker


class FolderInUseError(OutputPathError):
    """Another live specpilot process is writing the output (or a folder above it, or something inside it)."""


def _real(path: str | Path) -> Path:
    # realpath: a symlink to the folder and the folder itself are one folder
    return Path(os.path.realpath(Path(path).expanduser()))


def _lock_of(real: Path, kind: str) -> Path:
    # a file's lock, and that of a folder replaced as a whole (an export: staged beside it, then renamed in), lies
    # beside it: inside, the rename would take it away
    return real / LOCK_FILE if kind == "dir" else _beside(real)


def _beside(real: Path) -> Path:
    return real.parent / f".{real.name}{LOCK_SUFFIX}"


def _locks_at(real: Path) -> tuple[Path, Path]:
    """Both places a hold on `real` can be: inside it (a folder) and beside it (a file, a swapped folder)."""
    return real / LOCK_FILE, _beside(real)


def _command() -> str:
    """This process's command line as typed: `specpilot ...` for the console script and `python -m specpilot`."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if Path(sys.argv[0]).name == "specpilot" or getattr(main_spec, "name", None) == "specpilot.__main__":
        return " ".join(["specpilot", *sys.argv[1:]])
    return " ".join(sys.argv) or "python"


def _info(lock: Path) -> dict:
    try:
        info = json.loads(lock.read_text(encoding="utf-8"))
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):  # written a moment ago, not yet filled in
        return {}


def _holder(lock: Path) -> str:
    info = _info(lock)
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["started"])))
        return f"pid {int(info['pid'])}: `{info['command']}`, since {since}"
    except (KeyError, TypeError, ValueError):
        return "a process that is starting"


def _try_lock(fd: int) -> bool | None:
    """Take the exclusive lock. True: taken; False: another process holds it; None: this filesystem has no flock.
    A prober's momentary shared lock (`_locked_by_other`) is no holder: retried briefly."""
    for attempt in range(_BUSY_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt + 1 < _BUSY_TRIES:
                time.sleep(0.02 * (attempt + 1))
        except OSError:  # ENOLCK / EOPNOTSUPP (some network filesystems)
            return None
    return False


def _locked_by_other(lock: Path) -> bool:
    """Another process holds `lock`: a shared lock, tried once, is refused only by a holder's exclusive one (probes
    never block each other, so no retry is needed)."""
    if lock in _held:
        return False
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:  # no lock file (the usual case), or unreadable: nobody we can see holds it
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # held; by this very process when the file was moved away from where it was taken
        return _info(lock).get("pid") != os.getpid()
    except OSError:  # no flock on this filesystem
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _granted_alive(folder: Path) -> bool:
    """`folder` was granted by a process that still holds it (a dead granter's flock is gone)."""
    pid = _granted.get(folder)
    lock = folder / LOCK_FILE
    return pid is not None and _info(lock).get("pid") == pid and _locked_by_other(lock)


def _inside_mine(real: Path) -> bool:
    """`real` is a path this process holds, or lies in a folder it holds (or was granted by a live holder)."""
    for path, kind, _ in _held.values():
        if real == path or (kind == "dir" and path in real.parents):
            return True
    return any((real == folder or folder in real.parents) and _granted_alive(folder) for folder in list(_granted))


def _refusal(path: str | Path, real: Path, lock: Path, what: str) -> FolderInUseError:
    label = f"{what} {path}" if what else str(path)
    held = lock.parent if lock.name == LOCK_FILE else lock.parent / lock.name[1:-len(LOCK_SUFFIX)]
    if held == real:
        where = "is"
    elif held in real.parents:
        where = f"is inside {held}, which is"
    else:
        where = f"contains {held}, which is"
    return FolderInUseError(f"{label} {where} being written by another specpilot run ({_holder(lock)}): wait for it "
                            f"to end, or give another {what or 'path'}")


def _held_below(real: Path) -> Path | None:
    """A lock file below the folder `real` (to _SCAN_DEPTH levels) that another process holds, if any."""
    if not real.is_dir():
        return None
    stack, folders = [(real, 0)], 0
    while stack:
        folder, depth = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.name.endswith(LOCK_SUFFIX) and entry.name.startswith("."):
                lock = Path(entry.path)
                if not (folder == real and entry.name == LOCK_FILE) and _locked_by_other(lock) \
                        and not (entry.name == LOCK_FILE and _granted_alive(folder)):
                    return lock
            elif depth < _SCAN_DEPTH and entry.is_dir(follow_symlinks=False):
                folders += 1
                if folders > _SCAN_FOLDERS:  # not a run folder (a home folder given as --out): stop looking
                    return None
                stack.append((Path(entry.path), depth + 1))
    return None


def _other_holder(real: Path, kind: str) -> Path | None:
    """The lock file another process holds on `real` (as a folder or beside it, whatever `kind` this hold is), on
    a folder above it (up to one this process holds: its own writes) or, unless `real` is a file, below it; None
    when there is none."""
    for lock in _locks_at(real):
        if _locked_by_other(lock) and not (lock.name == LOCK_FILE and _granted_alive(real)):
            return lock
    for folder in real.parents:
        if any(lock in _held for lock in _locks_at(folder)) or _granted_alive(folder):
            break
        for lock in _locks_at(folder):
            if _locked_by_other(lock):
                return lock
    return _held_below(real) if kind != "file" else None


def check_not_in_use(path: str | Path, *, what: str = "--out", kind: str = "dir") -> None:
    """FolderInUseError when another process holds `path` (a folder, or a file with kind="file"), a folder above
    it (up to one this process holds: its own writes), or, for a folder, anything inside it."""
    if fcntl is None:
        return
    real = _real(path)
    if (lock := _other_holder(real, kind)) is not None:
        raise _refusal(path, real, lock, what)


def being_written(path: str | Path) -> str | None:
    """For a command that only reads `path` (eval --run, export --run): who else is writing it now (the run, a
    folder above it, or something inside it), for a note that what is read may still change; None when nobody."""
    lock = _other_holder(_real(path), "dir") if fcntl is not None else None
    return None if lock is None else _holder(lock)


def _missing_top(folder: Path) -> Path | None:
    """The topmost folder of `folder`'s path that does not exist yet (what making `folder` creates), if any."""
    top = None
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            break
        top = candidate
    return top


def _remove_made(folder: Path, top: Path | None) -> None:
    """Remove `folder` and its parents up to `top` (the folders a lock made) while they are empty."""
    if top is None:
        return
    for candidate in (folder, *folder.parents):
        try:
            candidate.rmdir()  # only an empty folder goes
        except OSError:
            return
        if candidate == top:
            return


def _acquire(lock: Path, path: str | Path, real: Path, what: str) -> int | None:
    """The descriptor holding `lock` (its holder's pid, command and start written in it), None where the filesystem
    has no flock; FolderInUseError when another process holds it. Nothing is left open on any error."""
    while True:  # the file locked must still be the one at `lock` (a holder removes it when it lets go)
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # its folder was removed meanwhile by a holder letting go: make it again
            continue
        taken = False
        try:
            taken = _try_lock(fd)
            if taken is None:
                os.close(fd)
                return None
            if taken is False:
                raise _refusal(path, real, lock, what)
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps({"pid": os.getpid(), "command": _command(), "started": time.time()}).encode())
                return fd
        except FileNotFoundError:  # removed between the open and the stat: open it again
            pass
        except BaseException:  # a refusal, a full disk, Ctrl-C: no descriptor (and flock) left behind
            if taken:  # held a moment: the file is this hold's to remove
                lock.unlink(missing_ok=True)
            os.close(fd)
            raise
        os.close(fd)


@contextmanager
def output_lock(path: str | Path, *, what: str = "--out", kind: str = "dir") -> Iterator[Path]:
    """Hold `path` for the block: kind "dir" a folder (created if missing), "file" a file, "swapped" a folder that
    is replaced as a whole. FolderInUseError, before anything is written, when another process holds it, a folder
    above it, or something inside it. Re-entrant: inside what this process holds (or was granted) it holds nothing
    more, as what it holds was checked when it was taken."""
    from specpilot.drafting.files import check_writable

    if kind not in ("dir", "file", "swapped"):
        raise ValueError(f"kind must be 'dir', 'file' or 'swapped', got {kind!r}")
    real = _real(path)
    if fcntl is not None and _inside_mine(real):
        yield Path(path)
        return
    check_writable(path, kind="file" if kind == "file" else "dir", what=what)
    check_not_in_use(path, what=what, kind=kind)
    if fcntl is None:
        yield Path(path)
        return
    lock = _lock_of(real, kind)
    top = _missing_top(lock.parent)
    fd, ours = None, False  # ours: the lock file is this hold's to remove (not another holder's)
    try:
        fd = _acquire(lock, path, real, what)
        ours = True  # held, or on a filesystem without flock (where the file guards nothing)
        if fd is not None:
            _held[lock] = (real, kind, fd)
            # checked again now that it is held: of two runs started together on nested paths, each of which
            # passed the check above before the other held anything, at least one sees the other here
            if (other := _other_holder(real, kind)) is not None:
                raise _refusal(path, real, other, what)
        yield Path(path)
    finally:
        _held.pop(lock, None)
        try:
            if ours:
                lock.unlink(missing_ok=True)  # removed while still held: a waiting opener re-checks the inode
            _remove_made(lock.parent, top)  # refused or failed before writing: no empty folders left behind
        except OSError:
            pass
        finally:
            if fd is not None:
                os.close(fd)  # closing releases the flock


def held_folders() -> dict[str, int]:
    """The folders this process holds (or was granted), for `grant` in a worker process it starts."""
    mine = {str(path): os.getpid() for path, kind, _ in _held.values() if kind == "dir"}
    return {**{str(folder): pid for folder, pid in _granted.items()}, **mine}


def grant(held: dict[str, int]) -> None:
    """In a worker process: write inside the folders its parent holds (`held_folders()` there), as long as the
    parent holds them."""
    _granted.update({Path(folder): int(pid) for folder, pid in held.items()})


def holds_output(param: str, *, what: str = "--out", kind: str = "dir"):
    """Decorator: while the function runs, its argument `param` (a folder, or a file with kind="file"; None:
    nothing) is held (`output_lock`)."""
    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:  # a wrong call: the function's own call raises Python's usual message
                return fn(*args, **kwargs)
            bound.apply_defaults()
            path = bound.arguments.get(param)
            if path is None:
                return fn(*args, **kwargs)
            with output_lock(path, what=what, kind=kind):
                return fn(*args, **kwargs)

        return inner

    return wrap
