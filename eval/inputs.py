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

from specpilot.drafting.files import read_json
from specpilot.drafting.types import TreeConfig

TRAINED_METHODS = {"ltd": ("depth", "size"), "depth_only": ("depth",), "size_only": ("size",)}
GRID_FIX = "give the grid.json that `specpilot grid --out FILE` wrote"
TRAIN_FIX = "train the run first (`specpilot train ... --run RUN`) or fix its policies.json"


class EvalInputError(ValueError):
    """An evaluation input (grid result, trained run, tree option, method list) cannot be used; says which."""


def read_grid_best(path: str | Path) -> dict:
    """{"depth", "size"[, "width"]} of a grid.json's best cell; InputFileError / FileNotFoundError /
    EvalInputError name the file."""
    path = Path(path)
    data = read_json(path, what="grid-search result", fix=GRID_FIX)
    best = data.get("best")
    if not isinstance(best, dict):
        raise EvalInputError(f"{path} has no best {{depth, size[, width]}} entry; {GRID_FIX}")
    try:
        out = {k: int(best[k]) for k in ("width", "depth", "size") if k in best}
    except (TypeError, ValueError) as err:
        raise EvalInputError(f"{path}: 'best' must hold integer depth/size/width ({err}); {GRID_FIX}") from None
    if "depth" not in out or "size" not in out:
        raise EvalInputError(f"{path} has no best {{depth, size[, width]}} entry; {GRID_FIX}")
    return out


def _policies_index(run_dir: Path) -> dict:
    return read_json(run_dir / "policies.json", what="policies index of a trained run", fix=TRAIN_FIX)


def run_tree(run_dir: str | Path) -> dict:
    """{"width", "max_depth", "max_size" (None without a size policy), "policies": ["depth", "size"]} of the tree
    the run's policies were trained on, from RUN/policies.json."""
    run_dir = Path(run_dir)
    index = _policies_index(run_dir)
    where = run_dir / "policies.json"
    entries = {kind: index.get(kind) for kind in ("depth", "size") if index.get(kind)}
    if not entries:
        raise EvalInputError(f"{where} names neither a depth nor a size policy; {TRAIN_FIX}")
    try:
        shapes = {(int(e["spec"]["width"]), int(e["spec"]["max_depth"])) for e in entries.values()}
        max_size = max(int(v) for v in entries["size"]["size_actions"]) if "size" in entries else None
    except (KeyError, TypeError, ValueError) as err:
        raise EvalInputError(f"{where}: a policy entry lacks its spec (width, max_depth) or size_actions "
                             f"({type(err).__name__}: {err}); {TRAIN_FIX}") from None
    if len(shapes) != 1:
        raise EvalInputError(f"{where}: the depth and size policies were trained on different trees {sorted(shapes)}")
    (width, max_depth), = shapes
    return {"width": width, "max_depth": max_depth, "max_size": max_size, "policies": sorted(entries)}


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
        elif name == "grid":
            if grid is None:
                problems.append("grid needs a grid-search result (--grid GRID.json)")
            else:
                read_grid_best(grid)
    if problems:
        raise EvalInputError(f"method(s) asked for cannot run: {'; '.join(problems)}")
    if run_dir is not None and any(n in TRAINED_METHODS for n in names):
        load_run_policies(run_dir)


def load_run_policies(run_dir: str | Path) -> None:
    """Load the run's policy zips once (PolicyLoadError naming a missing or corrupted file), before measuring."""
    from specpilot.policies.ppo import load_run_controllers

    load_run_controllers(run_dir, device="cpu")


def requested_methods(methods: list[str] | None, sampled: list[str] | None, *, grid, run_dir) -> list[str]:
    """The methods that must run: those named in `methods` / `sampled`, else (all methods by default) the ones the
    given --grid / --run enable (an input the user gave must work; methods without inputs may be skipped)."""
    if methods is not None or sampled is not None:
        return list(dict.fromkeys([*(methods or []), *(sampled or [])]))
    wanted = ["grid"] if grid is not None else []
    if run_dir is not None:
        has = set(run_tree(run_dir)["policies"])
        wanted += [n for n, needs in TRAINED_METHODS.items() if set(needs) <= has]
    return wanted
