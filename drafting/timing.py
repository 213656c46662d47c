"""Honest wall-clock timing: perf_counter, with device synchronisation before every read on CUDA."""
from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait until `device` finished its queued work (nothing to wait for on CPU). The device itself, not the current
    one: `torch.cuda.synchronize()` waits for cuda:0 while a pair on cuda:1 is still running."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """`now()` returns perf_counter() after the device finished all queued work (a no-op sync on CPU)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def timed(fn, device: torch.device | str | None = None):
    """(fn(), seconds) on `Clock` reads (default device: CUDA when there is one, so its queued work is counted)."""
    clock = Clock(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    start = clock.now()
    out = fn()
    return out, clock.now() - start
