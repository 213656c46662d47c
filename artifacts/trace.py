"""A recorded trace's files: trace.npz (the arrays) and trace.json (the header: pair, tree, budget, prompts).

The arrays and their checks live with the recorder (`specpilot.envs.record.Trace`, which saves / loads both
files through the names here); this module reads the header alone, without numpy, for what a command must check
before it loads anything: which pair and which tree a trace was recorded with (`specpilot.artifacts.contract`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specpilot.drafting.errors import InputFileError
from specpilot.drafting.files import atomic_write_json, read_json

ARRAYS_FILE = "trace.npz"
HEADER_FILE = "trace.json"
TRACE_VERSION = 1  # the header's own "version" key (traces were versioned before the other artifacts)
RECORD_AGAIN = "record it again with `specpilot record --out DIR`"
AR_FILE = "ar.json"  # live autoregressive timing of the trace's prompts (`specpilot.envs.shards.ar_summary`)


def trace_dir(path: str | Path) -> Path:
    """The folder of a trace given as its folder or its trace.npz / trace.json path."""
    path = Path(path)
    return path.parent if path.suffix in (".npz", ".json") and not path.is_dir() else path


def is_trace(path: str | Path) -> bool:
    """True when `path` (a folder or a trace.npz path) holds a trace's arrays."""
    return (trace_dir(path) / ARRAYS_FILE).is_file()


@dataclass
class TraceHeader:
    """trace.json: what the recording was made with. `data` is the whole header (prompts, timings, ...)."""

    width: int
    max_depth: int
    max_size: int
    max_new_tokens: int
    pair: dict | None = None
    dtype: str | None = None
    device: str | None = None
    data: dict = field(default_factory=dict, repr=False)
    path: Path | None = None

    @property
    def tree(self) -> dict:
        return {"width": self.width, "max_depth": self.max_depth, "max_size": self.max_size}

    @classmethod
    def from_dict(cls, head: dict, where: str | Path = HEADER_FILE) -> "TraceHeader":
        """The header's fields checked (version, integer tree and budget); InputFileError names `where`."""
        if head.get("version") != TRACE_VERSION:
            raise InputFileError(f"{where}: trace version {head.get('version')!r} is not {TRACE_VERSION}; "
                                 f"{RECORD_AGAIN}")
        try:
            tree = head["tree"]
            width, max_depth, max_size = (int(tree[k]) for k in ("width", "max_depth", "max_size"))
            max_new = int(head["max_new_tokens"])
        except (KeyError, TypeError, ValueError) as err:
            raise InputFileError(f"{where} lacks a valid tree {{width, max_depth, max_size}} / max_new_tokens entry "
                                 f"({type(err).__name__}: {err}); {RECORD_AGAIN}") from None
        pair = head.get("pair") if isinstance(head.get("pair"), dict) else None
        return cls(width, max_depth, max_size, max_new, pair, head.get("dtype"), head.get("device"), head)

    @classmethod
    def load(cls, path: str | Path) -> "TraceHeader":
        """The header of the trace at `path` (folder, trace.npz or trace.json); errors name the file."""
        file = trace_dir(path) / HEADER_FILE
        head = read_json(file, what=f"trace header ({HEADER_FILE})", fix=RECORD_AGAIN)
        out = cls.from_dict(head, file)
        out.path = trace_dir(path)
        return out

    def save(self, out_dir: str | Path) -> Path:
        return atomic_write_json(Path(out_dir) / HEADER_FILE, self.data)


def read_ar(trace: str | Path) -> dict | None:
    """The trace's ar.json ({"seconds_per_token", "tokens_per_s", ...}), None when it has none; errors name the
    file when it is unreadable or lacks a positive seconds_per_token."""
    path = trace_dir(trace) / AR_FILE
    if not path.is_file():
        return None
    fix = "delete it (replay then times plain steps from the profile) or record the traces again"
    data = read_json(path, what="autoregressive timing (ar.json)", fix=fix)
    try:
        if not float(data["seconds_per_token"]) > 0:
            raise ValueError("not positive")
    except (KeyError, TypeError, ValueError) as err:
        raise InputFileError(f"{path} lacks a positive seconds_per_token ({type(err).__name__}: {err}); {fix}") \
            from None
    return data

