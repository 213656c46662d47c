"""The replay data of a training run: traces of the training and validation prompts (`record_traces`).

    RUN/traces/{train,validation}/   trace.npz, trace.json, profile.json (`specpilot.envs.record.record_task`),
                                     ar.json (live autoregressive timing of the same prompts, `specpilot.envs.shards.measure_ar`)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specpilot.artifacts.contract import (PROFILE_CONTRACT, TRACE_CONTRACT, profile_fields, refuse_differences,
                                         trace_fields)
from specpilot.artifacts.profile import PROFILE_FILE, profile_path
from specpilot.artifacts.trace import AR_FILE, TraceHeader, is_trace  # noqa: F401 (AR_FILE re-exported)
from specpilot.drafting.files import read_json
from specpilot.drafting.types import TreeConfig
from specpilot.policies.observation import default_size_actions


@dataclass(frozen=True)
class TaskTraces:
    """The replay data of a run: a trace of the training prompts and one of the validation prompts."""

    train: Path
    validation: Path

    @classmethod
    def resolve(cls, traces: "TaskTraces | str | Path") -> "TaskTraces":
        """A TaskTraces, or a directory holding train/ and validation/ trace directories; ContractError when the
        validation trace or a profile beside either trace was not made like the training trace
        (`check_traces_agree`)."""
        if isinstance(traces, TaskTraces):
            check_traces_agree(traces)
            return traces
        root = Path(traces)
        out = cls(root / "train", root / "validation")
        for part in (out.train, out.validation):
            if not is_trace(part):
                raise FileNotFoundError(f"no trace at {part}: record the train and validation traces first "
                                        "(`record_traces(...)` or `specpilot record --suite train|validation`)")
        check_traces_agree(out)
        return out


def check_traces_agree(traces: TaskTraces) -> None:
    """ContractError, before anything is trained, when the validation trace or the profile.json beside either trace
    differs from the training trace in a contract field (pair, dtype, tree, budget, temperature): training would
    validate on another tree, or time replay with another pair's or tree's latencies. The message names the file
    and each differing field with both values. Files missing here are left to the loaders' own errors."""
    if not (traces.train / "trace.json").is_file():
        return
    train = trace_fields(TraceHeader.load(traces.train))
    expected = f"the training trace {traces.train}"
    if (traces.validation / "trace.json").is_file():
        refuse_differences(train, trace_fields(TraceHeader.load(traces.validation)), TRACE_CONTRACT,
                           given=f"the validation trace {traces.validation}", expected=expected,
                           fix="record both splits with one pair and the same --width/--max-depth/--max-size/"
                               "--max-new-tokens (`specpilot record --suite train|validation`)")
    for split in (traces.train, traces.validation):
        if profile_path(split).is_file():
            refuse_differences(train, profile_fields(profile_path(split)), PROFILE_CONTRACT,
                               given=f"the latency profile {profile_path(split)}", expected=expected,
                               fix=f"keep the {PROFILE_FILE} that `specpilot record` wrote with that trace "
                                   "(or record the trace again: it measures a new one)")


def record_traces(pair, out_dir: str | Path, *, train_prompts: Sequence, val_prompts: Sequence,
                  tree: TreeConfig | None = None, max_new_tokens: int = 64, profile_prompts: int | None = 8,
                  profile_cycles: int = 0, seed: int = 0, progress: bool = False, executor=None,
                  trace_workers=None, shared_profile: bool = False) -> TaskTraces:
    """Record out_dir/train and out_dir/validation (trace + latency profile + live AR timing, `ar.json`) on `pair`
    in this process or on `executor` (e.g. a Ray WorkerPool; `specpilot.envs.record.record_task`); `trace_workers`
    (a `specpilot.train.scale.processes.ProcessPool`) records the traces side by side and leaves the timing to
    `pair` / `executor` alone. shared_profile: the latency profile and AR timing are measured once, with the train
    split, and the validation split gets a copy (meta "shared_from"): one cost model of the machine behind grid
    search, training and validation (the demo's cost check refreshes both with one measurement too), one
    measurement less (~1 min of the demo on the 2-core CPU).

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
                    profile_cycles=profile_cycles, seed=seed, progress=progress, executor=executor, ar=True,
                    trace_workers=trace_workers, measure=not (shared_profile and path == out.validation))
    if shared_profile:
        share_profile(out.train, out.validation)
    return out


def share_profile(source: Path, to: Path) -> None:
    """Copy source's profile.json and ar.json to the trace folder `to`, each marked with where it was measured."""
    from specpilot.drafting.files import atomic_write_json
    from specpilot.envs.profile import LatencyProfile

    profile = LatencyProfile.load(profile_path(source))
    profile.meta["shared_from"] = str(source)
    profile.save(profile_path(to))
    if (source / AR_FILE).is_file():
        ar = read_json(source / AR_FILE, what="AR timing (ar.json)", fix="record the traces again")
        atomic_write_json(to / AR_FILE, {**ar, "shared_from": str(source)})
