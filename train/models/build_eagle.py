"""Train the embedded pair's EAGLE-3 head (`specpilot models build --eagle`, or `--eagle-only` to rebuild it alone).

Recipe (EAGLE-3 "training-time test", sized for a 2-core CPU):

1. draft vocabulary: the `draft_vocab_size` target ids the target most often predicts (argmax counts over corpus
   windows and target-written text; corpus frequency breaks ties), so the head's output layer stays cheap;
2. features: a frozen bf16 copy of the target runs with `output_hidden_states` under inference mode; the head
   fuses the states entering layers (2, L//2, L-3);
3. data: every batch mixes standard-library corpus windows with text the target wrote itself (greedy and sampled
   at T=1, shared with the separate draft; `pool_share` of the rows), from the first step;
4. training-time test: the head is unrolled `ttt_steps` times on its own output hidden states with the attention
   mask inference uses (`ttt_mask`); the loss at every step is the cross-entropy to the target's next-token
   distribution restricted to the draft vocabulary, plus `hard_weight` x cross-entropy to the target's argmax,
   with step k weighted `step_decay**(k-1)`;
5. seeded, step-budgeted (a wall-clock cap only as a safety), bf16 weights with fp32 masters; saved in the
   released layout (bf16 safetensors) and measured by `specpilot.train.models.eagle_metrics`.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specpilot.drafting.eagle import Eagle3Config, Eagle3Head
from specpilot.drafting.files import atomic_dir
from specpilot.train.models.training import bf16_teacher, log, random_windows, steps_for, train_loop
from specpilot.train.models.optim import use_bf16


@dataclass(frozen=True)
class EagleBudget:
    """Hyper-parameters and step budget of the head's training (weights depend on these and the seed only)."""

    tokens: int = 1_200_000          # head positions trained (each unrolled ttt_steps times)
    batch: int = 8                   # windows per step
    pool_share: float = 0.5          # fraction of each batch's windows that the target wrote itself
    seq: int = 128                   # head positions per window (the window holds seq + ttt_steps tokens)
    ttt_steps: int = 5               # training-time-test unroll depth
    lr: float = 3e-3
    # 2048 covers every target argmax seen in the build (166K positions); measured head step / target step
    # (8x384 target, batch-1 fp32 decode, quiet, 300 interleaved pairs): 1024 0.15, 2048 0.17, 4096 0.20, 8192 0.27
    draft_vocab_size: int = 2048
    vocab_windows: int = 256         # corpus windows whose target argmax is counted for the draft vocabulary
    hard_weight: float = 0.1         # weight of the cross-entropy to the target's argmax
    step_decay: float = 0.8          # loss weight of unroll step k is step_decay ** (k - 1)
    init_from_target: bool = True    # lm_head / norm start as the target's (see init_from_target)
    max_minutes: float = 120.0       # safety cap only

    @classmethod
    def quick(cls) -> "EagleBudget":
        return cls(tokens=512, batch=4, seq=32, ttt_steps=3, draft_vocab_size=256, vocab_windows=4, max_minutes=5.0)


def ttt_mask(n: int, step: int, device=None) -> torch.Tensor:
    """[1, 1, n, step * n] bool mask of unroll step `step` over the keys of steps 1..step (cache order).

    Entry j of step k (position j + k - 1, the k-th draft of the chain rooted at committed position j) sees
    the step-1 entries at positions <= j (the committed prefix, fed true target features), its own chain's
    earlier steps and itself: exactly what a chain drafted at inference time attends to."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (step - 1), dim=1)[None, None]


def unroll(head: Eagle3Head, fused: torch.Tensor, tokens: torch.Tensor, *, steps: int) -> list[torch.Tensor]:
    """Training-time test. fused [b, n, H] = fc(f_j); tokens [b, n + steps] (c_0..); returns per step k the draft
    logits [b, n, draft_vocab] of entry j, which predict c_{j+k+1} from input token c_{j+k} at position j+k-1.
    Along the accepted path drafted tokens equal the true ones, so true tokens as inputs give the same
    leading-match counts as greedy chains."""
    b, n, _ = fused.shape
    cache = head.new_cache()
    hidden, outs = fused, []
    base = torch.arange(n, device=fused.device)[None].expand(b, n)
    for k in range(1, steps + 1):
        logits, hidden = head(tokens[:, k:k + n], hidden, position_ids=base + (k - 1),
                              attention_mask=ttt_mask(n, k, fused.device), cache=cache)
        outs.append(logits)
    return outs


@torch.inference_mode()
def teacher_pass(teacher, x: torch.Tensor, aux_layer_ids: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [b, n, 3 * Ht] at aux_layer_ids, target logits [b, n, V] float) of token windows x [b, n]."""
    out = teacher(input_ids=x, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)
    return feats.clone(), out.logits.float().clone()  # clones: inference tensors cannot enter autograd


