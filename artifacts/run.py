"""A training run's folder: its layout, manifest.json, and each stage's files.

    RUN/manifest.json                      `RunManifest`: created, versions, contract (`specpilot.artifacts.contract`),
                                           traces, seeds, stage_setup, stages (status per stage), stage_selection, ...
    RUN/traces/{train,validation}/         trace.npz, trace.json, profile.json, ar.json
    RUN/grid.json                          `specpilot.artifacts.grid`
    RUN/<stage>/best.zip, best.json        the stage's best checkpoint on validation ({"score", "timesteps", ...})
    RUN/<stage>/checkpoints/step_<n>.zip   resumable checkpoints; progress.json points at the latest
    RUN/policies.json, RUN/stage1/policies.json, RUN/sampled/T<t>/policies.json   `specpilot.artifacts.policies`

A stage's status in the manifest ("running" while it trains, "interrupted" after Ctrl-C, "done") is what later
stages check before they build on it (`StageStatus`, `specpilot.artifacts.contract.check_stage_finished`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpilot.artifacts.common import load_object, save_object
from specpilot.artifacts.trace import AR_FILE  # noqa: F401 (RUN/traces/<split>/ar.json)
from specpilot.drafting.errors import InputFileError
from specpilot.drafting.files import read_json

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
TRACES_DIR = "traces"
BEST_ZIP = "best.zip"
BEST_JSON = "best.json"
CHECKPOINTS_DIR = "checkpoints"
PROGRESS_FILE = "progress.json"
MANIFEST_FIX = "restore it, or train into a new --run folder"
FINISHED = "done"


@dataclass
class StageStatus:
    """A stage's entry in the manifest's "stages": "running" | "interrupted" | "done", and its trained steps."""

    name: str
    status: str
    timesteps_done: int = 0
    total_timesteps: int | None = None
    checkpoint: str | None = None

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    @classmethod
    def from_entry(cls, name: str, entry: Any) -> "StageStatus":
        entry = entry if isinstance(entry, dict) else {}
        settings = entry.get("settings") if isinstance(entry.get("settings"), dict) else {}
        total = settings.get("total_timesteps")
        return cls(name, str(entry.get("status", "unknown")), int(entry.get("timesteps_done") or 0),
                   int(total) if total is not None else None, entry.get("checkpoint"))


@dataclass
class RunManifest:
    """RUN/manifest.json (sections merge one level deep on `update`); `data` is the whole file."""

    data: dict = field(default_factory=dict)
    path: Path | None = None

    @classmethod
    def load(cls, run_dir: str | Path, *, missing_ok: bool = True) -> "RunManifest":
        """The manifest of `run_dir` (empty when the run has none and `missing_ok`); a garbage file is an error
        naming it."""
        path = Path(run_dir) / MANIFEST_FILE
        if not path.exists() and missing_ok:
            return cls({}, path)
        return cls(load_object(path, what="run manifest", fix=MANIFEST_FIX, version=MANIFEST_VERSION), path)

    @classmethod
    def update(cls, run_dir: str | Path, **sections: Any) -> "RunManifest":
        """Merge `sections` into RUN/manifest.json (dict sections merge one level deep) and write it atomically."""
        manifest = cls.load(run_dir)
        if not manifest.data:
            manifest.data["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(manifest.data.get(key), dict):
                manifest.data[key].update(value)
            else:
                manifest.data[key] = value
        manifest.save()
        return manifest

    def save(self, path: str | Path | None = None) -> Path:
        self.path = save_object(path or self.path, self.data, version=MANIFEST_VERSION, indent=2, sort_keys=True,
                                default=str)
        return self.path

    def section(self, key: str) -> dict:
        """A section of the manifest ({} when the run has none yet); InputFileError naming the file when it is not
        a mapping (every command writes mappings: the file was edited or damaged, and reading it as empty would skip
        the run's checks)."""
        value = self.data.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise InputFileError(f"{self.path}: its {key!r} section is a {type(value).__name__}, not a mapping: the "
                                 f"run manifest was edited or damaged; {MANIFEST_FIX}")
        return value

    def __bool__(self) -> bool:
        return bool(self.data)

    # -- views --------------------------------------------------------------------------------------------------------
    @property
    def stages(self) -> dict[str, StageStatus]:
        return {name: StageStatus.from_entry(name, e) for name, e in self.section("stages").items()}

    def stage(self, name: str) -> StageStatus | None:
        return self.stages.get(name)

    def stage_setup(self, name: str) -> dict | None:
        setup = self.section("stage_setup").get(name)
        return setup if isinstance(setup, dict) else None

    def stage_selection(self, name: str) -> dict:
        chosen = self.section("stage_selection").get(name)
        return chosen if isinstance(chosen, dict) else {}

    @property
    def traces(self) -> dict:
        return self.section("traces")


def read_best(stage_dir: str | Path) -> dict | None:
    """RUN/<stage>/best.json, or None when absent or unreadable (it is advisory: a fresh validation rewrites it)."""
    path = Path(stage_dir) / BEST_JSON
    if not path.is_file():
        return None
    try:
        return read_json(path, what="stage's best-checkpoint record", fix="retrain the stage")
    except InputFileError:
        return None


def read_progress(stage_dir: str | Path) -> dict | None:
    """RUN/<stage>/checkpoints/progress.json (the latest complete checkpoint), or None when there is none;
    InputFileError naming the file when it is corrupted."""
    path = Path(stage_dir) / CHECKPOINTS_DIR / PROGRESS_FILE
    if not path.is_file():
        return None
    return read_json(path, what="checkpoint progress record",
                     fix=f"delete {path.parent} to restart the stage, or restore the file")


def write_record(path: str | Path, data: dict) -> Path:
    """A stage's small JSON record (best.json, progress.json), atomically."""
    from specpilot.drafting.files import atomic_write_json

    return atomic_write_json(path, data, indent=2, sort_keys=True, default=str)


def run_root(run_dir: str | Path) -> Path:
    """The run folder holding manifest.json: `run_dir` itself, or its parent for a sub-index such as RUN/stage1."""
    run_dir = Path(run_dir)
    for root in (run_dir, run_dir.parent):
        if (root / MANIFEST_FILE).is_file():
            return root
    return run_dir


def owning_run(path: str | Path) -> Path | None:
    """The run folder (one holding manifest.json) that `path` lies in, if any."""
    for folder in Path(path).resolve().parents:
        if (folder / MANIFEST_FILE).is_file():
            return folder
    return None


SAMPLED_DIR = "sampled"


def sampled_dir(run_dir: str | Path, temperature: float) -> Path:
    """RUN/sampled/T<t>: the policies trained live at sampling temperature t (train/rl/sampled.py)."""
    return Path(run_dir) / SAMPLED_DIR / f"T{temperature:g}"


def sampled_indexes(run_dir: str | Path) -> list[tuple[float, Path]]:
    """(temperature, folder) of every RUN/sampled/T<t>/ that holds a policies index, by temperature."""
    from specpilot.artifacts.policies import POLICIES_FILE

    found = []
    for index in Path(run_dir).glob(f"{SAMPLED_DIR}/T*/{POLICIES_FILE}"):
        try:
            found.append((float(index.parent.name[1:]), index.parent))
        except ValueError:
            continue  # not a T<number> folder
    return sorted(found)
