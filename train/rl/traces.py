"""The replay data of a training run: traces of the training and validation prompts (`record_traces`).

    RUN/traces/{train,validation}/   trace.npz, trace.json, profile.json (`specpilot.envs.record.record_task`),
                                     ar.json (live autoregressive timing of the same prompts, `specpilot.envs.shards.measure_ar`)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specpilot.artifacts.trace import AR_FILE, is_trace  # noqa: F401 (AR_FILE re-exported)
from specpilot.drafting.types import TreeConfig
from specpilot.policies.observation import default_size_actions


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
            if not is_trace(part):
                raise FileNotFoundError(f"no trace at {part}: record the train and validation traces first "
                                        "(`record_traces(...)` or `specpilot record --suite train|validation`)")
        return out


def record_traces(pair, out_dir: str | Path, *, train_prompts: Sequence, val_prompts: Sequence,
                  tree: TreeConfig | None = None, max_new_tokens: int = 64, profile_prompts: int | None = 8,
                  profile_cycles: int = 0, seed: int = 0, progress: bool = False, executor=None) -> TaskTraces:
    """Record out_dir/train and out_dir/validation (trace + latency profile + live AR timing, `ar.json`) on `pair`
    in this process or on `executor` (e.g. a Ray WorkerPool; `specpilot.envs.record.record_task`).

    Prompts are strings or token-id lists (callers resolve suite names: `specpilot.eval.suites.load_suite`); the
    recorded tree defaults to TreeConfig with max_size raised to the largest size action of the device.
    Held-out prompts never belong here.
    """
    from specpilot.drafting.executor import as_executor
    from specpilot.envs.record import record_task

    executor = as_executor(pair, executor)
    if tree is None:
        tree = TreeConfig(max_size=max(TreeConfig().max_size, *default_size_actions(executor.device)))
    out = TaskTraces(Path(out_dir) / "train", Path(out_dir) / "validation")
    for prompts, path in ((train_prompts, out.train), (val_prompts, out.validation)):
        prompts = [getattr(p, "prompt", p) for p in prompts]
        record_task(None, tree, prompts, path, max_new_tokens=max_new_tokens, profile_prompts=profile_prompts,
                    profile_cycles=profile_cycles, seed=seed, progress=progress, executor=executor, ar=True)
    return out
