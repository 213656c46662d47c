"""Several PPO seeds of the whole pipeline, one deployed: chosen on validation, every seed reported.

    out = run_seeds("runs/r1", traces, seeds=3, size_steps=..., options=TrainOptions(...))

Each seed trains the full pipeline (`run_pipeline`) in RUN/seed<k>/ with TrainOptions.seed = base + k; the seed whose
ltd controller (both policies) replays fastest on the VALIDATION trace is deployed: its policies are copied to
RUN/policies.json (and RUN/stage1/). RUN/seeds.json records, per seed, the validation tokens/s and the ltd-vs-static
replay ratio (the static config is the grid's best: the baseline ltd must beat), and the aggregate over seeds
(median, IQM, min, max), so a verdict never rests on one lucky seed.

workers > 1 trains that many seeds at once, each in its own process (spawned, `torch` threads = this process's
threads // workers; replay backend only: live training times the decoder and must run alone). On a 2-core CPU the
small replay networks train as fast on one thread as on two, so 3 seeds on 2 workers take about two seeds' time.
A seed's result depends on its seed and its thread count, not on what runs beside it. Each worker logs to its own
seed folder (RUN/seed<k>/tb, its own wandb run) instead of a logger passed in.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specpilot.drafting.control import FixedController
from specpilot.drafting.folder_lock import grant, held_folders, holds_output
from specpilot.envs.replay import ReplayModel
from specpilot.train.rl.stages import TaskTraces, TrainOptions, static_config

SEEDS_FILE = "seeds.json"


def iqm(values) -> float:
    """Interquartile mean: the mean of the middle half (the whole sample below 4 values, as quartiles of 2-3
    values are the extremes themselves)."""
    v = np.sort(np.asarray(values, dtype=float))
    if len(v) < 4:
        return float(v.mean())
    lo, hi = int(np.floor(len(v) * 0.25)), int(np.ceil(len(v) * 0.75))
    return float(v[lo:hi].mean())


def aggregate(values) -> dict:
    v = np.asarray(values, dtype=float)
    return {"median": float(np.median(v)), "iqm": iqm(v), "min": float(v.min()), "max": float(v.max()),
            "n": int(len(v))}


def choose_seed(scores: dict[int, float]) -> int:
    """The seed with the highest validation score (the smallest seed on ties)."""
    return min(scores, key=lambda s: (-scores[s], s))


def seed_worker_count(seeds: int, cores: int) -> int:
    """Worker processes for `seeds` replay pipelines on `cores` cores (one torch thread each): the count whose
    schedule ends first, fewest processes on ties. A pipeline in replay keeps one core busy and its seeds take
    about equal time, so k of them on `cores` cores take max(1, k / cores) pipelines' time; workers take the seeds
    in waves. 3 seeds on 2 cores: 3 workers (1.5 pipelines' time) rather than 2 (two waves, one core idle in the
    second); measured on the 2-core AMD EPYC with the demo's traces (3 seeds, 2 DAgger iterations and 2 rounds of
    6k PPO steps each, alternating): 65.2 / 63.7 s against 80.8 / 76.9 s, the same policies."""
    if seeds < 1 or cores < 1:
        raise ValueError(f"seeds and cores must be >= 1, got {seeds} and {cores}")

    def makespan(workers: int) -> float:
        full, rest = divmod(seeds, workers)
        return full * max(1.0, workers / cores) + (max(1.0, rest / cores) if rest else 0.0)

    return min(range(1, seeds + 1), key=lambda w: (makespan(w), w))


def _copy_policies(src: Path, dest: Path) -> None:
    """dest/policies.json (+ zips, made relative to dest) pointing at the same policies as src/policies.json."""
    import shutil

    index = json.loads((src / "policies.json").read_text())
    dest.mkdir(parents=True, exist_ok=True)
    for kind in ("depth", "size"):
        if index.get(kind):
            name = f"{kind}.zip"
            source = Path(index[kind]["path"])
            shutil.copyfile(source if source.is_absolute() else src / source, dest / name)
            index[kind]["path"] = name
    from specpilot.train.rl.ppo import write_json

    write_json(dest / "policies.json", index)


_training_seed = False  # in a seed worker process: whether it is running a seed now (`_seed_worker_signals`)


def _train_seed(seed_dir: Path, traces: TaskTraces, options: TrainOptions, pipeline: dict, threads: int) -> None:
    """One seed's pipeline in a worker process (module level, so a spawned process can import it)."""
    import torch

    from specpilot.train.rl.pipeline import run_pipeline

    global _training_seed
    torch.set_num_threads(threads)
    _training_seed = True
    try:
        run_pipeline(seed_dir, traces, options=options, **pipeline)
    finally:
        _training_seed = False


