"""The LTD training pipeline as importable functions (the `specpilot train` CLI and the demo call these).

    traces = record_traces(pair, "runs/r1/traces", tree=TreeConfig(width=8, max_depth=12, max_size=32))
    grid = grid_search(traces.train, pair=pair, val_prompts=load_prompts("validation"), out="runs/r1/grid.json")
    size1 = train_size("runs/r1", traces, steps=20_000)                    # stage 1: size vs random depths
    depth1 = train_depth("runs/r1", traces, steps=40_000)                  # stage 1: depth vs the grid's size
    final = coadapt("runs/r1", traces, rounds=3, steps=10_000)             # stage 2: size, depth, size
    controllers = load_run_controllers("runs/r1")                          # ltd / depth_only / size_only

Everything trains on REPLAY by default (`specpilot.envs.replay`: exact accepted lengths from a trace of the
training task, times from its latency profile); `backend="live"` trains on the live decoder instead (wall-clock
rewards; with `init_from=` it fine-tunes a replay-trained policy). Validation is always replay on the trace of the
*validation* prompts, deciding through `PPOController` (the inference code path): higher tokens/s is better.

Run directory (besides `specpilot.train.ppo`'s layout):
    RUN/traces/{train,validation}/   trace.npz, trace.json, profile.json, ar.json (`record_traces`)
    RUN/grid.json, RUN/grid.png      the static baseline (`specpilot.train.grid`); its best fixes the partners
    RUN/size_s1, RUN/depth_s1        stage 1;   RUN/co1_size, RUN/co2_depth, RUN/co3_size ... stage 2
    RUN/policies.json                final (co-adapted) depth + size policies; fallback = the grid's best config
    RUN/stage1/policies.json         the stage-1 policies (their own depth_only / size_only / ltd without stage 2)
    RUN/ablation/ablation.json       reward ablation (`reward_ablation`)

Validation speedup (logged as <stage>/val/speedup): replay tokens/s of the policy over the autoregressive
tokens/s of the same validation generations, from `specpilot.train.grid.replay_ar`: the live AR measurement
written by `record_traces` (ar.json) when present, else the profile's size-1 verification time per token.
"""
from __future__ import annotations

import json
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from specpilot.drafting.types import CycleRecord, DraftState, TreeConfig
from specpilot.envs.observation import ObservationSpec, default_size_actions
from specpilot.envs.replay import ReplayModel, replay_controller
from specpilot.policies.base import Controller, FixedController
from specpilot.train.grid import AR_FILE, replay_ar

REWARD_MODES = ("throughput", "acceptance", "time", "dinkelbach")
STATIC_FALLBACK = (4, 12)


# ---------------------------------------------------------------------------------------------------------------------
# traces


@dataclass(frozen=True)
class TaskTraces:
    """The replay data of a run: a trace of the training prompts and one of the validation prompts."""

    train: Path
    validation: Path

    @classmethod
    def resolve(cls, traces: "TaskTraces | str | Path") -> "TaskTraces":
        """A TaskTraces, or a directory holding train/ and validation/ trace directories."""
        if isinstance(traces, TaskTraces):
            return traces
        root = Path(traces)
        out = cls(root / "train", root / "validation")
        for part in (out.train, out.validation):
            if not (part / "trace.npz").is_file():
                raise FileNotFoundError(f"no trace at {part}: record the train and validation traces first "
                                        "(`record_traces(...)` or `specpilot record --suite train|validation`)")
        return out


def measure_ar(pair, prompts: Sequence, *, max_new_tokens: int, warmup: int = 1) -> dict:
    """Live autoregressive seconds per token on `prompts` (after `warmup` untimed generations)."""
    from specpilot.drafting.decoder import autoregressive_generate

    items = [getattr(p, "prompt", p) for p in prompts]
    for _ in range(warmup):
        autoregressive_generate(pair, items[0], max_new_tokens=max_new_tokens)
    tokens, seconds = 0, 0.0
    for p in items:
        out = autoregressive_generate(pair, p, max_new_tokens=max_new_tokens)
        tokens, seconds = tokens + out.num_tokens, seconds + out.total_s
    return {"seconds_per_token": seconds / max(tokens, 1), "tokens": tokens, "time_s": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"), "prompts": len(items),
            "max_new_tokens": max_new_tokens, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}


