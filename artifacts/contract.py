"""A run's contract: what it was made with, recorded once in RUN/manifest.json ("contract") and checked by every
command that reads the run's artifacts, so a run never silently mixes pairs, trees or unfinished stages.

    {"pair":   ModelPair.identity() of the recorded traces (target / drafter names, drafter kind, content hashes),
     "dtype":  the traces' dtype,
     "tree":   {"width", "max_depth", "max_size"} of the traces the policies train on,
     "size_actions": the size policy's choices (null until a size stage ran),
     "suites": {"train": {"trace", "prompts", "max_new_tokens"}, "validation": {...}}}

A mismatch is a `ContractError` (a ValueError: the command line prints its one line and exits 2) that names both
sides: what the run (or the file) says and what was given. Stages: a later stage refuses to build on an earlier one
whose status is not "done" (interrupted, still running) unless told (`allow_partial`, `--allow-partial`).
Runs written before contracts existed have none: their pair comes from the manifest's "traces.train_pair" when
recorded, and nothing else is checked.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from specpilot.artifacts.run import FINISHED, RunManifest, read_progress
from specpilot.artifacts.trace import TraceHeader
from specpilot.drafting.errors import InputFileError
from specpilot.drafting.files import read_json

TREE_KEYS = ("width", "max_depth")


class ContractError(ValueError):
    """Something given to a command does not belong to the run (or the file) it is used with; names both sides."""


def pair_label(identity: dict | None) -> str:
    """A pair's identity in a few words: name, drafter kind and the first digits of both content hashes."""
    if not isinstance(identity, dict):
        return "an unrecorded pair"
    hashes = ", ".join(f"{k.split('_')[0]} {str(identity[k])[:10]}" for k in ("target_hash", "draft_hash")
                       if identity.get(k))
    kind = identity.get("drafter") or "?"
    return f"{identity.get('name', '?')} ({kind} drafter{', ' + hashes if hashes else ''})"


def same_pair(a: dict | None, b: dict | None) -> bool:
    """True when two identities name the same models (content hashes when both have them, else names and drafter
    kind); an unrecorded side (None) matches anything."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return True
    keys = [k for k in ("target_hash", "draft_hash") if a.get(k) and b.get(k)]
    if not keys:
        keys = [k for k in ("drafter", "target", "draft") if a.get(k) and b.get(k)]
    return all(str(a[k]) == str(b[k]) for k in keys)


def check_pair(expected: dict | None, got: dict | None, *, expected_from: str, got_from: str, fix: str) -> None:
    """ContractError unless `got` is the pair `expected` records: "`got_from` is <pair>, but `expected_from` is
    <pair>; `fix`"."""
    if not same_pair(expected, got):
        raise ContractError(f"{got_from} is {pair_label(got)}, but {expected_from} is {pair_label(expected)}: "
                            f"they do not belong together; {fix}")


def tree_label(tree: dict) -> str:
    return " ".join(f"{'W' if k == 'width' else 'D' if k == 'max_depth' else 'V'}={tree[k]}"
                    for k in ("width", "max_depth", "max_size") if tree.get(k) is not None)


def check_tree(expected: dict | None, got: dict | None, *, expected_from: str, got_from: str, fix: str,
               keys: tuple[str, ...] = TREE_KEYS) -> None:
    """ContractError unless `got` has the same tree `keys` (width, max_depth) as `expected`."""
    if not isinstance(expected, dict) or not isinstance(got, dict):
        return
    diff = [k for k in keys if expected.get(k) is not None and got.get(k) is not None
            and int(expected[k]) != int(got[k])]
    if diff:
        raise ContractError(f"{got_from} has tree {tree_label({k: got[k] for k in keys})}, but {expected_from} "
                            f"has {tree_label({k: expected[k] for k in keys})}; {fix}")


