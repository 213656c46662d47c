"""Build the embedded default model pair (`specpilot models build`).

Everything is made offline from text every Python install has: the standard library's own sources (minus
`test/`, `idlelib/`, `site-packages` and site-specific files) plus the pure-Python sources of the pip and
setuptools wheels that `ensurepip` bundles. The steps:

1. collect the corpus and write a manifest (file list + sha256) so the build is auditable;
2. train a byte-level BPE tokenizer (exact round-trip of any text, one EOS token);
3. train a deep, narrow Llama target (8x384) for a fixed token budget, bf16 weights with fp32 masters;
4. have the target write text from corpus prompts (greedy and sampled at T=1): speculative acceptance is decided
   on such text, so both drafters train on it;
5. distil a one-layer draft towards the target (KL to the target's logits on that text and on corpus text);
6. optionally (--eagle) train an EAGLE-3 head on the target's features (specpilot.train.models.build_eagle);
7. measure on held-out code (the standard library's `test/` and `idlelib/` files, never trained on): target
   accuracy and perplexity, draft/target argmax agreement along the target's own greedy generations, the head's
   metrics beside the draft's, and the cost of one cached decode step (fp32, inference_mode, batch 1, 1 and 2
   threads, the way the CPU decoder runs them);
8. save tokenizer/, target/, draft/, eagle/ (bf16 safetensors), metrics.json and corpus_manifest.json.

Every stage is step-budgeted and seeded (BuildBudget, EagleBudget): the weights depend on the seed, the budgets
and the thread count, not on machine speed; wall-clock caps are only a safety net, and a capped stage says so.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specpilot.drafting.files import atomic_dir
from specpilot.drafting.folder_lock import LOCK_FILE
from specpilot.train.models.training import (bf16_teacher, generate, latency_summary, log, random_windows, steps_for,
                                           train_loop)
from specpilot.train.models.optim import use_bf16

EOS = "<|endoftext|>"


# ----------------------------------------------------------------------------------------------- corpus

def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel: Path) -> bool:
    top = rel.parts[0]
    return (top in {"test", "idlelib", "site-packages", "dist-packages", "lib-dynload", "__pycache__"}
            or top.startswith("config-")  # the interpreter's build configuration: site-specific
            or rel.name.startswith("_sysconfigdata"))  # paths and flags of this particular install


def collect_corpus(*, max_files: int | None = None) -> tuple[list[tuple[str, str]], dict[str, list[tuple[str, str]]],
                                                             dict]:
    """(train documents, held-out documents by set, manifest). Documents are (name, text) pairs; the held-out
    sets are the standard library's `test/` and `idlelib/` sources, which the corpus excludes.

    Files that are not UTF-8 are skipped (a handful of encoding test fixtures) rather than decoded lossily."""
    root = _stdlib_root()
    train: list[tuple[str, str]] = []
    held: dict[str, list[tuple[str, str]]] = {"test": [], "idlelib": []}  # both excluded from the corpus
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
        if rel.parts[0] in held:
            if max_held is None or len(held[rel.parts[0]]) < max_held:
                held[rel.parts[0]].append((str(rel), path.read_bytes().decode("utf-8", errors="replace")))
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
        "held_out": "stdlib test/ and idlelib/ (never trained on)",
        "held_out_files": {name: len(docs) for name, docs in held.items()},
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
    target is deep and narrow and the draft is a single, narrower layer (its tied 8192-way output head alone
    costs as much as a couple of target layers).

    Target size: 8 layers x 384 (17.3M parameters). Measured batch-1 fp32 cached decode steps on the 2-core
    reference CPU: 10x256 7.9 ms, 8x384 9.8 ms, 10x384 12.3 ms, 12x384 13.8 ms, 8x512 14.0 ms. 8x384 is inside
    the 8-15 ms aim (a slower target makes a head or draft relatively cheaper), trains fastest per token of
    those, and at bf16 on disk (35 MB) leaves room for the draft and the EAGLE head under 60 MB (8x512 alone
    would be 59 MB). The quick target keeps 4 layers so an EAGLE head's default feature layers (2, L//2, L-3)
    exist. Tied embeddings keep the files small."""
    from transformers import LlamaConfig

    # (hidden, layers, heads, intermediate); SwiGLU intermediate ~2.7x hidden, head_dim 32 (quick) / 64.
    target, draft = ((64, 4, 2, 176), (32, 1, 1, 88)) if quick else ((384, 8, 6, 1024), (128, 1, 2, 344))
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


