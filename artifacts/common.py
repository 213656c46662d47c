"""What every artifact module shares: the `format_version` rule and the checked read / atomic write of a JSON object.

A file without `format_version` was written before artifacts were versioned: it is read as version 0 (the same
fields). A file with a newer version than this specpilot knows is refused with the file named.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specpilot.drafting.errors import InputFileError
from specpilot.drafting.files import atomic_write_json, read_json

VERSION_KEY = "format_version"


def json_digest(value) -> str:
    """A short content hash of a JSON-able value (keys sorted, other objects as their str): the settings keys that
    decide whether stored work (shards, demo stages, verdicts) may be reused, and digests of prompt lists."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_object(path: str | Path, *, what: str, fix: str, version: int, key: str = VERSION_KEY) -> dict:
    """The JSON object in `path` (FileNotFoundError / InputFileError naming the file), its `key` version checked:
    absent (an older file) or <= `version`."""
    data = read_json(path, what=what, fix=fix)
    found = data.get(key, 0)
    if isinstance(found, bool) or not isinstance(found, int) or found < 0:
        raise InputFileError(f"{path}: {key} {found!r} of the {what} is not a version number; {fix}")
    if found > version:
        raise InputFileError(f"{path}: the {what} has {key} {found}, newer than this specpilot reads ({version}): "
                             "upgrade specpilot, or write the file again with this version")
    return data


def save_object(path: str | Path, data: dict, *, version: int, key: str = VERSION_KEY, **dump_kwargs) -> Path:
    """Write `data` (with `key` = version) atomically: a crash never leaves a half-written file."""
    return atomic_write_json(path, {key: version, **{k: v for k, v in data.items() if k != key}},
                             **dump_kwargs)

