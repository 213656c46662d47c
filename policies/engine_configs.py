"""Static speculative-decoding configs for the engines users already run, derived from a trained run.

None of these engines can run a per-token learned policy: transformers' assisted generation, vLLM and SGLang take a
fixed draft length (or a draft length driven by their own simple rules), so what `specpilot export` writes here are
the closest static approximations of what the policies do:

    hf/generation_config.json        the DRAFT's generation config for transformers assisted generation (chain):
                                     num_assistant_tokens = the depth policy's median depth, schedule "constant",
                                     assistant_confidence_threshold fitted to the depth policy's STOP decisions
    vllm/speculative_config.json     {"method": "draft_model", "model": <draft>, "num_speculative_tokens": K}
                                     (vLLM drafts chains: K = the same median depth)
    sglang/sglang_args.json          --speculative-algorithm / -num-steps (D) / -eagle-topk (W) /
                                     -num-draft-tokens (V + 1: SGLang counts the root, our sizes do not)
    sglang/sglang_adaptive.json      --speculative-adaptive-config: candidate_steps = the depth policy's most
                                     frequent depths; an EMA of acceptance length picks among them (topk = 1 only)

The tree shape (D, W, V) comes from the grid search's best static config when the run has one (`grid.json`),
else from the policies' measured choices, else from the run's fallback static config.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

DEFAULT_CONFIDENCE_THRESHOLD = 0.4  # transformers' default assistant_confidence_threshold

# SGLang adaptive-mode settings (units: EMA of the acceptance length in tokens, and batches):
ADAPTIVE_DEFAULTS = {
    "ema_alpha": 0.2,        # weight of the newest batch: ~5-batch memory, like GammaTune's rate 0.2 in LTD
    "update_interval": 10,   # re-decide the tier every 10 batches: switching has a CUDA-graph/cache cost
    "warmup_batches": 20,    # observe only at first: the EMA needs a few batches before it means anything
    "down_hysteresis": -0.25,  # step down only once the EMA falls 0.25 token below the switch point
    "up_hysteresis": 0.25,     # step up only once it exceeds the switch point by 0.25 token (no flapping)
}

README = """# Engine configs exported by specpilot

These engines cannot run specpilot's per-token learned policies (which decide after every draft level whether to
continue, and how many candidates to verify, from the draft's scores). The files here are the closest static
approximations; `decoder.json` in the parent directory records where each number came from (`engine_configs`).

- `hf/generation_config.json`: copy into the DRAFT model's directory (transformers reads the assistant's own
  generation config; passing num_assistant_tokens to generate() may not reach it). Chain drafting.
- `vllm/speculative_config.json`: pass as `speculative_config=` (Python) or `--speculative-config '<json>'`.
- `sglang/sglang_args.json`: the `--speculative-*` server arguments (num_draft_tokens counts the root token).
- `sglang/sglang_adaptive.json`: `--speculative-adaptive --speculative-adaptive-config sglang_adaptive.json`
  (adaptive mode needs `--speculative-eagle-topk 1`).

To run the learned policies themselves use specpilot: `SpeculativeDecoder.from_config(<export dir>)` or
`specpilot generate --config <export dir> --prompt ...`.
"""


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


def max_candidates(width: int, depth: int) -> int:
    return width + (depth - 1) * width * width if depth > 0 else 0


def hf_generation_config(num_tokens: int, threshold: float, base: dict | None = None) -> dict:
    """The draft's generation_config.json for assisted generation (base: the draft's own config, kept)."""
    config = dict(base or {})
    config.update({"num_assistant_tokens": int(max(1, num_tokens)), "num_assistant_tokens_schedule": "constant",
                   "assistant_confidence_threshold": float(threshold)})
    return config


def vllm_speculative_config(model: str, num_tokens: int) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": int(max(1, num_tokens)),
            "draft_tensor_parallel_size": 1}


def sglang_args(draft: str, depth: int, width: int, size: int, algorithm: str = "STANDALONE") -> dict:
    """SGLang server arguments for a (D, W, V) tree; V excludes the root, SGLang's num_draft_tokens includes it.
    STANDALONE = a separate small draft LM (what specpilot pairs are); use EAGLE/EAGLE3 with an EAGLE head."""
    depth, width = int(max(1, depth)), int(max(1, width))
    size = int(min(max(1, size), max_candidates(width, depth)))
    if width == 1:
        size = min(size, depth)  # a chain has exactly `depth` drafted tokens
    return {"speculative_algorithm": algorithm, "speculative_draft_model_path": str(draft),
            "speculative_num_steps": depth, "speculative_eagle_topk": width,
            "speculative_num_draft_tokens": size + 1}


def sglang_adaptive_config(depth_counts: dict, fallback_depth: int, max_tiers: int = 3) -> dict:
    """candidate_steps: the depth policy's `max_tiers` most frequent depths (sorted), else around fallback_depth."""
    if depth_counts:
        ranked = sorted(depth_counts.items(), key=lambda kv: (-kv[1], int(kv[0])))
        steps = sorted(int(k) for k, _ in ranked[:max_tiers])
    else:
        d = int(max(1, fallback_depth))
        steps = sorted({max(1, d // 2), d, d + d // 2})
    return {"candidate_steps": steps, **ADAPTIVE_DEFAULTS}


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


def write_engine_configs(out_dir: str | Path, *, draft: str, width: int, grid_best: dict | None,
                         choices: dict, fallback: tuple[int, int], draft_generation_config: dict | None = None) -> dict:
    """Write hf/, vllm/, sglang/ configs and README.md under out_dir/engines; return decoder.json's
    `engine_configs` section (relative file paths, the numbers used and their provenance).

    choices: {"depths": [per-cycle depth], "sizes": [per-cycle verified size], "stop_top_probs": [...],
              "stops": [...]} measured by running the exported controller (any list may be empty)."""
    out = Path(out_dir) / "engines"
    depth_summary = choice_summary(choices.get("depths") or [])
    size_summary = choice_summary(choices.get("sizes") or [])
    shape, shape_source = static_shape(grid_best, depth_summary, size_summary, width, fallback)
    chain_k = depth_summary["median"] if depth_summary else shape["depth"]
    chain_source = "policies (median depth)" if depth_summary else shape_source
    threshold, agreement = fit_confidence_threshold(choices.get("stop_top_probs") or [], choices.get("stops") or [])

    files = {
        "hf": ("hf/generation_config.json", hf_generation_config(chain_k, threshold, draft_generation_config)),
        "vllm": ("vllm/speculative_config.json", vllm_speculative_config(draft, chain_k)),
        "sglang": ("sglang/sglang_args.json", sglang_args(draft, shape["depth"], shape["width"], shape["size"])),
        "sglang_adaptive": ("sglang/sglang_adaptive.json",
                            sglang_adaptive_config(depth_summary["counts"] if depth_summary else {}, chain_k)),
    }
    for rel, data in files.values():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
    (out / "README.md").write_text(README)
    return {
        "note": "Static approximations: these engines cannot run per-token learned policies (see engines/README.md).",
        "files": {k: f"engines/{rel}" for k, (rel, _) in files.items()},
        "chain_depth": {"value": int(chain_k), "source": chain_source},
        "tree_shape": {**shape, "source": shape_source},
        "confidence_threshold": {"value": threshold, "agreement_with_depth_policy": agreement,
                                 "source": "fitted" if agreement is not None else "transformers default"},
        "choices": {"depth": depth_summary, "size": size_summary},
    }
