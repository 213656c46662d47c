"""Shared pieces of the model builders (build_pair, build_eagle, eagle_metrics): one training loop and its helpers.

- `train_loop`: the step loop every builder runs: a caller's step loss, backward, an AdamW step on the
  step-based schedule (`lr_at`), a progress line every 60 s, and the wall-clock safety cap;
- `random_windows` / `steps_for`: seeded corpus windows and the step budget they give;
- `bf16_teacher`: a frozen bf16 copy of a model for teacher forwards;
- `generate`: batched greedy or T=1 continuation with a KV cache (target-written text, measurements);
- `log`: the builders' timestamped progress lines.

The builders import these; this module imports no builder (no import circles).
"""
from __future__ import annotations

import copy
import math
import time
from typing import Callable

import numpy as np
import torch

from specpilot.train.models.optim import MasterWeightsAdamW, lr_at, use_bf16


def latency_summary(times: dict[str, list[float]], drafter: str, **meta) -> dict:
    """Median forward times (ms) of the target and the drafter ("draft" or "head") and their ratio, with the
    10th-90th percentile of the per-repetition ratio (the builders' metrics.json latency entries)."""
    ms = {k: 1000 * float(np.median(v)) for k, v in times.items()}
    ratio = np.array(times[drafter]) / np.array(times["target"])
    return {"target_ms": round(ms["target"], 3), f"{drafter}_ms": round(ms[drafter], 3),
            "ratio": round(ms[drafter] / ms["target"], 4),
            "ratio_p10_p90": [round(float(q), 4) for q in np.percentile(ratio, [10, 90])], **meta, "dtype": "float32"}


def log(msg: str) -> None:
    print(f"[build_pair {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def random_windows(stream: torch.Tensor, gen: torch.Generator, batch: int, seq: int, device: str) -> torch.Tensor:
    """[batch, seq + 1] windows of `stream` at starts drawn from `gen` (inputs plus the next-token targets)."""
    starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
    return torch.stack([stream[s: s + seq + 1] for s in starts.tolist()]).long().to(device)


def steps_for(tokens: int, batch: int, seq: int) -> int:
    return max(1, math.ceil(tokens / (batch * seq)))


def bf16_teacher(model, device: str):
    """A frozen bf16 copy of `model` for teacher forwards (native bf16 matmuls), or the model itself where bf16
    does not pay; training targets then carry bf16 rounding (~1e-2 relative), far below the students' error."""
    if not use_bf16(device):
        return model
    return copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)


@torch.inference_mode()
def generate(model, prompts: torch.Tensor, new_tokens: int, *, sample_gen: torch.Generator | None = None
             ) -> torch.Tensor:
    """Batched continuation of equal-length prompts with a KV cache (no padding needed): greedy, or sampled at
    temperature 1 from the model's distribution when `sample_gen` (a seeded CPU generator) is given."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompts, cache=cache, use_cache=True)
    seqs = [prompts]
    for _ in range(new_tokens):
        logits = out.logits[:, -1].float()
        if sample_gen is None:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(logits.softmax(-1).cpu(), 1, generator=sample_gen).to(logits.device)
        seqs.append(nxt)
        out = model(input_ids=nxt, cache=cache, use_cache=True)
    return torch.cat(seqs, dim=1)


def train_loop(model: torch.nn.Module, step_loss: Callable[[int], tuple[torch.Tensor, str]], *, name: str,
               steps_total: int, lr: float, bf16: bool, weight_decay: float, max_minutes: float,
               units_per_step: int, unit: str) -> dict:
    """Train `model` for steps 1..steps_total: `step_loss(step)` returns (loss, progress note); the loop runs
    backward and a `MasterWeightsAdamW` step at `lr_at(step progress, lr)`, logs
    "`name` step s/N `note` <units>/s elapsed" every 60 s and at the last step, and stops early only at the
    `max_minutes` safety cap (then flagged). Leaves the model in fp32 eval mode.
    Returns {"steps", "steps_planned", "seconds", "stopped_by_time_cap"}."""
    opt = MasterWeightsAdamW(model, lr=lr, bf16=bf16, weight_decay=weight_decay)
    model.train()
    t0, last_log, step, capped = time.time(), 0.0, 0, False
    for step in range(1, steps_total + 1):
        loss, note = step_loss(step)
        loss.backward()
        opt.step(lr_at((step - 1) / steps_total, lr))
        elapsed = time.time() - t0
        if elapsed - last_log > 60 or step == steps_total:
            last_log = elapsed
            log(f"{name} step {step}/{steps_total} {note} {step * units_per_step / max(elapsed, 1e-6):.0f} {unit}/s "
                f"elapsed {elapsed / 60:.1f} min")
        if elapsed > max_minutes * 60 and step < steps_total:
            capped = True
            log(f"{name}: wall-clock safety cap ({max_minutes} min) hit at step {step}/{steps_total}")
            break
    opt.finish()
    model.eval()
    return {"steps": step, "steps_planned": steps_total, "seconds": round(time.time() - t0, 1),
            "stopped_by_time_cap": capped}
