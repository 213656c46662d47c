"""Executors: where the work units of `record_task`, `grid_search` and `evaluate` run, in this process or on Ray.

    outcomes = executor.map(record_shard, [ShardTask(0, {"prompts": [...], ...}, prompts=[0, 1]), ...],
                            on_done=write_shard, progress=print)

An orchestrator splits its job into tasks, calls `executor.map(fn, tasks)` and merges the results; it is the same
code whichever executor runs the tasks, so it writes the same files. A work unit is a module-level function
`fn(worker, **payload)`: `worker.pair` is the worker's ModelPair, `worker.index` its number, `worker.first(what)`
is True the first time the worker's process does `what` (its warm-up) and `worker.say(msg)` reports progress.

- `LocalExecutor(pair)`: one worker, this process, tasks in order; a task that raises stops the job.
- `specpilot.train.scale.cluster.WorkerPool`: N Ray actors, each with its own pair on its own device; the next idle
  worker takes the next task, a failed task is retried once (`ShardOutcome.retried`).

Both give `len(executor)` (workers), `executor.workers` (one description per worker: device, host, ...) and
`executor.device` (the workers' device kind, e.g. for the default size actions).
"""
from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence


@dataclass
class ShardTask:
    """One unit of work: `payload` is the work function's keyword arguments, `prompts` the indices (into the
    caller's prompt list) it covers, for the report of retried prompts."""

    shard: int
    payload: dict
    prompts: list[int] = field(default_factory=list)


@dataclass
class ShardOutcome:
    """What a task returned, which worker ran it (its description), and the failure it was retried after."""

    shard: int
    result: Any
    worker: dict
    attempts: int = 1
    retried: str | None = None


class Executor(Protocol):
    workers: list[dict]

    def __len__(self) -> int: ...

    @property
    def device(self) -> str: ...

    def map(self, fn: Callable[..., Any], tasks: list[ShardTask], *,
            on_done: Callable[[ShardTask, ShardOutcome], None] | None = None,
            progress: Callable[[str], None] | None = None) -> list[ShardOutcome]: ...


def describe_worker(pair, index: int, *, gpu_ids: Sequence[str] = (), node_ip: str | None = None) -> dict:
    """Where a worker runs: its number, device (and GPU name), dtype, host, pid, torch threads and its small-row
    linear choice (`linear_kernels.describe`: measured in the worker's own process, at its thread count); the same
    keys in this process and on Ray, where `gpu_ids` and `node_ip` are filled in."""
    import torch

    from specpilot.drafting.linear_kernels import describe

    device = pair.device
    return {"worker": index, "device": str(device), "dtype": str(pair.dtype).replace("torch.", ""),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "gpu_ids": list(gpu_ids), "host": socket.gethostname(), "node_ip": node_ip, "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(), "pair": pair.identity(),
            "small_row_linears": describe([getattr(pair, k, None) for k in ("target", "draft", "eagle")])}


class LocalExecutor:
    """This process as the one worker of the job: `fn(self, **payload)` for each task, in order."""

    def __init__(self, pair) -> None:
        self.pair, self.index = pair, 0
        self._warm: set[str] = set()
        self._say: Callable[[str], None] = lambda msg: None
        self._workers: list[dict] | None = None

    def __len__(self) -> int:
        return 1

    @property
    def workers(self) -> list[dict]:
        if self._workers is None:
            self._workers = [describe_worker(self.pair, 0)]
        return self._workers

    @property
    def device(self) -> str:
        return str(self.pair.device)

    def first(self, what: str) -> bool:
        """True the first time this process does `what` (its warm-up is then run, and not kept)."""
        first = what not in self._warm
        self._warm.add(what)
        return first

    def say(self, msg: str) -> None:
        self._say(msg)

    def map(self, fn: Callable[..., Any], tasks: list[ShardTask], *,
            on_done: Callable[[ShardTask, ShardOutcome], None] | None = None,
            progress: Callable[[str], None] | None = None) -> list[ShardOutcome]:
        self._say = progress or (lambda msg: None)
        outcomes, started = [], time.perf_counter()
        for task in tasks:
            outcome = ShardOutcome(task.shard, fn(self, **task.payload), self.workers[0])
            outcomes.append(outcome)
            if on_done is not None:
                on_done(task, outcome)
            if len(tasks) > 1:
                self._say(f"shard {task.shard} done ({len(outcomes)}/{len(tasks)}, "
                          f"{time.perf_counter() - started:.1f}s)")
        return outcomes


def as_executor(pair=None, executor: Executor | None = None) -> Executor | None:
    """`executor`, else a LocalExecutor on `pair`, else None (neither given); both given is an error."""
    if pair is not None and executor is not None:
        raise ValueError("give pair= (run in this process) or executor= (e.g. a Ray WorkerPool), not both")
    return executor if executor is not None else (LocalExecutor(pair) if pair is not None else None)


def _count_tokens(worker, prompts: list[str]) -> dict:
    """Work unit of `prompt_lengths`: each prompt's token count and the context of the worker's pair."""
    return {"lengths": [len(worker.pair.encode(p)) for p in prompts], "context": int(worker.pair.max_context)}


def prompt_lengths(executor: Executor, prompts: Sequence[str]) -> tuple[dict[str, int], int]:
    """({prompt: token count}, the models' context), counted by a worker of `executor` with the pair that will
    decode them: in this process for a LocalExecutor, on a Ray worker for a WorkerPool (the driver may have no pair),
    so a command refuses prompts too long for the context before any work either way (`checks.check_prompt_lengths`).
    """
    prompts = list(dict.fromkeys(prompts))
    [outcome] = executor.map(_count_tokens, [ShardTask(0, {"prompts": prompts})])
    return dict(zip(prompts, outcome.result["lengths"])), outcome.result["context"]


def shard_ranges(n: int, workers: int, shard_size: int | None = None) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) prompt ranges. Default size ceil(n / (4 * workers)): several shards per worker, so fast
    workers take more and a resumed run loses little."""
    if n < 1:
        raise ValueError("no prompts to shard")
    size = int(shard_size) if shard_size else max(1, math.ceil(n / (4 * max(1, workers))))
    if size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def assign_groups(prompts: Sequence, workers: int, *, by_group: bool = True) -> list[list[int]]:
    """Prompt indices per worker. by_group: whole (task, language) groups, largest first onto the least-loaded
    worker (ties: the lower worker); else single prompts the same way. Each worker's list keeps prompt order;
    workers without a group get []."""
    groups: dict[Any, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault((getattr(p, "task", ""), getattr(p, "language", "")) if by_group else i, []).append(i)
    load: list[list[int]] = [[] for _ in range(workers)]
    for members in sorted(groups.values(), key=lambda m: (-len(m), m[0])):
        target = min(range(workers), key=lambda w: (len(load[w]), w))
        load[target].extend(members)
    return [sorted(x) for x in load]


def shard_report(tasks: Sequence[ShardTask], outcomes: Sequence[ShardOutcome], *, unit: str) -> dict:
    """Which worker ran which shard (the per-worker detail of a job's files), and the prompts that were retried."""
    return {"unit": unit, "workers": len({o.worker["worker"] for o in outcomes}),
            "shards": [{"shard": t.shard, "worker": o.worker["worker"], "device": o.worker["device"],
                        "prompts": t.prompts, "attempts": o.attempts, "retried": o.retried}
                       for t, o in zip(tasks, outcomes)],
            "retried_prompts": sorted(j for t, o in zip(tasks, outcomes) if o.retried for j in t.prompts)}