def train_target(model, stream: torch.Tensor, *, tokens: int, seed: int, device: str, batch: int = 8,
                 seq: int = 256, lr: float = 2e-3, max_minutes: float = 120.0) -> dict:
    """Next-token training on random corpus windows for a fixed step budget (ceil(tokens / (batch*seq)) steps):
    the windows, the schedule and so the weights depend on the seed and budget only, not on machine speed.
    `max_minutes` is a safety cap; a run it stops is flagged `stopped_by_time_cap` (and is not reproducible).
    bf16 weights with fp32 masters where the hardware does bf16 natively (see specpilot.train.models.optim)."""
    gen = torch.Generator().manual_seed(seed)
    bf16 = use_bf16(device)
    ema = None

    def step_loss(step: int) -> tuple[torch.Tensor, str]:
        nonlocal ema
        x = random_windows(stream, gen, batch, seq, device)
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        return loss, f"loss {ema:.3f}"

    run = train_loop(model, step_loss, name="target", steps_total=steps_for(tokens, batch, seq), lr=lr, bf16=bf16,
                     weight_decay=0.1, max_minutes=max_minutes, units_per_step=batch * seq, unit="tok")
    return {"steps": run["steps"], "steps_planned": run["steps_planned"], "tokens": run["steps"] * batch * seq,
            "seconds": run["seconds"], "final_loss_ema": ema, "batch": batch, "seq_len": seq,
            "peak_lr": lr, "bf16_master_weights": bf16, "threads": torch.get_num_threads(),
            "stopped_by_time_cap": run["stopped_by_time_cap"]}


def greedy_generate(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    return generate(model, prompts, new_tokens)


def target_text_pool(target, stream: torch.Tensor, *, sequences: int, seq: int, seed: int, device: str,
                     prompt_len: int = 32, batch: int = 64) -> torch.Tensor:
    """[sequences, seq + 1] token windows of text the target writes itself: corpus prompts of `prompt_len`
    tokens continued by the target (fp32, as it decodes at run time), alternately greedy and sampled at T=1.
    Speculative acceptance is decided on such text, so draft models trained on it match what they will see."""
    gen = torch.Generator().manual_seed(seed + 7)
    chunks = []
    for i in range(math.ceil(sequences / batch)):
        prompts = random_windows(stream, gen, batch, prompt_len - 1, device)
        chunks.append(generate(target, prompts, seq + 1 - prompt_len, sample_gen=gen if i % 2 else None))
    return torch.cat(chunks)[:sequences]


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


def distil_draft(draft, target, stream: torch.Tensor, pool: torch.Tensor, *, tokens: int, seed: int, device: str,
                 batch: int = 8, seq: int = 256, lr: float = 2e-3, max_minutes: float = 60.0) -> dict:
    """Train the draft to match the target's next-token distribution (forward KL, target as teacher) for
    ceil(tokens / (batch*seq)) steps. Steps alternate between `pool` (text the target wrote itself, where
    speculative acceptance is decided) and plain corpus windows (which keep the draft calibrated off that path)."""
    init_draft_from_target(draft, target)
    gen = torch.Generator().manual_seed(seed + 1)
    teacher = bf16_teacher(target, device)
    ema = None

    def step_loss(step: int) -> tuple[torch.Tensor, str]:
        nonlocal ema
        if step % 2:
            x = pool[torch.randint(0, pool.shape[0], (batch,), generator=gen)][:, :seq].to(device)
        else:
            x = random_windows(stream, gen, batch, seq, device)[:, :-1]
        with torch.inference_mode():
            t_logp = F.log_softmax(teacher(input_ids=x).logits.float(), dim=-1)
        t_logp = t_logp.clone()  # inference tensors cannot enter autograd
        d_logp = F.log_softmax(draft(input_ids=x).logits.float(), dim=-1)
        loss = (t_logp.exp() * (t_logp - d_logp)).sum(-1).mean()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        return loss, f"KL {ema:.3f}"

    run = train_loop(draft, step_loss, name="draft", steps_total=steps_for(tokens, batch, seq), lr=lr,
                     bf16=use_bf16(device), weight_decay=0.0, max_minutes=max_minutes, units_per_step=batch * seq,
                     unit="tok")
    return {"steps": run["steps"], "steps_planned": run["steps_planned"], "tokens": run["steps"] * batch * seq,
            "target_text_tokens": int(pool.numel()), "seconds": run["seconds"], "final_kl_ema": ema,
            "batch": batch, "seq_len": seq, "peak_lr": lr, "stopped_by_time_cap": run["stopped_by_time_cap"]}


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
def decode_step_ms(target, draft, *, context: int = 128, reps: int = 200, seed: int = 0, threads: int = 1) -> dict:
    """Median cost of one cached single-token decode step of each model (fp32, CPU, batch 1, `threads`).

    The two models are timed alternately so that load from other processes hits both alike; the ratio
    is the figure that matters (reported with the 10th-90th percentile of the per-pair ratios), the absolute
    numbers depend on the machine's load."""
    from transformers import DynamicCache

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
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
    torch.set_num_threads(saved_threads)
    return latency_summary(times, "draft", context=context, reps=reps, threads=threads)


def _dir_mb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6, 2)


