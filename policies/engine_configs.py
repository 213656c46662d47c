"""Static speculative-decoding configs for the engines users already run, derived from a trained run, written in
the form each engine reads (checked against transformers 5.24, vLLM 0.33 and SGLang 0.5.23 sources).

None of these engines can run a per-token learned policy: transformers' assisted generation, vLLM and SGLang take a
fixed draft length (or a draft length driven by their own simple rules), so what `specpilot export` writes here are
the closest static approximations of what the policies do. Which files depend on the pair's drafter:

    draft LM (drafter "draft_lm")
    hf/generation_config.json     the DRAFT's generation config: transformers' AssistedCandidateGenerator reads
                                  num_assistant_tokens (K = the depth policy's median depth), the "constant" schedule
                                  and assistant_confidence_threshold (fitted to the depth policy's STOP decisions)
                                  from `assistant_model.generation_config`, never from generate()'s arguments.
                                  With scikit-learn installed, transformers re-fits that threshold online within
                                  each generate() call (generation/candidate_generator.py: an ROC cost over the
                                  drafted tokens' probabilities and matches, once it has > 5 of them with at least
                                  one match and one miss), so the exported value holds only for the first rounds
    vllm/speculative_config.json  {"method": "draft_model", "model": <draft>, "num_speculative_tokens": K, ...}
    sglang/sglang_args.json       STANDALONE: --speculative-num-steps D / -eagle-topk W / -num-draft-tokens V + 1
    sglang/config.yaml            the same as `sglang.launch_server --config` reads it (dashed keys, + model-path)

    EAGLE-3 head (drafter "eagle3"): no hf/ (assisted generation cannot draft with a head)
    vllm/speculative_config.json  {"method": "eagle3", "model": <head>, "num_speculative_tokens": K}
    sglang/sglang_args.json       EAGLE3 with the head as --speculative-draft-model-path, D / W / V + 1
    sglang/sglang_adaptive.json   only with topk (W) 1: SGLang's adaptive steps config, keyed by batch size,
                                  {"1": {"candidate_steps": [...], ...}}; candidate_steps hold the static num_steps
    sglang/config.yaml            as above, plus speculative-adaptive / -adaptive-config when adaptive applies

SGLang ignores the adaptive config (with only a warning) for STANDALONE and for topk > 1, so it is not written
there.

Per batch size (grid.json's `per_batch_size`, the best static cell per batch size in batch replay: `specpilot grid
--batch-sizes`): vLLM's dynamic speculative decoding table `num_speculative_tokens_per_batch_size` in
speculative_config (inclusive [start, end, K] ranges: sorted, non-overlapping, the first from 1, the last size's K
inherited above it; K = the cell's depth, 0 where batched AR won; `num_speculative_tokens` holds the largest K, the
cap vLLM applies to every entry; vllm/config/speculative.py, vllm/v1/spec_decode/dynamic/utils.py), and, where the
adaptive config applies, one SGLang slot per measured batch size whose only candidate is that size's K (a batch uses
the largest key not above its CUDA-graph-padded size: speculative/adaptive_step_router.py), the static
--speculative-num-steps being the smallest size's K. Batch size b then gets the K measured at the largest measured
size <= b in both engines (tests/test_engine_batch_tables.py re-implements both lookups from the sources). SGLang
starts only when that num_steps is among the slots' candidates (`sglang_adaptive_refusal`): an adaptive file it would
refuse (K = 0 at every size; a learned table without config.yaml's steps) is not written, and README.md says why. The
tree shape (D, W, V) comes from the grid search's best static config when the run has one (`grid.json`), else from the
policies' measured choices, else from the run's fallback static config.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from specpilot.drafting.cycle_math import num_candidates
from specpilot.drafting.files import atomic_write_text

DEFAULT_CONFIDENCE_THRESHOLD = 0.4  # transformers' default assistant_confidence_threshold
ADAPTIVE_BATCH_SIZE = "1"  # the policies were measured at batch size 1: the slot SGLang uses for it

# SGLang adaptive-mode settings per batch-size slot (units: EMA of the accepted length in tokens, and batches):
ADAPTIVE_DEFAULTS = {
    "ema_alpha": 0.2,        # weight of the newest batch: ~5-batch memory, like GammaTune's rate 0.2 in LTD
    "update_interval": 10,   # re-decide the tier every 10 batches: switching has a CUDA-graph/cache cost
    "warmup_batches": 20,    # observe only at first: the EMA needs a few batches before it means anything
    "down_hysteresis": -0.25,  # step down only once the EMA falls 0.25 token below the switch point
    "up_hysteresis": 0.25,     # step up only once it exceeds the switch point by 0.25 token (no flapping)
}


def choice_summary(values: list[int]) -> dict | None:
    """{"n", "median", "mean", "p10", "p90", "counts": {value: n}} of per-cycle choices; None when empty."""
    if not values:
        return None
    arr = np.asarray(values, dtype=np.float64)
    return {"n": int(arr.size), "median": int(np.median(arr)), "mean": float(arr.mean()),
            "p10": int(np.percentile(arr, 10)), "p90": int(np.percentile(arr, 90)),
            "counts": {str(k): int(v) for k, v in sorted(Counter(int(x) for x in values).items())}}


def fit_confidence_threshold(top_probs: list[float], stops: list[bool]) -> tuple[float, float | None]:
    """The threshold t (grid 0.05..0.95) for which "stop when p(top child) < t" agrees most often with the depth
    policy's STOP decisions; (DEFAULT_CONFIDENCE_THRESHOLD, None) without decisions. Returns (t, agreement)."""
    if not top_probs:
        return DEFAULT_CONFIDENCE_THRESHOLD, None
    p = np.asarray(top_probs, dtype=np.float64)
    s = np.asarray(stops, dtype=bool)
    best_t, best_agree = DEFAULT_CONFIDENCE_THRESHOLD, -1.0
    for t in np.round(np.arange(0.05, 0.951, 0.05), 2):
        agree = float(np.mean((p < t) == s))
        # prefer the HF default on ties, then the smaller threshold (stops less: HF also caps the length)
        if agree > best_agree + 1e-12 or (abs(agree - best_agree) <= 1e-12 and t == DEFAULT_CONFIDENCE_THRESHOLD):
            best_t, best_agree = float(t), agree
    return best_t, best_agree


