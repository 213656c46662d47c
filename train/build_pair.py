"""Build the embedded default model pair (`specpilot models build`).

Everything is made offline from text every Python install has: the standard library's own sources (minus
`test/`, `idlelib/`, `site-packages` and site-specific files) plus the pure-Python sources of the pip and
setuptools wheels that `ensurepip` bundles. The steps:

1. collect the corpus and write a manifest (file list + sha256) so the build is auditable;
2. train a byte-level BPE tokenizer (exact round-trip of any text, one EOS token);
3. train a deep, narrow Llama target on a wall-clock budget;
4. distil a one-layer draft towards the target (KL to the target's logits on corpus text and on text the
   target itself generates greedily, which is the distribution speculative decoding sees);
5. measure on held-out code (the standard library's `test/` files, never trained on): target accuracy and
   perplexity, draft/target argmax agreement along the target's own greedy generations, and the cost of one
   cached decode step of each model (fp32, inference_mode, batch 1, the way the CPU decoder runs them);
6. save tokenizer/, target/, draft/ (bf16 safetensors), metrics.json and corpus_manifest.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

EOS = "<|endoftext|>"


def log(msg: str) -> None:
    print(f"[build_pair {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------- corpus

def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel: Path) -> bool:
    top = rel.parts[0]
    return (top in {"test", "idlelib", "site-packages", "dist-packages", "lib-dynload", "__pycache__"}
            or top.startswith("config-")  # the interpreter's build configuration: site-specific
            or rel.name.startswith("_sysconfigdata"))  # paths and flags of this particular install


def collect_corpus(*, max_files: int | None = None) -> tuple[list[tuple[str, str]], list[tuple[str, str]], dict]:
    """(train documents, held-out documents, manifest). Documents are (name, text) pairs.

    Files that are not UTF-8 are skipped (a handful of encoding test fixtures) rather than decoded lossily."""
    root = _stdlib_root()
    train: list[tuple[str, str]] = []
    held: list[tuple[str, str]] = []
    entries: list[dict] = []
    skipped: list[str] = []

    def add(name: str, data: bytes, into: list) -> None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(name)
            return
        into.append((name, text))
        if into is train:
            entries.append({"path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})

    max_held = None if max_files is None else max(4, max_files // 4)
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "test":
            if max_held is None or len(held) < max_held:
                held.append((str(rel), path.read_bytes().decode("utf-8", errors="replace")))
        elif not _excluded(rel) and (max_files is None or len(train) < max_files):
            add(str(rel), path.read_bytes(), train)
    # pip and setuptools as shipped with Python: more real-world code, still offline and identical everywhere.
    # (--quick, which passes max_files, reads only the first few standard-library files.)
    for wheel in sorted((root / "ensurepip" / "_bundled").glob("*.whl")) if max_files is None else []:
        with zipfile.ZipFile(wheel) as zf:
            for member in sorted(n for n in zf.namelist() if n.endswith(".py")):
                add(f"ensurepip/_bundled/{wheel.name}!{member}", zf.read(member), train)
    digest = hashlib.sha256("".join(f"{e['path']}\0{e['sha256']}\n" for e in entries).encode()).hexdigest()
    manifest = {
        "stdlib": str(root),
        "python": sys.version.split()[0],
        "files": entries,
        "num_files": len(entries),
        "total_bytes": sum(e["bytes"] for e in entries),
        "sha256": digest,
        "skipped_not_utf8": skipped,
        "held_out": "stdlib test/ (never trained on)",
        "held_out_files": len(held),
    }
    return train, held, manifest


# -------------------------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], *, vocab_size: int = 8192):
    """Byte-level BPE wrapped as a transformers fast tokenizer. Byte-level with no normalizer and no prefix
    space means decode(encode(text)) == text for every string (any script, emoji, tabs, CRLF)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   clean_up_tokenization_spaces=False)


