"""The replay data of a training run: traces of the training and validation prompts (`record_traces`).

    RUN/traces/{train,validation}/   trace.npz, trace.json, profile.json (`specpilot.envs.record.record_task`),
                                     ar.json (live autoregressive timing of the same prompts, `measure_ar`)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specpilot.artifacts.trace import AR_FILE, is_trace, write_ar  # noqa: F401 (AR_FILE re-exported)
from specpilot.drafting.types import TreeConfig
from specpilot.policies.observation import default_size_actions



@dataclass(frozen=True)
class TaskTraces:
    """The replay data of a run: a trace of the training prompts and one of the validation prompts."""

    train: Path
    validation: Path

    @classmethod
    def resolve(cls, traces: "TaskTraces | str | Path") -> "TaskTraces":
        """A TaskTraces, or a directory holding train/ and validation/ trace directories."""
        if isinstance(traces, TaskTraces):
            return traces
        root = Path(traces)
        out = cls(root / "train", root / "validation")
        for part in (out.train, out.validation):
            if not is_trace(part):
                raise FileNotFoundError(f"no trace at {part}: record the train and validation traces first "
                                        "(`record_traces(...)` or `specpilot record --suite train|validation`)")
        return out


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


def record_traces(pair, out_dir: str | Path, *, train_prompts: Sequence, val_prompts: Sequence,
                  tree: TreeConfig | None = None, max_new_tokens: int = 64, profile_prompts: int | None = 8,
                  seed: int = 0, progress: bool = False) -> TaskTraces:
    """Record out_dir/train and out_dir/validation (trace + latency profile + live AR timing, `ar.json`).

    Prompts are strings or token-id lists (callers resolve suite names: `specpilot.eval.suites.load_suite`); the
    recorded tree defaults to TreeConfig with max_size raised to the largest size action of the device.
    Held-out prompts never belong here.
    """
    from specpilot.envs.record import record_task

    if tree is None:
        tree = TreeConfig(max_size=max(TreeConfig().max_size, *default_size_actions(str(pair.device))))
    out = TaskTraces(Path(out_dir) / "train", Path(out_dir) / "validation")
    for prompts, path in ((train_prompts, out.train), (val_prompts, out.validation)):
        prompts = [getattr(p, "prompt", p) for p in prompts]
        record_task(pair, tree, prompts, path, max_new_tokens=max_new_tokens, profile_prompts=profile_prompts,
                    seed=seed, progress=progress)
        ar = measure_ar(pair, prompts, max_new_tokens=max_new_tokens)
        write_ar(path, ar)
    return out