def record_traces(pair, out_dir: str | Path, *, tree: TreeConfig | None = None, train_prompts: Sequence | None = None,
                  val_prompts: Sequence | None = None, max_new_tokens: int = 64, profile_prompts: int | None = 8,
                  seed: int = 0, progress: bool = False) -> TaskTraces:
    """Record out_dir/train and out_dir/validation (trace + latency profile + live AR timing, `ar.json`).

    Defaults: the bundled `train` and `validation` suites; the recorded tree `tree` (default TreeConfig with
    max_size raised to the largest size action of the device). Held-out prompts never belong here.
    """
    from specpilot.envs.record import load_prompts, record_task

    if tree is None:
        tree = TreeConfig(max_size=max(TreeConfig().max_size, *default_size_actions(str(pair.device))))
    out = TaskTraces(Path(out_dir) / "train", Path(out_dir) / "validation")
    for split, prompts, path in (("train", train_prompts, out.train), ("validation", val_prompts, out.validation)):
        prompts = list(prompts) if prompts is not None else load_prompts(split)
        record_task(pair, tree, prompts, path, max_new_tokens=max_new_tokens, profile_prompts=profile_prompts,
                    seed=seed, progress=progress)
        ar = measure_ar(pair, prompts, max_new_tokens=max_new_tokens)
        (path / AR_FILE).write_text(json.dumps(ar, indent=1))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# validation


class _Tally(Controller):
    """Delegates to `inner` and tallies the cycles it is shown (for mean depth / size / accepted length)."""

    def __init__(self, inner: Controller) -> None:
        self.inner, self.name = inner, inner.name
        self.depths: list[int] = []
        self.sizes: list[int] = []

    def reset(self) -> None:
        self.inner.reset()

    def should_stop(self, state: DraftState) -> bool:
        return self.inner.should_stop(state)

    def choose_size(self, state: DraftState) -> int:
        return self.inner.choose_size(state)

    def observe(self, record: CycleRecord) -> None:
        self.depths.append(record.depth)
        self.sizes.append(record.size)
        self.inner.observe(record)


def evaluate_replay(controller: Controller, model: ReplayModel, ar_tokens_per_s: float | None = None) -> dict:
    """Replay throughput of `controller` on `model`'s trace with depth/size tallies (and speedup vs AR)."""
    tally = _Tally(controller)
    res = replay_controller(model, controller=tally)
    res["depth_mean"] = float(np.mean(tally.depths)) if tally.depths else float("nan")
    res["size_mean"] = float(np.mean(tally.sizes)) if tally.sizes else float("nan")
    res["depth_hist"] = np.bincount(tally.depths, minlength=model.trace.max_depth + 1).tolist()
    if ar_tokens_per_s:
        res["speedup"] = res["tokens_per_s"] / ar_tokens_per_s
    return res


def validation_fn(
    val_trace: str | Path,
    *,
    kind: str,
    spec: ObservationSpec,
    partner: Controller,
    size_actions: Sequence[int] | None = None,
    profile: str | Path | None = None,
    max_new_tokens: int | None = None,
    logger=None,
    stage: str = "stage",
) -> Callable[[Any], float]:
    """val_fn(model) -> replay tokens/s on the validation trace, deciding exactly as inference does.

    The model's policy becomes the `kind` half of a PPOController; `partner` decides the other half (a fixed
    config, a RandomDepthController, or a frozen PPOController). Metrics go to `logger` under <stage>/val/.
    """
    from specpilot.policies.ppo import PPOController

    model_r = ReplayModel(val_trace, profile, max_new_tokens=max_new_tokens)
    ar = replay_ar(model_r)
    calls = {"n": 0}

    def val(model) -> float:
        policy = model.policy if hasattr(model, "policy") else model
        if kind == "size":
            ctrl = PPOController(None, policy, size_spec=spec, size_actions=list(size_actions), fallback=partner)
        else:
            ctrl = PPOController(policy, None, depth_spec=spec, fallback=partner)
        seed = getattr(partner, "seed", None)
        if callable(seed):
            seed(1234)  # the same partner draws at every validation
        res = evaluate_replay(ctrl, model_r, ar["tokens_per_s"])
        calls["n"] += 1
        if logger is not None:
            step = int(getattr(model, "num_timesteps", calls["n"]))
            logger.log({f"{stage}/val/tokens_per_s": res["tokens_per_s"], f"{stage}/val/speedup": res["speedup"],
                        f"{stage}/val/mean_accepted_length": res["mean_accepted_length"],
                        f"{stage}/val/depth_mean": res["depth_mean"], f"{stage}/val/size_mean": res["size_mean"]},
                       step=step)
        return float(res["tokens_per_s"])

    return val


# ---------------------------------------------------------------------------------------------------------------------
# settings and stages