def tokenize_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one id stream, each followed by EOS (so the models learn where files end)."""
    encs = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    eos = np.array([tokenizer.eos_token_id], dtype=np.int32)
    parts = [p for e in encs for p in (np.asarray(e.ids, dtype=np.int32), eos)]
    return torch.from_numpy(np.concatenate(parts))


# ------------------------------------------------------------------------------------------------ models

def model_configs(vocab_size: int, eos_token_id: int, *, quick: bool = False):
    """(target, draft) LlamaConfigs. On CPU a batch-1 decode step is dominated by per-layer overhead, so the
    target is deep and narrow and the draft is a single, narrower layer. The draft's width matters too: its
    tied 8192-way output head alone costs as much as ~2.5 target layers at width 256, and a 256-wide draft
    measured 0.24-0.26 of the target's step (too close to the 0.25 goal), a 128-wide one ~0.18.
    Tied embeddings keep the files small."""
    from transformers import LlamaConfig

    # (hidden, layers, heads, intermediate); SwiGLU intermediate ~2.7x hidden, head_dim 32 (quick) / 64.
    target, draft = ((64, 2, 2, 176), (32, 1, 1, 88)) if quick else ((256, 10, 4, 688), (128, 1, 2, 344))
    configs = []
    for hidden, layers, heads, inter in (target, draft):
        configs.append(LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=heads, intermediate_size=inter, max_position_embeddings=1024,
            tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0,
            eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=eos_token_id))
    return configs[0], configs[1]


def _new_model(config, seed: int):
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                                               do_sample=False)
    return model


def _use_bf16_autocast(device: str) -> bool:
    """bf16 autocast only where the hardware does bf16 matmuls natively: CUDA, or CPUs with AMX/AVX512-BF16.
    Without them (plain AVX2) PyTorch emulates bf16 and training is ~20x slower than fp32."""
    if device.startswith("cuda"):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def _lr_at(progress: float, peak: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warmup then cosine decay to floor*peak, on *time* progress so the schedule fits the budget."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.02)
    p = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p)))


def _batch(stream: torch.Tensor, gen: torch.Generator, batch: int, seq: int, device: str) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
    return torch.stack([stream[s: s + seq + 1] for s in starts.tolist()]).long().to(device)


def train_target(model, stream: torch.Tensor, *, minutes: float, seed: int, device: str, batch: int = 4,
                 seq: int = 256, lr: float = 1.5e-3) -> dict:
    """Next-token training on random windows until the wall-clock budget is spent. Small batches: with a
    few hundred thousand tokens in budget, more optimizer steps beat larger batches."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    use_bf16 = _use_bf16_autocast(device)
    model.train()
    budget, t0, last_log = minutes * 60.0, time.time(), 0.0
    steps, tokens, ema = 0, 0, None
    while (elapsed := time.time() - t0) < budget:
        for group in opt.param_groups:
            group["lr"] = _lr_at(elapsed / budget, lr)
        x = _batch(stream, gen, batch, seq, device)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps, tokens = steps + 1, tokens + batch * seq
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if elapsed - last_log > 60:
            last_log = elapsed
            log(f"target step {steps} tokens {tokens} loss {ema:.3f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{tokens / max(elapsed, 1e-6):.0f} tok/s elapsed {elapsed / 60:.1f} min")
    model.eval()
    return {"steps": steps, "tokens": tokens, "seconds": round(time.time() - t0, 1), "final_loss_ema": ema,
            "batch": batch, "seq_len": seq, "peak_lr": lr, "bf16_autocast": use_bf16}


@torch.inference_mode()
def greedy_generate(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Batched greedy continuation of equal-length prompts with a KV cache (no padding needed)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompts, cache=cache, use_cache=True)
    seqs = [prompts]
    for _ in range(new_tokens):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        seqs.append(nxt)
        out = model(input_ids=nxt, cache=cache, use_cache=True)
    return torch.cat(seqs, dim=1)


@torch.no_grad()
def init_draft_from_target(draft, target) -> None:
    """Give the draft a head start from the target. Same width: copy embeddings, first layer and final norm.
    Narrower: project the target's (tied) embeddings onto their top principal directions, which keeps the
    token geometry the target's output head relies on."""
    if draft.config.hidden_size == target.config.hidden_size:
        state = draft.state_dict()
        draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in state}, strict=False)
        return
    emb = target.get_input_embeddings().weight.float()
    _, _, vh = torch.linalg.svd(emb - emb.mean(0), full_matrices=False)
    proj = emb @ vh[: draft.config.hidden_size].T
    proj *= emb.norm(dim=1).mean() / proj.norm(dim=1).mean()  # keep the target's embedding scale
    draft.get_input_embeddings().weight.copy_(proj.to(draft.dtype))