SIGTERM_GRACE_S = 2.0  # see _seed_worker_signals
_interrupted_at: list[float] = []  # in a seed worker: when its first SIGTERM (its Ctrl-C) arrived


def _seed_worker_signals() -> None:
    """A seed worker's initializer: it ignores SIGINT and takes SIGTERM as its Ctrl-C, once. The main process
    forwards an interrupt as one SIGTERM to each worker (`_stop_workers`), so a worker is interrupted exactly once
    (train_policy saves its checkpoint) whether the terminal's Ctrl-C reached the whole process group or `kill -INT`
    reached the main process only; a second SIGINT in the group cannot cut the checkpoint's save short. A SIGTERM
    sent to the whole group (a scheduler preempting the job) reaches a worker twice, from the group and forwarded by
    the main process, within moments: a second one in the first SIGTERM_GRACE_S seconds is that echo and is ignored;
    a later one ends the worker at once."""
    import os
    import signal
    import time

    def interrupt(signum, frame):
        if not _training_seed:  # idle between seeds: the pool's shutdown ends it cleanly
            return
        if _interrupted_at:
            if time.monotonic() - _interrupted_at[0] < SIGTERM_GRACE_S:
                return
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the worker at once
            os.kill(os.getpid(), signal.SIGTERM)
            return
        _interrupted_at.append(time.monotonic())
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, interrupt)


def _watch_parent(parent: int, every_s: float = 0.5) -> None:
    """A seed worker whose main process died (kill -9) stops as if interrupted: a training seed saves its checkpoint
    and ends, then the worker exits; an idle one exits at once. Orphans trained on into a run folder that nobody
    held any more, beside the next run let in."""
    import os
    import signal
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        if _training_seed and not _interrupted_at:  # (an interrupted one is saving its checkpoint already)
            os.kill(os.getpid(), signal.SIGTERM)  # the worker's Ctrl-C: its stage saves a checkpoint
        while _training_seed:
            time.sleep(0.1)
        os._exit(1)

    threading.Thread(target=watch, name="specpilot-parent-watch", daemon=True).start()


def _seed_worker_init(held: dict[str, int]) -> None:
    """A seed worker's initializer: its signals (`_seed_worker_signals`), the run folder its main process holds
    (`folder_lock.grant`: it writes its seed's folder inside it), and a watch on the main process."""
    import os

    _seed_worker_signals()
    grant(held)
    _watch_parent(os.getppid())


def _stop_workers(pool) -> None:
    """Interrupt every live worker process of `pool` (SIGTERM: their Ctrl-C, see `_seed_worker_signals`)."""
    import os
    import signal

    for pid, process in list((getattr(pool, "_processes", None) or {}).items()):
        if process.is_alive():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:  # it ended meanwhile
                pass


def _train_in_processes(jobs: list[tuple[Path, TrainOptions]], traces: TaskTraces, pipeline: dict,
                        workers: int, progress=None) -> None:
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import torch

    threads = max(1, torch.get_num_threads() // workers)
    pipeline = {k: v for k, v in pipeline.items() if k != "logger"}  # each worker logs to its own seed folder
    context = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_seed_worker_init,
                             initargs=(held_folders(),)) as pool:
        started = time.monotonic()
        futures = {pool.submit(_train_seed, seed_dir, traces, options, pipeline, threads): (seed_dir, options.seed)
                   for seed_dir, options in jobs}
        if progress:
            progress(f"training seeds {', '.join(str(o.seed) for _, o in jobs)} on {workers} worker processes "
                     f"({threads} torch thread(s) each; logs in each seed's folder)")
        try:
            for future in as_completed(futures):
                future.result()  # the first failure (or Ctrl-C) stops the others; finished stages stay for --resume
                if progress:
                    seed_dir, seed = futures[future]
                    progress(f"seed {seed} trained ({seed_dir}, {time.monotonic() - started:.0f} s)")
        except BaseException as err:
            for future in futures:
                future.cancel()
            if isinstance(err, KeyboardInterrupt):  # the workers ignore SIGINT: pass it on, then wait for their saves
                _stop_workers(pool)
            raise


