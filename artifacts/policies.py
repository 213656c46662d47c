"""policies.json: which policy zips are a run's final depth / size policies (RUN/, RUN/stage1/, RUN/sampled/T<t>/).

    {"format_version": 1,
     "depth": null | {"path": "co2_depth/best.zip", "spec": ObservationSpec.to_dict()},
     "size":  null | {"path": ..., "spec": ..., "size_actions": [4, 8, ...]},
     "fallback": {"depth": int | null, "size": int | null},     the static config for the undecided half
     "off_switch": {...}}                                       optional: train/rl/sampled.py's live verdict

Paths are relative to the index's folder (absolute when the zip lies outside it). Specs stay dicts here: the
`ObservationSpec` class belongs to the policies layer above.

Reading checks the values against the tree the policies were trained on (a hand-edited value out of it would be
capped by the decoder without a word): every size action in 1..the size spec's num_scores (the largest size the
size policy observes), fallback depth in 0..max_depth, fallback size in 1..the candidates a tree of the specs' width
and max_depth drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specpilot.artifacts.common import load_object, save_object
from specpilot.drafting.checks import check_int
from specpilot.drafting.errors import InputFileError

POLICIES_FILE = "policies.json"
POLICIES_VERSION = 1
KINDS = ("depth", "size")
TRAIN_FIX = "train the run first (`specpilot train ... --run RUN`) or fix its policies.json"


@dataclass
class PolicyEntry:
    """One policy of the index: its zip (as recorded), observation spec (dict) and, for size, the size actions."""

    path: str
    spec: dict
    size_actions: list[int] | None = None

    def to_dict(self) -> dict:
        out = {"path": self.path, "spec": self.spec}
        if self.size_actions is not None:
            out["size_actions"] = [int(v) for v in self.size_actions]
        return out


@dataclass
class PoliciesIndex:
    depth: PolicyEntry | None = None
    size: PolicyEntry | None = None
    fallback: dict = field(default_factory=lambda: {"depth": None, "size": None})
    off_switch: dict | None = None
    data: dict = field(default_factory=dict, repr=False)
    path: Path | None = None

    @classmethod
    def from_dict(cls, data: dict, path: str | Path = POLICIES_FILE, *, fix: str = TRAIN_FIX) -> "PoliciesIndex":
        """Entries checked: each named policy has a string path and a spec dict (size: its size actions)."""
        entries = {}
        for kind in KINDS:
            e = data.get(kind)
            if not e:
                entries[kind] = None
                continue
            if not isinstance(e, dict) or not isinstance(e.get("path"), str) or not isinstance(e.get("spec"), dict):
                raise InputFileError(f"{path}: the {kind} entry lacks 'path' or 'spec'; {fix}")
            actions = e.get("size_actions")
            if kind == "size":
                try:
                    actions = [int(v) for v in actions]
                except (TypeError, ValueError):
                    raise InputFileError(f"{path}: the size entry's size_actions {actions!r} is not a list of "
                                         f"integers; {fix}") from None
            entries[kind] = PolicyEntry(e["path"], e["spec"], actions if kind == "size" else None)
        fb = data.get("fallback") if isinstance(data.get("fallback"), dict) else {}
        off = data.get("off_switch") if isinstance(data.get("off_switch"), dict) else None
        index = cls(entries["depth"], entries["size"], {"depth": fb.get("depth"), "size": fb.get("size")}, off,
                    data, Path(path))
        index.check_values(fix=fix)
        return index

    def check_values(self, *, fix: str = TRAIN_FIX) -> None:
        """InputFileError naming the file, the field, the value and its range when a size action or a fallback
        value lies outside the tree the policies were trained on (specs without a tree are left to `tree()`)."""
        max_depth = _spec_int([e.spec for e in self.entries().values()], "max_depth")
        size = self.size
        if size is not None:
            limit = _spec_int([size.spec], "num_scores")
            why = f"the size policy observes {limit} candidates, its spec's num_scores"
            for value in size.size_actions:
                self._check("each of size.size_actions", value, 1, limit, why, fix)
        depth = self.fallback.get("depth")
        if depth is not None:
            self._check("fallback.depth", depth, 0, max_depth, f"the policies' tree has max_depth {max_depth}; "
                        "0 never drafts", fix)
        if self.fallback.get("size") is not None:
            # the index does not record the tree's max_size (the decoder clips to it); a size above every candidate
            # a tree of this width and depth drafts is no size at all (the size actions may stop below max_size)
            width = _spec_int([e.spec for e in self.entries().values()], "width")
            # (W + (D - 1) W^2, `drafting.cycle_math.num_candidates`: artifacts import nothing above drafting's files)
            most = width + (max_depth - 1) * width * width if width is not None and max_depth is not None else None
            self._check("fallback.size", self.fallback["size"], 0 if depth == 0 else 1, most,
                        f"a width-{width}, depth-{max_depth} tree drafts {most} candidates", fix)

    def _check(self, name: str, value, low: int, high: int | None, why: str, fix: str) -> None:
        try:
            check_int(name, value, minimum=low, maximum=high)
        except (TypeError, ValueError) as err:
            raise InputFileError(f"{self.path}: {err}" + (f" ({why})" if high is not None else "")
                                 + f"; {fix}") from None

    @classmethod
    def load(cls, index: str | Path, *, fix: str = TRAIN_FIX) -> "PoliciesIndex":
        """The index at `index` (a folder holding policies.json, or the file); errors name the file."""
        path = Path(index)
        path = path / POLICIES_FILE if path.suffix != ".json" else path
        return cls.from_dict(load_object(path, what="policies index", fix=fix, version=POLICIES_VERSION), path,
                             fix=fix)

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.data.items() if k not in (*KINDS, "fallback", "off_switch")}
        out.update(depth=self.depth.to_dict() if self.depth else None, size=self.size.to_dict() if self.size else None,
                   fallback=dict(self.fallback))
        if self.off_switch is not None:
            out["off_switch"] = self.off_switch
        return out

    def save(self, index: str | Path) -> Path:
        path = Path(index)
        path = path / POLICIES_FILE if path.suffix != ".json" else path
        self.path = save_object(path, self.to_dict(), version=POLICIES_VERSION, indent=2, sort_keys=True,
                                default=str)
        return self.path

    # -- views --------------------------------------------------------------------------------------------------------
    def entries(self) -> dict[str, PolicyEntry]:
        return {k: e for k, e in (("depth", self.depth), ("size", self.size)) if e is not None}

    def entry(self, kind: str) -> PolicyEntry | None:
        return self.depth if kind == "depth" else self.size

    def tree(self) -> dict:
        """{"width", "max_depth", "max_size" (None without a size policy), "policies"} the policies were trained on;
        InputFileError when the specs lack them or the two policies disagree."""
        entries = self.entries()
        if not entries:
            raise InputFileError(f"{self.path} names neither a depth nor a size policy; {TRAIN_FIX}")
        try:
            shapes = {(int(e.spec["width"]), int(e.spec["max_depth"])) for e in entries.values()}
        except (KeyError, TypeError, ValueError) as err:
            raise InputFileError(f"{self.path}: a policy entry lacks its spec (width, max_depth) "
                                 f"({type(err).__name__}: {err}); {TRAIN_FIX}") from None
        if len(shapes) != 1:
            raise InputFileError(f"{self.path}: the depth and size policies were trained on different trees "
                                 f"{sorted(shapes)}")
        (width, max_depth), = shapes
        max_size = max(self.size.size_actions) if self.size is not None and self.size.size_actions else None
        return {"width": width, "max_depth": max_depth, "max_size": max_size, "policies": sorted(entries)}

    def resolve(self, kind: str, folder: str | Path | None = None) -> Path:
        """The zip of `kind` as a path (relative paths under the index's folder, or `folder`)."""
        entry = self.entry(kind)
        if entry is None:
            raise InputFileError(f"{self.path} has no {kind} policy; {TRAIN_FIX}")
        base = Path(folder) if folder is not None else (self.path.parent if self.path else Path("."))
        return base / entry.path


def _spec_int(specs: list[dict], key: str) -> int | None:
    """specs[...][key] as an int when the first spec that has it holds an integer, else None."""
    for spec in specs:
        value = spec.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
