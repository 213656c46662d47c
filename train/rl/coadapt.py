"""Stage 2 of LTD: co-adaptation (alternate size / depth with the partner frozen), and the policies indexes.

    RUN/policies.json          the final depth + size policies (fallback: the static config)
    RUN/stage1/policies.json   the stage-1 policies (zips copied in, so the directory stands alone)
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Sequence

import numpy as np

from specpilot.drafting.control import FixedController
from specpilot.drafting.folder_lock import holds_output
from specpilot.train.rl.stages import (StageResult, StageSpec, TaskTraces, TrainOptions, load_partner, run_logger,
                                    run_relative, stage_result, static_config, train_stage)


def coadapt_stages(rounds: int) -> list[tuple[str, str]]:
    """(kind, stage folder) of each co-adaptation round: size first, then alternating (co1_size, co2_depth, ...)."""
    kinds = ["size" if i % 2 == 0 else "depth" for i in range(rounds)]
    return [(kind, f"co{i + 1}_{kind}") for i, kind in enumerate(kinds)]


def write_index(index_dir: Path, depth: StageResult | None, size: StageResult | None, static: tuple[int, int],
                copy: bool) -> Path:
    """index_dir/policies.json for these stage results (copying the zips in when `copy`)."""
    from specpilot.train.rl.ppo import write_policies_index

    index_dir.mkdir(parents=True, exist_ok=True)

    def place(res: StageResult | None, name: str) -> Path | None:
        if res is None or not copy:
            return None if res is None else res.best
        dest = index_dir / f"{name}.zip"
        shutil.copyfile(res.best, dest)
        return dest

    return write_policies_index(index_dir, depth=place(depth, "depth"), size=place(size, "size"),
                                depth_spec=depth.spec if depth else None, size_spec=size.spec if size else None,
                                size_actions=size.size_actions if size else None,
                                fallback_depth=static[0], fallback_size=static[1])


def write_stage1_index(run_dir: str | Path, depth: StageResult | None, size: StageResult | None,
                       static: tuple[int, int] | str | Path | None = None) -> Path:
    """RUN/stage1/policies.json (zips copied in, so the directory stands alone) for the stage-1 policies."""
    run_dir = Path(run_dir)
    return write_index(run_dir / "stage1", depth, size, static_config(run_dir, static), copy=True)


@holds_output("run_dir", what="run folder")
def coadapt(run_dir: str | Path, traces: TaskTraces | str | Path, *, rounds: int = 3,
            steps: int | Sequence[int] = 10_000, size_stage: str = "size_s1", depth_stage: str = "depth_s1",
            options: TrainOptions | None = None, wandb: str | None = None, logger=None) -> dict:
    """Alternate size, depth, size, ... (`rounds` stages) with the partner frozen; each stage starts from the latest
    policy of its kind (stage 1's `size_stage` / `depth_stage` best.zip first) and keeps its best validation
    checkpoint (or its starting policy when that validates better). Writes RUN/policies.json and returns
    {"rounds": [StageResult dicts], "policies": path, "depth": zip, "size": zip}. steps: per round, or a list."""
    from specpilot.train.rl.ppo import update_manifest

    run_dir, options = Path(run_dir), options or TrainOptions()
    traces = TaskTraces.resolve(traces)
    static = static_config(run_dir, options.static)
    budgets = [int(steps)] * rounds if isinstance(steps, (int, np.integer)) else [int(s) for s in steps]
    if len(budgets) != rounds:
        raise ValueError(f"steps has {len(budgets)} budgets for {rounds} rounds")
    latest = {kind: stage_result(run_dir, stage, allow_partial=options.allow_partial)
              for kind, stage in (("size", size_stage), ("depth", depth_stage))}
    results: list[StageResult] = []
    with run_logger(run_dir, logger, wandb, {"stage": "coadapt", "rounds": rounds, "steps": budgets}) as log:
        for i, (kind, stage) in enumerate(coadapt_stages(rounds)):
            other = latest["depth" if kind == "size" else "size"]
            frozen = load_partner(other.kind, other.best, other.spec, size_actions=other.size_actions,
                                  fallback=FixedController(*static))
            spec = StageSpec(kind, stage, budgets[i], partner=frozen, val_partner=frozen,
                             size_actions=latest["size"].size_actions, init_from=latest[kind].best,
                             keep_init_if_better=True, seed_offset=i + 1)
            latest[kind] = train_stage(spec, run_dir, traces, options, log)
            results.append(latest[kind])
        index = write_index(run_dir, latest["depth"], latest["size"], static, copy=False)
    final = {kind: run_relative(latest[kind].best, run_dir) for kind in ("depth", "size")}  # the run may move
    update_manifest(run_dir, coadapt={"rounds": [{**r.to_dict(), "best": run_relative(r.best, run_dir)}
                                                 for r in results], "static": list(static), "final": final})
    return {"rounds": [r.to_dict() for r in results], "policies": index, "depth": latest["depth"].best,
            "size": latest["size"].best}