@holds_output("run_dir", what="run folder")
def run_seeds(run_dir: str | Path, traces: TaskTraces | str | Path, *, seeds: int = 3,
              options: TrainOptions | None = None, workers: int = 1, progress=None, **pipeline) -> dict:
    """`seeds` full pipelines (seed = options.seed + k) in RUN/seed<k>/, the best on validation deployed (see the
    module docstring; `workers` > 1: that many seeds at once, in separate processes, replay backend only).
    `progress`: called with a line when the workers start and as each seed finishes. `pipeline`: run_pipeline's
    keyword arguments. Returns the RUN/seeds.json content."""
    from specpilot.policies.ppo import load_run_controllers
    from specpilot.train.rl.pipeline import run_pipeline
    from specpilot.train.rl.ppo import update_manifest, write_json
    from specpilot.train.rl.validation import evaluate_replay

    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    run_dir, options = Path(run_dir), options or TrainOptions()
    traces = TaskTraces.resolve(traces)
    static = static_config(run_dir, options.static)  # fixed once: the seed directories hold no grid.json
    val = ReplayModel(traces.validation)
    static_val = evaluate_replay(FixedController(*static), val)["tokens_per_s"]
    jobs = [(run_dir / f"seed{k}", dataclasses.replace(options, seed=options.seed + k, static=static))
            for k in range(seeds)]
    workers = min(workers, seeds)
    if workers > 1 and options.backend == "replay" and options.pair is None and options.cluster is None:
        _train_in_processes(jobs, traces, pipeline, workers, progress)
    else:
        for seed_dir, seed_options in jobs:
            run_pipeline(seed_dir, traces, options=seed_options, **pipeline)
    per_seed = []
    for seed_dir, seed_options in jobs:
        ltd = load_run_controllers(seed_dir)["ltd"]
        score = evaluate_replay(ltd, val)["tokens_per_s"]
        per_seed.append({"seed": seed_options.seed, "dir": str(seed_dir), "val_tokens_per_s": score,
                         "ltd_vs_static": score / static_val})
    chosen = choose_seed({s["seed"]: s["val_tokens_per_s"] for s in per_seed})
    chosen_dir = Path(next(s["dir"] for s in per_seed if s["seed"] == chosen))
    _copy_policies(chosen_dir, run_dir)
    if (chosen_dir / "stage1" / "policies.json").is_file():
        _copy_policies(chosen_dir / "stage1", run_dir / "stage1")
    out = {"seeds": per_seed, "chosen": chosen, "chosen_dir": str(chosen_dir), "static": list(static),
           "static_val_tokens_per_s": static_val, "split": "validation",
           "ltd_vs_static": aggregate([s["ltd_vs_static"] for s in per_seed])}
    write_json(run_dir / SEEDS_FILE, out)
    update_manifest(run_dir, seeds_run={"chosen": chosen, "n": seeds})
    return out


def read_seeds(run_dir: str | Path) -> dict:
    """RUN/seeds.json as `run_seeds` writes it; InputFileError naming the file when it is unreadable or damaged
    (a field missing or of another type)."""
    from specpilot.drafting.errors import InputFileError
    from specpilot.drafting.files import read_json

    path = Path(run_dir) / SEEDS_FILE
    fix = "restore it, or train the seeds again (`specpilot train all --seeds N`, the demo's train stage)"
    info = read_json(path, what="seeds record", fix=fix)
    seeds = info.get("seeds")
    ok = (isinstance(seeds, list) and seeds and all(isinstance(s, dict) and isinstance(s.get("dir"), str)
                                                     and "seed" in s for s in seeds)
          and isinstance(info.get("static"), list) and len(info["static"]) == 2 and "chosen" in info)
    if not ok:
        raise InputFileError(f"{path} is damaged (it needs 'seeds': a list of {{'seed', 'dir'}}, 'static': "
                             f"[depth, size] and 'chosen'); {fix}")
    return info


def evaluate_seeds(run_dir: str | Path, trace: str | Path, *, static: tuple[int, int] | None = None,
                   prompts: Sequence[int] | None = None) -> dict:
    """Replay ltd-vs-static ratio of every seed of a `run_seeds` run on any trace (e.g. held-out prompts; only
    `prompts` of it when given, e.g. those whose output is not degenerate) and their aggregate:
    {"seeds": [{"seed", "ltd_tokens_per_s", "ltd_vs_static"}], "ltd_vs_static": aggregate}."""
    from specpilot.policies.ppo import load_run_controllers
    from specpilot.train.rl.validation import evaluate_replay

    run_dir = Path(run_dir)
    info = read_seeds(run_dir)
    static = tuple(static or info["static"])
    model = ReplayModel(trace)
    base = evaluate_replay(FixedController(*static), model, prompts=prompts)["tokens_per_s"]
    rows = []
    for s in info["seeds"]:
        ltd = evaluate_replay(load_run_controllers(s["dir"])["ltd"], model, prompts=prompts)["tokens_per_s"]
        rows.append({"seed": s["seed"], "ltd_tokens_per_s": ltd, "ltd_vs_static": ltd / base,
                     "chosen": s["seed"] == info["chosen"]})
    return {"seeds": rows, "static": list(static), "static_tokens_per_s": base,
            "ltd_vs_static": aggregate([r["ltd_vs_static"] for r in rows])}
