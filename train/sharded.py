"""Sharded runs on a WorkerPool: plan shards, run them through the library's own entry points, merge the results.

    record_sharded(pool, tree, prompts, "out/")   # = record_task: out/trace.npz, trace.json, profile.json
    evaluate_sharded(pool, prompts, methods=...)  # = evaluate(): an EvalResult for write_report

Recording: prompts are cut into contiguous shards; each shard runs `record_trace` (and `collect_samples` on the
prompts the profile covers) on a worker. A finished shard is written to OUT/shards/shard-XXXX/ (trace.npz,
trace.json, samples.json, ar.json, then done.json last); a re-run of the same plan skips shards whose done.json
exists, so an interrupted run resumes. The merge concatenates the per-prompt arrays in prompt order with re-based
offsets: trace.npz/trace.json equal a single-process recording in every token and tree table (float scores equal
up to the workers' kernels), and profile.json aggregates every shard's samples with the device of each recorded in
its meta. OUT/cluster.json says which worker ran which shard, which prompts were retried and which shards resumed.

Evaluation: the unit of work is a (task, language) group, so every report row (a ratio of a method over `ar`) is
measured by one worker on one device, with all methods interleaved there by `evaluate()` itself. Groups are
balanced over workers by prompt count; rows get `worker` and `device`; meta gets `workers`.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from specpilot.envs.profile import ProfileSamples
from specpilot.envs.record import Trace
from specpilot.train.cluster import ClusterError, ShardOutcome, ShardTask, WorkerPool

SHARDS_DIR = "shards"
DONE_FILE = "done.json"
CLUSTER_FILE = "cluster.json"


def shard_ranges(n: int, workers: int, shard_size: int | None = None) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) prompt ranges. Default size ceil(n / (4 * workers)): several shards per worker, so fast
    workers take more and a resumed run loses little."""
    if n < 1:
        raise ValueError("no prompts to shard")
    size = int(shard_size) if shard_size else max(1, math.ceil(n / (4 * max(1, workers))))
    if size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


# ---------------------------------------------------------------------------------------------------------------------
# merging


def merge_traces(traces: Sequence[Trace]) -> Trace:
    """One Trace from shard traces in prompt order: per-prompt arrays concatenated, `*_offsets` re-based."""
    if not traces:
        raise ValueError("no shard traces to merge")
    first = traces[0].header
    for t in traces[1:]:
        for key in ("version", "tree", "max_new_tokens", "eos_token_id", "temperature"):
            if t.header.get(key) != first.get(key):
                raise ValueError(f"shard traces differ in {key!r} ({first.get(key)} vs {t.header.get(key)})")
        if {k: v for k, v in t.header["pair"].items()} != first["pair"]:
            raise ValueError(f"shard traces come from different pairs ({first['pair']} vs {t.header['pair']})")
    arrays: dict[str, np.ndarray] = {}
    for key in traces[0].arrays:
        parts = [t.arrays[key] for t in traces]
        if key.endswith("_offsets"):
            lengths = np.concatenate([np.diff(p) for p in parts])
            arrays[key] = np.concatenate([[0], np.cumsum(lengths)]).astype(parts[0].dtype)
        else:
            arrays[key] = np.concatenate(parts)
    header = dict(first)
    header["prompts"] = [p for t in traces for p in t.header["prompts"]]
    header["positions"] = int(arrays["scores"].shape[0])
    header["recorded_s"] = float(sum(t.header.get("recorded_s", 0.0) for t in traces))
    header["sharded"] = {"shards": len(traces), "devices": sorted({str(t.header.get("device")) for t in traces})}
    return Trace(header, arrays)


def samples_to_dict(samples: ProfileSamples) -> dict:
    """ProfileSamples as plain JSON-able data (shards travel and are stored this way)."""
    return {"max_depth": samples.max_depth, "width": samples.width,
            "first": {str(k): list(v) for k, v in samples.first.items()},
            "levels": {str(k): list(v) for k, v in samples.levels.items()},
            "verify": [list(v) for v in samples.verify], "meta": dict(samples.meta)}


