"""The shards of a recording (`specpilot.envs.record.record_task`): the work unit, resumable shard folders, the merge.

Prompts are cut into contiguous shards (`specpilot.drafting.executor.shard_ranges`); `record_shard` runs
`record_trace` (and `collect_samples` on the prompts the profile covers, and `measure_ar` when asked) on a worker
of the executor. A finished shard is written to OUT/shards/shard-XXXX/ (trace.npz, trace.json, samples.json,
ar.json, then done.json last); a re-run of the same plan skips shards whose done.json exists, so an interrupted
run resumes. The merge concatenates the per-prompt arrays in prompt order with re-based offsets: the trace equals
a recording of all prompts at once in every token and tree table (float scores equal up to the workers'
kernels), and profile.json pools every shard's samples with the device of each recorded in its meta.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specpilot.drafting.errors import InputFileError
from specpilot.drafting.executor import ShardOutcome
from specpilot.drafting.files import atomic_write_json, read_json
from specpilot.envs.profile import ProfileSamples
from specpilot.envs.record import Trace

SHARDS_DIR = "shards"
DONE_FILE = "done.json"
AR_FILE = "ar.json"
CLUSTER_FILE = "cluster.json"  # which worker recorded which shard (the per-worker detail of a recording)


def measure_ar(pair, prompts: Sequence, *, max_new_tokens: int, warmup: int = 1) -> dict:
    """Live autoregressive seconds per token on `prompts` (after `warmup` untimed generations)."""
    from specpilot.drafting.decoder import autoregressive_generate

    items = [getattr(p, "prompt", p) for p in prompts]
    for _ in range(warmup):
        autoregressive_generate(pair, items[0], max_new_tokens=max_new_tokens)
    tokens, seconds = 0, 0.0
    for p in items:
        out = autoregressive_generate(pair, p, max_new_tokens=max_new_tokens)
        tokens, seconds = tokens + out.num_tokens, seconds + out.total_s
    return {"seconds_per_token": seconds / max(tokens, 1), "tokens": tokens, "time_s": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"), "prompts": len(items),
            "max_new_tokens": max_new_tokens, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}


def record_shard(worker, *, prompts: list, tree: dict, max_new_tokens: int, profile_prompts: list, seed: list[int],
                 ar: bool, progress: bool = False) -> dict:
    """The work unit: the trace of `prompts`, profile samples of `profile_prompts` and (ar) the live AR timing."""
    from specpilot.drafting.types import TreeConfig
    from specpilot.envs.profile import collect_samples
    from specpilot.envs.record import record_trace

    tree_config = TreeConfig(**tree)
    trace = record_trace(worker.pair, tree_config, prompts, max_new_tokens=max_new_tokens, progress=progress)
    out = {"header": trace.header, "arrays": trace.arrays, "samples": None, "ar": None}
    if profile_prompts:
        samples = collect_samples(worker.pair, tree_config, profile_prompts, max_new_tokens=max_new_tokens,
                                  rng=np.random.default_rng(seed), warmup_cycles=16 if worker.first("profile") else 0)
        out["samples"] = samples_to_dict(samples)
    if ar:
        out["ar"] = measure_ar(worker.pair, prompts, max_new_tokens=max_new_tokens,
                               warmup=1 if worker.first("ar") else 0)
    return out


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
# shard folders


def plan_key(**parts) -> str:
    """A short hash of everything a recording's shards depend on (a shard of another plan is never reused)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_shard(shard_dir: Path, outcome: ShardOutcome, key: str, prompts: tuple[int, int]) -> None:
    shard_dir.mkdir(parents=True, exist_ok=True)
    res = outcome.result
    Trace(res["header"], res["arrays"]).save(shard_dir)
    if res["samples"] is not None:
        atomic_write_json(shard_dir / "samples.json", res["samples"], indent=None)
    if res["ar"] is not None:
        atomic_write_json(shard_dir / AR_FILE, res["ar"])
    done = {"key": key, "prompts": list(range(*prompts)), "worker": outcome.worker, "attempts": outcome.attempts,
            "retried": outcome.retried}
    atomic_write_json(shard_dir / DONE_FILE, done)  # last: its presence means the shard is complete


def read_done(shard_dir: Path, key: str) -> dict | None:
    """The shard's done.json, None when the shard is not finished; refuses a shard of another recording."""
    if not (shard_dir / DONE_FILE).is_file():
        return None
    done = read_json(shard_dir / DONE_FILE, what="finished-shard marker", fix="delete the shard folder to record "
                     "it again")
    if done.get("key") != key:
        raise InputFileError(f"{shard_dir} belongs to another recording (other prompts, tree or settings): use "
                             f"another --out, or delete {shard_dir.parent} to record again")
    return done


def merge_shards(out_dir: Path, dirs: list[Path], ranges, key: str, *, resumed: list[int], ar: bool,
                 seed: int) -> dict:
    """Merge the shard folders into out_dir's trace, profile (and ar.json); describe the shards."""
    traces = [Trace.load(d) for d in dirs]
    trace = merge_traces(traces)
    trace.save(out_dir)
    shards, samples, ar_parts, retried = [], [], [], []
    fix = "delete the shard folder to record it again"
    for i, d in enumerate(dirs):
        done = read_done(d, key)
        device = traces[i].header.get("device")
        if (d / "samples.json").is_file():
            data = read_json(d / "samples.json", what="profile samples of a shard", fix=fix)
            samples.append((str(device), samples_from_dict(data)))
        if ar:
            ar_parts.append(read_json(d / AR_FILE, what="AR timing of a shard", fix=fix))
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
        atomic_write_json(out_dir / AR_FILE, merge_ar(ar_parts))
    return {"out": str(out_dir), "shards": shards, "retried_prompts": retried, "resumed_shards": resumed,
            "positions": trace.header["positions"]}