def distil_draft(draft, target, stream: torch.Tensor, *, minutes: float, seed: int, device: str,
                 batch: int = 8, seq: int = 256, lr: float = 2e-3, gen_fraction: float = 0.3) -> dict:
    """Train the draft to match the target's next-token distribution (forward KL, target as teacher).

    Speculative acceptance is decided on the text the target itself produces, so up to `gen_fraction` of the
    budget first builds a pool of target greedy continuations (of training-corpus prompts); training then
    alternates between those and plain corpus windows (which keep the draft calibrated off that path)."""
    init_draft_from_target(draft, target)
    gen = torch.Generator().manual_seed(seed + 1)
    budget, t0 = minutes * 60.0, time.time()
    prompt_len, new = 32, seq - 32
    pool: list[torch.Tensor] = []
    while time.time() - t0 < gen_fraction * budget or not pool:
        pool.append(greedy_generate(target, _batch(stream, gen, 16, prompt_len - 1, device), new))
    pool_t = torch.cat(pool)
    log(f"draft: generated {pool_t.shape[0]} target continuations ({pool_t.numel()} tokens) "
        f"in {time.time() - t0:.0f}s")
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    use_bf16 = _use_bf16_autocast(device)
    draft.train()
    t1 = time.time()
    budget_left = max(budget - (t1 - t0), 1.0)
    steps, tokens, ema, last_log = 0, 0, None, 0.0
    while (elapsed := time.time() - t1) < budget_left:
        for group in opt.param_groups:
            group["lr"] = _lr_at(elapsed / budget_left, lr)
        if steps % 2 == 0:
            idx = torch.randint(0, pool_t.shape[0], (batch,), generator=gen)
            x = pool_t[idx][:, :-1]
        else:
            x = _batch(stream, gen, batch, seq, device)[:, :-1]
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=use_bf16):
            with torch.inference_mode():
                t_logp = F.log_softmax(target(input_ids=x).logits.float(), dim=-1)
            d_logp = F.log_softmax(draft(input_ids=x).logits.float(), dim=-1)
        t_logp = t_logp.clone()  # inference tensors cannot enter autograd
        loss = (t_logp.exp() * (t_logp - d_logp)).sum(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps, tokens = steps + 1, tokens + x.numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if elapsed - last_log > 60:
            last_log = elapsed
            log(f"draft step {steps} tokens {tokens} KL {ema:.3f} {tokens / max(elapsed, 1e-6):.0f} tok/s "
                f"elapsed {(time.time() - t0) / 60:.1f} min")
    draft.eval()
    return {"steps": steps, "tokens": tokens, "generated_tokens": int(pool_t.numel()),
            "seconds": round(time.time() - t0, 1), "final_kl_ema": ema, "batch": batch, "seq_len": seq,
            "peak_lr": lr}


# ------------------------------------------------------------------------------------------- evaluation

@torch.inference_mode()
def heldout_metrics(model, stream: torch.Tensor, *, windows: int, seq: int, device: str) -> dict:
    """Top-1 next-token accuracy and perplexity on evenly spaced held-out windows (deterministic)."""
    starts = np.linspace(0, len(stream) - seq - 2, windows).astype(int)
    nll, correct, count = 0.0, 0, 0
    for chunk in np.array_split(starts, max(1, windows // 8)):
        x = torch.stack([stream[s: s + seq + 1] for s in chunk]).long().to(device)
        logits = model(input_ids=x[:, :-1]).logits.float()
        y = x[:, 1:]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        count += y.numel()
    return {"accuracy": round(correct / count, 4), "perplexity": round(math.exp(nll / count), 3), "tokens": count}


@torch.inference_mode()
def greedy_agreement(target, draft, stream: torch.Tensor, *, prompts: int, prompt_len: int, new_tokens: int,
                     device: str) -> dict:
    """How often the draft's argmax equals the target's along text the target generates greedily from
    held-out prompts: the per-token acceptance rate of greedy speculative decoding."""
    starts = np.linspace(0, len(stream) - prompt_len - 1, prompts).astype(int)
    p = torch.stack([stream[s: s + prompt_len] for s in starts]).long().to(device)
    seqs = greedy_generate(target, p, new_tokens)
    t_arg = target(input_ids=seqs).logits.argmax(-1)[:, prompt_len - 1: -1]
    d_arg = draft(input_ids=seqs).logits.argmax(-1)[:, prompt_len - 1: -1]
    return {"agreement": round((t_arg == d_arg).float().mean().item(), 4), "positions": int(t_arg.numel()),
            "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens}


@torch.inference_mode()
def decode_step_ms(target, draft, *, context: int = 128, reps: int = 200, seed: int = 0) -> dict:
    """Median cost of one cached single-token decode step of each model (fp32, CPU, batch 1).

    The two models are timed alternately so that load from other processes hits both alike; the ratio
    is the figure that matters, the absolute numbers depend on the machine's load."""
    from transformers import DynamicCache

    models = {"target": target, "draft": draft}
    dtypes = {n: next(m.parameters()).dtype for n, m in models.items()}
    for m in models.values():
        m.float()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, target.config.vocab_size, (1, context), generator=gen)
    caches, toks, times = {}, {}, {n: [] for n in models}
    for n, m in models.items():
        caches[n] = DynamicCache(config=m.config)
        toks[n] = m(input_ids=x, cache=caches[n], use_cache=True).logits[:, -1:].argmax(-1)
    for i in range(reps + 10):
        for n, m in models.items():
            t = time.perf_counter()
            out = m(input_ids=toks[n], cache=caches[n], use_cache=True)
            toks[n] = out.logits[:, -1:].argmax(-1)
            dt = time.perf_counter() - t
            caches[n].crop(-1)  # keep the context length fixed
            if i >= 10:
                times[n].append(dt)
    for n, m in models.items():
        m.to(dtypes[n])
    ms = {n: 1000 * float(np.median(v)) for n, v in times.items()}
    return {"target_ms": round(ms["target"], 3), "draft_ms": round(ms["draft"], 3),
            "ratio": round(ms["draft"] / ms["target"], 4), "context": context, "reps": reps,
            "threads": torch.get_num_threads(), "dtype": "float32"}


def _dir_mb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6, 2)


# ------------------------------------------------------------------------------------------------- build

def build_pair(out_dir: str | Path, *, target_minutes: float = 40.0, draft_minutes: float = 12.0, seed: int = 0,
               device: str | None = None, quick: bool = False, threads: int | None = None,
               draft_only: bool = False) -> dict:
    """Build, evaluate and save the pair under out_dir; returns (and writes) the metrics.

    draft_only: keep the tokenizer and target an earlier build saved in out_dir (same corpus required) and
    only re-distil the draft and re-measure everything; the target is then evaluated as shipped (bf16)."""
    out = Path(out_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    np.random.seed(seed)
    t_start = time.time()

    train_docs, held_docs, manifest = collect_corpus(max_files=40 if quick else None)
    log(f"corpus: {manifest['num_files']} files, {manifest['total_bytes'] / 1e6:.1f} MB, sha256 "
        f"{manifest['sha256'][:16]}; held-out {len(held_docs)} files")
    previous = None
    if draft_only:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        previous = json.loads((out / "metrics.json").read_text())
        if previous["corpus_sha256"] != manifest["sha256"]:
            raise ValueError("draft_only: the saved target was trained on another corpus; rebuild everything")
        tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    else:
        tokenizer = train_tokenizer([t for _, t in train_docs], vocab_size=512 if quick else 8192)
    train_stream = tokenize_stream(tokenizer, [t for _, t in train_docs])
    held_stream = tokenize_stream(tokenizer, [t for _, t in held_docs])
    bytes_per_token = manifest["total_bytes"] / len(train_stream)
    log(f"tokenizer: vocab {len(tokenizer)}, train {len(train_stream)} tokens ({bytes_per_token:.2f} bytes/token), "
        f"held-out {len(held_stream)} tokens")

    t_cfg, d_cfg = model_configs(len(tokenizer), tokenizer.eos_token_id, quick=quick)
    if previous is not None:
        target = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32).to(device).eval()
        t_cfg = target.config
    else:
        target = _new_model(t_cfg, seed).to(device)
    draft = _new_model(d_cfg, seed + 1).to(device)
    log(f"target {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M params "
        f"({t_cfg.num_hidden_layers} layers x {t_cfg.hidden_size}), draft "
        f"{sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params (1 layer x {d_cfg.hidden_size}), "
        f"threads {torch.get_num_threads()}")
    seq = 64 if quick else 256
    if previous is not None:
        target_train = dict(previous["target"]["train"], reused_from_previous_build=True)
    else:
        target_train = train_target(target, train_stream, minutes=target_minutes, seed=seed, device=device,
                                    seq=seq)
    draft_train = distil_draft(draft, target, train_stream, minutes=draft_minutes, seed=seed, device=device,
                               seq=seq)

    log("evaluating on held-out stdlib test/ code")
    win = dict(windows=8, seq=64) if quick else dict(windows=48, seq=256)
    metrics = {
        "target": {"config": {k: getattr(t_cfg, k) for k in ("hidden_size", "num_hidden_layers",
                                                               "num_attention_heads", "intermediate_size")},
                   "params": sum(p.numel() for p in target.parameters()), "train": target_train,
                   "heldout": heldout_metrics(target, held_stream, device=device, **win)},
        "draft": {"config": {k: getattr(d_cfg, k) for k in ("hidden_size", "num_hidden_layers",
                                                              "num_attention_heads", "intermediate_size")},
                  "params": sum(p.numel() for p in draft.parameters()), "train": draft_train,
                  "heldout": heldout_metrics(draft, held_stream, device=device, **win)},
        "agreement_on_target_greedy": greedy_agreement(
            target, draft, held_stream, device=device,
            **(dict(prompts=4, prompt_len=16, new_tokens=16) if quick else dict(prompts=32, prompt_len=64,
                                                                              new_tokens=96))),
        "decode_cost": decode_step_ms(target.cpu(), draft.cpu(), reps=20 if quick else 300, seed=seed),
        "tokenizer": {"vocab_size": len(tokenizer), "eos_token": EOS, "eos_token_id": tokenizer.eos_token_id,
                      "train_bytes_per_token": round(bytes_per_token, 3)},
        "corpus_sha256": manifest["sha256"],
        "seed": seed, "quick": quick,
        "torch": torch.__version__,
    }
    target.to(device)
    draft.to(device)

    out.mkdir(parents=True, exist_ok=True)
    saved = [("draft", draft)]
    if previous is None:
        tokenizer.save_pretrained(out / "tokenizer")
        saved.insert(0, ("target", target))
    else:
        metrics["previous_draft"] = {k: previous[k] for k in ("agreement_on_target_greedy", "decode_cost")}
        metrics["previous_draft"]["config"] = previous["draft"]["config"]
    # bf16 on disk halves the size; loading casts to the runtime dtype (fp32 on CPU).
    for name, model in saved:
        model.to(torch.bfloat16).save_pretrained(out / name)
        model.float()
    metrics["files_mb"] = {n: _dir_mb(out / n) for n in ("tokenizer", "target", "draft")}
    metrics["build_minutes"] = round((time.time() - t_start) / 60, 2)
    metrics["goals"] = {
        "agreement>=0.65": metrics["agreement_on_target_greedy"]["agreement"] >= 0.65,
        "cost_ratio<=0.25": metrics["decode_cost"]["ratio"] <= 0.25,
        "target+draft<40MB": metrics["files_mb"]["target"] + metrics["files_mb"]["draft"] < 40,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out / "corpus_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log("metrics: " + json.dumps({k: metrics[k] for k in ("agreement_on_target_greedy", "decode_cost",
                                                          "files_mb", "goals", "build_minutes")}))
    log(f"target held-out {metrics['target']['heldout']}; draft held-out {metrics['draft']['heldout']}")
    return metrics


