"""Policies for sampled decoding: the depth and size policies fine-tuned on the LIVE decoder at a temperature > 0.

Replay models greedy decoding only (under sampling the emitted text depends on the decisions), so a run's
temperature-T policies train on live environments at T: the depth policy first, from a fresh initialisation (the
greedy policy never skips drafting and has stopped exploring it, while at T > 0 a plain step may be the better
choice), against the static size of the grid at T; then the size policy, from the greedy one, against that frozen
depth policy. No replay validation exists at T > 0, so each stage keeps its final policy. Written to
RUN/sampled/T<t>/policies.json, which evaluation uses at that temperature.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from specpilot.drafting.control import FixedController
from specpilot.envs.environments import as_size_controller
from specpilot.train.coadapt import write_index
from specpilot.train.stages import (StageSpec, TaskTraces, TrainOptions, load_partner, make_logger, static_config,
                                    train_stage)


def sampled_dir(run_dir: str | Path, temperature: float) -> Path:
    return Path(run_dir) / "sampled" / f"T{temperature:g}"


def _static_at(run_dir: Path, temperature: float, options: TrainOptions) -> tuple[int, int]:
    """The grid's drafting config at `temperature` (best_by_temperature, when it drafts), else the greedy one."""
    grid = Path(options.static) if isinstance(options.static, (str, Path)) else run_dir / "grid.json"
    cell = (json.loads(grid.read_text()).get("best_by_temperature") or {}).get(f"{temperature:g}") \
        if grid.is_file() else None
    if cell and int(cell["depth"]) >= 1:
        return int(cell["depth"]), int(cell["size"])
    return static_config(run_dir, options.static)


def train_sampled(run_dir: str | Path, traces: TaskTraces | str | Path, temperature: float, *, depth_steps: int,
                  size_steps: int, options: TrainOptions, wandb: str | None = None) -> Path:
    """Fine-tune the run's final policies live at `temperature`; returns the written policies.json."""
    if temperature <= 0:
        raise ValueError(f"train_sampled is for temperatures > 0 (greedy policies train on replay), got {temperature}")
    run_dir, traces = Path(run_dir), TaskTraces.resolve(traces)
    options = replace(options, backend="live", temperature=float(temperature))
    final = json.loads((run_dir / "policies.json").read_text())
    static = _static_at(run_dir, temperature, options)
    tag = f"T{temperature:g}"
    log, owned = make_logger(run_dir, None, wandb, {"stage": f"sampled_{tag}", "temperature": temperature})
    try:
        size_partner = as_size_controller(static[1])
        depth = train_stage(StageSpec("depth", f"{tag}_depth", depth_steps, partner=size_partner,
                                      val_partner=size_partner), run_dir, traces, options, log)
        frozen = load_partner("depth", depth.best, depth.spec, fallback=FixedController(*static))
        size = train_stage(StageSpec("size", f"{tag}_size", size_steps, partner=frozen, val_partner=frozen,
                                     size_actions=final["size"]["size_actions"],
                                     init_from=run_dir / final["size"]["path"], seed_offset=1),
                           run_dir, traces, options, log)
    finally:
        if owned:
            log.close()
    return write_index(sampled_dir(run_dir, temperature), depth, size, static, copy=True)

