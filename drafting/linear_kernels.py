"""Small-row linears on CPU: the 2-8 rows of a verify block or a draft level computed as one product on every thread.

A speculative cycle feeds its models a few rows at a time: a verify forward the root and V candidates, a draft level
the beam's W nodes. On the reference machine (2-core AMD EPYC, AVX2, torch 2.13 with MKL 2024.2, 2 threads) torch's
CPU linear over 2-8 rows ran about as one thread would, while the same product taken the other way round, W @ x^T
(the rows as the narrow side of the product), used both: the embedded target's forward over 2 tokens took 13.2 ms
against 9.0 ms over one, and 8.4 ms with the product turned. With one thread the two ways cost the same; one row
(autoregressive decoding, plain steps) is left as torch computes it either way, so baselines keep their speed.

`enable_small_row_linears(model)` turns every plain `torch.nn.Linear` of `model` whose weight is large enough to
matter (>= MIN_WEIGHT_ELEMENTS, on CPU) into a `SmallRowLinear`: the same module (weights, state_dict, pickling)
whose forward takes W @ x^T for 2..MAX_ROWS rows when `measure()` found it faster on this machine (a probe chain of
layers, at the current thread count and dtype, once per process: ~0.3 s), and `F.linear` otherwise. The values are
the same product rounded in another order (greedy speculative output still equals the target's greedy output, as
tests check). Reports record the measurement (`describe`; report.json meta `small_row_linears`).
`ModelPair` enables it on CPU unless asked not to (`small_row_linears=False`, or SPECPILOT_SMALL_ROW_LINEARS=0).
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

MAX_ROWS = 8  # verify blocks and draft levels of the demo's trees; longer inputs keep torch's own linear
MIN_WEIGHT_ELEMENTS = 1 << 16  # smaller layers cost less than the Python around them: not worth a branch
MIN_GAIN = 0.9  # W @ x^T taken when the probe ran it in at most 90% of F.linear's time (a near tie stays with torch)
PROBE_LAYERS, PROBE_WIDTH = 8, 1024  # a chain of 8 1024x1024 layers (32 MB in fp32): past the caches, as a model
PROBE_REPEATS = 5
ENV_SWITCH = "SPECPILOT_SMALL_ROW_LINEARS"

_MEASURED: dict[tuple[torch.dtype, int], dict] = {}


def wanted(asked: bool | None) -> bool:
    """Whether to enable the small-row path: `asked`, or when None the environment (anything but "0" means yes)."""
    if asked is not None:
        return bool(asked)
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


def measure(dtype: torch.dtype = torch.float32, threads: int | None = None) -> dict:
    """{"ratio", "rows", "threads", "dtype"}: W @ x^T over F.linear on a probe chain (PROBE_LAYERS layers of
    PROBE_WIDTH, run as a model's layers run: each weight read from memory), summed over 2..MAX_ROWS rows, each the
    fastest of PROBE_REPEATS interleaved calls (on a shared machine other work only adds time); `rows` is 2..MAX_ROWS
    when ratio <= MIN_GAIN, else empty. One decision for the whole range: the slow path is how the BLAS threads a
    narrow product, and per-row timings of a few hundred microseconds flip with the machine's load. Measured once per
    process per (dtype, threads); one thread or a dtype other than fp32 / bf16 / fp16: not measured, no rows."""
    threads = torch.get_num_threads() if threads is None else int(threads)
    key = (dtype, threads)
    if key in _MEASURED:
        return _MEASURED[key]
    out = {"ratio": None, "rows": [], "threads": threads, "dtype": str(dtype).removeprefix("torch.")}
    if threads > 1 and dtype in (torch.float32, torch.bfloat16, torch.float16):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            gen = torch.Generator().manual_seed(0)
            layers = [torch.randn(PROBE_WIDTH, PROBE_WIDTH, generator=gen).to(dtype) for _ in range(PROBE_LAYERS)]
            fastest = {False: 0.0, True: 0.0}
            with torch.inference_mode():
                for rows in range(2, MAX_ROWS + 1):
                    x = torch.randn(1, rows, PROBE_WIDTH, generator=gen).to(dtype)
                    best = {False: float("inf"), True: float("inf")}
                    for r in range(PROBE_REPEATS + 1):
                        for turned in ((False, True) if r % 2 else (True, False)):
                            t0 = time.perf_counter()
                            _probe_chain(x, layers, turned)
                            if r:  # the first pass warms up
                                best[turned] = min(best[turned], time.perf_counter() - t0)
                    for turned in best:
                        fastest[turned] += best[turned]
            out["ratio"] = round(fastest[True] / fastest[False], 4)
            out["rows"] = list(range(2, MAX_ROWS + 1)) if out["ratio"] <= MIN_GAIN else []
        finally:
            torch.set_num_threads(before)
    _MEASURED[key] = out
    out["rows_set"] = frozenset(out["rows"])
    return out


def faster_rows(dtype: torch.dtype = torch.float32, threads: int | None = None) -> frozenset[int]:
    """Row counts taken as W @ x^T at `dtype` and `threads` (default: torch's current count): `measure`'s rows."""
    return measure(dtype, threads)["rows_set"]


def _probe_chain(x: torch.Tensor, layers: list[torch.Tensor], turned: bool) -> torch.Tensor:
    for weight in layers:
        x = _turned(x, weight, None) if turned else F.linear(x, weight)
    return x


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


def describe(models) -> dict:
    """What reports record: whether any of `models` (None entries skipped) has SmallRowLinear layers, and the
    measurement deciding the rows they take at the current thread count."""
    dtypes = {m.weight.dtype for model in models if model is not None for m in model.modules()
              if type(m) is SmallRowLinear}
    if not dtypes:
        return {"enabled": False}
    return {"enabled": True, "measured": [{k: v for k, v in measure(d).items() if k != "rows_set"}
                                          for d in sorted(dtypes, key=str)]}
