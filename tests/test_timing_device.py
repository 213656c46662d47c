"""Clock reads wait for the pair's own GPU: `torch.cuda.synchronize()` with no argument waits for the current device
(cuda:0), so a pair on cuda:1 would be timed before its kernels finished. The CUDA calls are recorded instead of
run (CI has no GPU)."""
from __future__ import annotations

import pytest
import torch

from specpilot.drafting.timing import Clock, synchronize, timed
from specpilot.eval import rounds
from specpilot.eval.hf_baselines import TimingStreamer


@pytest.fixture
def cuda_calls(monkeypatch):
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: calls.append(("reset_peak", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device=None: calls.append(("peak", device)) or 2 ** 21)
    return calls


@pytest.mark.parametrize("device", ["cuda:1", "cuda:0", "cuda"])
def test_every_clock_waits_for_the_pairs_device(device, cuda_calls):
    want = torch.device(device)
    Clock(device).now()
    synchronize(device)
    timed(lambda: None, device)  # two reads
    rounds._sync(want)
    streamer = TimingStreamer(0.0, want)
    streamer.put(torch.tensor([[1, 2]]))  # the prompt: skipped
    streamer.put(torch.tensor([3]))
    with rounds.MemoryMonitor(want) as memory:
        memory.begin()
        assert memory.end() == 2.0
    assert cuda_calls == [("synchronize", want)] * 6 + [("reset_peak", want), ("peak", want)]
    assert streamer.token_times and len(streamer.token_times) == 1


def test_cpu_clocks_wait_for_nothing(cuda_calls):
    Clock("cpu").now()
    synchronize("cpu")
    rounds._sync(torch.device("cpu"))
    TimingStreamer(0.0, torch.device("cpu")).put(torch.tensor([1]))
    assert cuda_calls == []


def _allocate_and_touch(megabytes: int) -> bytearray:
    block = bytearray(megabytes * 2 ** 20)
    block[::4096] = b"\x01" * len(block[::4096])  # touch every page: RSS, not just address space
    return block


@pytest.mark.skipif(not rounds.MemoryMonitor._reset_kernel_peak(), reason="no kernel peak-RSS mark to reset here")
def test_cpu_peak_memory_is_the_kernels_high_water_mark_without_a_sampling_thread():
    with rounds.MemoryMonitor(torch.device("cpu")) as memory:
        assert memory.kernel_peak and memory._thread is None  # nothing runs beside the timed call
        memory.begin()
        before = memory.end()
        block = _allocate_and_touch(64)
        del block  # freed before end(): only a high-water mark (or a lucky sample) still sees it
        peak = memory.end()
        memory.begin()  # reset: the freed block no longer counts
        after = memory.end()
    assert peak >= before + 60
    assert after < peak - 60
    assert "high-water" in rounds.MemoryMonitor.source("cpu")


def test_cpu_peak_memory_falls_back_to_sampling_where_the_kernel_keeps_no_mark(monkeypatch):
    monkeypatch.setattr(rounds.MemoryMonitor, "CLEAR_REFS", "/nonexistent/clear_refs")
    with rounds.MemoryMonitor(torch.device("cpu"), interval_s=0.001) as memory:
        assert not memory.kernel_peak and memory._thread is not None
        memory.begin()
        block = _allocate_and_touch(64)
        peak = memory.end()
        del block
    assert peak >= memory._rss_mb() - 1 and peak > 60
    assert rounds.MemoryMonitor.source("cpu") == "process RSS, sampled"