@torch.inference_mode()
def choose_draft_vocab(teacher, stream: torch.Tensor, pool: torch.Tensor, *, size: int, windows: int, seq: int,
                       seed: int, device: str) -> tuple[torch.Tensor, dict]:
    """The `size` target ids the target predicts most often (argmax over `windows` corpus windows and all of
    `pool`), ties broken by corpus frequency; returns (ascending ids, coverage statistics)."""
    vocab = teacher.config.vocab_size
    counts = torch.zeros(vocab, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed + 11)
    corpus = random_windows(stream, gen, windows, seq, device)
    for chunk in (*corpus.split(16), *pool.split(16)):
        arg = teacher(input_ids=chunk.to(device)).logits.argmax(-1).reshape(-1).cpu()
        counts += torch.bincount(arg, minlength=vocab).double()
    freq = torch.bincount(stream.long(), minlength=vocab).double()
    score = counts + freq / (freq.sum() + 1.0)  # the fraction < 1 only orders tokens of equal argmax count
    ids = torch.topk(score, size).indices.sort().values
    coverage = float(counts[ids].sum() / counts.sum())
    return ids, {"draft_vocab_size": size, "argmax_positions_counted": int(counts.sum()),
                 "argmax_coverage": round(coverage, 5),
                 "corpus_token_coverage": round(float(freq[ids].sum() / freq.sum()), 5)}


def _step_loss(logits: torch.Tensor, t_logits: torch.Tensor, vocab_ids: torch.Tensor, t2d_index: torch.Tensor,
               hard_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, agreement) of one unroll step: soft CE to the target's distribution renormalised on the draft
    vocabulary, plus hard_weight x CE to the target's argmax where the draft vocabulary has it."""
    logq = F.log_softmax(logits.float(), dim=-1)                          # [b, n, Vd]
    p = F.softmax(t_logits[..., vocab_ids], dim=-1)                       # [b, n, Vd]
    soft = -(p * logq).sum(-1).mean()
    arg = t2d_index[t_logits.argmax(-1)]                                  # [b, n], -1 when not draftable
    ok = arg >= 0
    hard = -logq.gather(-1, arg.clamp(min=0)[..., None])[..., 0][ok].mean() if ok.any() else soft * 0
    agree = (logits.argmax(-1) == arg).float().mean()
    return soft + hard_weight * hard, agree


