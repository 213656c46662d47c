"""decoder.json: an exported decoder's config (`specpilot export`; loaded by `specpilot.policies.exported`).

    format "specpilot-decoder", format_version DECODER_VERSION, tree {width, max_depth, max_size, size_actions},
    pair (ModelPair.identity()), policies {depth, size, fallback}, engine_configs, versions, measured, source_run

The fields each policy entry holds and what loading checks are documented in `specpilot.policies.exported`; this
module owns the file: its name, format, checked read (refusing another format or version with the file named) and
atomic write.
"""
from __future__ import annotations

import json
from pathlib import Path

from specpilot.drafting.files import atomic_write_json

DECODER_FILE = "decoder.json"
FORMAT_NAME = "specpilot-decoder"
DECODER_VERSION = 2  # 2: observation spec v3 (skip decisions before drafting); 1 refused: re-export


class ExportedConfigError(RuntimeError):
    """An exported decoder directory cannot be used: the message names the file and says what to do."""


def decoder_path(config: str | Path) -> Path:
    """decoder.json of an export folder, or the file itself."""
    path = Path(config)
    return path / DECODER_FILE if path.is_dir() or path.suffix != ".json" else path


def read_decoder_config(config: str | Path) -> dict:
    """decoder.json of an export folder (or the file), format and version checked; "_path" added."""
    path = decoder_path(config)
    if not path.is_file():
        raise ExportedConfigError(f"{path} not found: export a trained run with `specpilot export --run RUN_DIR "
                                  f"--out {path.parent}` (or point at the directory that holds decoder.json)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportedConfigError(f"{path} is not valid JSON ({err}); it is corrupted: re-export the run") from err
    if not isinstance(meta, dict):
        raise ExportedConfigError(f"{path} does not hold a JSON object; re-export the run")
    if meta.get("format") != FORMAT_NAME:
        raise ExportedConfigError(f"{path} is not a specpilot decoder config (format {meta.get('format')!r}, "
                                  f"expected {FORMAT_NAME!r}); export a run with `specpilot export`")
    version = meta.get("format_version")
    if version != DECODER_VERSION:
        raise ExportedConfigError(
            f"{path} has format_version {version!r} but this specpilot reads version {DECODER_VERSION}: re-export "
            "the run with this specpilot version, or load it with the specpilot version that exported it")
    meta["_path"] = str(path)
    return meta


def write_decoder_config(out_dir: str | Path, meta: dict) -> Path:
    """out_dir/decoder.json, atomically (written last by an export: its presence means the export is complete)."""
    return atomic_write_json(Path(out_dir) / DECODER_FILE,
                             {**meta, "format": FORMAT_NAME, "format_version": DECODER_VERSION},
                             indent=2, sort_keys=True, default=str)