# ------------------------------------------------------------------------------------------------- build

@dataclass(frozen=True)
class BuildBudget:
    """Step budgets of `specpilot models build`. The weights depend on these and the seed only (and on the thread
    count through floating-point summation order); the minute figures are safety caps, not schedules.
    Defaults are sized for under an hour on 2 quiet cores of the reference CPU: measured there (2 threads, quiet)
    the target trains at ~2250 tokens/s (~25 min), then target text ~2 min, draft ~4, EAGLE head ~10, measurements
    ~4. On a machine shared with other jobs pass threads=1 (see build_pair) and expect 2-3x longer."""

    seq: int = 256                    # training window length (tokens)
    target_tokens: int = 3_000_000    # next-token training tokens of the target
    target_batch: int = 8
    target_lr: float = 2e-3
    pool_sequences: int = 512         # target-written windows shared by the draft and the EAGLE head
    draft_tokens: int = 800_000       # distillation tokens of the separate draft (half target-written)
    draft_batch: int = 8
    target_max_minutes: float = 240.0
    draft_max_minutes: float = 90.0

    @classmethod
    def quick(cls) -> "BuildBudget":
        """A tiny pair in about a minute (smoke tests)."""
        return cls(seq=64, target_tokens=2_048, target_batch=4, pool_sequences=4, draft_tokens=1_024,
                   draft_batch=4, target_max_minutes=5.0, draft_max_minutes=5.0)


