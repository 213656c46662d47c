"""Small-row linears on CPU: the few rows of a decoding step computed as a product that uses every thread.

Decoding feeds its models a few rows at a time: an autoregressive step or a plain step one, a verify forward the root
and V candidates, a draft level the beam's W nodes. On the reference machine (2-core AMD EPYC, AVX2, torch 2.13 with
MKL 2024.2, 2 threads) torch's CPU linear over 2-8 rows ran about as one thread would, while the same product taken
the other way round, W @ x^T (the rows as the narrow side of the product), used both: the embedded target's forward
over 2 tokens took 13.2 ms against 9.0 ms over one, and 8.4 ms with the product turned. The turned product is also
fastest at some widths (on that machine: 2, 4, 8, 16, 24, 32 rows), so a block of 10-15 rows runs faster padded with
zero rows to 16 and a single row padded to 2 than either way unpadded. With one thread both ways cost the same; in
bf16 on that CPU the turned product is slower.

`enable_small_row_linears(model)` turns every plain `torch.nn.Linear` of `model` whose weight is large enough to
matter (>= MIN_WEIGHT_ELEMENTS, on CPU) into a `SmallRowLinear`: the same module (weights, state_dict, pickling)
whose forward follows a row plan, {rows: width}: `rows` rows are computed as W @ x^T over `width` rows (the input
padded with zero rows, the padded outputs dropped), other row counts by `F.linear`. `measure()` makes the plan on
this machine, once per process for each (layer shapes, dtype, thread count): a probe chain of random layers shaped as
the model's own (in module order, up to PROBE_BYTES, repeated up to PROBE_MIN_BYTES: past the caches, as in
decoding), every row count 1..MAX_ROWS timed both ways, each the fastest of PROBE_REPEATS interleaved calls; a row
count takes the width whose turned time is lowest when that is at most MIN_GAIN of `F.linear`'s (~2 s for the
embedded target), kept on disk for later processes on the same machine (`plan_cache`; SPECPILOT_ROW_PLAN_CACHE=0:
every process probes). Each output row is the same dot products rounded in another order (greedy speculative output
still equals the target's greedy output, as tests check). Reports record the plan (`describe`; report.json meta
`small_row_linears`), latency profiles the target's (`target_row_plan`: a padded verify block is priced padded).
`ModelPair` enables it on CPU unless asked not to (`small_row_linears=False`, or SPECPILOT_SMALL_ROW_LINEARS=0).
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from specpilot.drafting import plan_cache

MAX_ROWS = 33  # the plan covers 1..MAX_ROWS rows (verify blocks of V <= 32 with the root, draft levels) and pads to it
MIN_WEIGHT_ELEMENTS = 1 << 16  # smaller layers cost less than the Python around them: not worth a branch
MIN_GAIN = 0.9  # the turned product taken when the probe ran it in at most 90% of F.linear's time (a near tie: torch)
PROBE_BYTES = 128 << 20  # the probe chain: a model of the embedded size whole (its weights stream from memory)
PROBE_MIN_BYTES = 32 << 20  # and at least this much (a small model's layers repeated): past the caches
PROBE_REPEATS = 2
DEFAULT_SHAPES = ((1024, 1024),) * 8  # the probe without a model: 8 layers of 1024x1024 (32 MB in fp32)
ENV_SWITCH = "SPECPILOT_SMALL_ROW_LINEARS"

_MEASURED: dict[tuple[str, torch.dtype, int], dict] = {}


def wanted(asked: bool | None) -> bool:
    """Whether to enable the small-row path: `asked`, or when None the environment (anything but "0" means yes)."""
    if asked is not None:
        return bool(asked)
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


def shapes_key(shapes) -> str:
    """The probe's layer shapes [(out, in), ...] as a string ("384x384,1024x384"): the key layers carry (a string
    hashes once, and survives pickling into another process, which measures its own plan)."""
    return ",".join(f"{int(o)}x{int(i)}" for o, i in shapes)


def _shapes(key: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in part.split("x")) for part in key.split(",")]


DEFAULT_KEY = shapes_key(DEFAULT_SHAPES)


def probe_shapes(model: torch.nn.Module) -> str:
    """`model`'s turnable layer shapes in module order, up to PROBE_BYTES of fp32 weights (at least one layer), and
    repeated until they reach PROBE_MIN_BYTES (a small model's layers would stay in the caches across probe calls,
    while in decoding the other model's forward evicts them), as a `shapes_key`; DEFAULT_KEY when it has none."""
    shapes, total = [], 0
    for module in model.modules():
        if _turnable(module) and total < PROBE_BYTES:
            shapes.append(tuple(module.weight.shape))
            total += 4 * module.weight.numel()
    if not shapes:
        return DEFAULT_KEY
    repeats = -(-PROBE_MIN_BYTES // total)
    return shapes_key(shapes * repeats)


def measure(dtype: torch.dtype = torch.float32, threads: int | None = None, key: str = DEFAULT_KEY) -> dict:
    """{"ratio", "rows", "plan", "threads", "dtype", "layers", "source", "measured_at"}: the row plan for layers
    shaped as `key` (module docstring): "plan" [[rows, width], ...] (JSON-friendly; "widths" the same as a dict),
    "rows" the row counts it turns, "ratio" the probe chain's time with the plan over F.linear's, summed over
    1..MAX_ROWS rows, "source" "probe" (measured by this process), "cache" (by an earlier one on this machine:
    `plan_cache`) or "none". Made once per process per (key, dtype, threads); one thread or a dtype other than
    fp32 / bf16 / fp16: not measured, no rows."""
    threads = torch.get_num_threads() if threads is None else int(threads)
    index = (key, dtype, threads)
    if index in _MEASURED:
        return _MEASURED[index]
    shapes = _shapes(key)
    name = str(dtype).removeprefix("torch.")
    probed = threads > 1 and dtype in (torch.float32, torch.bfloat16, torch.float16)
    cached = plan_cache.load(key, name, threads, len(shapes), MAX_ROWS) if probed else None
    if cached is not None:
        cached["widths"] = {r: w for r, w in cached["plan"]}
        _MEASURED[index] = cached
        return cached
    out = {"ratio": None, "rows": [], "plan": [], "threads": threads, "dtype": name, "layers": len(shapes),
           "source": "probe" if probed else "none",
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z") if probed else None}
    if probed:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            plain, turned = _probe(shapes, dtype)
        finally:
            torch.set_num_threads(before)
        plan = {}
        for rows in plain:
            width = min((w for w in turned if w >= rows), key=turned.__getitem__)
            if turned[width] <= MIN_GAIN * plain[rows]:
                plan[rows] = width
        planned = sum(turned[plan[r]] if r in plan else plain[r] for r in plain)
        out.update(ratio=round(planned / sum(plain.values()), 4), rows=sorted(plan),
                   plan=[[r, w] for r, w in sorted(plan.items())])
        plan_cache.store(key, out)
    out["widths"] = {r: w for r, w in out["plan"]}
    _MEASURED[index] = out
    return out


def _probe(shapes: list[tuple[int, int]], dtype: torch.dtype) -> tuple[dict[int, float], dict[int, float]]:
    """The chain's fastest time over 1..MAX_ROWS rows with F.linear and turned, interleaved (the first pass warms
    up; the order alternates so neither way always runs on the other's warm caches)."""
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(o, i, generator=gen).to(dtype) for o, i in shapes]
    inputs = {(rows, i): torch.randn(rows, i, generator=gen).to(dtype)
              for rows in range(1, MAX_ROWS + 1) for i in {i for _, i in shapes}}
    fastest = {False: {}, True: {}}
    with torch.inference_mode():
        for r in range(PROBE_REPEATS + 1):
            for rows in range(1, MAX_ROWS + 1):
                for turned in ((False, True) if (r + rows) % 2 else (True, False)):
                    t0 = time.perf_counter()
                    for weight in layers:
                        x = inputs[rows, weight.shape[1]]
                        _turned(x, weight, None, rows) if turned else F.linear(x, weight)
                    seconds = time.perf_counter() - t0
                    if r:
                        fastest[turned][rows] = min(fastest[turned].get(rows, seconds), seconds)
    return fastest[False], fastest[True]


def row_plan(dtype: torch.dtype = torch.float32, threads: int | None = None, key: str = DEFAULT_KEY) -> dict[int, int]:
    """{rows: width} taken as W @ x^T at `dtype` and `threads` (default: torch's current count): `measure`'s plan."""
    return measure(dtype, threads, key)["widths"]


def _turned(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, width: int) -> torch.Tensor:
    """F.linear(x, weight, bias) as (weight @ x^T)^T over `width` >= its rows (zero rows padded, their outputs
    dropped), returned contiguous (the layers after it view it)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if width > rows:
        flat = torch.cat((flat, flat.new_zeros(width - rows, flat.shape[1])))
    y = torch.mm(weight, flat.t())
    y = (y[:, :rows] if width > rows else y).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


class SmallRowLinear(torch.nn.Linear):
    """A torch.nn.Linear whose forward follows the row plan `measure` made for its model's layer shapes (module
    docstring). The layer keeps the plan it follows with the thread count and dtype it was made for (looking it up on
    every call cost ~3 us, 1-2% of a forward of the embedded target); a copy in another process measures its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        if rows <= MAX_ROWS:
            width = self._widths().get(rows)
            if width and x.is_cpu:
                return _turned(x, self.weight, self.bias, width)
        return F.linear(x, self.weight, self.bias)

    def _widths(self) -> dict[int, int]:
        threads, kept = torch.get_num_threads(), self.__dict__.get("_plan")
        weight = self._parameters["weight"]
        if kept is None or kept[0] != threads or kept[1] is not weight.dtype:
            kept = (threads, weight.dtype, row_plan(weight.dtype, threads, getattr(self, "probe_key", DEFAULT_KEY)))
            self.__dict__["_plan"] = kept
        return kept[2]

    def __setstate__(self, state: dict) -> None:
        super().__setstate__({k: v for k, v in state.items() if k != "_plan"})  # pickled or copied: re-measured


def _turnable(module: torch.nn.Module) -> bool:
    return type(module) in (torch.nn.Linear, SmallRowLinear) and module.weight.device.type == "cpu" \
        and module.weight.numel() >= MIN_WEIGHT_ELEMENTS


def enable_small_row_linears(model: torch.nn.Module) -> int:
    """Turn `model`'s plain nn.Linear layers (not subclasses: quantised or custom layers keep their forward) with at
    least MIN_WEIGHT_ELEMENTS weights on CPU into SmallRowLinear, and make their row plan now (`measure`, for the
    model's layer shapes and each dtype: not inside a timed step); returns how many are SmallRowLinear now.
    Idempotent; `disable_small_row_linears` undoes it."""
    key = probe_shapes(model)
    turned = 0
    for module in model.modules():
        if _turnable(module):
            module.__class__ = SmallRowLinear
            module.probe_key = key
            module.__dict__.pop("_plan", None)
            measure(module.weight.dtype, key=key)
            turned += 1
    return turned


def disable_small_row_linears(model: torch.nn.Module) -> int:
    """Turn `model`'s SmallRowLinear layers back into torch.nn.Linear; returns how many."""
    undone = 0
    for module in model.modules():
        if type(module) is SmallRowLinear:
            module.__class__ = torch.nn.Linear
            module.__dict__.pop("probe_key", None)
            module.__dict__.pop("_plan", None)
            undone += 1
    return undone


def target_row_plan(model: torch.nn.Module | None) -> list[list[int]]:
    """[[rows, width], ...]: the row plan `model`'s first SmallRowLinear follows at the current thread count ([]
    when it has none: on GPU, switched off, one thread). Latency profiles record it (`envs.profile`: a verify block
    the plan pads costs what the padded block does)."""
    for m in (model.modules() if model is not None else ()):
        if type(m) is SmallRowLinear:
            return [list(p) for p in measure(m.weight.dtype, key=getattr(m, "probe_key", DEFAULT_KEY))["plan"]]
    return []


def describe(models) -> dict:
    """What reports record: whether any of `models` (None entries skipped) has SmallRowLinear layers, and the
    plan each of their (layer shapes, dtype) follows at the current thread count, in the order of `models` (the
    target's first where callers pass it first)."""
    kinds = []
    for model in models:
        for m in (model.modules() if model is not None else ()):
            if type(m) is SmallRowLinear and (getattr(m, "probe_key", DEFAULT_KEY), m.weight.dtype) not in kinds:
                kinds.append((getattr(m, "probe_key", DEFAULT_KEY), m.weight.dtype))
    if not kinds:
        return {"enabled": False}
    return {"enabled": True, "measured": [{k: v for k, v in measure(dtype, key=key).items() if k != "widths"}
                                          for key, dtype in kinds]}
