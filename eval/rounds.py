"""The measurement loop: interleaved rounds of timed generations, and when to stop adding rounds.

One loop measures everything in the package (evaluation methods, arbitrary Controllers from the grid search or
training, the cost-model check), with one clock:

- a *round* runs every prompt once; per prompt the round's methods run back to back in the order of the next row
  of a Williams design (`method_order`): over each block of rows every method runs in every position, and right
  after every other method, equally often. Drift in load or clock frequency then hits every method alike, and so
  does any carry-over from the method that ran just before (a plain rotation puts B right after A in all but one
  of every len(methods) units, so such a carry-over would bias A vs B); all methods get the unit's
  seed (`seed + round * n_prompts + prompt index`);
- wall time is measured around each call (perf_counter after device synchronisation), identically for all;
- `RoundPlan` says how many rounds: a fixed number, or "auto": at least `min_rounds`, then more until the
  deciding comparison's interval is narrow enough, the time budget would not fit another round, or `max_rounds`
  (two methods that made the same decisions still differ by their decision time, so that is no reason to stop). Rounds after the first `full_rounds` run only `ar` and
  the deciding pair (the comparison the extra rounds are for); every other method keeps its earlier units.
  At temperatures > 0 the floor may be lower (`sampled_min_rounds`): the greedy comparison is the headline, and the
  intervals resample prompts, so a sampled setting's second round mostly re-times the same prompts.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specpilot.drafting.timing import synchronize
from specpilot.eval.compare import DECIDE, compare, unit_records
from specpilot.eval.metrics import RunRecord


@dataclass(frozen=True)
class RoundPlan:
    """How many rounds to run (module docstring).

    auto: adapt (True) or run exactly `max_rounds` rounds (False); min_rounds: rounds before any stop (auto);
    max_rounds: the most rounds (auto) or the fixed count; time_budget_s: wall-time budget of the whole
    evaluation, split evenly over the temperatures still to run (None: no budget); target_half_width: stop when
    the deciding interval's half-width relative to its ratio is at most this (0.015: +-1.5%); decide: the
    deciding (method, baseline); full_rounds: rounds in which every method runs (None: all rounds);
    sampled_min_rounds: min_rounds at temperatures > 0 (None: min_rounds)."""

    auto: bool = False
    min_rounds: int = 2
    max_rounds: int = 1
    time_budget_s: float | None = None
    target_half_width: float = 0.015
    decide: tuple[str, str] = DECIDE
    full_rounds: int | None = None
    sampled_min_rounds: int | None = None

    def __post_init__(self) -> None:
        if self.max_rounds < 1 or self.min_rounds < 1:
            raise ValueError(f"rounds must be >= 1 (got min_rounds={self.min_rounds}, max_rounds={self.max_rounds})")
        if self.sampled_min_rounds is not None and self.sampled_min_rounds < 1:
            raise ValueError(f"sampled_min_rounds must be >= 1 or None, got {self.sampled_min_rounds}")
        if self.auto and self.min_rounds > self.max_rounds:
            raise ValueError(f"min_rounds={self.min_rounds} exceeds max_rounds={self.max_rounds}")
        if self.full_rounds is not None and self.full_rounds < 1:
            raise ValueError(f"full_rounds must be >= 1 or None, got {self.full_rounds}")
        if not self.target_half_width > 0:
            raise ValueError(f"target_half_width must be > 0, got {self.target_half_width}")

    @classmethod
    def make(cls, rounds: int | str, **kwargs) -> "RoundPlan":
        """rounds: an int >= 1 (fixed) or "auto"."""
        if rounds == "auto":
            kwargs.setdefault("max_rounds", 20)
            return cls(auto=True, **kwargs)
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds must be a positive int or \"auto\", got {rounds!r}")
        kwargs.pop("max_rounds", None)
        return cls(auto=False, max_rounds=rounds, **kwargs)

    def describe(self) -> dict:
        """The plan for meta["rounds"]."""
        return {"mode": "auto" if self.auto else "fixed", "min_rounds": self.min_rounds,
                "max_rounds": self.max_rounds, "full_rounds": self.full_rounds, "time_budget_s": self.time_budget_s,
                "target_half_width": self.target_half_width, "decide": list(self.decide),
                "sampled_min_rounds": self.sampled_min_rounds}

    def methods(self, round_index: int, running: list[str]) -> list[str]:
        """The methods of round `round_index` (0-based)."""
        # without the deciding pair among the methods a partial round would time `ar` alone
        if self.full_rounds is None or round_index < self.full_rounds or not all(m in running for m in self.decide):
            return running
        return [m for m in running if m == "ar" or m in self.decide]

    def stop_reason(self, done: int, decided: dict | None, remaining_s: float | None,
                    next_round_s: float, temperature: float = 0.0) -> str | None:
        """Why to stop after `done` rounds at `temperature` (None: run another). `decided`: the deciding
        comparison so far."""
        if not self.auto:
            return "fixed" if done >= self.max_rounds else None
        floor = (self.min_rounds if temperature == 0 or self.sampled_min_rounds is None
                 else min(self.sampled_min_rounds, self.max_rounds))
        if decided is None:  # nothing to decide: later rounds would rerun only `ar`
            enough = min(floor, self.full_rounds or floor)
            return "no deciding comparison" if done >= enough else None
        if done < floor:
            return None
        if decided["half_width"] <= self.target_half_width:
            return "target reached"
        if done >= self.max_rounds:
            return "max rounds"
        if remaining_s is not None and remaining_s < next_round_s:
            return "time budget"
        return None


# ---- timing ----------------------------------------------------------------------------------------------------
class MemoryMonitor:
    """Peak memory per call: the CUDA allocator's peak on GPU; on CPU the process's peak RSS.

    On Linux the kernel keeps that peak itself (VmHWM in /proc/self/status; writing "5" to /proc/self/clear_refs
    resets it to the current RSS), so nothing runs beside the timed call and no short spike is missed. Elsewhere (or
    where clear_refs cannot be written) one background thread samples the RSS every `interval_s`, plus before and
    after each call; such a thread wakes ~50 times a second on the cores the timed call uses (one paired run on the
    2-core CPU: generations 0.8% slower with it, intervals [-0.9, +2.7]% for ltd and [-0.4, +2.0]% for the grid)."""

    STATUS, CLEAR_REFS = "/proc/self/status", "/proc/self/clear_refs"

    def __init__(self, device: torch.device, interval_s: float = 0.02) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.interval_s = interval_s
        self._peak = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self.kernel_peak = not self.cuda and self._reset_kernel_peak()
        if not self.cuda and not self.kernel_peak:
            import psutil
            self._proc = psutil.Process()

    @classmethod
    def _reset_kernel_peak(cls) -> bool:
        """Reset the kernel's peak-RSS mark; False where there is none to reset (not Linux, or not writable)."""
        try:
            with open(cls.CLEAR_REFS, "w") as f:
                f.write("5")
            return cls._kernel_peak_mb() is not None
        except OSError:
            return False

    @classmethod
    def _kernel_peak_mb(cls) -> float | None:
        with open(cls.STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
        return None

    @classmethod
    def source(cls, device) -> str:
        """What `end` reports on this machine for `device` (the report's protocol names it)."""
        if torch.device(device).type == "cuda":
            return "CUDA allocator peak"
        if cls._reset_kernel_peak():
            return "process peak RSS (the kernel's high-water mark, reset before each call)"
        return "process RSS, sampled"

    def _rss_mb(self) -> float:
        return self._proc.memory_info().rss / 2**20

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = self._rss_mb()
            with self._lock:
                self._peak = max(self._peak, rss)

    def __enter__(self) -> "MemoryMonitor":
        if not self.cuda and not self.kernel_peak:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def begin(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)  # the pair's GPU, not the current one
        elif self.kernel_peak:
            self._reset_kernel_peak()
        else:
            with self._lock:
                self._peak = self._rss_mb()

    def end(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.kernel_peak:
            return self._kernel_peak_mb()
        rss = self._rss_mb()
        with self._lock:
            return max(self._peak, rss)


def _sync(device: torch.device) -> float:
    synchronize(device)
    return time.perf_counter()


def timed(method: Callable[..., RunRecord], ids: list[int], sampling: dict, device: torch.device,
           memory: MemoryMonitor | None) -> RunRecord:
    if memory is not None:
        memory.begin()
    t0 = _sync(device)
    rec = method(ids, **sampling)
    rec.wall_s = _sync(device) - t0
    if memory is not None:
        rec.peak_mem_mb = memory.end()
    return rec


def method_order(names: list[str], unit: int) -> list[str]:
    """The order in which `names` run for the `unit`-th unit: row `unit` (cyclically) of a Williams design.

    The rows are a Latin square whose first row is 0, 1, m-1, 2, m-2, ... and whose row i adds i (mod m); for an
    odd m the reversed rows follow. Over any len(rows) consecutive units (m rows for even m, 2m for odd m) every
    method takes every position equally often and follows every other method equally often (first-order
    carry-over balance). For m = 3 the six rows are the six permutations."""
    m = len(names)
    if m < 2:
        return list(names)
    first, low, high = [0], 1, m - 1
    while len(first) < m:
        first.append(low)
        low += 1
        if len(first) < m:
            first.append(high)
            high -= 1
    rows = [[(x + i) % m for x in first] for i in range(m)]
    if m % 2:
        rows += [row[::-1] for row in rows]
    return [names[x] for x in rows[unit % len(rows)]]


# ---- the loop --------------------------------------------------------------------------------------------------
@dataclass
class Measurer:
    """Runs timed generations for one evaluation and keeps their records. A method that raises is dropped with
    its error in `failed` (the others go on); `ar`, the reference, must not fail."""

    methods: dict[str, Callable[..., RunRecord]]
    ids: list[list[int]]
    prompt_ids: list[str]
    device: torch.device
    memory: MemoryMonitor | None
    seed: int
    failed: dict[str, str]
    records: list[RunRecord]
    # greedy new tokens -> whether the target's output is degenerate (`eval.degeneracy`): such prompts are left out
    # of the stopping rule's interval as they are out of the verdict's; None: nothing is left out
    degenerate: Callable[[list[int]], bool] | None = None
    _flags: dict = field(default_factory=dict)

    def flagged(self) -> set[str]:
        """Prompt ids whose greedy `ar` output so far is degenerate (each measured once)."""
        if self.degenerate is None:
            return set()
        from specpilot.eval.degeneracy import greedy_outputs

        for pid, tokens in greedy_outputs(self.records).items():
            if pid not in self._flags:
                self._flags[pid] = bool(self.degenerate(tokens))
        return {pid for pid, bad in self._flags.items() if bad}

    def call(self, name: str, index: int, sampling: dict, seed: int) -> RunRecord | None:
        if name in self.failed:
            return None
        try:
            return timed(self.methods[name], self.ids[index], {**sampling, "seed": seed}, self.device, self.memory)
        except Exception as err:  # noqa: BLE001 - a broken method must not sink the others
            if name == "ar":
                raise
            self.failed[name] = f"{type(err).__name__}: {err}"
            return None

    def warmup(self, names: list[str], sampling: dict, n: int) -> None:
        """Untimed, unrecorded generations: kernels, allocator and caches warm before anything is timed."""
        for name in names:
            for w in range(n):
                if self.call(name, w % len(self.ids), sampling, self.seed) is None:
                    break

    def round(self, r: int, names: list[str], sampling: dict) -> None:
        """Every prompt once; per prompt the methods back to back, in `method_order`'s row for (round, prompt)."""
        n = len(self.ids)
        for i in range(n):
            k = r * n + i
            active = [m for m in names if m not in self.failed]
            if not active:
                return
            for name in method_order(active, k):
                rec = self.call(name, i, sampling, self.seed + k)
                if rec is not None:
                    rec.prompt_id, rec.repeat = self.prompt_ids[i], r
                    rec.temperature, rec.concurrency = float(sampling["temperature"]), 1
                    self.records.append(rec)


def run_rounds(measurer: Measurer, running: list[str], sampling: dict, plan: RoundPlan, *,
               deadline: float | None, say: Callable[[str], None]) -> dict:
    """Rounds at one temperature until `plan` says stop; returns what was run and why it stopped."""
    temperature = float(sampling["temperature"])
    started = time.perf_counter()
    done, last_s, decided, stop = 0, 0.0, None, None
    while stop is None:
        t0 = time.perf_counter()
        measurer.round(done, plan.methods(done, running), sampling)
        done, last_s = done + 1, time.perf_counter() - t0
        decided = _decided(measurer, plan, temperature)
        remaining = None if deadline is None else deadline - time.perf_counter()
        stop = plan.stop_reason(done, decided, remaining, last_s, temperature)
        width = "" if decided is None else f", {plan.decide[0]} vs {plan.decide[1]} +-{_pct(decided['half_width'])}"
        say(f"T={temperature:g} round {done} done ({last_s:.0f}s{width})")
    return {"rounds": done, "units": done * len(measurer.ids), "stopped_by": stop,
            "decide": list(plan.decide), "decide_half_width": None if decided is None else decided["half_width"],
            "decide_same_decisions": None if decided is None else decided["same_decisions"],
            "seconds": round(time.perf_counter() - started, 1)}


def _decided(measurer: Measurer, plan: RoundPlan, temperature: float) -> dict | None:
    if any(m in measurer.failed for m in plan.decide):
        return None
    flagged = measurer.flagged()
    records = [r for r in measurer.records if r.prompt_id not in flagged]
    by_method = unit_records(records, temperature=temperature)
    return compare(by_method, *plan.decide, temperature=temperature)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else "inf"