def samples_from_dict(data: dict) -> ProfileSamples:
    samples = ProfileSamples(max_depth=int(data["max_depth"]), width=int(data["width"]), meta=dict(data["meta"]))
    for k, v in data["first"].items():
        samples.first[int(k)].extend(v)
    for k, v in data["levels"].items():
        samples.levels[int(k)].extend(v)
    samples.verify.extend((int(a), int(b), float(c)) for a, b, c in data["verify"])
    return samples


def merge_samples(parts: Sequence[tuple[str, ProfileSamples]]) -> ProfileSamples:
    """Pool (device, samples) shards into one ProfileSamples. meta["devices"] lists the devices and
    meta["sample_device"] gives, for every sample in pooled order, the index of its device in that list
    ({"first": {n: [...]}, "levels": {l: [...]}, "verify": [...]}); measured_s is summed."""
    if not parts:
        raise ValueError("no profile samples to merge")
    base = parts[0][1]
    devices = sorted({d for d, _ in parts})
    merged = ProfileSamples(max_depth=base.max_depth, width=base.width, meta=dict(base.meta))
    where: dict[str, Any] = {"first": defaultdict(list), "levels": defaultdict(list), "verify": []}
    for device, s in parts:
        if (s.max_depth, s.width) != (base.max_depth, base.width):
            raise ValueError("profile shards were measured with different trees")
        idx = devices.index(device)
        for key, table in (("first", s.first), ("levels", s.levels)):
            for k, values in table.items():
                getattr(merged, key)[k].extend(values)
                where[key][k].extend([idx] * len(values))
        merged.verify.extend(s.verify)
        where["verify"].extend([idx] * len(s.verify))
    merged.meta["measured_s"] = float(sum(s.meta.get("measured_s", 0.0) for _, s in parts))
    merged.meta["devices"] = devices
    merged.meta["sample_device"] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in where.items()}
    return merged


def merge_ar(parts: Sequence[dict]) -> dict:
    """Pool `measure_ar` dicts of shards (sums of tokens and time), keeping each shard's numbers."""
    tokens = sum(int(p["tokens"]) for p in parts)
    seconds = sum(float(p["time_s"]) for p in parts)
    return {"seconds_per_token": seconds / max(tokens, 1), "tokens": tokens, "time_s": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
            "prompts": sum(int(p["prompts"]) for p in parts), "max_new_tokens": parts[0]["max_new_tokens"],
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "shards": list(parts)}


# ---------------------------------------------------------------------------------------------------------------------
# recording


def _plan_key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _write_shard(shard_dir: Path, outcome: ShardOutcome, key: str, prompts: tuple[int, int]) -> None:
    shard_dir.mkdir(parents=True, exist_ok=True)
    res = outcome.result
    Trace(res["header"], res["arrays"]).save(shard_dir)
    if res["samples"] is not None:
        (shard_dir / "samples.json").write_text(json.dumps(res["samples"]))
    if res["ar"] is not None:
        (shard_dir / "ar.json").write_text(json.dumps(res["ar"], indent=1))
    done = {"key": key, "prompts": list(range(*prompts)), "worker": outcome.worker, "attempts": outcome.attempts,
            "retried": outcome.retried}
    (shard_dir / DONE_FILE).write_text(json.dumps(done, indent=1))  # last: its presence means the shard is complete


def _read_done(shard_dir: Path, key: str) -> dict | None:
    path = shard_dir / DONE_FILE
    if not path.is_file():
        return None
    done = json.loads(path.read_text())
    if done.get("key") != key:
        raise ClusterError(f"{shard_dir} belongs to another recording (other prompts, tree or settings): use "
                           f"another --out, or delete {shard_dir.parent} to record again")
    return done