def hf_generation_config(num_tokens: int, threshold: float, base: dict | None = None) -> dict:
    """The draft's generation_config.json for assisted generation (base: the draft's own config, kept)."""
    config = {k: v for k, v in (base or {}).items() if k != "_from_model_config"}  # a saved file, not derived
    config.update({"num_assistant_tokens": int(max(1, num_tokens)), "num_assistant_tokens_schedule": "constant",
                   "assistant_confidence_threshold": float(threshold)})
    return config


def batch_size_steps(per_batch_size: list[dict]) -> list[tuple[int, int]]:
    """[(batch size, K)] of the measured table, ascending: K = the best static cell's depth at that size (0: batched
    autoregressive decoding won, drafting off)."""
    rows = sorted(per_batch_size, key=lambda r: int(r["batch_size"]))
    return [(int(r["batch_size"]), max(0, int(r["depth"]))) for r in rows]


def vllm_batch_schedule(per_batch_size: list[dict]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size`: inclusive [start, end, K] ranges; measured size B_i covers
    [B_i, B_{i+1} - 1] (the first range starts at 1 whatever the smallest measured size; the last is [B_n, B_n]
    and vLLM carries its K to every larger batch), adjacent ranges with the same K merged."""
    steps = batch_size_steps(per_batch_size)
    if not steps:
        raise ValueError("the per-batch-size table is empty")
    ranges: list[list[int]] = []
    for i, (b, k) in enumerate(steps):
        start = 1 if i == 0 else b
        end = steps[i + 1][0] - 1 if i + 1 < len(steps) else b
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, k])
    return ranges


def vllm_speculative_config(model: str, num_tokens: int, *, drafter: str = "draft_lm",
                            schedule: list[list[int]] | None = None) -> dict:
    """vLLM's speculative_config: method "draft_model" for a draft LM, "eagle3" for an EAGLE-3 head. With a
    per-batch-size `schedule` (`vllm_batch_schedule`) it is written as `num_speculative_tokens_per_batch_size`, and
    `num_speculative_tokens` becomes its largest K (vLLM caps every entry at it; it must stay > 0)."""
    if schedule:
        num_tokens = max(k for _, _, k in schedule)
    config = {"method": "eagle3" if drafter == "eagle3" else "draft_model", "model": str(model),
              "num_speculative_tokens": int(max(1, num_tokens))}
    if drafter != "eagle3":
        config["draft_tensor_parallel_size"] = 1
    if schedule:
        config["num_speculative_tokens_per_batch_size"] = [[int(a), int(b), int(k)] for a, b, k in schedule]
    return config


def sglang_args(draft: str, depth: int, width: int, size: int, algorithm: str = "STANDALONE") -> dict:
    """SGLang server arguments for a (D, W, V) tree; V excludes the root, SGLang's num_draft_tokens includes it.
    STANDALONE = a separate small draft LM; EAGLE3 = an EAGLE-3 head. With topk 1 (a chain) every drafted token
    is verified: num_draft_tokens = num_steps + 1."""
    depth, width = int(max(1, depth)), int(max(1, width))
    size = int(min(max(1, size), num_candidates(width, depth)))
    if width == 1:
        size = depth  # a chain has exactly `depth` drafted tokens
    return {"speculative_algorithm": algorithm, "speculative_draft_model_path": str(draft),
            "speculative_num_steps": depth, "speculative_eagle_topk": width,
            "speculative_num_draft_tokens": size + 1}


def sglang_adaptive_config(depth_counts: dict, num_steps: int, max_tiers: int = 3,
                           per_batch_size: list[dict] | None = None) -> dict:
    """SGLang's --speculative-adaptive-config, keyed by batch size: {"1": {"candidate_steps": [...], knobs}}.
    candidate_steps: the depth policy's `max_tiers` most frequent depths plus the static `num_steps` (SGLang
    refuses a num_steps outside them); without measured depths, tiers around num_steps.
    With a measured `per_batch_size` table: one slot per measured batch size, {"<B>": {"candidate_steps": [K_B]}}
    (a single candidate: the slot stays at the measured K; 0 turns drafting off), the knobs at the top level
    (SGLang applies them to every slot); the static num_steps should then be the smallest size's K
    (`sglang_batch_num_steps`)."""
    if per_batch_size:
        return {**{str(b): {"candidate_steps": [k]} for b, k in batch_size_steps(per_batch_size)},
                **ADAPTIVE_DEFAULTS}
    num_steps = int(max(1, num_steps))
    if depth_counts:
        ranked = sorted(depth_counts.items(), key=lambda kv: (-kv[1], int(kv[0])))
        steps = {int(k) for k, _ in ranked[:max_tiers]}
    else:
        steps = {max(1, num_steps // 2), num_steps + num_steps // 2}
    return {ADAPTIVE_BATCH_SIZE: {"candidate_steps": sorted(steps | {num_steps}), **ADAPTIVE_DEFAULTS}}


def sglang_batch_num_steps(per_batch_size: list[dict], fallback: int) -> int:
    """The static --speculative-num-steps that goes with the per-batch-size slots: the smallest measured size's K
    (that slot starts, and stays, at it); when that K is 0 (num_steps must be >= 1) the smallest positive K of the
    table (SGLang requires num_steps among the slots' candidates; a single-candidate slot ignores it), else
    `fallback`."""
    ks = [k for _, k in batch_size_steps(per_batch_size)]
    positive = sorted(k for k in ks if k >= 1)
    return ks[0] if ks[0] >= 1 else positive[0] if positive else int(max(1, fallback))


def sglang_adaptive_refusal(adaptive: dict, num_steps: int) -> str | None:
    """Why SGLang would refuse to start with this adaptive config and --speculative-num-steps `num_steps`, or None.
    server_args.py `_init_adaptive_speculative_params`: num_steps must be among the union of the slots'
    candidate_steps ("... is not in the adaptive config candidate_steps ... Pass one of those values.")."""
    union = sorted({int(s) for key, slot in adaptive.items() if key.isdigit() for s in slot["candidate_steps"]})
    if num_steps in union:
        return None
    if union == [0]:
        return ("drafting lost to batched AR at every measured batch size (K = 0 in every slot), and SGLang needs "
                f"--speculative-num-steps ({num_steps}) among the candidates: serve without the speculative flags "
                "to follow the measured table")
    return (f"SGLang needs --speculative-num-steps ({num_steps}) among the slots' candidate_steps {union}; "
            f"pass one of them ({max(union)} drafts deepest) with this file")


def yaml_text(entries: dict) -> str:
    """A flat mapping as YAML (scalars only; strings double-quoted, which YAML reads like JSON strings)."""
    lines = []
    for key, value in entries.items():
        text = ("true" if value else "false") if isinstance(value, bool) else \
            json.dumps(value) if isinstance(value, str) else str(value)
        lines.append(f"{key}: {text}")
    return "\n".join(lines) + "\n"


def sglang_launch_config(args: dict, *, target: str, tokenizer: str | None, adaptive_path: str | None) -> dict:
    """`sglang.launch_server --config FILE` entries: the server flags with dashes (that is how SGLang's config
    merger turns keys back into flags), the target as model-path, and the adaptive switch when it applies."""
    entries = {"model-path": str(target)}
    if tokenizer:
        entries["tokenizer-path"] = str(tokenizer)
    entries.update({key.replace("_", "-"): value for key, value in args.items()})
    if adaptive_path:
        entries.update({"speculative-adaptive": True, "speculative-adaptive-config": str(adaptive_path)})
    return entries


def static_shape(grid_best: dict | None, depth_summary: dict | None, size_summary: dict | None, width: int,
                 fallback: tuple[int, int]) -> tuple[dict, str]:
    """(D, W, V) for the tree engines and where it came from: "grid" | "policies" | "fallback"."""
    if grid_best:
        return ({"depth": int(grid_best["depth"]), "width": int(grid_best.get("width", width)),
                 "size": int(grid_best["size"])}, "grid")
    if depth_summary or size_summary:
        return ({"depth": depth_summary["median"] if depth_summary else int(fallback[0]), "width": int(width),
                 "size": size_summary["median"] if size_summary else int(fallback[1])}, "policies")
    return {"depth": int(fallback[0]), "width": int(width), "size": int(fallback[1])}, "fallback"


def plain_decoding_reason(grid_best: dict | None, chain_k: int, chain_source: str,
                          per_batch_size: list[dict] | None) -> str | None:
    """Why no engine file is written, when the run found plain target decoding faster than any static draft
    config: the grid's best cell has depth 0 (or, without a grid, the policies' median depth is 0) and no measured
    batch size drafts. The engines cannot take "depth 0" (vLLM and SGLang need at least one speculative token,
    transformers' assisted generation at least one assistant token), so a file would speculate anyway, slower.
    None when drafting pays somewhere."""
    if per_batch_size and any(k for _, k in batch_size_steps(per_batch_size)):
        return None
    if grid_best:
        if int(grid_best["depth"]) > 0:
            return None
        what = "the grid search measured plain target decoding (depth 0) faster than every static draft config"
    elif chain_k > 0:
        return None
    else:
        what = f"the {chain_source} chose plain target steps (depth 0)"
    return (f"{what}: an engine config speculates at least one token, which this run measured slower; serve the "
            "target without speculative decoding (decoder.json's learned policies may still pay: "
            "`specpilot generate --config`)")


ENGINE_FILES = {"hf": "hf/generation_config.json", "vllm": "vllm/speculative_config.json",
                "sglang": "sglang/sglang_args.json", "sglang_config": "sglang/config.yaml",
                "sglang_adaptive": "sglang/sglang_adaptive.json",
                # the learned batch-aware policy's own per-batch-size table, beside the grid's (`learned_batch`)
                "vllm_learned": "vllm/speculative_config.learned.json",
                "sglang_adaptive_learned": "sglang/sglang_adaptive.learned.json"}


def write_engine_configs(out_dir: str | Path, *, pair: dict, width: int, grid_best: dict | None, choices: dict,
                         fallback: tuple[int, int], draft_generation_config: dict | None = None,
                         tokenizer: str | None = None, final_dir: str | Path | None = None,
                         per_batch_size: list[dict] | None = None,
                         learned_per_batch_size: list[dict] | None = None) -> dict:
    """Write the engine files (see the module docstring) and README.md under out_dir/engines, each atomically;
    return decoder.json's `engine_configs` section (relative file paths, the numbers used and their provenance).

    pair: `ModelPair.identity()` ("target", "draft" = the drafter's path, "drafter" = "draft_lm" | "eagle3").
    choices: {"depths": [per-cycle depth], "sizes": [per-cycle verified size], "stop_top_probs": [...],
              "stops": [...]} measured by running the exported controller (any list may be empty).
    tokenizer: the folder of the target's tokenizer when the target folder has none (the embedded pair).
    final_dir: where out_dir will end up when it is a temporary folder (an export swaps its folder in when complete):
    the paths written into the files name it.
    per_batch_size: grid.json's measured table (best static cell per batch size): vLLM's and SGLang's
    per-batch-size tables are written from it (see the module docstring).
    learned_per_batch_size: the learned batch-aware policy's own table (rows {batch_size, depth, size}: its modal
    choice per batch size in batch replay, `envs.batch_replay.learned_batch_table`), written the same way into
    vllm/speculative_config.learned.json (and sglang/sglang_adaptive.learned.json where the adaptive config
    applies), beside the grid's; decoder.json's `per_batch_size_learned` says so (source "learned")."""
    out = Path(out_dir) / "engines"
    shown = Path(final_dir) / "engines" if final_dir is not None else out
    drafter = pair.get("drafter") or "draft_lm"
    target, draft = str(pair.get("target") or "TARGET"), str(pair.get("draft") or "DRAFT")
    depth_summary = choice_summary(choices.get("depths") or [])
    size_summary = choice_summary(choices.get("sizes") or [])
    shape, shape_source = static_shape(grid_best, depth_summary, size_summary, width, fallback)
    chain_k = depth_summary["median"] if depth_summary else shape["depth"]
    chain_source = "policies (median depth)" if depth_summary else shape_source
    threshold, agreement = fit_confidence_threshold(choices.get("stop_top_probs") or [], choices.get("stops") or [])

    files: dict[str, str] = {}
    skipped: dict[str, str] = {}
    if drafter == "eagle3":
        skipped["hf"] = "transformers' assisted generation drafts with a separate LM; it cannot use an EAGLE-3 head"
    else:
        files["hf"] = json.dumps(hf_generation_config(chain_k, threshold, draft_generation_config), indent=2)
    schedule = vllm_batch_schedule(per_batch_size) if per_batch_size else None
    files["vllm"] = json.dumps(vllm_speculative_config(draft, chain_k, drafter=drafter, schedule=schedule), indent=2)
    args = sglang_args(draft, shape["depth"], shape["width"], shape["size"],
                       "EAGLE3" if drafter == "eagle3" else "STANDALONE")
    adaptive_path = None
    if drafter == "eagle3" and args["speculative_eagle_topk"] == 1:
        if per_batch_size:  # the static steps = the smallest batch size's K: its slot then starts at it
            steps = sglang_batch_num_steps(per_batch_size, args["speculative_num_steps"])
            args.update(speculative_num_steps=steps, speculative_num_draft_tokens=steps + 1)
        adaptive = sglang_adaptive_config(depth_counts=depth_summary["counts"] if depth_summary else {},
                                          num_steps=args["speculative_num_steps"], per_batch_size=per_batch_size)
        refusal = sglang_adaptive_refusal(adaptive, args["speculative_num_steps"])
        if refusal is None:
            files["sglang_adaptive"] = json.dumps(adaptive, indent=2)
            adaptive_path = (shown / ENGINE_FILES["sglang_adaptive"]).resolve()
        else:
            skipped["sglang_adaptive"] = refusal
    else:
        skipped["sglang_adaptive"] = ("SGLang's adaptive steps run only for EAGLE/EAGLE3 with --speculative-eagle-topk "
                                      "1" + (f"; this tree has topk {args['speculative_eagle_topk']}"
                                             if drafter == "eagle3" else "; this pair drafts with a separate LM "
                                                                         "(STANDALONE)"))
    learned_schedule = vllm_batch_schedule(learned_per_batch_size) if learned_per_batch_size else None
    if learned_per_batch_size:
        files["vllm_learned"] = json.dumps(vllm_speculative_config(draft, chain_k, drafter=drafter,
                                                                   schedule=learned_schedule), indent=2)
        if "sglang_adaptive" in files:
            learned = sglang_adaptive_config(depth_counts={}, num_steps=args["speculative_num_steps"],
                                             per_batch_size=learned_per_batch_size)
            refusal = sglang_adaptive_refusal(learned, args["speculative_num_steps"])
            if refusal is None:  # it replaces the grid's file under the same config.yaml
                files["sglang_adaptive_learned"] = json.dumps(learned, indent=2)
            else:
                skipped["sglang_adaptive_learned"] = f"with config.yaml's steps: {refusal}"
        elif "sglang_adaptive" in skipped:
            skipped["sglang_adaptive_learned"] = f"as for the grid's table: {skipped['sglang_adaptive']}"
    files["sglang"] = json.dumps(args, indent=2)
    files["sglang_config"] = yaml_text(sglang_launch_config(args, target=target, tokenizer=tokenizer,
                                                            adaptive_path=adaptive_path))
    plain = plain_decoding_reason(grid_best, chain_k, chain_source, per_batch_size)
    if plain is not None:  # every engine file would speculate at least one token, which the run measured slower
        for key in ("hf", "vllm", "sglang", "sglang_config", "sglang_adaptive"):
            if files.pop(key, None) is not None or key not in skipped:
                skipped[key] = plain
    if learned_per_batch_size and not any(k for _, k in batch_size_steps(learned_per_batch_size)):
        for key in ("vllm_learned", "sglang_adaptive_learned"):
            files.pop(key, None)
            skipped[key] = "the learned policy takes plain target steps at every batch size: nothing to speculate"
    for key, rel in ENGINE_FILES.items():
        if key in files:
            atomic_write_text(out / rel, files[key].rstrip("\n") + "\n")
        else:
            (out / rel).unlink(missing_ok=True)  # a stale file of an earlier export must not look current
    atomic_write_text(out / "README.md", engines_readme(shown, files, skipped, target=target, tokenizer=tokenizer))
    return {
        "note": "Static approximations: these engines cannot run per-token learned policies (see engines/README.md).",
        "drafter": drafter,
        "files": {k: f"engines/{ENGINE_FILES[k]}" for k in ENGINE_FILES if k in files},
        "skipped": skipped,
        "chain_depth": {"value": int(chain_k), "source": chain_source},
        "tree_shape": {**shape, "source": shape_source},
        "confidence_threshold": {"value": threshold, "agreement_with_depth_policy": agreement,
                                 "source": "fitted" if agreement is not None else "transformers default"},
        "choices": {"depth": depth_summary, "size": size_summary},
        "per_batch_size": ({"table": [{k: r[k] for k in ("batch_size", "depth", "size") if k in r}
                                      for r in per_batch_size],
                            "vllm_num_speculative_tokens_per_batch_size": schedule,
                            "sglang_adaptive_keys": ([str(b) for b, _ in batch_size_steps(per_batch_size)]
                                                     if "sglang_adaptive" in files else None),
                            "source": "grid per_batch_size (batch replay)"} if per_batch_size else None),
        "per_batch_size_learned": ({"table": [{k: r[k] for k in ("batch_size", "depth", "size", "depth_share")
                                               if k in r} for r in learned_per_batch_size],
                                    "vllm_num_speculative_tokens_per_batch_size": learned_schedule,
                                    "files": [f"engines/{ENGINE_FILES[k]}" for k in
                                              ("vllm_learned", "sglang_adaptive_learned") if k in files],
                                    "source": "learned"} if learned_per_batch_size else None),
    }


def engines_readme(out: Path, files: dict, skipped: dict, *, target: str, tokenizer: str | None) -> str:
    """How each engine takes the files just written (paths filled in)."""
    root = out.resolve()
    tok = f" --tokenizer {tokenizer}" if tokenizer else ""
    parts = [
        "# Engine configs exported by specpilot", "",
        "These engines cannot run specpilot's per-token learned policies (which decide after every draft level "
        "whether to continue, and how many candidates to verify, from the draft's scores). The files here are the "
        "closest static approximations; `decoder.json` in the parent directory records where each number came "
        "from (`engine_configs`). Model paths are local to the machine that exported them: replace them elsewhere.",
    ]
    if "hf" in files:
        parts += ["", "## transformers (assisted generation)", "",
                  "transformers reads the assistant's settings from the assistant model's own generation config "
                  "(num_assistant_tokens passed to generate() does not reach it). Either copy "
                  "`hf/generation_config.json` into the draft's folder before loading it, or:", "",
                  "    from transformers import GenerationConfig",
                  f"    assistant.generation_config = GenerationConfig.from_pretrained(\"{root / 'hf'}\")",
                  "    target.generate(**inputs, assistant_model=assistant)", "",
                  "With scikit-learn installed, transformers re-fits `assistant_confidence_threshold` online in "
                  "every generate() call (`AssistedCandidateGenerator`, generation/candidate_generator.py: once more "
                  "than 5 drafted tokens have been judged, with at least one accepted and one rejected, it takes the "
                  "threshold minimising an ROC cost), so the exported value holds only for the first few rounds of "
                  "each call; without scikit-learn it stays as exported."]
    parts += ["", "## vLLM", "",
              f"    vllm serve {target}{tok} --speculative-config \"$(cat {root / ENGINE_FILES['vllm']})\"", "",
              "(Python: `LLM(model=..., tokenizer=..., speculative_config=json.load(open(...)))`.) "
              + ("The target folder holds no tokenizer files (the embedded pair keeps them in a sibling "
                 "`tokenizer/` folder): pass that folder with `--tokenizer`, as above." if tokenizer else
                 "Pass `--tokenizer` when the target folder has no tokenizer files.")]
    parts += ["", "## SGLang", "",
              f"    python -m sglang.launch_server --config {root / ENGINE_FILES['sglang_config']}", "",
              "`sglang/config.yaml` holds the server flags with dashed keys (how `--config` reads them); "
              "`sglang/sglang_args.json` the same values as a JSON object (`speculative_num_draft_tokens` counts "
              "the root token)."]
    if "sglang_adaptive" in files:
        parts.append("`sglang/sglang_adaptive.json` is SGLang's adaptive-steps config, keyed by batch size; "
                     "config.yaml switches it on (`speculative-adaptive`).")
    if "num_speculative_tokens_per_batch_size" in files.get("vllm", ""):
        parts += ["", "## Per batch size", "",
                  "`vllm/speculative_config.json` carries `num_speculative_tokens_per_batch_size`, vLLM's dynamic "
                  "speculative decoding table ([start, end, K], inclusive; K = 0 turns drafting off at those batch "
                  "sizes): the grid's best static depth per batch size, measured in batch replay (`specpilot grid "
                  "--batch-sizes`). vLLM looks K up by the number of scheduled requests; it disables the table "
                  "(with a warning) under data parallelism."]
    if "vllm_learned" in files:
        parts += ["", "## The learned policy's per-batch-size table", "",
                  f"`{ENGINE_FILES['vllm_learned']}`"
                  + (f" and `{ENGINE_FILES['sglang_adaptive_learned']}`" if "sglang_adaptive_learned" in files
                     else "")
                  + " hold the same tables built from the learned batch-aware policy instead of the grid: at each "
                    "batch size the depth it chose most often in batch replay of the validation trace. Use them in "
                    "place of the files above (same keys)."]
    for key, reason in skipped.items():
        parts.append(f"Not written: {ENGINE_FILES[key]} ({reason}).")
    parts += ["", "To run the learned policies themselves use specpilot: `SpeculativeDecoder.from_config(<export "
              "dir>)` or `specpilot generate --config <export dir> --prompt ...`."]
    return "\n".join(parts) + "\n"
