"""Local worker processes that each hold their own model pair: an executor for work that reads no clock.

    with ProcessPool(PairSpec(dtype="float32"), workers=2) as pool:
        record_task(pair, tree, prompts, "out/", trace_workers=pool)   # traces on 2 processes, timing here alone

Batch-1 decoding of a small pair on a CPU runs about as fast on one torch thread as on two (the embedded pair,
2-core AMD EPYC: 3.5 s a trace prompt on one thread, 3.7 s on two), so two one-thread processes side by side record
about 1.8x as many trace prompts a second as one process (3.97 s a prompt each). Their clocks are not trusted:
processes that share the cores slow each other, so latency profiles and AR timings are measured by one process alone
(`specpilot.envs.record.record_task(trace_workers=...)`).

`ProcessPool` speaks the executor protocol of `specpilot.drafting.executor` (as the Ray `WorkerPool` does):
`map(fn, tasks)` runs `fn(worker, **payload)` on the next idle process, `worker.pair` is that process's pair. The
processes are spawned (a fork of a process holding torch threads can deadlock), load their pair once at start
(all at once, so a pair that cannot load fails here, in one line), ignore Ctrl-C (the main process stops them: work
finished so far was handed back already) and exit when the main process dies. A task that raises stops the job; no
retry (a failure on this machine repeats).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

from specpilot.drafting.executor import ShardOutcome, ShardTask, describe_worker
from specpilot.train.scale.cluster import PairSpec

START_TIMEOUT_S = 900.0  # a process that has not loaded its pair by then (others waiting on it) fails the start


class _ProcessWorker:
    """The worker object of one pool process: its pair, number, warm-ups and progress lines."""

    def __init__(self, spec: PairSpec, index: int) -> None:
        self.spec, self.index = spec, index
        self.pair = spec.load()
        self._warm: set[str] = set()

    def first(self, what: str) -> bool:
        """True the first time this process does `what` (its warm-up is then run, and not kept)."""
        first = what not in self._warm
        self._warm.add(what)
        return first

    def say(self, msg: str) -> None:
        print(f"[worker {self.index}]", msg, flush=True)


_WORKER: _ProcessWorker | None = None  # in a pool process: its worker (made by _start)
_SETUP: tuple | None = None  # in a pool process: (spec, index, barrier), set by _init


def _init(spec: PairSpec, counter, barrier, parent: int) -> None:
    """Initializer of a pool process: its number, Ctrl-C left to the main process, a watch on the main process."""
    import signal

    global _SETUP
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    _SETUP = (spec, index, barrier)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:  # an orphan (its main process killed) would otherwise decode on for nobody
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="specpilot-pool-watch", daemon=True).start()


def _start() -> dict:
    """First task of every process: load the pair, wait until every process has (so each start task ran in a
    process of its own), describe the worker."""
    global _WORKER
    spec, index, barrier = _SETUP
    try:
        _WORKER = _ProcessWorker(spec, index)
    except BaseException:
        barrier.abort()  # the others stop waiting at once: the pool fails with this error, not a timeout
        raise
    barrier.wait(START_TIMEOUT_S)
    return describe_worker(_WORKER.pair, index)


def _run(fn: Callable[..., Any], payload: dict) -> tuple[Any, dict]:
    return fn(_WORKER, **payload), describe_worker(_WORKER.pair, _WORKER.index)


class ProcessPool:
    """`workers` spawned processes on this machine, each loading `spec`'s pair with `spec.threads` torch threads.

    Use it as a context manager (or call `close()`): the processes end with it."""

    def __init__(self, spec: PairSpec, workers: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        if int(workers) < 1:
            raise ValueError(f"ProcessPool needs at least 1 worker, got {workers}")
        self.spec = spec
        self._interrupted = True  # until the processes have started (then: whether a job stopped midway)
        context = multiprocessing.get_context("spawn")
        self._sync = (context.Value("i", 0), context.Barrier(int(workers)))
        self._pool = ProcessPoolExecutor(max_workers=int(workers), mp_context=context, initializer=_init,
                                         initargs=(spec, *self._sync, os.getpid()))
        try:
            futures = [self._pool.submit(_start) for _ in range(int(workers))]
            errors = [err for f in futures if (err := f.exception()) is not None]
            if errors:  # the load error itself, not the others' broken barrier
                raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
            self.workers: list[dict] = sorted((f.result() for f in futures), key=lambda w: w["worker"])
            self._interrupted = False
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.workers)

    @property
    def device(self) -> str:
        return str(self.workers[0]["device"])

    def map(self, fn: Callable[..., Any], tasks: list[ShardTask], *,
            on_done: Callable[[ShardTask, ShardOutcome], None] | None = None,
            progress: Callable[[str], None] | None = None) -> list[ShardOutcome]:
        """Run `fn(worker, **task.payload)` for every task on the next idle process; `on_done` is called in this
        process as each finishes (in finishing order); the outcomes come back in task order."""
        from concurrent.futures import as_completed

        say = progress or (lambda msg: None)
        futures = {self._pool.submit(_run, fn, task.payload): task for task in tasks}
        outcomes: dict[int, ShardOutcome] = {}
        started = time.perf_counter()
        try:
            for future in as_completed(futures):
                task = futures[future]
                result, worker = future.result()
                outcomes[task.shard] = outcome = ShardOutcome(task.shard, result, worker)
                if on_done is not None:
                    on_done(task, outcome)
                if len(tasks) > 1:
                    say(f"shard {task.shard} done on worker {worker['worker']} ({len(outcomes)}/{len(tasks)}, "
                        f"{time.perf_counter() - started:.1f}s)")
        except BaseException:
            self._interrupted = True  # a task may still run: close() ends the processes instead of waiting
            for future in futures:
                future.cancel()
            raise
        return [outcomes[task.shard] for task in tasks]

    def close(self) -> None:
        """End the processes: at once after a job that stopped midway (a task still running is lost; the finished
        ones were handed back), else cleanly."""
        if not self._interrupted:
            self._pool.shutdown(wait=True)
            return
        processes = list((getattr(self._pool, "_processes", None) or {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(timeout=10)

    def __enter__(self) -> "ProcessPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pair_bytes(pair) -> int:
    """Bytes of the pair's weights as loaded (target, draft LM or EAGLE-3 head; a shared tensor counted once)."""
    import torch

    seen: set[int] = set()
    total = 0
    for model in (getattr(pair, "target", None), getattr(pair, "draft", None), getattr(pair, "eagle", None)):
        if isinstance(model, torch.nn.Module):
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.numel() * tensor.element_size()
    return total


MEMORY_SHARE = 0.5  # of the memory available now, what the recording processes' pairs may take together


def trace_worker_count(pair, *, cores: int | None = None, available: int | None = None) -> tuple[int, str]:
    """(processes that may record traces side by side for `pair` here, why): one per usable core on a CPU while
    their copies of the pair fit MEMORY_SHARE of the available memory; 0 on an accelerator (the processes would
    queue on one device), on one core, or when fewer than two copies fit."""
    from specpilot.drafting.cliargs import usable_cores
    from specpilot.drafting.pair import available_memory

    if pair.device.type != "cpu":
        return 0, f"decoding on {pair.device}: processes would share one device"
    cores = usable_cores() if cores is None else int(cores)
    if cores < 2:
        return 0, "one usable core"
    available = available_memory() if available is None else available
    need = max(1, pair_bytes(pair))
    fit = cores if available is None else int(MEMORY_SHARE * available // need)
    if fit < 2:
        return 0, (f"two more copies of the pair ({need / 2**30:.1f} GiB each) would take over "
                   f"{MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB available")
    count = min(cores, fit)
    return count, f"{count} of {cores} usable cores" + (f" (memory for {fit} copies of the pair)" if fit < cores
                                                         else "")
