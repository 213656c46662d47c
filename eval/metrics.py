"""Evaluation metrics: one `RunRecord` per timed generation, and the aggregation of a group of them into a row.

Definitions (the report repeats them):
- speedup: (sum of tokens / sum of wall time) of a method, divided by the same ratio for `ar`, over the *same*
  prompts and repeats. Pooled ratios, not a mean of per-prompt ratios: that is the throughput a user sees.
- tau: mean tokens emitted per target forward (per cycle), bonus token included; 1.0 for autoregressive decoding.
- ttft_s: wall time from the call to the first new token (prefill included).
- inter-token latency: gaps between successive *deliveries* of tokens to a streaming client. Tokens a speculative
  cycle emits together share one timestamp and are one delivery (as vLLM's benchmark counts ITL per chunk);
  counting the zero gaps inside a burst would report a meaningless 0 s median. tpot_s (wall time after the first
  token / tokens after the first) gives the per-token view.
- policy_overhead: controller decision time / wall time; draft_frac and verify_frac: draft or verify time / wall
  time (the rest is prefill, sampling and bookkeeping outside cycles).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

ITL_QUANTILES = (50.0, 90.0, 99.0)


@dataclass
class RunRecord:
    """One timed generation of one prompt by one method.

    wall_s is measured by the runner around the call (perf_counter, device synchronised), the same way for every
    method; token_times are seconds from the start of the call at which each new token was available; prefill_s
    the part of wall_s spent on the prompt's prefill (0 when unknown: transformers' generate).
    repeat is the evaluation round: a (prompt_id, repeat) pair is one unit of the paired comparisons.
    cycles: (depth, size, emitted) per cycle for speculative methods; chunk_sizes: tokens per delivery when only
    a stream is observable (transformers' generate).
    """

    prompt_id: str
    method: str
    tokens: list[int]
    wall_s: float
    token_times: list[float] = field(default_factory=list)
    cycles: list[tuple[int, int, int]] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    policy_s: float = 0.0
    prefill_s: float = 0.0
    peak_mem_mb: float = float("nan")
    repeat: int = 0
    temperature: float = 0.0
    concurrency: int = 1

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def percentiles(values, qs=ITL_QUANTILES) -> list[float]:
    """numpy percentiles with linear interpolation (NaN for no values)."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return [float("nan")] * len(qs)
    return [float(v) for v in np.percentile(arr, list(qs), method="linear")]


def delivery_times(token_times: list[float]) -> list[float]:
    """Distinct, ordered delivery instants: tokens made available at the same instant form one delivery."""
    out: list[float] = []
    for t in token_times:
        if not out or t > out[-1]:
            out.append(float(t))
    return out


def inter_token_latencies(token_times: list[float]) -> list[float]:
    """Gaps between successive deliveries (see the module docstring)."""
    d = delivery_times(token_times)
    return [b - a for a, b in zip(d, d[1:])]


def chunk_sizes(token_times: list[float]) -> list[int]:
    """Tokens per delivery, for tau when the only observable is the token stream."""
    sizes: list[int] = []
    last = None
    for t in token_times:
        if last is not None and t <= last:
            sizes[-1] += 1
        else:
            sizes.append(1)
            last = t
    return sizes


def pooled_tau(records: list[RunRecord]) -> float:
    """tau pooled over runs: emitted / cycles; from the delivery chunks when no cycles were recorded."""
    emitted = sum(c[2] for r in records for c in r.cycles)
    n_cycles = sum(len(r.cycles) for r in records)
    if n_cycles:
        return emitted / n_cycles
    sizes = [s for r in records for s in chunk_sizes(r.token_times)]
    return sum(sizes) / len(sizes) if sizes else float("nan")


def throughput(records: list[RunRecord]) -> float:
    """Pooled tokens per second."""
    total = sum(r.wall_s for r in records)
    return sum(r.n_tokens for r in records) / total if total > 0 else float("nan")


def _nan_max(values) -> float:
    vals = [v for v in values if v == v]  # NaN != NaN
    return max(vals) if vals else float("nan")


def aggregate(records: list[RunRecord], ar_records: list[RunRecord] | None,
              *, identical: bool | None) -> dict:
    """Metrics of one (task, language, method, temperature) group. `ar_records` are `ar`'s runs on the same
    prompts (None when `ar` was not run: speedup is then NaN). `identical` is decided by the runner."""
    wall = sum(r.wall_s for r in records)
    n_tokens = sum(r.n_tokens for r in records)
    tps = throughput(records)
    ar_tps = throughput(ar_records) if ar_records else float("nan")
    itls = [g for r in records for g in inter_token_latencies(r.token_times)]
    p50, p90, p99 = percentiles(itls)
    ttfts = [r.token_times[0] for r in records if r.token_times]
    tpots = [(r.wall_s - r.token_times[0]) / (r.n_tokens - 1) for r in records if r.n_tokens > 1 and r.token_times]
    depths = Counter(c[0] for r in records for c in r.cycles)
    sizes = Counter(c[1] for r in records for c in r.cycles)
    # (depth, size) -> [count, summed emitted]: the report's heat map of choices by accepted length
    choices: dict[tuple[int, int], list[int]] = {}
    for r in records:
        for d, s, e in r.cycles:
            cell = choices.setdefault((d, s), [0, 0])
            cell[0] += 1
            cell[1] += e
    frac = (lambda x: x / wall if wall > 0 else float("nan"))
    return {
        "speedup": tps / ar_tps if ar_tps == ar_tps and ar_tps > 0 else float("nan"),
        "tau": pooled_tau(records),
        "tokens_per_s": tps,
        "ttft_s": float(np.mean(ttfts)) if ttfts else float("nan"),
        "itl_p50_s": p50,
        "itl_p90_s": p90,
        "itl_p99_s": p99,
        "tpot_s": float(np.mean(tpots)) if tpots else float("nan"),
        "total_s": wall,
        "peak_mem_mb": _nan_max(r.peak_mem_mb for r in records),
        "policy_overhead": frac(sum(r.policy_s for r in records)),
        "draft_frac": frac(sum(r.draft_s for r in records)),
        "verify_frac": frac(sum(r.verify_s for r in records)),
        "identical_to_ar": identical,
        "n_prompts": len({r.prompt_id for r in records}),
        "n_runs": len(records),
        "n_tokens": n_tokens,
        "depth_dist": {str(k): v for k, v in sorted(depths.items())},
        "size_dist": {str(k): v for k, v in sorted(sizes.items())},
        "choices": [[d, s, n, e / n] for (d, s), (n, e) in sorted(choices.items())],
    }
