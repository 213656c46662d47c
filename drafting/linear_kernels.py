"""Small-row linears on CPU: the 2-8 rows of a verify block or a draft level computed as one product on every thread.

A speculative cycle feeds its models a few rows at a time: a verify forward the root and V candidates, a draft level
the beam's W nodes. On the reference machine (2-core AMD EPYC, AVX2, torch 2.13 with MKL 2024.2, 2 threads) torch's
CPU linear over 2-8 rows ran about as one thread would, while the same product taken the other way round, W @ x^T
(the rows as the narrow side of the product), used both: the embedded target's forward over 2 tokens took 13.2 ms
against 9.0 ms over one, and 8.4 ms with the product turned. With one thread the two ways cost the same; one row
(autoregressive decoding, plain steps) is left as torch computes it either way, so baselines keep their speed.

`enable_small_row_linears(model)` turns every plain `torch.nn.Linear` of `model` whose weight is large enough to
matter (>= MIN_WEIGHT_ELEMENTS, on CPU) into a `SmallRowLinear`: the same module (weights, state_dict, pickling)
whose forward takes W @ x^T for the row counts where `faster_rows()` measured it faster on this machine, at the
current thread count and dtype, and `F.linear` otherwise. The values are the same product, rounded in another
order (float round-off; greedy speculative output still equals the target's greedy output, as tests check).
`ModelPair` enables it on CPU unless asked not to (`small_row_linears=False`, or SPECPILOT_SMALL_ROW_LINEARS=0).
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

MAX_ROWS = 8  # verify blocks and draft levels of the demo's trees; longer inputs keep torch's own linear
MIN_WEIGHT_ELEMENTS = 1 << 16  # smaller layers cost less than the Python around them: not worth a branch
MIN_GAIN = 0.9  # W @ x^T taken where it measured at most 90% of F.linear's time (a near tie stays with torch)
PROBE_SHAPE = (4096, 1024)  # a 16 MB fp32 weight: past the caches, as a model's layers are during a forward
PROBE_REPEATS = 7
ENV_SWITCH = "SPECPILOT_SMALL_ROW_LINEARS"

_FASTER: dict[tuple[torch.dtype, int], frozenset[int]] = {}


def wanted(asked: bool | None) -> bool:
    """Whether to enable the small-row path: `asked`, or when None the environment (anything but "0" means yes)."""
    if asked is not None:
        return bool(asked)
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


def _timed_us(fn, order: list) -> None:
    t0 = time.perf_counter()
    fn()
    order.append(1e6 * (time.perf_counter() - t0))


def faster_rows(dtype: torch.dtype = torch.float32, threads: int | None = None) -> frozenset[int]:
    """Row counts 2..MAX_ROWS where W @ x^T measured faster than F.linear (<= MIN_GAIN of its median time) on a
    PROBE_SHAPE weight of `dtype` at `threads` (default: torch's current count); measured once per process per
    (dtype, threads), the two interleaved. One thread: none (there is no second thread to gain)."""
    threads = torch.get_num_threads() if threads is None else int(threads)
    key = (dtype, threads)
    if key in _FASTER:
        return _FASTER[key]
    if threads <= 1 or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        _FASTER[key] = frozenset()
        return _FASTER[key]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(*PROBE_SHAPE, generator=gen).to(dtype)
        chosen = set()
        with torch.inference_mode():
            for rows in range(2, MAX_ROWS + 1):
                x = torch.randn(1, rows, PROBE_SHAPE[1], generator=gen).to(dtype)
                plain, turned = [], []
                for r in range(PROBE_REPEATS + 2):
                    for fn, out in ((lambda: F.linear(x, weight), plain), (lambda: _turned(x, weight, None), turned)):
                        _timed_us(fn, out)
                plain, turned = sorted(plain[2:]), sorted(turned[2:])  # two warm-up calls each
                if turned[len(turned) // 2] <= MIN_GAIN * plain[len(plain) // 2]:
                    chosen.add(rows)
    finally:
        torch.set_num_threads(before)
    _FASTER[key] = frozenset(chosen)
    return _FASTER[key]


def _turned(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) as (weight @ x^T)^T, returned contiguous (the layers after it view it)."""
    rows = x.numel() // x.shape[-1]
    y = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


class SmallRowLinear(torch.nn.Linear):
    """A torch.nn.Linear whose forward takes W @ x^T for the row counts `faster_rows` chose (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        if 1 < rows <= MAX_ROWS and x.is_cpu and rows in faster_rows(self.weight.dtype):
            return _turned(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def enable_small_row_linears(model: torch.nn.Module) -> int:
    """Turn `model`'s plain nn.Linear layers (not subclasses: quantised or custom layers keep their forward) with at
    least MIN_WEIGHT_ELEMENTS weights on CPU into SmallRowLinear, and measure `faster_rows` for their dtype now (not
    inside a timed step); returns how many are SmallRowLinear now. Idempotent; `disable_small_row_linears` undoes it."""
    turned = 0
    for module in model.modules():
        if type(module) in (torch.nn.Linear, SmallRowLinear) and module.weight.device.type == "cpu" \
                and module.weight.numel() >= MIN_WEIGHT_ELEMENTS:
            module.__class__ = SmallRowLinear
            faster_rows(module.weight.dtype)
            turned += 1
    return turned


def disable_small_row_linears(model: torch.nn.Module) -> int:
    """Turn `model`'s SmallRowLinear layers back into torch.nn.Linear; returns how many."""
    undone = 0
    for module in model.modules():
        if type(module) is SmallRowLinear:
            module.__class__ = torch.nn.Linear
            undone += 1
    return undone