def _load_previous(out: Path, manifest: dict):
    """(previous metrics, tokenizer, target) of an earlier build in `out`, for the stages that reuse them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = out / "metrics.json"
    if not (out / "target" / "config.json").exists() or not path.exists():
        raise FileNotFoundError(f"no finished target under {out}; run a full build (or --target-only) there first")
    previous = json.loads(path.read_text())
    if previous["corpus_sha256"] != manifest["sha256"]:
        raise ValueError(f"the target saved in {out} was trained on another corpus (sha256 "
                         f"{previous['corpus_sha256'][:16]} vs {manifest['sha256'][:16]}); rebuild everything")
    tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    target = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32).eval()
    return previous, tokenizer, target


def _model_summary(model, train: dict | None, held: dict[str, torch.Tensor], *, device: str, quick: bool) -> dict:
    cfg = model.config
    win = dict(windows=8, seq=64) if quick else dict(windows=48, seq=256)
    return {"config": {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                     "intermediate_size")},
            "params": sum(p.numel() for p in model.parameters()), "train": train,
            "heldout": {name: heldout_metrics(model, stream, device=device, **win) for name, stream in held.items()}}


BUILD_MARKERS = ("metrics.json", "corpus_manifest.json")  # written by a build (the second as soon as the target is)


def save_folder(model, path: Path) -> None:
    """`model.save_pretrained(path)` written beside `path` and swapped in complete (`drafting.files.atomic_dir`): a
    build interrupted while saving leaves the earlier folder (or none), never one with a truncated weights file."""
    with atomic_dir(path) as staging:
        model.save_pretrained(staging)


def check_build_folder(out: Path, *, quick: bool = False) -> None:
    """A full build writes tokenizer/, target/ and draft/ into `out` and removes a stale eagle/: `out` must be new,
    empty, or an earlier build's folder (it holds metrics.json or corpus_manifest.json), never someone's models;
    and a quick build never replaces a full one (its metrics.json says "quick": false)."""
    def held(p: Path) -> bool:  # this build's own lock (`models build` holds its --out), a killed save's staging
        return p.name == LOCK_FILE or (p.name.startswith(".") and ".partial-" in p.name)

    if out.is_dir() and any(not held(p) for p in out.iterdir()) and \
            not any((out / name).is_file() for name in BUILD_MARKERS):
        raise ValueError(f"{out} holds files but is not an earlier `specpilot models build` folder (no "
                         f"{' or '.join(BUILD_MARKERS)}): a build overwrites target/, draft/ and tokenizer/ there "
                         "and removes eagle/, so give a new or empty folder")
    if quick and _full_build_in(out):
        raise ValueError(f"{out} holds a full build (metrics.json says quick: false): a --quick build would "
                         "replace its models with a tiny smoke-test pair; give another --out, or move it away first")


def _full_build_in(folder: Path) -> bool:
    """True when `folder` holds a full (not --quick) build: its metrics.json says "quick": false."""
    try:
        return json.loads((folder / "metrics.json").read_text(encoding="utf-8")).get("quick") is False
    except (OSError, ValueError, AttributeError):
        return False


def build_pair(out_dir: str | Path, *, budget: BuildBudget | None = None, seed: int = 0, device: str | None = None,
               quick: bool = False, threads: int | None = None, target_only: bool = False,
               reuse_target: bool = False, eagle: bool = False, eagle_only: bool = False,
               eagle_budget: "EagleBudget | None" = None) -> dict:
    """Build, evaluate and save the pair under out_dir; returns (and writes) the metrics.

    Stages: tokenizer + target, then the separate draft, then (eagle=True) the EAGLE-3 head in out_dir/eagle.
    target_only: stop after saving the tokenizer and target (a later call can reuse them).
    reuse_target: keep the tokenizer and target an earlier build saved in out_dir (same corpus required).
    eagle_only: keep tokenizer, target and draft; train and measure only the head (implies eagle).
    eagle_budget: the head's specpilot.train.models.build_eagle.EagleBudget (default: its defaults, or quick())."""
    out = Path(out_dir)
    if not (reuse_target or eagle_only):
        check_build_folder(out, quick=quick)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    budget = budget or (BuildBudget.quick() if quick else BuildBudget())
    # Both cores of the 2-core reference box (tiny --quick models: one; threads only add synchronisation there).
    # On an oversubscribed machine pass threads=1: a 2-thread training step measured 2.9x slower at load ~8.
    torch.set_num_threads(threads or (1 if quick else min(2, os.cpu_count() or 1)))
    torch.manual_seed(seed)
    np.random.seed(seed)
    t_start = time.time()
    timings: dict[str, float] = {}

    train_docs, held_docs, manifest = collect_corpus(max_files=40 if quick else None)
    log(f"corpus: {manifest['num_files']} files, {manifest['total_bytes'] / 1e6:.1f} MB, sha256 "
        f"{manifest['sha256'][:16]}; held-out {manifest['held_out_files']} files")
    previous = None
    if reuse_target or eagle_only:
        previous, tokenizer, target = _load_previous(out, manifest)
        target = target.to(device)
    else:
        tokenizer = train_tokenizer([t for _, t in train_docs], vocab_size=512 if quick else 8192)
    train_stream = tokenize_stream(tokenizer, [t for _, t in train_docs])
    held = {name: tokenize_stream(tokenizer, [t for _, t in docs]) for name, docs in held_docs.items()}
    bytes_per_token = manifest["total_bytes"] / len(train_stream)
    log(f"tokenizer: vocab {len(tokenizer)}, train {len(train_stream)} tokens ({bytes_per_token:.2f} bytes/token), "
        f"held-out {', '.join(f'{n} {len(s)}' for n, s in held.items())} tokens; threads {torch.get_num_threads()}")
    t_cfg, d_cfg = model_configs(len(tokenizer), tokenizer.eos_token_id, quick=quick)

    if previous is None:
        target, target_train = _target_stage(out, tokenizer, train_stream, t_cfg, manifest, budget=budget, seed=seed,
                                             device=device, keep_head=eagle, timings=timings)
    else:
        target_train = dict(previous["target"]["train"], reused_from_previous_build=True)
        timings.update(previous.get("build_minutes_by_stage", {}))  # stages run again below overwrite theirs
    metrics = {"target": _model_summary(target, target_train, held, device=device, quick=quick),
               "tokenizer": {"vocab_size": len(tokenizer), "eos_token": EOS, "eos_token_id": tokenizer.eos_token_id,
                             "train_bytes_per_token": round(bytes_per_token, 3)},
               "corpus_sha256": manifest["sha256"], "seed": seed, "quick": quick, "torch": torch.__version__,
               "budget": asdict(budget)}
    log(f"target held-out {metrics['target']['heldout']}")
    if not target_only:
        metrics.update(_draft_stage(out, target, train_stream, held, previous, d_cfg, budget=budget, seed=seed,
                                    device=device, quick=quick, reuse=eagle_only, timings=timings))
    if "draft" in metrics and (eagle or eagle_only or (out / "eagle" / "config.json").exists()):
        metrics["eagle"] = _eagle_stage(out, target, metrics, train_stream, held, previous, train=eagle or eagle_only,
                                        budget=eagle_budget, seed=seed, device=device, quick=quick, timings=timings)
    metrics.pop("_draft_model", None)
    metrics.pop("_pool", None)
    return _finish(out, metrics, timings, t_start)


