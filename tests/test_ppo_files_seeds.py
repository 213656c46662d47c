"""Seed worker processes take an interrupt only from the main process (`_stop_workers`), exactly once: a SIGINT of
the terminal's process group does not reach them twice, and `kill -INT <main pid>` still stops them."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from specpilot.train.rl import seeds


def train_until_interrupted(folder: str) -> None:
    """A stand-in for one seed's training: runs until interrupted, then says so (as train_policy saves a checkpoint)."""
    seeds._training_seed = True
    (Path(folder) / f"started-{os.getpid()}").touch()
    try:
        while True:
            time.sleep(0.01)
    except KeyboardInterrupt:
        (Path(folder) / f"interrupted-{os.getpid()}").touch()
        raise


def wait_for(folder: Path, prefix: str, count: int, timeout_s: float = 60.0) -> list[Path]:
    deadline = time.monotonic() + timeout_s
    while len(found := list(folder.glob(f"{prefix}-*"))) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_workers_ignore_sigint_and_stop_once_when_the_main_process_is_interrupted(tmp_path):
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=context, initializer=seeds._seed_worker_signals) as pool:
        futures = [pool.submit(train_until_interrupted, str(tmp_path)) for _ in range(2)]
        assert len(wait_for(tmp_path, "started", 2)) == 2
        for pid in list(pool._processes):
            os.kill(pid, signal.SIGINT)  # the terminal's Ctrl-C reaches the whole group: the main process handles it
        time.sleep(0.3)
        assert not list(tmp_path.glob("interrupted-*"))
        seeds._stop_workers(pool)
        for future in futures:
            with pytest.raises(KeyboardInterrupt):
                future.result(timeout=60)
    assert len(list(tmp_path.glob("interrupted-*"))) == 2


def test_a_sigterm_to_the_whole_group_interrupts_each_worker_once(tmp_path):
    """A scheduler's SIGTERM reaches the workers from the group and again forwarded by the main process: the echo
    inside the grace period is ignored, so the checkpoint's save is not cut short by a second signal."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=context, initializer=seeds._seed_worker_signals) as pool:
        futures = [pool.submit(train_until_interrupted, str(tmp_path)) for _ in range(2)]
        assert len(wait_for(tmp_path, "started", 2)) == 2
        for pid in list(pool._processes):
            os.kill(pid, signal.SIGTERM)  # the group's SIGTERM
        seeds._stop_workers(pool)  # the main process forwards its own at once
        for future in futures:
            with pytest.raises(KeyboardInterrupt):  # interrupted, not killed (BrokenProcessPool)
                future.result(timeout=60)
    assert len(list(tmp_path.glob("interrupted-*"))) == 2
