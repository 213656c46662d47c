"""grid.json: the result of `specpilot grid` (the best static configuration, per width, depth and size).

    best                  {"width", "depth", "size", "source": "live" | "replay", ...}: the best cell (may be
                          depth 0: plain target steps won)
    best_drafting         the best cell that drafts (depth >= 1): the partner of training stages
    best_by_temperature   {"<T>": cell}: the best cell measured live at sampling temperature T > 0
    per_batch_size        [{"batch_size", "width", "depth", "size", "tokens_per_s", "speedup_vs_ar", ...}]: the best
                          static cell per batch size in batch replay (depth 0: batched AR won), ascending batch
                          sizes ([] in files written before it, or without --batch-sizes); rows re-checked live
                          (source "live") add live_tokens_per_s, live_speedup_vs_ar, live_speedup_ci [low, high]
                          (paired 95% over batched AR), live_ar_tokens_per_s and replay_choice
    table, live, live_ar, oracle, sampled_live, batch_table, batch_live   the measurements
    meta                  {"traces": [{"trace", "width", "max_depth", "max_size", "pair", ...}], "pair", ...}

`GridResult.load` reads it once, checked, for every caller (eval's `grid` method, training's static partner, the
sampled stages, export's engine configs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specpilot.artifacts.common import load_object, save_object
from specpilot.drafting.errors import InputFileError

GRID_FILE = "grid.json"
GRID_VERSION = 1
GRID_FIX = "give the grid.json that `specpilot grid --out FILE` wrote"


def _cell(value, path: Path, name: str) -> dict | None:
    """{"depth", "size"[, "width"]} as ints (other keys kept), or None when absent."""
    if value is None:
        return None
    if not isinstance(value, dict) or "depth" not in value or "size" not in value:
        raise InputFileError(f"{path} has no {name} {{depth, size[, width]}} entry; {GRID_FIX}")
    try:
        ints = {k: int(value[k]) for k in ("width", "depth", "size") if k in value}
    except (TypeError, ValueError) as err:
        raise InputFileError(f"{path}: '{name}' must hold integer depth/size/width ({err}); {GRID_FIX}") from None
    return {**value, **ints}


def _per_batch(value, path: Path) -> list[dict]:
    """per_batch_size rows with int batch_size (>= 1, strictly ascending), depth, size (and width); [] when absent."""
    if value is None:
        return []
    fix = f"{path}: per_batch_size must be a list of {{batch_size, depth, size}} rows, batch sizes ascending; {GRID_FIX}"
    if not isinstance(value, list):
        raise InputFileError(fix)
    rows = []
    for i, row in enumerate(value):
        if not isinstance(row, dict) or "batch_size" not in row:
            raise InputFileError(fix)
        cell = _cell(row, path, f"per_batch_size[{i}]")
        try:
            cell["batch_size"] = int(row["batch_size"])
        except (TypeError, ValueError):
            raise InputFileError(fix) from None
        if cell["batch_size"] < 1 or cell["depth"] < 0 or (rows and cell["batch_size"] <= rows[-1]["batch_size"]):
            raise InputFileError(fix)
        try:  # the live re-check's fields, when the row has them
            for key in ("live_tokens_per_s", "live_speedup_vs_ar", "live_ar_tokens_per_s"):
                if key in row:
                    cell[key] = float(row[key])
            if "live_speedup_ci" in row:
                low, high = row["live_speedup_ci"]
                cell["live_speedup_ci"] = [None if v is None else float(v) for v in (low, high)]
        except (TypeError, ValueError):
            raise InputFileError(f"{path}: per_batch_size[{i}] has non-numeric live fields "
                                 f"(live_tokens_per_s, live_speedup_vs_ar, live_speedup_ci [low, high]); {GRID_FIX}"
                                 ) from None
        rows.append(cell)
    return rows


@dataclass
class GridResult:
    """A grid search's result (see the module docstring); `data` is the whole file."""

    best: dict
    best_drafting: dict | None = None
    best_by_temperature: dict[str, dict] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict, repr=False)
    path: Path | None = None
    per_batch_size: list[dict] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict, path: str | Path = GRID_FILE) -> "GridResult":
        path = Path(path)
        if not isinstance(data.get("best"), dict):
            raise InputFileError(f"{path} has no best {{depth, size[, width]}} entry; {GRID_FIX}")
        by_t = data.get("best_by_temperature") or {}
        if not isinstance(by_t, dict):
            raise InputFileError(f"{path}: best_by_temperature must map temperatures to cells; {GRID_FIX}")
        meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
        return cls(_cell(data["best"], path, "best"), _cell(data.get("best_drafting"), path, "best_drafting"),
                   {str(t): _cell(c, path, f"best_by_temperature[{t}]") for t, c in by_t.items()}, meta, data, path,
                   _per_batch(data.get("per_batch_size"), path))

    @classmethod
    def load(cls, path: str | Path) -> "GridResult":
        """grid.json at `path`; FileNotFoundError / InputFileError name the file."""
        path = Path(path)
        return cls.from_dict(load_object(path, what="grid-search result", fix=GRID_FIX, version=GRID_VERSION), path)

    def save(self, path: str | Path) -> Path:
        data = {**self.data, "best": self.best, "best_drafting": self.best_drafting,
                "best_by_temperature": self.best_by_temperature, "meta": self.meta,
                "per_batch_size": self.per_batch_size}
        self.path = save_object(path, data, version=GRID_VERSION, default=float)
        return self.path

    # -- views --------------------------------------------------------------------------------------------------------
    def static_cell(self) -> dict | None:
        """The cell training partners use: the best when it drafts, else the best drafting cell (None if neither)."""
        return self.best if self.best["depth"] >= 1 else self.best_drafting

    def at_temperature(self, temperature: float) -> dict | None:
        return self.best_by_temperature.get(f"{temperature:g}")

    @property
    def traces(self) -> list[dict]:
        """meta.traces: one entry per width swept ({"trace", "width", "max_depth", "max_size", "pair", ...})."""
        return [t for t in self.meta.get("traces") or [] if isinstance(t, dict)]

    @property
    def widths(self) -> list[int]:
        return sorted({int(t["width"]) for t in self.traces if t.get("width") is not None})

    def trace_pairs(self) -> list[dict]:
        """The pairs the swept traces were recorded with (and the live phase's, when it ran)."""
        pairs = [t["pair"] for t in self.traces if isinstance(t.get("pair"), dict)]
        return pairs + ([self.meta["pair"]] if isinstance(self.meta.get("pair"), dict) else [])


def save_grid(path: str | Path, result: dict) -> Path:
    """Write a grid_search result dict as grid.json (atomic, versioned)."""
    return save_object(path, result, version=GRID_VERSION, default=float)
