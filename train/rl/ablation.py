"""The reward ablation (LTD Table 2): the same policy trained once per reward mode, compared on validation replay."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from specpilot.drafting.control import FixedController
from specpilot.drafting.files import atomic_write_json
from specpilot.drafting.folder_lock import holds_output
from specpilot.envs.replay import ReplayModel
from specpilot.train.rl.stages import (REWARD_MODES, TaskTraces, TrainOptions, run_logger, static_config, train_depth,
                                    train_size)
from specpilot.train.rl.validation import evaluate_replay, replay_ar

_REPORTED = ("tokens_per_s", "speedup", "mean_accepted_length", "depth_mean", "size_mean", "cycles")


def _policy_row(path: Path, res, kind: str, static: tuple[int, int], val_model: ReplayModel, ar: dict) -> dict:
    from specpilot.policies.ppo import PPOController, load_sb3_model

    policy = load_sb3_model(path).policy
    fallback = FixedController(*static)
    ctrl = (PPOController(None, policy, size_spec=res.spec, size_actions=res.size_actions, fallback=fallback)
            if kind == "size" else PPOController(policy, None, depth_spec=res.spec, fallback=fallback))
    ev = evaluate_replay(ctrl, val_model, ar["tokens_per_s"])
    return {k: ev[k] for k in _REPORTED}


@holds_output("run_dir", what="run folder")
def reward_ablation(run_dir: str | Path, traces: TaskTraces | str | Path, *, kind: str = "size",
                    rewards: Sequence[str] = REWARD_MODES, steps: int = 10_000, options: TrainOptions | None = None,
                    wandb: str | None = None, logger=None, out: str | Path | None = None) -> dict:
    """Train the `kind` policy once per reward mode (same budget, seed, partner) under RUN/ablation/, and report
    replay validation tokens/s, speedup, mean accepted length and mean chosen depth/size of the final policy and
    of the validation-best checkpoint; write RUN/ablation/ablation.json (or `out`).

    Report the final policy to compare rewards: the best checkpoint is selected *by throughput*, which partly
    hides what a reward optimises."""
    from specpilot.train.rl.ppo import read_progress

    bad = [r for r in rewards if r not in REWARD_MODES]
    if bad:
        raise ValueError(f"unknown reward mode(s) {bad}; choose from {REWARD_MODES}")
    run_dir, options = Path(run_dir), options or TrainOptions()
    ab_dir, traces = run_dir / "ablation", TaskTraces.resolve(traces)
    static = static_config(run_dir, options.static)
    val_model = ReplayModel(traces.validation)
    ar = replay_ar(val_model)
    rows: list[dict[str, Any]] = []
    with run_logger(ab_dir, logger, wandb, {"ablation": kind, "rewards": list(rewards), "steps": steps}) as log:
        for reward in rewards:
            stage = f"{kind}_{reward}"
            train = train_size if kind == "size" else train_depth
            res = train(ab_dir, traces, steps=steps, stage=stage, logger=log,
                        options=replace(options, reward=reward, static=static))
            progress = read_progress(ab_dir / stage)
            final_zip = ab_dir / stage / "checkpoints" / progress["checkpoint"]
            rows.append({"reward": reward, "stage": stage, "steps": int(progress["timesteps_done"]),
                         "final": _policy_row(final_zip, res, kind, static, val_model, ar),
                         "best": _policy_row(res.best, res, kind, static, val_model, ar)})
    result = {"kind": kind, "steps": steps, "static": list(static), "rows": rows, "ar": ar,
              "notes": "replay on the validation trace; 'final' = policy at the end of training, 'best' = "
                       "checkpoint with the best validation throughput"}
    path = Path(out) if out is not None else ab_dir / "ablation.json"
    atomic_write_json(path, result, default=float)
    result["path"] = str(path)
    return result
