"""The inputs an evaluation depends on, checked before it measures anything.

- `read_grid_best(path)`: a grid-search result's best static config, or an error naming the file;
- `run_tree(run_dir)`: the tree a trained run's policies were trained on (their contract: the observation spec's
  width and max_depth, the size actions' largest size);
- `resolve_tree(run_dir, width=, max_depth=, max_size=)`: the evaluation tree, the run's when there is one (an
  explicit value that differs from it is refused, never silently used or ignored);
- `check_methods(names, grid=, run_dir=)`: every method asked for by name can run (a missing or broken run, grid
  result or module is an error here, where `evaluate()` would skip the method with a note).
"""
from __future__ import annotations

from pathlib import Path

from specpilot.artifacts.grid import GRID_FIX, GridResult  # noqa: F401 (GRID_FIX re-exported)
from specpilot.artifacts.contract import ContractError, RunContract, check_pair
from specpilot.artifacts.policies import TRAIN_FIX, PoliciesIndex
from specpilot.artifacts.run import run_root
from specpilot.drafting.errors import InputFileError
from specpilot.drafting.types import TreeConfig

TRAINED_METHODS = {"ltd": ("depth", "size"), "depth_only": ("depth",), "size_only": ("size",),
                   "ltd_guarded": ("depth", "size")}
GUARDED = "ltd_guarded"  # also needs the run's validation guard (RUN/batch_guard.json, from train --batch-sizes)


def has_batch_guard(run_dir: str | Path) -> bool:
    from specpilot.policies.ppo import BATCH_GUARD_FILE

    return (Path(run_dir) / BATCH_GUARD_FILE).is_file()


class EvalInputError(ValueError):
    """An evaluation input (grid result, trained run, tree option, method list) cannot be used; says which."""


def read_grid_best(path: str | Path) -> dict:
    """{"depth", "size"[, "width"]} of a grid.json's best cell; InputFileError / FileNotFoundError name the file."""
    best = GridResult.load(path).best
    return {k: best[k] for k in ("width", "depth", "size") if k in best}


def run_tree(run_dir: str | Path) -> dict:
    """{"width", "max_depth", "max_size" (None without a size policy), "policies": ["depth", "size"]} of the tree
    the run's policies were trained on, from RUN/policies.json."""
    index = PoliciesIndex.load(Path(run_dir), fix=TRAIN_FIX)
    try:
        return index.tree()
    except InputFileError as err:
        raise EvalInputError(str(err)) from None


def resolve_tree(run_dir: str | Path | None, *, width: int | None = None, max_depth: int | None = None,
                 max_size: int | None = None, default: TreeConfig | None = None) -> TreeConfig:
    """The evaluation tree: with a run, the run's tree (an explicit width / max_depth / max_size that differs is
    refused: a run's tree is its policies' contract); without one, the explicit values over `default`."""
    default = default or TreeConfig()
    given = {"width": width, "max_depth": max_depth, "max_size": max_size}
    if run_dir is None:
        return TreeConfig(**{k: v if v is not None else getattr(default, k) for k, v in given.items()})
    contract = run_tree(run_dir)
    conflicts = [f"--{k.replace('_', '-')} {v} (the run's is {contract[k]})" for k, v in given.items()
                 if v is not None and contract[k] is not None and v != contract[k]]
    if conflicts:
        raise EvalInputError(f"{', '.join(conflicts)}: {run_dir} was trained on width {contract['width']}, "
                             f"max_depth {contract['max_depth']}"
                             + (f", max_size {contract['max_size']}" if contract["max_size"] else "")
                             + "; a run's tree is its policies' contract: drop the option or pass the run's value")
    size = contract["max_size"] or (max_size if max_size is not None else default.max_size)
    return TreeConfig(width=contract["width"], max_depth=contract["max_depth"], max_size=size)


RUN_DTYPE_SOURCE = "the run's dtype (its traces and profile were measured in it)"


def run_dtype(run_dir: str | Path | None, device: str | None, dtype=None) -> tuple[object, str | None]:
    """(dtype to load the pair in, note or None) for evaluating a run: `dtype` when asked for, else the dtype the
    run's traces and profile were measured in (its contract) when this device runs it natively, else the device's
    default with a note (the same rule as an exported decoder, `policies.exported.export_dtype`): the policies and
    the grid chose for the costs of that dtype."""
    from specpilot.policies.exported import export_dtype

    if dtype is not None or run_dir is None:
        return dtype, None
    contract = RunContract.of_run(run_root(run_dir))
    return export_dtype({"dtype": contract.dtype if contract is not None else None}, device, None)


