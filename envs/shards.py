"""What the shards of a recording (`specpilot.envs.record.record_task`) carry besides their traces, and its files.

A shard's profile samples travel and are stored as plain data (`samples_to_dict`) and pool into one profile
(`merge_samples`, the device of every sample kept); its live autoregressive timing (`measure_ar`) pools into
ar.json (`merge_ar`). OUT/shards/shard-XXXX/done.json marks a finished shard of one recording plan (`plan_key`,
`read_done`: the models by content hash and dtype, not by path, so the same pair elsewhere resumes);
OUT/cluster.json says which worker recorded which shard.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from specpilot.artifacts.common import json_digest
from specpilot.artifacts.trace import AR_FILE
from specpilot.drafting.errors import InputFileError
from specpilot.drafting.files import read_json
from specpilot.envs.profile import ProfileSamples

SHARDS_DIR = "shards"
DONE_FILE = "done.json"
CLUSTER_FILE = "cluster.json"  # which worker recorded which shard (the per-worker detail of a recording)


def measure_ar(pair, prompts: Sequence, *, max_new_tokens: int, warmup: int = 1) -> dict:
    """Live autoregressive seconds per token on `prompts` (after `warmup` untimed generations)."""
    from specpilot.drafting.decoder import autoregressive_generate

    items = [getattr(p, "prompt", p) for p in prompts]
    for _ in range(warmup):
        autoregressive_generate(pair, items[0], max_new_tokens=max_new_tokens)
    timing = []
    for p in items:
        out = autoregressive_generate(pair, p, max_new_tokens=max_new_tokens)
        timing.append((out.num_tokens, out.total_s))
    return ar_summary(timing, prompts=len(items), max_new_tokens=max_new_tokens)


def ar_summary(timing: Sequence[tuple[int, float]], *, prompts: int, max_new_tokens: int,
               source: str | None = None) -> dict:
    """The ar.json dict of per-generation (tokens, seconds) of live autoregressive generations."""
    tokens = sum(int(n) for n, _ in timing)
    seconds = sum(float(s) for _, s in timing)
    out = {"seconds_per_token": seconds / max(tokens, 1), "tokens": tokens, "time_s": seconds,
           "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"), "prompts": prompts,
           "max_new_tokens": max_new_tokens, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if source:
        out["source"] = source
    return out


# ---------------------------------------------------------------------------------------------------------------------
# merging


def samples_to_dict(samples: ProfileSamples) -> dict:
    """ProfileSamples as plain JSON-able data (shards travel and are stored this way)."""
    return {"max_depth": samples.max_depth, "width": samples.width,
            "first": {str(k): list(v) for k, v in samples.first.items()},
            "levels": {str(k): list(v) for k, v in samples.levels.items()},
            "verify": [list(v) for v in samples.verify], "meta": dict(samples.meta),
            "decisions": {str(k): list(v) for k, v in samples.decisions.items()}}


def samples_from_dict(data: dict) -> ProfileSamples:
    samples = ProfileSamples(max_depth=int(data["max_depth"]), width=int(data["width"]), meta=dict(data["meta"]))
    for k, v in data["first"].items():
        samples.first[int(k)].extend(v)
    for k, v in data["levels"].items():
        samples.levels[int(k)].extend(v)
    samples.verify.extend((int(a), int(b), float(c)) for a, b, c in data["verify"])
    for k, v in (data.get("decisions") or {}).items():
        samples.decisions[str(k)].extend(float(x) for x in v)
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
        for question, values in s.decisions.items():  # (each shard's probe timed on its own machine)
            merged.decisions[question].extend(values)
    merged.meta["measured_s"] = float(sum(s.meta.get("measured_s", 0.0) for _, s in parts))
    merged.meta.pop("ar_s", None), merged.meta.pop("ar_tokens", None)
    if all(s.meta.get("ar_tokens") for _, s in parts):  # AR timed beside every shard's profile prompts
        merged.meta["ar_s"] = float(sum(s.meta["ar_s"] for _, s in parts))
        merged.meta["ar_tokens"] = int(sum(s.meta["ar_tokens"] for _, s in parts))
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


# what identifies a pair in a plan: its models' contents and numbers, never the paths they were loaded from (the same
# pair written relatively, absolutely or copied elsewhere resumes; a pair's "name" is made of its folders' names)
PAIR_CONTENT = ("target_hash", "draft_hash", "drafter", "vocab_size")


def pair_content(identity: dict, dtype: str | None = None) -> dict:
    """The parts of `ModelPair.identity()` (and the weights' dtype) a recording depends on: content hashes, drafter
    kind, vocabulary and dtype; the target/draft paths and the name made of them are left out."""
    out = {k: identity.get(k) for k in PAIR_CONTENT}
    if dtype is not None:
        out["dtype"] = str(dtype).replace("torch.", "")
    return out


def plan_key(**parts) -> str:
    """A short hash of everything a recording's shards depend on (a shard of another plan is never reused)."""
    return json_digest(parts)


def plan_fields(**parts) -> dict:
    """What done.json keeps of a plan to say, when a shard is refused, which of its fields differ: short values as
    they are, long ones (the prompts) as a count and a hash."""
    out = {}
    for name, value in parts.items():
        text = json.dumps(value, sort_keys=True, default=str)
        if len(text) <= 80:
            out[name] = json.loads(text)
        else:
            digest = hashlib.sha256(text.encode()).hexdigest()[:12]
            out[name] = f"{len(value)} items, sha256 {digest}" if isinstance(value, (list, tuple)) else \
                f"sha256 {digest}"
    return out


def _differences(recorded: dict, now: dict) -> list[str]:
    return [f"{name} (recorded {recorded.get(name, 'unset')!r}, now {now.get(name, 'unset')!r})"
            for name in sorted(set(recorded) | set(now)) if recorded.get(name) != now.get(name)]


def recorded_keys(shards_dir: Path) -> set[str]:
    """The plan keys in the done.json files under shards_dir (unreadable ones skipped: `read_done` reports them)."""
    keys = set()
    for done in sorted(Path(shards_dir).glob(f"shard-*/{DONE_FILE}")):
        try:
            key = json.loads(done.read_text(encoding="utf-8")).get("key")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(key, str):
            keys.add(key)
    return keys


def read_done(shard_dir: Path, key: str, *, plan: dict | None = None, also: Sequence[str] = ()) -> dict | None:
    """The shard's done.json, None when the shard is not finished; refuses a shard of another recording, naming
    the fields of `plan` (`plan_fields`) that differ from the ones it was recorded with. `also`: keys of the same
    plan as older versions wrote them (a shard they finished still resumes)."""
    if not (shard_dir / DONE_FILE).is_file():
        return None
    done = read_json(shard_dir / DONE_FILE, what="finished-shard marker", fix="delete the shard folder to record "
                     "it again")
    if done.get("key") == key or (done.get("key") in also and done.get("key") is not None):
        return done
    recorded = done.get("plan")
    if isinstance(recorded, dict) and plan is not None:
        diff = _differences(recorded, plan)
        if any(not d.startswith("shards ") for d in diff):  # the layout alone is resumed (`record._shard_layout`)
            diff = [d for d in diff if not d.startswith("shards ")]
        elif diff:
            diff = [d + " (the shard layout follows --workers, or the Ray cluster's size, when the recording "
                    "started: give that --workers / --ray again)" for d in diff]
        what = "its " + "; ".join(diff) if diff else "its settings hash differently (a newer specpilot?)"
    else:
        what = ("it was written by an older specpilot that kept no settings to compare (its prompts, tree, "
                "settings, models or their paths differ)")
    raise InputFileError(f"{shard_dir} holds a finished shard of another recording: {what}. Run again with what it "
                         f"was recorded with to resume it, or use another --out to record these settings without "
                         f"touching it")