def train_eagle_head(head: Eagle3Head, teacher, stream: torch.Tensor, pool: torch.Tensor, *, budget: EagleBudget,
                     seed: int, device: str) -> dict:
    """Training-time-test training of `head` (see the module docstring) for ceil(tokens / (batch*seq)) steps."""
    gen = torch.Generator().manual_seed(seed + 3)
    K, n = budget.ttt_steps, budget.seq
    corpus_rows = min(budget.batch - 1, max(1, round(budget.batch * (1.0 - budget.pool_share))))
    if pool.shape[1] < n + K:
        raise ValueError(f"target-written windows have {pool.shape[1]} tokens; the head needs seq + ttt_steps = "
                         f"{n + K}: lower EagleBudget.seq or raise the build's window length")
    vocab_ids = torch.nonzero(head.t2d).reshape(-1)
    t2d_index = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=head.t2d.device)
    t2d_index[vocab_ids] = torch.arange(vocab_ids.numel(), device=vocab_ids.device)
    weights = [budget.step_decay ** k for k in range(K)]
    ema = None

    def step_loss(step: int) -> tuple[torch.Tensor, str]:
        nonlocal ema
        rows = torch.randint(0, pool.shape[0], (budget.batch - corpus_rows,), generator=gen)
        starts = torch.randint(0, pool.shape[1] - (n + K) + 1, (1,), generator=gen).item()
        x = torch.cat([random_windows(stream, gen, corpus_rows, n + K - 1, device),
                       pool[rows, starts:starts + n + K].to(device)])        # [batch, n + K]
        feats, t_logits = teacher_pass(teacher, x, head.aux_layer_ids)
        outs = unroll(head, head.fc(feats[:, :n].to(head.fc.weight.dtype)), x, steps=K)
        losses, agrees = zip(*(_step_loss(o, t_logits[:, k + 1:k + 1 + n], vocab_ids, t2d_index, budget.hard_weight)
                               for k, o in enumerate(outs)))
        loss = sum(w * l for w, l in zip(weights, losses)) / sum(weights)
        cur = [a.item() for a in agrees]
        ema = cur if ema is None else [0.95 * e + 0.05 * c for e, c in zip(ema, cur)]
        return loss, f"loss {loss.item():.3f} argmax agreement by unroll step {[round(e, 3) for e in ema]}"

    run = train_loop(head, step_loss, name="eagle", steps_total=steps_for(budget.tokens, budget.batch, n),
                     lr=budget.lr, bf16=use_bf16(device), weight_decay=0.0, max_minutes=budget.max_minutes,
                     units_per_step=budget.batch * n, unit="pos")
    return {"steps": run["steps"], "steps_planned": run["steps_planned"], "positions": run["steps"] * budget.batch * n,
            "seconds": run["seconds"], "final_agreement_ema_by_step": [round(e, 4) for e in ema],
            "stopped_by_time_cap": run["stopped_by_time_cap"], **asdict(budget)}


@torch.no_grad()
def init_from_target(head: Eagle3Head, target) -> None:
    """Start the head's output side as the target's: `norm` from the target's final norm and `lm_head` from the
    target's output rows of the draft vocabulary. The head's output hidden state then begins in the space the
    target's own last hidden state lives in, which it is trained to imitate."""
    ids = torch.nonzero(head.t2d).reshape(-1)
    head.lm_head.weight.copy_(target.get_output_embeddings().weight[ids].to(head.lm_head.weight.dtype))
    head.norm.weight.copy_(target.model.norm.weight.to(head.norm.weight.dtype))


def build_eagle_head(out_dir: str | Path, target, train_stream: torch.Tensor, *, pool: torch.Tensor, seed: int,
                     device: str, budget: EagleBudget) -> tuple[Eagle3Head, dict]:
    """Choose the draft vocabulary, train the head against `target` and save it to out_dir (released layout,
    bf16). Returns (the head in fp32, its build metrics); `specpilot.train.models.eagle_metrics` measures it."""
    teacher = bf16_teacher(target, device)
    t0 = time.time()
    vocab_ids, vocab_stats = choose_draft_vocab(teacher, train_stream, pool, size=budget.draft_vocab_size,
                                                windows=budget.vocab_windows, seq=budget.seq + budget.ttt_steps,
                                                seed=seed, device=device)
    log(f"eagle: draft vocabulary {vocab_stats} in {time.time() - t0:.0f}s")
    torch.manual_seed(seed + 2)
    config = Eagle3Config.for_target(target.config, draft_vocab_size=budget.draft_vocab_size)
    head = Eagle3Head(config, target).to(device)
    head.set_draft_vocab(vocab_ids)
    if budget.init_from_target:
        init_from_target(head, target)
    log(f"eagle head {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M params, aux layers "
        f"{config.aux_layer_ids}, draft vocabulary {config.draft_vocab_size}")
    train = train_eagle_head(head, teacher, train_stream, pool, budget=budget, seed=seed, device=device)
    del teacher
    with atomic_dir(out_dir) as staging:  # an interrupted save leaves the earlier head (or none), never a torn one
        head.to(torch.bfloat16).save_pretrained(staging)  # bf16 on disk like the target and draft
    head.float()
    return head, {"config": config.to_dict(), "params": sum(p.numel() for p in head.parameters()),
                  "vocabulary": vocab_stats, "train": train}
