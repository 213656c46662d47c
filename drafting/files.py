"""Files in and out: output locations checked before any work starts, results written atomically, JSON inputs read
with errors that name the file.

    check_writable(path, kind="dir")      refuse a read-only folder, or a file where a folder belongs (and the
                                          reverse), before a command measures anything
    atomic_path(path) / atomic_write_text  write to a temporary sibling, then os.replace: a crash or Ctrl-C never
                                          leaves a half-written report, trace or config behind
    atomic_dir(path) / swap_in_dir        the same for a whole folder (a saved model, an export): written beside
                                          `path`, swapped in complete
    read_json(path, what=..., fix=...)    a JSON object, or FileNotFoundError / InputFileError naming the file
    load_weights(path, what=..., fix=...) a safetensors / torch weights file's tensors, or InputFileError naming
                                          the file when it is truncated, empty or garbage
    damaged_weights(folder, what=, fix=)  after a model folder failed to load: the InputFileError naming its
                                          damaged weights file, or None when every weights file reads
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specpilot.drafting.errors import InputFileError, NotEnoughMemoryError, OutputPathError

# The embedded pair (`specpilot.drafting.pair.DEFAULT_PAIR_DIR`, named here too because pair.py imports torch and
# this module must stay light): its damaged files are rebuilt, not copied again.
EMBEDDED_PAIR_DIR = Path(__file__).resolve().parent / "default_pair"
# The weights files transformers and the EAGLE-3 loader read from a model folder (single or sharded), safetensors
# first: a folder with both loads its safetensors, so only those can be the reason a load failed.
WEIGHT_PATTERNS = (("model.safetensors", "model-*-of-*.safetensors"),
                   ("pytorch_model.bin", "pytorch_model-*-of-*.bin"))


def nearest_existing(path: Path) -> Path:
    """`path` or the nearest of its parents that exists (what creating `path` would start from)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _probe(folder: Path, label: str) -> None:
    """Create and delete a temporary file in `folder`: the only test that holds for root and read-only mounts."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".specpilot-probe-"):
            pass
    except OSError as err:
        raise OutputPathError(f"{label}: cannot write in {folder} ({err.strerror or err}); choose a writable "
                              "location") from None


# Linux's FS_IOC_GETFLAGS and the inode flags that forbid replacing a file, for root too (`chattr +i` / `+a`)
_GETFLAGS, _IMMUTABLE, _APPEND_ONLY = 0x80086601, 0x10, 0x20


def _unreplaceable(path: Path) -> str | None:
    """"immutable" / "append-only" when `path`'s inode flags forbid replacing it (os.replace would fail with EPERM
    only when the results are written, after the work), else None (also where the filesystem keeps no flags)."""
    try:
        import fcntl
        import struct

        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (ImportError, OSError):
        return None
    try:
        flags = struct.unpack("i", fcntl.ioctl(fd, _GETFLAGS, struct.pack("i", 0)))[0]
    except OSError:  # ENOTTY: no inode flags on this filesystem
        return None
    finally:
        os.close(fd)
    return "immutable" if flags & _IMMUTABLE else "append-only" if flags & _APPEND_ONLY else None


def check_writable(path: str | Path, *, kind: str = "dir", what: str | None = None) -> Path:
    """`path` as a Path when it can take output of `kind` ("dir": a folder, created later if missing; "file": a
    file, replaced if it exists); else OutputPathError naming `what` (e.g. "--out") and the path. Creates nothing."""
    if kind not in ("dir", "file"):
        raise ValueError(f"kind must be 'dir' or 'file', got {kind!r}")
    path = Path(path).expanduser()
    label = f"{what} {path}" if what else str(path)
    try:
        _check_writable(path, kind, label)
    except OutputPathError:
        raise
    except OSError as err:  # a name too long, a folder on the way this user may not enter
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(path) else ""
        raise OutputPathError(f"{label}: {err.strerror or err}{where}; choose another location") from None
    return path


def path_text_problem(path: str | Path) -> str | None:
    """Why `path` cannot be handed on as UTF-8 text (TensorBoard, matplotlib and the reports take paths as text and
    write them as UTF-8), or None: bytes that are not UTF-8 (they reach Python as lone surrogates), or a non-ASCII
    path under a locale that stores paths in another encoding (TensorBoard would write to a different name)."""
    import sys

    text = str(path)
    locale = (f"this process reads file names as {sys.getfilesystemencoding()} (its locale), not UTF-8; use an ASCII "
              "name, or a UTF-8 locale (e.g. LC_ALL=C.UTF-8)")
    try:
        raw = os.fsencode(text)  # the name's bytes on disk
    except UnicodeEncodeError:  # text this locale cannot store at all (a library caller's "runs/café" under LC_ALL=C)
        return locale
    try:
        utf8 = text.encode("utf-8")
    except UnicodeEncodeError:
        utf8 = None
    if raw == utf8:
        return None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "its name holds bytes that are not UTF-8 text; rename it"
    if sys.getfilesystemencoding().lower().replace("-", "") == "utf8":
        return "its name holds escaped bytes (lone surrogates), not text; give it as text"
    return locale


def _check_writable(path: Path, kind: str, label: str) -> None:
    for candidate in (path, *path.parents):  # exists() is False for these, so they would pass as "created later"
        if candidate.is_symlink() and not candidate.exists():
            raise OutputPathError(f"{label}: {candidate} is a symbolic link that leads nowhere (to a missing path, "
                                  "or round a loop): remove it, or point it at something that exists")
    if (problem := path_text_problem(path)) is not None:
        raise OutputPathError(f"{printable(label)} cannot be used: {problem}")
    if kind == "dir" and path.exists() and not path.is_dir():
        raise OutputPathError(f"{label} is an existing file, not a folder: give a folder path (it is created if "
                              "missing)")
    if kind == "file" and path.is_dir():
        raise OutputPathError(f"{label} is a folder: give a file path")
    if kind == "file" and path.is_file() and (flag := _unreplaceable(path)):
        raise OutputPathError(f"{label} is marked {flag} (chattr +{flag[0]}; `lsattr` shows it), so it cannot be "
                              f"replaced: clear the flag (chattr -{flag[0]}), or choose another location")
    # a symlinked file is written through (atomic_path): its target's folder must take the file
    folder = path if kind == "dir" else (Path(os.path.realpath(path)) if path.is_symlink() else path).parent
    existing = nearest_existing(folder)
    if not existing.is_dir():
        raise OutputPathError(f"{label}: {existing} is a file, so no folder can be created below it")
    _probe(existing, label)


def printable(text: str, errors: str = "backslashreplace") -> str:
    """`text` with undecodable bytes (lone surrogates) shown escaped (or as U+FFFD with errors="replace"): a message
    or a figure title must print."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", errors)