# --------------------------------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specpilot.drafting.cliargs import device, output_dir, positive_float, positive_int, seed
    from specpilot.drafting.pair import DEFAULT_PAIR_DIR

    parser.add_argument("action", choices=["build"], help="build: train and save the default pair")
    # building over the shipped pair must be asked for: --out is required except with --quick
    parser.add_argument("--out", default=None, type=output_dir,
                        help=f"output folder, required unless --quick (default with --quick: a temp folder); give "
                             f"--out {DEFAULT_PAIR_DIR} to rebuild the pair shipped in the package")
    parser.add_argument("--target-minutes", type=positive_float, default=40.0,
                        help="wall-clock budget for the target")
    parser.add_argument("--draft-minutes", type=positive_float, default=12.0, help="wall-clock budget for the draft")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the corpus split and of training")
    parser.add_argument("--device", type=device, default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="tiny pair in about a minute (smoke test)")
    parser.add_argument("--draft-only", action="store_true",
                        help="keep the tokenizer and target already in --out; re-distil and re-measure the draft")


def _refuse_default_out(shipped) -> None:
    raise ValueError(f"--out is required: give the folder to build into (--out {shipped} rebuilds the pair shipped "
                     "in the package, overwriting it)")


def run(args: argparse.Namespace) -> int:
    from specpilot.drafting.pair import DEFAULT_PAIR_DIR

    if args.quick:
        out = args.out or tempfile.mkdtemp(prefix="specpilot_pair_")
        minutes = dict(target_minutes=min(args.target_minutes, 0.25), draft_minutes=min(args.draft_minutes, 0.15))
    else:
        out = args.out or _refuse_default_out(DEFAULT_PAIR_DIR)
        minutes = dict(target_minutes=args.target_minutes, draft_minutes=args.draft_minutes)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    metrics = build_pair(out, seed=args.seed, device=args.device, quick=args.quick, threads=args.threads,
                         draft_only=args.draft_only, **minutes)
    print(json.dumps({"out": str(out), "goals": metrics["goals"]}))
    return 0