def record_sharded(pool: WorkerPool, tree, prompts: Sequence, out_dir: str | Path, *, max_new_tokens: int = 128,
                   profile_prompts: int | None = None, seed: int = 0, ar: bool = False,
                   shard_size: int | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """`specpilot.envs.record.record_task` on a WorkerPool: write out_dir/trace.npz, trace.json, profile.json (and
    ar.json when `ar`, as `record_traces` does) plus cluster.json; return cluster.json's content.

    prompts: strings (or objects with .prompt). profile_prompts: the profile covers the first N (default all).
    Each shard seeds its profile's random (depth, size) draws with (seed, shard)."""
    items = [getattr(p, "prompt", p) for p in prompts]
    out_dir = Path(out_dir)
    ranges = shard_ranges(len(items), len(pool), shard_size)
    n_profile = len(items) if not profile_prompts else min(int(profile_prompts), len(items))
    tree_dict = {"width": tree.width, "max_depth": tree.max_depth, "max_size": tree.max_size}
    spec = {k: v for k, v in pool.spec.to_dict().items() if k in ("target", "draft", "eagle", "dtype")}
    key = _plan_key(prompts=items, tree=tree_dict, max_new_tokens=max_new_tokens, profile=n_profile, seed=seed,
                    ar=ar, ranges=ranges, pair=spec)
    shard_root = out_dir / SHARDS_DIR
    started = time.perf_counter()
    dirs = [shard_root / f"shard-{i:04d}" for i in range(len(ranges))]
    finished = {i: d for i, d in enumerate(_read_done(p, key) for p in dirs) if d is not None}
    tasks = [ShardTask(i, "record", {"prompts": items[lo:hi], "tree": tree_dict, "max_new_tokens": max_new_tokens,
                                     "profile_prompts": items[lo:min(hi, n_profile)], "seed": [seed, i], "ar": ar},
                       list(range(lo, hi)))
             for i, (lo, hi) in enumerate(ranges) if i not in finished]
    if progress and finished:
        progress(f"resuming: {len(finished)} of {len(ranges)} shards already recorded under {shard_root}")

    def write(task: ShardTask, outcome: ShardOutcome) -> None:
        _write_shard(dirs[task.shard], outcome, key, ranges[task.shard])

    pool.run_shards(tasks, on_done=write, progress=progress)
    summary = _merge_recording(out_dir, dirs, ranges, key, resumed=sorted(finished), ar=ar, seed=seed)
    summary.update(workers=pool.workers, wall_s=time.perf_counter() - started)
    (out_dir / CLUSTER_FILE).write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _merge_recording(out_dir: Path, dirs: list[Path], ranges, key: str, *, resumed: list[int], ar: bool,
                     seed: int) -> dict:
    """Merge the shard directories into out_dir's trace, profile (and ar.json); describe the shards."""
    from specpilot.train.traces import AR_FILE

    traces = [Trace.load(d) for d in dirs]
    trace = merge_traces(traces)
    trace.save(out_dir)
    shards, samples, ar_parts, retried = [], [], [], []
    for i, d in enumerate(dirs):
        done = _read_done(d, key)
        device = traces[i].header.get("device")
        if (d / "samples.json").is_file():
            samples.append((str(device), samples_from_dict(json.loads((d / "samples.json").read_text()))))
        if ar:
            ar_parts.append(json.loads((d / "ar.json").read_text()))
        if done.get("retried"):
            retried.extend(range(*ranges[i]))
        shards.append({"shard": i, "prompts": list(range(*ranges[i])), "device": device,
                       "worker": (done.get("worker") or {}).get("worker"), "attempts": done.get("attempts"),
                       "retried": done.get("retried"), "resumed": i in resumed})
    if samples:
        pooled = merge_samples(samples)
        pooled.meta["seed"] = seed
        profile = pooled.profile()
        profile.meta["pair"] = trace.header["pair"]
        profile.save(out_dir / "profile.json")
    if ar:
        (out_dir / AR_FILE).write_text(json.dumps(merge_ar(ar_parts), indent=1))
    return {"out": str(out_dir), "shards": shards, "retried_prompts": retried, "resumed_shards": resumed,
            "positions": trace.header["positions"]}


# ---------------------------------------------------------------------------------------------------------------------
# evaluation


def assign_groups(prompts: Sequence, workers: int) -> list[list[int]]:
    """Prompt indices per worker: whole (task, language) groups, largest first onto the least-loaded worker
    (ties: the lower worker). Each worker's list keeps prompt order; workers without a group get []."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault((getattr(p, "task", ""), getattr(p, "language", "")), []).append(i)
    load = [[] for _ in range(workers)]
    for members in sorted(groups.values(), key=lambda m: (-len(m), m[0])):
        target = min(range(workers), key=lambda w: (len(load[w]), w))
        load[target].extend(members)
    return [sorted(x) for x in load]


def merge_meta(metas: Sequence[dict], workers: Sequence[dict]) -> dict:
    """Merge per-worker meta blocks generically: equal values are kept, dicts merge key by key, numbers that differ
    are summed (counts) unless they are per-run settings (then the first is kept and all are listed under
    `per_worker`); `workers` lists each worker's description (device, GPU, host, threads)."""
    merged: dict = {}
    per_worker: dict = {}
    for key in dict.fromkeys(k for m in metas for k in m):
        values = [m.get(key) for m in metas if key in m]
        if all(v == values[0] for v in values):
            merged[key] = values[0]
        elif all(isinstance(v, dict) for v in values):
            merged[key] = {k: v for d in values for k, v in d.items()}
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values) and key.startswith("prompts_"):
            merged[key] = sum(values)
        else:
            merged[key] = values[0]
            per_worker[key] = values
    merged["workers"] = list(workers)
    if per_worker:
        merged["per_worker"] = per_worker
    return merged