@dataclass
class RunContract:
    """What a run was made with (see the module docstring). Fields are None when unknown (an older run)."""

    pair: dict | None = None
    dtype: str | None = None
    tree: dict | None = None
    size_actions: list[int] | None = None
    suites: dict = field(default_factory=dict)

    @classmethod
    def from_traces(cls, train, validation=None, *, size_actions=None, paths: dict | None = None) -> "RunContract":
        """From the trace headers (`specpilot.artifacts.trace.TraceHeader`) of the training (and validation) split."""
        suites = {}
        for split, head in (("train", train), ("validation", validation)):
            if head is not None:
                suites[split] = {"trace": str((paths or {}).get(split) or head.path),
                                 "prompts": len(head.data.get("prompts") or []),
                                 "max_new_tokens": head.max_new_tokens}
        return cls(train.pair, train.dtype, dict(train.tree),
                   [int(v) for v in size_actions] if size_actions else None, suites)

    @classmethod
    def of_run(cls, run_dir: str | Path | RunManifest) -> "RunContract | None":
        """The run's recorded contract; for an older run the pair its traces were recorded with; None when the run
        records nothing."""
        manifest = run_dir if isinstance(run_dir, RunManifest) else RunManifest.load(run_dir)
        data = manifest.section("contract")
        if data:
            _check_recorded(data, manifest.path)
            return cls(**{k: data.get(k) for k in ("pair", "dtype", "tree", "size_actions")},
                       suites=data.get("suites") or {})
        legacy = next((p for p in (manifest.traces.get("train_pair"), manifest.data.get("pair"),
                                   manifest.data.get("models")) if isinstance(p, dict)), None)
        return cls(pair=legacy) if legacy is not None else None

    def to_dict(self) -> dict:
        return asdict(self)

    def check(self, other: "RunContract", *, run: str, given: str, fix: str) -> None:
        """ContractError when `other` (what a command is about to add to the run) differs in pair or tree."""
        check_pair(self.pair, other.pair, expected_from=f"{run}", got_from=given, fix=fix)
        check_tree(self.tree, other.tree, expected_from=run, got_from=given, fix=fix)


def _check_recorded(data: dict, path) -> None:
    """InputFileError naming the manifest when a recorded contract field has another type than a run writes (an
    edited or damaged file: a number as the dtype would travel into the export, a string tree would skip checks)."""
    def integers(value) -> bool:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)

    expected = {"pair": (dict, "a mapping"), "dtype": (str, "a dtype name"), "tree": (dict, "a mapping"),
                "suites": (dict, "a mapping")}
    bad = [f"{k} is {data[k]!r:.40} ({type(data[k]).__name__}), not {what}" for k, (kind, what) in expected.items()
           if data.get(k) is not None and not isinstance(data[k], kind)]
    tree = data.get("tree")
    if isinstance(tree, dict):
        bad += [f"tree.{k} is {tree[k]!r:.20}, not an integer" for k in ("width", "max_depth", "max_size")
                if tree.get(k) is not None and not integers([tree[k]])]
    if data.get("size_actions") is not None and not integers(data["size_actions"]):
        bad.append(f"size_actions is {data['size_actions']!r:.40}, not a list of integers")
    if bad:
        raise InputFileError(f"{path}: the run's contract is damaged ({'; '.join(bad)}): restore the file, or train "
                             "into a new --run folder")


def record_contract(run_dir: str | Path, contract: RunContract, *, given: str, fix: str) -> RunContract:
    """The run's contract after adding `contract` to it: written when the run has none yet; else checked against
    it (ContractError naming `given` and the run) and completed with what it lacked (size actions, suites)."""
    run_dir = Path(run_dir)
    manifest = RunManifest.load(run_dir)
    recorded = RunContract.of_run(manifest)
    if recorded is not None:
        recorded.check(contract, run=f"run {run_dir} (manifest.json)", given=given, fix=fix)
        if not manifest.section("contract"):  # an older run: its contract starts now, with its own pair
            recorded = RunContract(recorded.pair or contract.pair, contract.dtype, contract.tree,
                                   contract.size_actions, contract.suites)
        else:
            recorded.size_actions = recorded.size_actions or contract.size_actions
            recorded.suites = {**contract.suites, **(recorded.suites or {})}
            recorded.tree = recorded.tree or contract.tree
            recorded.dtype = recorded.dtype or contract.dtype
    else:
        recorded = contract
    RunManifest.update(run_dir, contract=recorded.to_dict())
    return recorded


def check_stage_finished(run_dir: str | Path, stage: str, *, allow_partial: bool = False,
                         option: str = "--allow-partial") -> None:
    """ContractError unless the manifest records stage `stage` as finished ("done"); an older run without a status
    for it passes. `allow_partial` accepts an interrupted or running stage's best checkpoint."""
    status = RunManifest.load(run_dir).stage(stage)
    if status is None or status.finished or allow_partial:
        return
    progress = read_progress(Path(run_dir) / stage)  # a stage killed after its last checkpoint did finish
    if progress and int(progress.get("timesteps_done", 0)) >= int(progress.get("total_timesteps") or 1 << 62):
        return
    steps = f"{status.timesteps_done}" + (f"/{status.total_timesteps}" if status.total_timesteps else "")
    raise ContractError(f"stage {stage!r} of {run_dir} is {status.status} ({steps} steps), not {FINISHED}: finish it "
                        f"first (the command that trained it, with --resume), or pass {option} to build on its best "
                        "checkpoint so far")


