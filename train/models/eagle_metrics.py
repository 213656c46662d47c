"""Measurements of an EAGLE-3 head beside the separate draft LM, on code the corpus excludes.

Definitions (every figure is against the fp32 target, as it runs at decode time):
- teacher-forced agreement: at position j of a held-out window, the head gets (fc(f_j), c_{j+1}) and the draft
  the prefix c_0..c_{j+1}; agreement = how often their argmax equals the target's argmax for c_{j+2};
- calibration: positions binned by the drafter's top-1 probability (10 equal bins); per bin the count, mean
  top-1 probability and agreement; `ece` = count-weighted mean |probability - agreement|;
- along the target's greedy text (held-out prompts continued greedily by the target): chain tau at depth D =
  mean over start positions of 1 + the number of leading draft tokens (of a greedy chain of D) that equal the
  target's tokens (the accepted length of greedy chain speculation, bonus token included). The head drafts
  with true target features for committed tokens and its own hidden states along the chain; the separate draft
  runs on the committed prefix. `step1_agreement` is the first chain step's hit rate;
- step cost: median batch-1 cached decode step (fp32, context 128) of the head vs the target, timed alternately,
  at 1 and 2 threads; the ratio carries the 10th-90th percentile of per-pair ratios.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from transformers import DynamicCache

from specpilot.drafting.eagle import Eagle3Head
from specpilot.train.models.build_eagle import unroll
from specpilot.train.models.training import generate, latency_summary

TAU_DEPTHS = (2, 3, 4, 6)


def _windows(stream: torch.Tensor, count: int, length: int, device: str) -> torch.Tensor:
    starts = np.linspace(0, len(stream) - length - 1, count).astype(int)
    return torch.stack([stream[s: s + length] for s in starts]).long().to(device)


def calibration(conf: torch.Tensor, hit: torch.Tensor, bins: int = 10) -> dict:
    """Binned top-1 probability vs agreement (see the module docstring)."""
    edges = torch.linspace(0, 1, bins + 1)
    rows, ece = [], 0.0
    for i in range(bins):
        sel = (conf >= edges[i]) & ((conf < edges[i + 1]) if i < bins - 1 else (conf <= 1))
        if sel.any():
            c, a = float(conf[sel].mean()), float(hit[sel].float().mean())
            rows.append({"bin": [round(float(edges[i]), 2), round(float(edges[i + 1]), 2)], "count": int(sel.sum()),
                         "mean_top1_prob": round(c, 4), "agreement": round(a, 4)})
            ece += int(sel.sum()) * abs(c - a)
    return {"bins": rows, "ece": round(ece / max(1, conf.numel()), 4)}


@torch.inference_mode()
def teacher_forced(head: Eagle3Head, target, draft, stream: torch.Tensor, *, windows: int, seq: int,
                   device: str) -> dict:
    """Teacher-forced agreement and calibration of the head and the draft on held-out windows."""
    x = _windows(stream, windows, seq, device)
    out = target(input_ids=x, output_hidden_states=True)
    t_arg = out.logits.argmax(-1)[:, 1:]                                   # target's choice for c_{j+2}
    h_logits, _ = head(x[:, 1:], head.fuse(out.hidden_states)[:, :-1],
                       position_ids=torch.arange(seq - 1, device=device)[None].expand(windows, -1))
    h_prob = h_logits.softmax(-1)
    h_hit = head.to_target_ids(h_prob.argmax(-1)) == t_arg
    d_prob = draft(input_ids=x).logits.float().softmax(-1)[:, 1:]
    d_hit = d_prob.argmax(-1) == t_arg
    return {name: {"agreement": round(float(hit.float().mean()), 4), "positions": int(hit.numel()),
                   "calibration": calibration(prob.max(-1).values.reshape(-1).cpu(), hit.reshape(-1).cpu())}
            for name, prob, hit in (("head", h_prob, h_hit), ("draft", d_prob, d_hit))}


def _tau(hits: torch.Tensor) -> dict:
    """hits [starts, depth] bool (chain step k correct) -> step-1 agreement and tau at TAU_DEPTHS."""
    leading = hits.long().cumprod(dim=1)                                   # 1 while every earlier step hit
    return {"step1_agreement": round(float(hits[:, 0].float().mean()), 4),
            "tau": {str(d): round(1.0 + float(leading[:, :d].sum(1).float().mean()), 4) for d in TAU_DEPTHS},
            "chains": int(hits.shape[0])}


@torch.inference_mode()
def along_greedy_text(head: Eagle3Head, target, draft, stream: torch.Tensor, *, prompts: int, prompt_len: int,
                      new_tokens: int, device: str) -> dict:
    """Step-1 agreement and chain tau (depths 2/3/4/6) of the head and the draft along target greedy text."""
    depth = max(TAU_DEPTHS)
    seqs = generate(target, _windows(stream, prompts, prompt_len, device), new_tokens)   # [p, P + N]
    total = seqs.shape[1]
    out = target(input_ids=seqs, output_hidden_states=True)
    n = total - depth                                                      # head entries j = 0..n-1
    steps = unroll(head, head.fuse(out.hidden_states)[:, :n], seqs, steps=depth)
    # chain rooted at j drafts c_{j+2}..; keep roots whose whole chain lies in the generated part
    roots = torch.arange(prompt_len - 2, total - depth - 1, device=device)
    head_hits = torch.stack([head.to_target_ids(steps[k].argmax(-1))[:, roots] == seqs[:, roots + k + 2]
                             for k in range(depth)], dim=-1)
    d_arg = draft(input_ids=seqs).logits.argmax(-1)                         # d_arg[i] predicts c_{i+1}
    draft_hits = torch.stack([d_arg[:, roots + k + 1] == seqs[:, roots + k + 2] for k in range(depth)], dim=-1)
    return {"head": _tau(head_hits.reshape(-1, depth)), "draft": _tau(draft_hits.reshape(-1, depth)),
            "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens}


@torch.inference_mode()
def step_cost(head: Eagle3Head, target, *, threads: int, context: int = 128, reps: int = 200,
              seed: int = 0) -> dict:
    """Median batch-1 cached decode step of the head vs the target (fp32, CPU), timed alternately."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, target.config.vocab_size, (1, context), generator=gen)
    t_cache = DynamicCache(config=target.config)
    out = target(input_ids=x, cache=t_cache, use_cache=True, output_hidden_states=True)
    t_tok = out.logits[:, -1:].argmax(-1)
    h_cache = head.new_cache()
    pos = torch.arange(context)[None]
    _, hid = head(x, head.fuse(out.hidden_states), position_ids=pos, cache=h_cache)
    h_in, h_tok, h_pos = hid[:, -1:], x[:, -1:], torch.tensor([[context]])
    times: dict[str, list[float]] = {"target": [], "head": []}
    for i in range(reps + 10):
        t = time.perf_counter()
        t_tok = target(input_ids=t_tok, cache=t_cache, use_cache=True).logits[:, -1:].argmax(-1)
        dt_target = time.perf_counter() - t
        t = time.perf_counter()
        logits, h_out = head(h_tok, h_in, position_ids=h_pos, cache=h_cache)
        h_tok = head.to_target_ids(logits[:, -1:].argmax(-1))
        dt_head = time.perf_counter() - t
        t_cache.crop(-1)
        h_cache.crop(-1)  # both contexts stay fixed
        if i >= 10:
            times["target"].append(dt_target)
            times["head"].append(dt_head)
    torch.set_num_threads(saved)
    return latency_summary(times, "head", threads=threads, context=context, reps=reps)


def eagle_metrics(head: Eagle3Head, target, draft, held: dict[str, torch.Tensor], *, device: str, quick: bool,
                  seed: int = 0) -> dict:
    """All of the above on every held-out set, plus the step cost at 1 and 2 threads."""
    tf = dict(windows=4, seq=32) if quick else dict(windows=32, seq=256)
    greedy = dict(prompts=2, prompt_len=16, new_tokens=24) if quick else dict(prompts=24, prompt_len=64,
                                                                             new_tokens=96)
    for m in (head, target, draft):
        m.float().eval()
    metrics = {"teacher_forced": {name: teacher_forced(head, target, draft, s, device=device, **tf)
                                  for name, s in held.items()},
               "target_greedy": {name: along_greedy_text(head, target, draft, s, device=device, **greedy)
                                 for name, s in held.items()}}
    head_cpu, target_cpu = head.cpu(), target.cpu()
    metrics["step_cost"] = {f"threads_{n}": step_cost(head_cpu, target_cpu, threads=n, reps=20 if quick else 300,
                                                      seed=seed) for n in (1, 2)}
    head.to(device)
    target.to(device)
    return metrics