def budget_settings(kind: str, steps: int, *, seed: int = 0, **overrides):
    """The paper's PPOSettings for `kind`, scaled to a small budget unless overridden.

    With `steps` below 8 paper rollouts (8 x 2048), n_steps shrinks to the power of two giving >= 8 updates
    (>= 64), batch_size to min(256, n_steps) and n_epochs to 10 (below 4096 steps); eval/checkpoint cadence
    defaults to ~10 validations per stage. Every field can be overridden (None values are ignored).
    """
    from specpilot.train.ppo import settings_for

    overrides = {k: v for k, v in overrides.items() if v is not None}
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n_steps = overrides.pop("n_steps", None)
    if n_steps is None:
        n_steps = 2048 if steps >= 8 * 2048 else max(64, 2 ** int(np.floor(np.log2(max(steps / 8, 1)))))
    batch = overrides.pop("batch_size", None) or min(256, n_steps)
    epochs = overrides.pop("n_epochs", None) or (20 if steps >= 4096 else 10)
    every = max(n_steps, (steps // 10) // n_steps * n_steps)
    base = dict(total_timesteps=steps, n_steps=int(n_steps), batch_size=int(batch), n_epochs=int(epochs), seed=seed,
                eval_every=every, checkpoint_every=every)
    base.update(overrides)
    return settings_for(kind, **base)


@dataclass
class StageResult:
    """What one training stage produced (returned by train_size / train_depth, collected by coadapt)."""

    stage: str
    kind: str
    best: Path
    spec: ObservationSpec
    size_actions: list[int] | None
    score: float | None
    skipped: bool = False
    validation: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["best"], d["spec"] = str(self.best), self.spec.to_dict()
        return d


def static_config(run_dir: str | Path, static: tuple[int, int] | str | Path | None = None) -> tuple[int, int]:
    """(depth, size) of the static baseline: `static` itself, a grid.json path, RUN/grid.json, else (4, 12)."""
    if isinstance(static, (tuple, list)):
        return int(static[0]), int(static[1])
    path = Path(static) if static is not None else Path(run_dir) / "grid.json"
    if path.is_file():
        best = json.loads(path.read_text())["best"]
        return int(best["depth"]), int(best["size"])
    if static is not None:
        raise FileNotFoundError(f"grid result {path} not found: run `specpilot grid` or pass static=(depth, size)")
    warnings.warn(f"no grid result at {path} and no static=(depth, size): using {STATIC_FALLBACK}; run "
                  "`specpilot grid` first for the real baseline", stacklevel=3)
    return STATIC_FALLBACK


def _stage_done(run_dir: Path, stage: str, steps: int) -> dict | None:
    """The stage's best.json when it finished a budget >= steps (so a resumed pipeline skips it)."""
    from specpilot.train.ppo import read_progress

    stage_dir = run_dir / stage
    progress = read_progress(stage_dir) if (stage_dir / "checkpoints").is_dir() else None
    best = stage_dir / "best.json"
    if progress and int(progress["timesteps_done"]) >= steps and (stage_dir / "best.zip").is_file() and best.is_file():
        return json.loads(best.read_text())
    return None


def _size_actions(trace: ReplayModel, size_actions: Sequence[int] | None) -> list[int]:
    acts = [int(v) for v in (size_actions or default_size_actions(trace.trace.header.get("device")))]
    return [v for v in acts if v <= trace.trace.max_size] or [trace.trace.max_size]


def stage_result(run_dir: str | Path, stage: str) -> StageResult:
    """A finished stage's StageResult, rebuilt from the manifest (kind, spec, size actions) and best.json."""
    run_dir = Path(run_dir)
    best = run_dir / stage / "best.zip"
    if not best.is_file():
        raise FileNotFoundError(f"{best} not found: train stage {stage!r} first (stage 1: `specpilot train size` "
                                "and `specpilot train depth`)")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    setup = (manifest.get("stage_setup") or {}).get(stage)
    if setup is None:
        raise FileNotFoundError(f"{run_dir / 'manifest.json'} has no setup for stage {stage!r}: was it trained by "
                                "specpilot.train.pipeline?")
    info = json.loads((run_dir / stage / "best.json").read_text()) if (run_dir / stage / "best.json").is_file() \
        else {}
    return StageResult(stage, setup["kind"], best, ObservationSpec.from_dict(setup["spec"]), setup.get("size_actions"),
                       info.get("score"))


def load_partner(kind: str, path: str | Path, spec: ObservationSpec, *, size_actions: Sequence[int] | None = None,
                 fallback: Controller | None = None) -> Controller:
    """A frozen policy zip as a Controller deciding `kind` (the rest by `fallback`)."""
    from specpilot.policies.ppo import PPOController, load_sb3_policy

    policy = load_sb3_policy(path)
    if kind == "depth":
        return PPOController(policy, None, depth_spec=spec, fallback=fallback, name="frozen_depth")
    return PPOController(None, policy, size_spec=spec, size_actions=list(size_actions), fallback=fallback,
                         name="frozen_size")


def _train_stage(
    kind: str,
    run_dir: str | Path,
    traces: TaskTraces | str | Path,
    *,
    stage: str,
    steps: int,
    partner: Any,
    val_partner: Controller,
    size_actions: Sequence[int] | None,
    reward: str,
    backend: str,
    pair,
    train_prompts: Sequence | None,
    init_from: str | Path | None,
    resume: bool,
    logger,
    seed: int,
    max_context: int,
    settings_overrides: dict,
    keep_init_if_better: bool = False,
    cluster=None,
) -> StageResult:
    from specpilot.envs.replay import ReplayDepthEnv, ReplaySizeEnv
    from specpilot.train.ppo import train_policy, update_manifest

    run_dir = Path(run_dir)
    traces = TaskTraces.resolve(traces)
    train_model = ReplayModel(traces.train)
    tr = train_model.trace
    actions = _size_actions(train_model, size_actions) if kind == "size" else None
    if kind == "size":
        spec = ObservationSpec.for_size(tr.width, tr.max_depth, size_actions=actions, max_context=max_context)
    else:
        spec = ObservationSpec.for_depth(tr.width, tr.max_depth, max_context=max_context)
    settings = budget_settings(kind, steps, seed=seed, **settings_overrides)

    if resume:
        done = _stage_done(run_dir, stage, settings.total_timesteps)
        if done is not None:
            manifest = json.loads((run_dir / "manifest.json").read_text())
            chosen = (manifest.get("stage_selection") or {}).get(stage) or {}
            if chosen.get("final") and Path(chosen["final"]).is_file():
                return StageResult(stage, kind, Path(chosen["final"]), spec, actions, chosen.get("score"),
                                   skipped=True, validation=chosen)
            return StageResult(stage, kind, run_dir / stage / "best.zip", spec, actions, done.get("score"),
                               skipped=True)

    make_venv = None  # a VecEnv factory replacing SB3's local DummyVecEnv (Ray workers' live environments)
    if backend == "replay":
        if kind == "size":
            def make_env():
                return ReplaySizeEnv(traces.train, reward=reward, size_actions=actions, depth_controller=partner,
                                     max_context=max_context)
        else:
            def make_env():
                return ReplayDepthEnv(traces.train, reward=reward, size_controller=partner, max_context=max_context)
    elif backend == "live":
        from specpilot.envs.live import DepthEnv, SizeEnv
        from specpilot.envs.record import load_prompts

        if pair is None and cluster is None:
            raise ValueError("backend='live' needs pair= (the models to decode with) or cluster= (a WorkerPool)")
        prompts = list(train_prompts) if train_prompts is not None else load_prompts("train")
        tree = TreeConfig(width=tr.width, max_depth=tr.max_depth, max_size=tr.max_size)
        if kind == "size":
            def make_env():
                return SizeEnv(pair, prompts, max_new_tokens=tr.max_new_tokens, tree=tree, reward=reward,
                               size_actions=actions, depth_controller=partner, max_context=max_context)
        else:
            def make_env():
                return DepthEnv(pair, prompts, max_new_tokens=tr.max_new_tokens, tree=tree, reward=reward,
                                size_controller=partner, max_context=max_context)
        if cluster is not None:  # the same environments, one per Ray worker, each on the worker's own pair
            from functools import partial

            from specpilot.train.ray_vecenv import RayVecEnv

            partner_kw = {"size_actions": actions, "depth_controller": partner} if kind == "size" \
                else {"size_controller": partner}
            env_fn = partial(SizeEnv if kind == "size" else DepthEnv, prompts=prompts,
                             max_new_tokens=tr.max_new_tokens, tree=tree, reward=reward, max_context=max_context,
                             **partner_kw)

            def make_venv():
                return RayVecEnv(cluster, env_fn)
    else:
        raise ValueError(f"backend must be 'replay' or 'live', got {backend!r}")

    val = validation_fn(traces.validation, kind=kind, spec=spec, partner=val_partner, size_actions=actions,
                        logger=logger, stage=stage)
    update_manifest(run_dir, traces={"train": str(traces.train), "validation": str(traces.validation),
                                     "train_pair": tr.header.get("pair")},
                    seeds={stage: seed},
                    stage_setup={stage: {"kind": kind, "backend": backend, "reward": reward,
                                         "partner": _describe(partner), "val_partner": _describe(val_partner),
                                         "size_actions": actions, "spec": spec.to_dict(),
                                         "init_from": str(init_from or "")}})
    best = train_policy(make_env, val, settings, run_dir, stage, resume=resume, logger=logger,
                        init_from=init_from, venv_factory=make_venv)
    info = json.loads((run_dir / stage / "best.json").read_text())
    result = StageResult(stage, kind, best, spec, actions, info.get("score"))
    if init_from is not None and keep_init_if_better:
        # validation only runs after training steps: the starting policy itself competes too, so a
        # co-adaptation round can never hand on a policy worse (on validation) than the one it started from
        from stable_baselines3 import PPO

        init_score = val(PPO.load(init_from, device="cpu"))
        result.validation = {"init_score": init_score, "stage_best_score": result.score}
        if result.score is None or init_score > result.score:
            result = StageResult(stage, kind, Path(init_from), spec, actions, init_score,
                                 validation={**result.validation, "kept_init": True})
        update_manifest(run_dir, stage_selection={stage: {**result.validation, "final": str(result.best),
                                                          "score": result.score}})
    return result


def _describe(partner: Any) -> Any:
    if isinstance(partner, Controller):
        return partner.describe()
    return partner if isinstance(partner, (int, list, tuple, type(None))) else str(partner)


def _make_logger(run_dir, logger, wandb: str | None, config: dict):
    """(logger, owned): an explicit logger is used as is; otherwise a RunLogger this call closes."""
    if logger is not None:
        return logger, False
    from specpilot.train.logging import RunLogger

    return RunLogger(run_dir, config, mode=wandb), True


def train_size(
    run_dir: str | Path,
    traces: TaskTraces | str | Path,
    *,
    steps: int = 20_000,
    depth_partner: Any = None,
    depth_range: tuple[int, int] | None = None,
    static: tuple[int, int] | str | Path | None = None,
    size_actions: Sequence[int] | None = None,
    reward: str = "dinkelbach",
    backend: str = "replay",
    pair=None,
    cluster=None,
    train_prompts: Sequence | None = None,
    stage: str = "size_s1",
    init_from: str | Path | None = None,
    resume: bool = False,
    seed: int = 0,
    wandb: str | None = None,
    logger=None,
    max_context: int = 4096,
    **settings_overrides: Any,
) -> StageResult:
    """Stage 1 size policy: PPO against random depths in `depth_range` (default 1..max_depth), or `depth_partner`
    (an int depth, a (low, high) pair, a Controller). Validation: the grid's static depth (`static`: (depth, size),
    a grid.json, default RUN/grid.json) with the policy choosing sizes, on the validation trace.

    settings_overrides: any PPOSettings field (n_steps, batch_size, n_epochs, pi_arch, vf_arch, gamma,
    learning_rate, ent_coef, eval_every, ...); defaults from `budget_settings`.
    cluster: a `specpilot.train.cluster.WorkerPool`: with backend="live", one environment per Ray worker
    (`specpilot.train.ray_vecenv.RayVecEnv`) instead of a local one on `pair`.
    """
    traces = TaskTraces.resolve(traces)
    depth, _ = static_config(run_dir, static)
    max_depth = ReplayModel(traces.train).trace.max_depth
    if depth_partner is None:
        lo, hi = depth_range or (1, max_depth)
        depth_partner = (int(lo), int(hi))
    from specpilot.envs.live import as_depth_controller

    val_partner = FixedController(depth=min(depth, max_depth), size=1)
    log, owned = _make_logger(run_dir, logger, wandb, {"stage": stage, "kind": "size", "steps": steps})
    try:
        return _train_stage("size", run_dir, traces, stage=stage, steps=steps,
                            partner=as_depth_controller(depth_partner), val_partner=val_partner,
                            size_actions=size_actions, reward=reward, backend=backend, pair=pair,
                            cluster=cluster, train_prompts=train_prompts, init_from=init_from, resume=resume, logger=log, seed=seed,
                            max_context=max_context, settings_overrides=settings_overrides)
    finally:
        if owned:
            log.close()


def train_depth(
    run_dir: str | Path,
    traces: TaskTraces | str | Path,
    *,
    steps: int = 40_000,
    size_partner: Any = None,
    static: tuple[int, int] | str | Path | None = None,
    reward: str = "dinkelbach",
    backend: str = "replay",
    pair=None,
    cluster=None,
    train_prompts: Sequence | None = None,
    stage: str = "depth_s1",
    init_from: str | Path | None = None,
    resume: bool = False,
    seed: int = 0,
    wandb: str | None = None,
    logger=None,
    max_context: int = 4096,
    **settings_overrides: Any,
) -> StageResult:
    """Stage 1 depth policy: PPO with the verification size fixed at the grid's best (`static`; the paper uses
    EAGLE-3's 60 on GPU), or `size_partner` (an int size or a Controller). Validated with the same partner."""
    _, size = static_config(run_dir, static)
    from specpilot.envs.live import as_size_controller

    partner = as_size_controller(size_partner if size_partner is not None else size)
    log, owned = _make_logger(run_dir, logger, wandb, {"stage": stage, "kind": "depth", "steps": steps})
    try:
        return _train_stage("depth", run_dir, traces, stage=stage, steps=steps, partner=partner,
                            val_partner=partner, size_actions=None, reward=reward, backend=backend, pair=pair,
                            cluster=cluster, train_prompts=train_prompts, init_from=init_from, resume=resume, logger=log, seed=seed,
                            max_context=max_context, settings_overrides=settings_overrides)
    finally:
        if owned:
            log.close()


def _write_index(index_dir: Path, depth: StageResult | None, size: StageResult | None, static: tuple[int, int],
                 copy: bool) -> Path:
    from specpilot.train.ppo import write_policies_index

    index_dir.mkdir(parents=True, exist_ok=True)

    def place(res: StageResult | None, name: str) -> Path | None:
        if res is None:
            return None
        if not copy:
            return res.best
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
    return _write_index(run_dir / "stage1", depth, size, static_config(run_dir, static), copy=True)


def coadapt(
    run_dir: str | Path,
    traces: TaskTraces | str | Path,
    *,
    rounds: int = 3,
    steps: int | Sequence[int] = 10_000,
    size_stage: str = "size_s1",
    depth_stage: str = "depth_s1",
    static: tuple[int, int] | str | Path | None = None,
    reward: str = "dinkelbach",
    backend: str = "replay",
    pair=None,
    cluster=None,
    train_prompts: Sequence | None = None,
    resume: bool = False,
    seed: int = 0,
    wandb: str | None = None,
    logger=None,
    max_context: int = 4096,
    **settings_overrides: Any,
) -> dict:
    """Stage 2: alternate size, depth, size, ... (`rounds` stages) with the partner frozen; each stage starts
    from the latest policy of its kind (stage 1's `size_stage` / `depth_stage` best.zip first) and keeps its
    best validation checkpoint. Writes RUN/policies.json (the final depth + size; fallback = the static config)
    and returns {"rounds": [StageResult dicts], "policies": path, "depth": zip, "size": zip}.

    steps: per round, or one budget per round.
    """
    run_dir = Path(run_dir)
    traces = TaskTraces.resolve(traces)
    static_cfg = static_config(run_dir, static)
    budgets = [int(steps)] * rounds if isinstance(steps, (int, np.integer)) else [int(s) for s in steps]
    if len(budgets) != rounds:
        raise ValueError(f"steps has {len(budgets)} budgets for {rounds} rounds")
    latest = {"size": stage_result(run_dir, size_stage), "depth": stage_result(run_dir, depth_stage)}
    log, owned = _make_logger(run_dir, logger, wandb, {"stage": "coadapt", "rounds": rounds, "steps": budgets})
    results: list[StageResult] = []
    try:
        for i in range(rounds):
            kind = "size" if i % 2 == 0 else "depth"
            other = "depth" if kind == "size" else "size"
            stage = f"co{i + 1}_{kind}"
            p = latest[other]
            fixed = FixedController(*static_cfg)
            frozen = load_partner(other, p.best, p.spec, size_actions=p.size_actions, fallback=fixed)
            res = _train_stage(kind, run_dir, traces, stage=stage, steps=budgets[i], partner=frozen,
                               val_partner=frozen, size_actions=latest["size"].size_actions, reward=reward,
                               backend=backend, pair=pair, cluster=cluster, train_prompts=train_prompts,
                               init_from=latest[kind].best, resume=resume, logger=log, seed=seed + i + 1,
                               max_context=max_context, settings_overrides=dict(settings_overrides),
                               keep_init_if_better=True)
            results.append(res)
            latest[kind] = res
        index = _write_index(run_dir, latest["depth"], latest["size"], static_cfg, copy=False)
    finally:
        if owned:
            log.close()
    from specpilot.train.ppo import update_manifest

    update_manifest(run_dir, coadapt={"rounds": [r.to_dict() for r in results], "static": list(static_cfg),
                                      "final": {"depth": str(latest["depth"].best), "size": str(latest["size"].best)}})
    return {"rounds": [r.to_dict() for r in results], "policies": index, "depth": latest["depth"].best,
            "size": latest["size"].best}


# ---------------------------------------------------------------------------------------------------------------------
# evaluation of a run, reward ablation


def evaluate_run(run_dir: str | Path, traces: TaskTraces | str | Path, *, split: str = "validation",
                 static: tuple[int, int] | str | Path | None = None, include_stage1: bool = True) -> dict:
    """Replay tokens/s (+ speedup, tau, mean depth/size) on the `split` trace of: the static config, each
    controller of RUN/policies.json (ltd, depth_only, size_only), the stage-1 ones (prefixed `s1_`), and the
    replay oracle over the same actions."""
    from specpilot.envs.replay import replay_oracle
    from specpilot.policies.ppo import load_run_controllers

    run_dir = Path(run_dir)
    traces = TaskTraces.resolve(traces)
    model = ReplayModel(getattr(traces, split))
    ar = replay_ar(model)
    static_cfg = static_config(run_dir, static)
    out: dict[str, dict] = {"static": evaluate_replay(FixedController(*static_cfg), model, ar["tokens_per_s"])}
    out["static"]["config"] = list(static_cfg)
    sets = [("", run_dir)]
    if include_stage1 and (run_dir / "stage1" / "policies.json").is_file():
        sets.append(("s1_", run_dir / "stage1"))
    size_actions = None
    for prefix, d in sets:
        if not (d / "policies.json").is_file():
            continue
        for name, ctrl in load_run_controllers(d).items():
            out[prefix + name] = evaluate_replay(ctrl, model, ar["tokens_per_s"])
            size_actions = size_actions or getattr(ctrl, "size_actions", None)
    oracle = replay_oracle(model, sizes=size_actions or _size_actions(model, None))
    out["oracle"] = {**oracle["oracle"], "speedup": oracle["oracle"]["tokens_per_s"] / ar["tokens_per_s"]}
    out["replay_best_static"] = {**oracle["best_static"],
                                 "speedup": oracle["best_static"]["tokens_per_s"] / ar["tokens_per_s"]}
    out["ar"] = ar
    return out


def evaluate_live(pair, controllers: dict[str, Controller], prompts: Sequence, *, tree: TreeConfig,
                  max_new_tokens: int = 64, repeats: int = 1, warmup: int = 1, progress: bool = False) -> dict:
    """Live tokens/s of each controller and of autoregressive decoding on `prompts`, interleaved.

    Per (prompt, repeat) every method runs once, in an order rotated by one each time; `warmup` untimed
    generations of each method first. Time = the decoder's generation time (`GenerationOutput.total_s`, after the
    untimed prefill), which includes the controller's decision time; `policy_overhead` = policy_s / that time.
    Returns {name: {tokens_per_s, speedup, mean_accepted_length, policy_overhead, depth_mean, size_mean, ...}}.
    """
    from specpilot.drafting.decoder import SpeculativeDecoder, autoregressive_generate

    decoder = SpeculativeDecoder(pair, tree)
    names = ["ar", *controllers]
    run = {"ar": lambda p: autoregressive_generate(pair, p, max_new_tokens=max_new_tokens)}
    for name, ctrl in controllers.items():
        run[name] = lambda p, c=ctrl: decoder.generate(p, controller=c, max_new_tokens=max_new_tokens)
    ids = [pair.encode(getattr(p, "prompt", p)) for p in prompts]
    for _ in range(warmup):
        for name in names:
            run[name](ids[0])
    acc = {n: {"tokens": 0, "time_s": 0.0, "policy_s": 0.0, "cycles": 0, "depths": [], "sizes": []} for n in names}
    turn = 0
    started = time.perf_counter()
    for r in range(repeats):
        for i, p in enumerate(ids):
            order = names[turn % len(names):] + names[: turn % len(names)]
            turn += 1
            for name in order:
                out = run[name](p)
                a = acc[name]
                a["tokens"] += out.num_tokens
                a["time_s"] += out.total_s
                a["policy_s"] += out.policy_s
                a["cycles"] += len(out.cycles) if out.cycles else out.num_tokens
                a["depths"] += [c.depth for c in out.cycles]
                a["sizes"] += [c.size for c in out.cycles]
            if progress:
                print(f"  live eval: repeat {r + 1}/{repeats} prompt {i + 1}/{len(ids)} "
                      f"({time.perf_counter() - started:.0f}s)", flush=True)
    res = {}
    ar_tps = acc["ar"]["tokens"] / acc["ar"]["time_s"]
    for name in names:
        a = acc[name]
        tps = a["tokens"] / a["time_s"] if a["time_s"] > 0 else float("nan")
        res[name] = {"tokens": a["tokens"], "time_s": a["time_s"], "tokens_per_s": tps, "speedup": tps / ar_tps,
                     "mean_accepted_length": a["tokens"] / a["cycles"] if a["cycles"] else float("nan"),
                     "policy_s": a["policy_s"],
                     "policy_overhead": a["policy_s"] / a["time_s"] if a["time_s"] > 0 else float("nan"),
                     "depth_mean": float(np.mean(a["depths"])) if a["depths"] else None,
                     "size_mean": float(np.mean(a["sizes"])) if a["sizes"] else None}
    return res


def reward_ablation(
    run_dir: str | Path,
    traces: TaskTraces | str | Path,
    *,
    kind: str = "size",
    rewards: Sequence[str] = REWARD_MODES,
    steps: int = 10_000,
    static: tuple[int, int] | str | Path | None = None,
    resume: bool = False,
    seed: int = 0,
    wandb: str | None = None,
    logger=None,
    out: str | Path | None = None,
    **settings_overrides: Any,
) -> dict:
    """Train the `kind` policy once per reward mode (same budget, seed, partner) under RUN/ablation/, and report
    replay validation tokens/s, speedup, mean accepted length and mean chosen depth/size of the final policy and
    of the validation-best checkpoint; write RUN/ablation/ablation.json (or `out`).

    Partners as in stage 1: size vs random depths (validated at the static depth), depth vs the static size.
    Report the final policy to compare rewards: the best checkpoint is selected *by throughput*, which partly
    hides what a reward optimises."""
    from stable_baselines3 import PPO

    from specpilot.policies.ppo import PPOController
    from specpilot.train.ppo import read_progress

    bad = [r for r in rewards if r not in REWARD_MODES]
    if bad:
        raise ValueError(f"unknown reward mode(s) {bad}; choose from {REWARD_MODES}")
    run_dir = Path(run_dir)
    ab_dir = run_dir / "ablation"
    traces = TaskTraces.resolve(traces)
    static_cfg = static_config(run_dir, static)
    val_model = ReplayModel(traces.validation)
    ar = replay_ar(val_model)
    rows = []
    log, owned = _make_logger(ab_dir, logger, wandb, {"ablation": kind, "rewards": list(rewards), "steps": steps})
    try:
        for reward in rewards:
            stage = f"{kind}_{reward}"
            fn = train_size if kind == "size" else train_depth
            res = fn(ab_dir, traces, steps=steps, static=static_cfg, reward=reward, stage=stage, resume=resume,
                     seed=seed, logger=log, **settings_overrides)
            progress = read_progress(ab_dir / stage)
            final_zip = ab_dir / stage / "checkpoints" / progress["checkpoint"]
            row: dict[str, Any] = {"reward": reward, "stage": stage, "steps": int(progress["timesteps_done"])}
            for label, path in (("final", final_zip), ("best", res.best)):
                policy = PPO.load(path, device="cpu").policy
                fallback = FixedController(*static_cfg)
                ctrl = (PPOController(None, policy, size_spec=res.spec, size_actions=res.size_actions,
                                      fallback=fallback) if kind == "size"
                        else PPOController(policy, None, depth_spec=res.spec, fallback=fallback))
                ev = evaluate_replay(ctrl, val_model, ar["tokens_per_s"])
                row[label] = {k: ev[k] for k in ("tokens_per_s", "speedup", "mean_accepted_length", "depth_mean",
                                                 "size_mean", "cycles")}
            rows.append(row)
    finally:
        if owned:
            log.close()
    result = {"kind": kind, "steps": steps, "static": list(static_cfg), "rows": rows, "ar": ar,
              "notes": "replay on the validation trace; 'final' = policy at the end of training, 'best' = "
                       "checkpoint with the best validation throughput"}
    path = Path(out) if out is not None else ab_dir / "ablation.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=float))
    result["path"] = str(path)
    return result


def run_pipeline(
    run_dir: str | Path,
    traces: TaskTraces | str | Path,
    *,
    size_steps: int = 20_000,
    depth_steps: int = 40_000,
    coadapt_steps: int | Sequence[int] = 10_000,
    rounds: int = 3,
    static: tuple[int, int] | str | Path | None = None,
    size_actions: Sequence[int] | None = None,
    depth_range: tuple[int, int] | None = None,
    reward: str = "dinkelbach",
    resume: bool = False,
    seed: int = 0,
    wandb: str | None = None,
    **settings_overrides: Any,
) -> dict:
    """Stage 1 (size, depth) + RUN/stage1/policies.json, then `rounds` of co-adaptation (0: stage 1 only, in
    which case RUN/policies.json points at the stage-1 policies). Returns the StageResults and index paths."""
    run_dir = Path(run_dir)
    log, _ = _make_logger(run_dir, None, wandb, {"pipeline": True, "size_steps": size_steps,
                                                 "depth_steps": depth_steps, "coadapt_steps": coadapt_steps,
                                                 "rounds": rounds, "reward": reward, "seed": seed})
    try:
        size1 = train_size(run_dir, traces, steps=size_steps, static=static, size_actions=size_actions,
                           depth_range=depth_range, reward=reward, resume=resume, seed=seed, logger=log,
                           **settings_overrides)
        depth1 = train_depth(run_dir, traces, steps=depth_steps, static=static, reward=reward, resume=resume,
                             seed=seed, logger=log, **settings_overrides)
        stage1 = write_stage1_index(run_dir, depth1, size1, static)
        if rounds > 0:
            final = coadapt(run_dir, traces, rounds=rounds, steps=coadapt_steps, static=static, reward=reward,
                            resume=resume, seed=seed, logger=log, **settings_overrides)
            policies = final["policies"]
        else:
            final = None
            policies = _write_index(run_dir, depth1, size1, static_config(run_dir, static), copy=False)
    finally:
        log.close()
    return {"size_s1": size1.to_dict(), "depth_s1": depth1.to_dict(), "stage1_policies": stage1,
            "coadapt": final, "policies": policies}