def check_grid(grid, contract: RunContract, *, grid_from: str, run: str, fix: str) -> None:
    """ContractError when a grid result (`specpilot.artifacts.grid.GridResult`) was not searched on this run's pair
    and tree: its traces' (or live phase's) pair differs, or none of its traces has the run's width / max depth."""
    for pair in grid.trace_pairs():
        check_pair(contract.pair, pair, expected_from=run, got_from=grid_from, fix=fix)
    tree = contract.tree or {}
    swept = [t for t in grid.traces if t.get("width") is not None]
    if tree.get("width") is not None and swept and not any(int(t["width"]) == int(tree["width"]) for t in swept):
        shapes = ", ".join(sorted({tree_label({"width": t["width"], "max_depth": t.get("max_depth")}) for t in swept}))
        raise ContractError(f"{grid_from} was searched on tree {shapes}, but {run} has "
                            f"{tree_label({k: tree.get(k) for k in TREE_KEYS})}; {fix}")


# what a trace's recording fixes that validation and replay timing rely on being the training trace's
TRACE_CONTRACT = ("pair", "dtype", "width", "max_depth", "max_size", "max_new_tokens", "temperature")
# what a latency profile records of the same (its meta holds the pair and dtype it was measured with)
PROFILE_CONTRACT = ("pair", "dtype", "width", "max_depth")


def check_profile_belongs(trace, profile: str | Path, *, given: str, fix: str) -> None:
    """ContractError when `profile` (a profile.json path) was measured with another pair, dtype or tree than
    `trace` (a loaded Trace or TraceHeader) records: replay would time these decisions with another model's or
    tree's latencies. `given` names the file as the user gave it (e.g. "--batch-profile P"); `fix` says what to do.
    A profile that is not a file is left to the loader's own error."""
    if not Path(profile).is_file():
        return
    folder = getattr(trace, "path", None)
    head = trace if isinstance(trace, TraceHeader) else TraceHeader.from_dict(trace.header, folder or "trace.json")
    refuse_differences(trace_fields(head), profile_fields(Path(profile)), PROFILE_CONTRACT, given=given,
                        expected=f"the trace {folder}" if folder else "the trace", fix=fix, label="trace")


def trace_fields(head: TraceHeader) -> dict:
    """The contract fields (TRACE_CONTRACT) a trace's header records."""
    return {"pair": head.pair, "dtype": _dtype_name(head.dtype), **head.tree, "max_new_tokens": head.max_new_tokens,
            "temperature": head.data.get("temperature")}


def profile_fields(path: Path) -> dict:
    """The contract fields a profile.json records; a malformed file yields None fields (LatencyProfile.load names
    what is wrong with it when replay loads it)."""
    data = read_json(path, what="latency profile", fix="measure it again with `specpilot record --out DIR`")
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    return {"pair": meta.get("pair"), "dtype": _dtype_name(meta.get("dtype")),
            "width": data.get("width"), "max_depth": data.get("max_depth")}


def _dtype_name(dtype) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def refuse_differences(train: dict, got: dict, keys: Sequence[str], *, given: str, expected: str,
                        fix: str, label: str = "training trace") -> None:
    """ContractError listing each of `keys` whose value in `got` differs from the training trace's; a field one
    side does not record (None: an older file) is not compared."""
    differing = [f"{key} {_shown(key, got[key])} ({label}: {_shown(key, train[key])})" for key in keys
                 if _differs(key, train.get(key), got.get(key))]
    if differing:
        raise ContractError(f"{given} does not belong with {expected}: {'; '.join(differing)}; {fix}")


def _differs(key: str, a, b) -> bool:
    if a is None or b is None:
        return False
    if key == "pair":
        return not same_pair(a, b)
    if key == "temperature":
        return float(a) != float(b)
    return str(a) != str(b)


def _shown(key: str, value) -> str:
    return pair_label(value) if key == "pair" else str(value)