def check_outputs(outputs: dict[Path, str], *, fix: str, what: str = "output") -> None:
    """Every folder ("dir") and file ("file") in `outputs` that a command will write can take it, checked before
    any work: a file where it writes a folder, or a folder where it writes a file (report.json made a folder by
    mistake), is an OutputPathError naming the path and ending with `fix`; found only at the end, it cost the
    whole run."""
    for path, kind in sorted(outputs.items(), key=lambda item: len(Path(item[0]).parts)):  # folders before files
        path = Path(path)
        if kind == "dir" and path.exists() and not path.is_dir():
            raise OutputPathError(f"{path} is a file, where this command writes a folder: {fix}")
        if kind == "file" and path.is_dir():
            raise OutputPathError(f"{path} is a folder, where this command writes a file: {fix}")
        check_writable(path, kind=kind, what=what)


def _temporary_sibling(path: Path) -> Path:
    # the suffix stays last: numpy appends .npz and matplotlib picks the format from it
    return path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write to; on success it replaces `path` in one step (os.replace),
    on an exception (or Ctrl-C) it is deleted and `path` is left as it was. A symbolic link is written through (its
    target is replaced, as a shell's `>` does), not replaced by a file."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        if err.filename is not None or err.errno is None:
            raise
        # a write error (a full disk) names no file: name the one this write was for
        raise OSError(err.errno, f"{err.strerror} while writing {path}") from err
    finally:
        tmp.unlink(missing_ok=True)


def swap_in_dir(staging: Path, out_dir: Path) -> None:
    """Put the complete folder `staging` at out_dir: an earlier out_dir is moved aside, the new one renamed in, the
    old one deleted (or moved back if the rename fails)."""
    if not out_dir.exists():
        os.replace(staging, out_dir)
        return
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out_dir, old)
    try:
        os.replace(staging, out_dir)
    except BaseException:
        os.replace(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path` to write a whole folder into (`save_pretrained`); on success it
    replaces `path` (`swap_in_dir`), on an exception (or Ctrl-C) it is deleted and `path` is left as it was: an
    interrupted save never leaves a model folder with a truncated weights file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        swap_in_dir(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    with atomic_path(path) as tmp:
        # a path of undecodable bytes quoted in a report (a suite's file name) is written escaped (\udcff): the
        # file stays UTF-8, which every reader of it expects (a JSON report reads the escape back as it was)
        tmp.write_text(text, encoding=encoding, errors="backslashreplace")
    return Path(path)


def atomic_write_json(path: str | Path, data, **dump_kwargs) -> Path:
    return atomic_write_text(path, json.dumps(data, **{"indent": 1, **dump_kwargs}) + "\n")


def read_json(path: str | Path, *, what: str, fix: str, kind: type = dict):
    """The JSON value in `path` (a `kind`, default an object). A missing file raises FileNotFoundError, a truncated
    or garbage one InputFileError; both name the file, say it is the `what`, and end with `fix`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {what} not found; {fix}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        detail = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8 text"
        raise InputFileError(f"{path} is not a readable {what} ({detail}): the file is truncated or corrupted; "
                             f"{fix}") from None
    except OSError as err:
        raise InputFileError(f"{path}: cannot read the {what} ({err.strerror or err}); {fix}") from None
    if not isinstance(data, kind):
        raise InputFileError(f"{path} is not a {what}: it holds a JSON {type(data).__name__}, not a JSON "
                             f"{'object' if kind is dict else kind.__name__}; {fix}")
    return data


def model_files_fix(folder: str | Path) -> str:
    """How to get a good copy of a model folder's files: the embedded pair's are rebuilt, anyone else's copied or
    saved again (the end of the messages about damaged model files)."""
    folder = Path(folder).expanduser().resolve()
    if folder == EMBEDDED_PAIR_DIR or EMBEDDED_PAIR_DIR in folder.parents:
        return "rebuild the embedded pair with `specpilot models build`"
    return ("re-copy the folder, or save the model again with `save_pretrained` "
            "(the embedded pair: `specpilot models build`)")


def out_of_memory(err: BaseException) -> bool:
    # safetensors reports a failed mmap as an I/O error carrying the OS's text: ENOMEM is about memory, not the file
    return isinstance(err, MemoryError) or getattr(err, "errno", None) == errno.ENOMEM \
        or "Cannot allocate memory" in str(err)


def not_enough_memory(what: str, err: BaseException) -> NotEnoughMemoryError:
    """The error for an intact file that could not be mapped or loaded for want of memory (`out_of_memory(err)`)."""
    return NotEnoughMemoryError(f"not enough memory to load {what} ({' '.join(str(err).split())}); the files are "
                                "not at fault: free memory, or raise the process's limit (`ulimit -v`)")


def _damaged(path: Path, what: str, fix: str, err: BaseException) -> InputFileError | NotEnoughMemoryError:
    detail = " ".join(str(err).split()) or f"{type(err).__name__}: the file ends too early"
    if out_of_memory(err):
        return not_enough_memory(f"the {what}'s weights file {path}", err)
    return InputFileError(f"{path}: the {what}'s weights file is damaged or incomplete (truncated, empty or "
                          f"garbage: {detail}); {fix}")


def _unreadable_weights() -> tuple[type[BaseException], ...]:
    """What reading a damaged weights file raises: safetensors' error on a bad header or a file shorter than its
    header says; torch.load's on a cut zip (OSError, RuntimeError), an empty file (EOFError) or garbage (pickle)."""
    import pickle

    from safetensors import SafetensorError

    return SafetensorError, OSError, EOFError, RuntimeError, pickle.UnpicklingError, MemoryError


def load_weights(path: str | Path, *, what: str, fix: str) -> dict:
    """The tensors of a `.safetensors` file (else a torch file, read with weights_only), on the CPU. A truncated,
    empty or garbage file raises InputFileError naming the file, saying it is the `what` weights, ending with
    `fix`. Only the read is guarded: nothing but the file can be wrong there."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        import torch

        return torch.load(path, map_location="cpu", weights_only=True)
    except _unreadable_weights() as err:
        raise _damaged(path, what, fix, err) from err


def _check_weights(path: Path, *, what: str, fix: str) -> None:
    """Read `path` as `load_weights` does, but a safetensors file only as far as its header (which safetensors
    checks against the file's length): cheap even for a large model."""
    if path.suffix != ".safetensors":
        load_weights(path, what=what, fix=fix)
        return
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except _unreadable_weights() as err:
        raise _damaged(path, what, fix, err) from err


def damaged_weights(folder: str | Path, *, what: str, fix: str) -> InputFileError | NotEnoughMemoryError | None:
    """For a model folder that failed to load: the InputFileError naming its first damaged weights file (of the
    kind a loader reads: safetensors when there are any), NotEnoughMemoryError when one could not even be mapped,
    or None when they all read (the failure was something else, and its own error should stand)."""
    folder = Path(folder)
    for patterns in WEIGHT_PATTERNS:
        files = sorted({f for pattern in patterns for f in folder.glob(pattern) if f.is_file()})
        for file in files:
            try:
                _check_weights(file, what=what, fix=fix)
            except (InputFileError, NotEnoughMemoryError) as err:
                return err
        if files:
            return None
    return None
