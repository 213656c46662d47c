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