def evaluate_sharded(pool: WorkerPool, prompts: Sequence, *, progress: Callable[[str], None] | None = None,
                     **evaluate_kwargs):
    """`specpilot.eval.runner.evaluate` across the pool: each worker evaluates whole (task, language) groups with
    every method interleaved; returns one EvalResult (rows tagged with worker and device, records in prompt order,
    meta merged with per-worker devices). Paths in evaluate_kwargs (grid=, run_dir=) must exist on every node."""
    from specpilot.eval.runner import EvalResult
    from specpilot.eval.suites import prompt_mix

    if not prompts:
        raise ValueError("no prompts to evaluate")
    plan = [idx for idx in assign_groups(prompts, len(pool)) if idx]
    if progress and len(plan) < len(pool):
        progress(f"{len(plan)} (task, language) groups for {len(pool)} workers: {len(pool) - len(plan)} stay idle")
    tasks = [ShardTask(i, "evaluate", {"prompts": [prompts[j] for j in idx], "kwargs": evaluate_kwargs}, idx)
             for i, idx in enumerate(plan)]
    outcomes = pool.run_shards(tasks, progress=progress)
    order = {getattr(p, "id", i): i for i, p in enumerate(prompts)}
    results, records, metas = [], [], []
    for outcome in outcomes:
        res = outcome.result
        tag = {"worker": outcome.worker["worker"], "device": outcome.worker["device"]}
        results.extend({**row, **tag} for row in res.results)
        records.extend(res.records)
        metas.append(res.meta)
    records.sort(key=lambda r: order.get(r.prompt_id, 0))
    meta = merge_meta(metas, [o.worker for o in outcomes])
    meta["prompt_mix"] = prompt_mix(list(prompts))
    meta["cluster"] = {"unit": "(task, language) group", "shards": [
        {"shard": t.shard, "worker": o.worker["worker"], "device": o.worker["device"], "prompts": t.prompts,
         "attempts": o.attempts, "retried": o.retried} for t, o in zip(tasks, outcomes)],
        "retried_prompts": sorted(j for t, o in zip(tasks, outcomes) if o.retried for j in t.prompts)}
    return EvalResult(results=results, meta=meta, records=records)
