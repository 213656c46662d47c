"""What counts as bad input, as opposed to a bug: the one rule the command line uses to print a sentence instead of a
traceback (`specpilot.cli.main`), and the error class for unreadable files.

A *user error* is an exception the package raises on purpose about what it was given:

- any exception class defined in the specpilot package (`VocabularyMismatchError`, `EagleHeadError`,
  `PolicyLoadError`, `ExportedConfigError`, `ExportError`, `SuiteError`, `CheckpointError`, `ClusterError`,
  `InputFileError`, ... and every class added later), wherever it is raised;
- `ValueError` / `TypeError` (and their subclasses) raised by a `raise` statement in specpilot's own code: argument
  and input validation. The same exceptions raised deep inside torch, numpy or transformers are bugs of ours (we
  passed them something we should have checked) and keep their traceback;
- `OSError` (a path that does not exist, a folder that cannot be written, a full disk): about the machine and the
  paths given, never about the code;
- running out of accelerator memory (a smaller model, batch or tree is the fix, not a code change);
- one of specpilot's own warnings (a note) made an error by `-W error` / PYTHONWARNINGS=error: the note is the
  message.

Everything else (AssertionError, IndexError, KeyError, RuntimeError from library internals, ...) is a bug and
keeps its traceback. Messages of user errors name the argument or file and say what to do.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE = "specpilot"
PACKAGE_DIR = Path(__file__).resolve().parent.parent


class InputFileError(ValueError):
    """A file the package reads is truncated, garbage or lacks what it must hold; the message names the file and
    says how to make a good one."""


class OutputPathError(ValueError):
    """An output location cannot take the results (a read-only folder, an existing file where a folder belongs, a
    folder where a file belongs); raised before any work starts (`specpilot.drafting.files.check_writable`)."""


class DependencyError(RuntimeError):
    """An installed library is too old (or too new) for the package; the message names the version found and the
    pip command that fixes it."""


class NotEnoughMemoryError(MemoryError):
    """The machine (or a limit such as `ulimit -v`) gave too little memory to map or load a file that is intact:
    not the file's fault, so the message does not send the user to rebuild it."""


class NonFiniteLogitsError(ValueError):
    """A model's logits are inf or nan: float16's range (to 65504) overflowed, most often. Running in bfloat16 or
    float32 is the fix, so it is the user's choice to change, not a bug."""


def overflow_fix(dtype_name: str) -> str:
    """The fix a NonFiniteLogitsError message ends with, for a model running in `dtype_name`."""
    if dtype_name == "float16":
        return ("; float16 overflows past 65504: load the pair in bfloat16 or float32 (--dtype bfloat16 / float32, "
                "dtype= in ModelPair.from_pretrained)")
    return f"; the model's weights or inputs give inf/nan in {dtype_name}: check the checkpoint, or try float32"


def defined_in_package(err: BaseException) -> bool:
    """True when the exception's class (or a base class) is one of specpilot's own error classes."""
    return any(cls.__module__.split(".")[0] == PACKAGE for cls in type(err).__mro__)


def raised_in_package(err: BaseException) -> bool:
    """True when the innermost frame of the traceback is specpilot code: the error was raised by our own `raise`
    (or a builtin called there, e.g. `int(text)` on a bad argument), not inside a library we call."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    try:
        rel = Path(tb.tb_frame.f_code.co_filename).resolve().relative_to(PACKAGE_DIR)
    except ValueError:
        return False
    # a virtual environment inside the checkout (make creates .venv there) holds libraries, not specpilot: their
    # frames count as library frames, so an exit code does not depend on where the environment lives
    return rel.parts[0] not in ("tests", "benchmarks") and not rel.parts[0].startswith(".") \
        and "site-packages" not in rel.parts


def is_user_error(err: BaseException) -> bool:
    """Bad input (one line on the command line) rather than a bug (a traceback); see the module docstring."""
    if defined_in_package(err) or isinstance(err, OSError):
        return True
    if type(err).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError / torch.cuda.OutOfMemoryError
        return True
    if type(err).__name__ == "SafetensorError" and "I/O error" in str(err):  # a full disk or a lost mount while
        return True                                                            # writing weights: not a bug
    # a warning of ours (a note) made an error by -W error / PYTHONWARNINGS=error: the note is the message
    return isinstance(err, (ValueError, TypeError, Warning)) and raised_in_package(err)


def one_line(err: BaseException) -> str:
    """The error's message on one line (library messages sometimes span several)."""
    text = " ".join(str(err).split())
    if isinstance(err, KeyError) and len(err.args) == 1:
        text = str(err.args[0])
    return text or type(err).__name__