def check_methods(names: list[str], *, grid: str | Path | None = None, run_dir: str | Path | None = None,
                  drafter_kind: str | None = None) -> None:
    """Raise EvalInputError unless every method in `names` can run with these inputs: the run has the policies and
    they load, the grid result is readable, transformers' assisted generation has a draft LM (not an EAGLE-3 head,
    when `drafter_kind` is known). No model is loaded."""
    problems = []
    if drafter_kind == "eagle3" and "hf_assisted" in names:
        problems.append("hf_assisted needs a draft LM: transformers' assisted generation cannot draft with an "
                        "EAGLE-3 head (use --draft, or leave hf_assisted out)")
    for name in names:
        if name in TRAINED_METHODS:
            if run_dir is None:
                problems.append(f"{name} needs a trained run (--run RUN)")
                continue
            needs = TRAINED_METHODS[name]
            has = run_tree(run_dir)["policies"]
            if not set(needs) <= set(has):
                problems.append(f"{name} needs a {' and a '.join(needs)} policy but {run_dir} has only {has}")
            elif name == GUARDED and not has_batch_guard(run_dir):
                problems.append(f"{name} needs the run's batch guard, which {run_dir} does not have (train with "
                                "--batch-sizes writes RUN/batch_guard.json)")
        elif name == "grid":
            if grid is None:
                problems.append("grid needs a grid-search result (--grid GRID.json)")
            else:
                read_grid_best(grid)
        elif name == "batch_table":
            if grid is None:
                problems.append("batch_table needs a grid-search result with a per_batch_size table (--grid GRID.json)")
            elif not GridResult.load(grid).per_batch_size:
                problems.append(f"batch_table needs a per_batch_size table, which {grid} does not have")
    if problems:
        raise EvalInputError(f"method(s) asked for cannot run: {'; '.join(problems)}")
    if run_dir is not None and any(n in TRAINED_METHODS for n in names):
        load_run_policies(run_dir)


def check_inputs_pair(identity: dict, *, run_dir: str | Path | None = None, grid: str | Path | None = None) -> None:
    """ContractError (one line naming both pairs) when the trained run or the grid result was made on another
    pair than the one loaded for the evaluation (`identity`: `ModelPair.identity()`, or an executor's
    `workers[0]["pair"]`): its policies / static config would be measured on models they were never chosen for."""
    if run_dir is None and grid is None:
        return
    loaded = "the pair loaded for evaluation"
    if run_dir is not None:
        contract = RunContract.of_run(run_root(run_dir))
        if contract is None:  # export refuses such a run too: its policies would be measured on any pair unchecked
            raise ContractError(f"run {run_dir} records no pair (no manifest.json with its contract): the pair its "
                                "policies were trained on is unknown, so they cannot be checked against the pair "
                                f"loaded for evaluation; restore {run_root(run_dir) / 'manifest.json'}, or drop --run")
        check_pair(contract.pair, identity, expected_from=f"run {run_dir}", got_from=loaded,
                   fix="evaluate with the pair the run was trained on (--target/--draft/--eagle), or drop --run")
    if grid is not None:
        for recorded in GridResult.load(grid).trace_pairs():
            check_pair(recorded, identity, expected_from=f"grid result {grid}", got_from=loaded,
                       fix="evaluate with the pair the grid was searched on, or drop --grid")


def load_run_policies(run_dir: str | Path) -> None:
    """Load the run's policy zips once, the deployed ones and those trained at each sampling temperature
    (RUN/sampled/T<t>/), so a missing or corrupted file is a PolicyLoadError naming it before measuring."""
    from specpilot.artifacts.run import sampled_indexes
    from specpilot.policies.ppo import load_run_controllers

    load_run_controllers(run_dir, device="cpu")
    for _, folder in sampled_indexes(run_dir):
        load_run_controllers(folder, device="cpu")


def requested_methods(methods: list[str] | None, sampled: list[str] | None, *, grid, run_dir) -> list[str]:
    """The methods that must run: those named in `methods` / `sampled`, else (all methods by default) the ones the
    given --grid / --run enable (an input the user gave must work; methods without inputs may be skipped)."""
    if methods is not None or sampled is not None:
        return list(dict.fromkeys([*(methods or []), *(sampled or [])]))
    wanted = ["grid"] if grid is not None else []
    if run_dir is not None:
        has = set(run_tree(run_dir)["policies"])
        wanted += [n for n, needs in TRAINED_METHODS.items()
                   if set(needs) <= has and (n != GUARDED or has_batch_guard(run_dir))]
    return wanted