def _target_stage(out: Path, tokenizer, train_stream: torch.Tensor, t_cfg, manifest: dict, *, budget: BuildBudget,
                  seed: int, device: str, keep_head: bool, timings: dict):
    """Train a new target; save it with the tokenizer and manifest. Returns (target, training stats)."""
    target = _new_model(t_cfg, seed).to(device)
    log(f"target {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M params "
        f"({t_cfg.num_hidden_layers} layers x {t_cfg.hidden_size})")
    t0 = time.time()
    stats = train_target(target, train_stream, tokens=budget.target_tokens, seed=seed, device=device,
                         batch=budget.target_batch, seq=budget.seq, lr=budget.target_lr,
                         max_minutes=budget.target_max_minutes)
    timings["target_minutes"] = round((time.time() - t0) / 60, 2)
    out.mkdir(parents=True, exist_ok=True)
    save_folder(tokenizer, out / "tokenizer")
    save_folder(target.to(torch.bfloat16), out / "target")  # bf16 on disk; loading casts to fp32 on CPU
    target.float()
    (out / "corpus_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if (out / "eagle").exists() and not keep_head:
        shutil.rmtree(out / "eagle")  # a head trained on the old target's features would be silently wrong
        log(f"removed {out / 'eagle'}: it was trained for the previous target (rebuild it with --eagle-only)")
    return target, stats


def _eagle_stage(out: Path, target, metrics: dict, train_stream: torch.Tensor, held: dict[str, torch.Tensor],
                 previous: dict | None, *, train: bool, budget, seed: int, device: str, quick: bool,
                 timings: dict) -> dict:
    """Train the EAGLE-3 head (train=True), or re-measure the one an earlier build trained against this same
    target beside the new draft. Returns its metrics."""
    from specpilot.drafting.eagle import Eagle3Head
    from specpilot.train.models.build_eagle import EagleBudget, build_eagle_head
    from specpilot.train.models.eagle_metrics import eagle_metrics

    if train:
        t0 = time.time()
        budget = budget or (EagleBudget.quick() if quick else EagleBudget())
        head, result = build_eagle_head(out / "eagle", target, train_stream, pool=metrics["_pool"], seed=seed,
                                        device=device, budget=budget)
        result.update(eagle_metrics(head, target, metrics["_draft_model"], held, device=device,
                                    quick=budget.seq < 64, seed=seed))
        timings["eagle_minutes"] = round((time.time() - t0) / 60, 2)
        return result
    head = Eagle3Head.from_pretrained(out / "eagle", target)
    kept = {k: previous["eagle"][k] for k in ("config", "params", "vocabulary", "train")
            if previous and k in previous.get("eagle", {})}
    return dict(kept, **eagle_metrics(head, target, metrics["_draft_model"], held, device=device, quick=quick,
                                      seed=seed), reused_from_previous_build=True)


def _draft_stage(out: Path, target, train_stream: torch.Tensor, held: dict[str, torch.Tensor], previous: dict | None,
                 d_cfg, *, budget: BuildBudget, seed: int, device: str, quick: bool, reuse: bool,
                 timings: dict) -> dict:
    """Distil (or, reuse=True, load) the separate draft and measure it against the target. Returns metrics plus
    the private entries `_draft_model` and `_pool` (the target-written text, shared with the EAGLE head)."""
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    pool = target_text_pool(target, train_stream, sequences=budget.pool_sequences, seq=budget.seq, seed=seed,
                            device=device)
    timings["target_text_minutes"] = round((time.time() - t0) / 60, 2)
    log(f"target text: {pool.shape[0]} windows ({pool.numel()} tokens, half greedy, half sampled) "
        f"in {time.time() - t0:.0f}s")
    if reuse:
        draft = AutoModelForCausalLM.from_pretrained(str(out / "draft"), dtype=torch.float32).to(device).eval()
        draft_train = dict(previous["draft"]["train"], reused_from_previous_build=True)
    else:
        draft = _new_model(d_cfg, seed + 1).to(device)
        log(f"draft {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params "
            f"(1 layer x {d_cfg.hidden_size})")
        t0 = time.time()
        draft_train = distil_draft(draft, target, train_stream, pool, tokens=budget.draft_tokens, seed=seed,
                                   device=device, batch=budget.draft_batch, seq=budget.seq,
                                   max_minutes=budget.draft_max_minutes)
        timings["draft_minutes"] = round((time.time() - t0) / 60, 2)
        save_folder(draft.to(torch.bfloat16), out / "draft")
        draft.float()
    log("measuring the draft against the target on held-out code")
    agreement_args = dict(prompts=4, prompt_len=16, new_tokens=16) if quick else dict(prompts=32, prompt_len=64,
                                                                                      new_tokens=96)
    metrics = {"draft": _model_summary(draft, draft_train, held, device=device, quick=quick),
               "agreement_on_target_greedy": {name: greedy_agreement(target, draft, stream, device=device,
                                                                     **agreement_args)
                                              for name, stream in held.items()},
               "decode_cost": {f"threads_{n}": decode_step_ms(target.cpu(), draft.cpu(), threads=n,
                                                              reps=20 if quick else 300, seed=seed)
                               for n in (1, 2)},
               "_draft_model": draft.to(device), "_pool": pool}
    target.to(device)
    if previous is not None and not reuse and "draft" in previous:
        metrics["previous_draft"] = {k: previous[k] for k in ("agreement_on_target_greedy", "decode_cost")
                                     if k in previous}
    return metrics


def _finish(out: Path, metrics: dict, timings: dict, t_start: float) -> dict:
    """Sizes, goals, timings; write metrics.json."""
    out.mkdir(parents=True, exist_ok=True)
    metrics["files_mb"] = {n: _dir_mb(out / n) for n in ("tokenizer", "target", "draft", "eagle") if (out / n).exists()}
    metrics["build_minutes_by_stage"] = timings
    metrics["build_minutes"] = round((time.time() - t_start) / 60, 2)
    test_acc = metrics["target"]["heldout"]["test"]["accuracy"]
    goals = {"target_test_accuracy>=0.18": test_acc >= 0.18,
             "target_idlelib_accuracy>=0.18": metrics["target"]["heldout"]["idlelib"]["accuracy"] >= 0.18}
    if "draft" in metrics:
        goals["draft_agreement>=0.65"] = metrics["agreement_on_target_greedy"]["test"]["agreement"] >= 0.65
        goals["draft_cost_ratio<=0.25"] = metrics["decode_cost"]["threads_1"]["ratio"] <= 0.25
    if "eagle" in metrics:
        goals["head_cost_ratio<=0.25"] = metrics["eagle"]["step_cost"]["threads_1"]["ratio"] <= 0.25
    goals["default_pair<60MB"] = sum(metrics["files_mb"].values()) < 60
    metrics["goals"] = goals
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log("metrics: " + json.dumps({k: metrics[k] for k in ("files_mb", "goals", "build_minutes_by_stage")
                                  if k in metrics}))
    return metrics


# --------------------------------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specpilot.drafting.cliargs import device, output_dir, positive_int, seed, thread_count
    from specpilot.drafting.pair import DEFAULT_PAIR_DIR

    d = BuildBudget()
    parser.add_argument("action", choices=["build"], help="build: train and save the default pair")
    # building over the shipped pair must be asked for: --out is required except with --quick
    parser.add_argument("--out", default=None, type=output_dir,
                        help=f"output folder, required unless --quick (default with --quick: a temp folder); give "
                             f"--out {DEFAULT_PAIR_DIR} to rebuild the pair shipped in the package")
    parser.add_argument("--target-tokens", type=positive_int, default=None,
                        help=f"target training tokens (default: {d.target_tokens}; --quick has its own budget)")
    parser.add_argument("--draft-tokens", type=positive_int, default=None,
                        help=f"draft distillation tokens (default: {d.draft_tokens}; --quick has its own budget)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the corpus split and of training")
    parser.add_argument("--device", type=device, default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=thread_count, default=None,
                        help="torch CPU threads (default: `specpilot --threads`, else 2, or 1 on 1 core; --quick: "
                             "1)")
    parser.add_argument("--quick", action="store_true", help="tiny pair in about a minute (smoke test)")
    stage = parser.add_mutually_exclusive_group()
    stage.add_argument("--target-only", action="store_true", help="stop after the tokenizer and target")
    stage.add_argument("--draft-only", action="store_true",
                       help="keep the tokenizer and target already in --out; re-distil the draft (and, with "
                            "--eagle, retrain the head) and re-measure")
    stage.add_argument("--eagle-only", action="store_true",
                       help="keep tokenizer, target and draft in --out; train and measure only the EAGLE-3 head")
    parser.add_argument("--eagle", action="store_true", help="also train the EAGLE-3 head (out/eagle)")


def _refuse_default_out(shipped) -> None:
    raise ValueError(f"--out is required: give the folder to build into (--out {shipped} rebuilds the pair shipped "
                     "in the package, overwriting it)")


def run(args: argparse.Namespace) -> int:
    from specpilot.drafting.folder_lock import output_lock
    from specpilot.drafting.pair import DEFAULT_PAIR_DIR

    given = [o for o, v in (("--target-tokens", args.target_tokens), ("--draft-tokens", args.draft_tokens)) if v]
    if args.quick and given:
        raise ValueError(f"{' and '.join(given)} would be ignored: --quick builds with its own tiny budget; drop "
                         f"{'them' if len(given) > 1 else 'it'} or --quick")
    if args.target_only and args.eagle:
        raise ValueError("--eagle trains the head on the target and the draft's stages, which --target-only stops "
                         "before: drop one of them (--eagle-only trains the head later)")
    global_threads = getattr(args, "global_threads", None)
    if global_threads is not None and args.threads is not None and global_threads != args.threads:
        raise ValueError(f"`specpilot --threads {global_threads}` and `models build --threads {args.threads}` "
                         "disagree: give one of them")
    threads = args.threads if args.threads is not None else global_threads
    if args.quick:
        out = args.out or tempfile.mkdtemp(prefix="specpilot_pair_")
        budget = BuildBudget.quick()
    else:
        out = args.out or _refuse_default_out(DEFAULT_PAIR_DIR)
        default = BuildBudget()
        budget = BuildBudget(target_tokens=args.target_tokens or default.target_tokens,
                             draft_tokens=args.draft_tokens or default.draft_tokens)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    with output_lock(out, what="--out"):  # two builds into one folder would mix their models
        metrics = build_pair(out, budget=budget, seed=args.seed, device=args.device, quick=args.quick,
                             threads=threads, target_only=args.target_only, reuse_target=args.draft_only,
                             eagle=args.eagle, eagle_only=args.eagle_only)
    print(json.dumps({"out": str(out), "goals": metrics["goals"]}))
    return 0
