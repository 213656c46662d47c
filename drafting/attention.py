"""Attention layouts a speculative forward must reproduce: sliding windows, and whether a model takes tree masks.

Tree drafting and tree verification hand the model explicit 4-D boolean masks with explicit position ids, and
transformers then uses the mask as given in every layer. A layer that attends through a sliding window (Mistral,
Gemma 2/3, GPT-OSS, ...) must still not see keys its own causal mask would hide once a sequence outgrows the window,
so `model_mask` narrows a tree mask for each window the model uses: a key at position k stays visible from a query
at position p iff p - k < window (transformers' `sliding_window_overlay`). Models that mix full and sliding layers
(a `layer_types` list) take the {layer type: mask} dict their forward builds itself from a 2-D mask. SDPA takes
boolean masks; eager attention adds the mask to the scores, so it gets 0 / most-negative floats (`MaskLayout`).

Only the committed prefix can fall out of a window: drafted nodes are within max_depth of every query that sees
them. The prefix sits at the front of every cache in order (single sequences: index = position; batches: holes
between valid slots), which is all `model_mask` needs to know where each key is.

`check_tree_attention` probes, when a pair is built, that a model honours 4-D masks and position ids at all
(models that build ALiBi biases from a 2-D mask, such as BLOOM, do not), so such a model is refused with a clear
error instead of decoding wrong tokens.

`decoding_mode` is the context every decoding forward runs in: inference mode, and on CUDA SDPA without its cuDNN
backend (see DECODING_SDPA_BACKENDS for why).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from specpilot.drafting.errors import NonFiniteLogitsError, overflow_fix

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")

# SDPA's backends while decoding on CUDA: all but cuDNN. On an H200 (torch 2.11+cu130) SDPA sent masked bf16 attention
# to cuDNN, which builds a graph for every new (query, key) length: the embedded target's first forward at a new
# query length took 49-1170 ms against 5.9-8.6 ms once built (benchmarks/gpu_check.py --sections shapes). Decoding
# meets a new length every cycle (tree blocks of varying size over a growing cache), so a bf16 tree decoder ran at
# 0.5-0.67x of AR on new prompts while fp32 (SDPA's efficient kernel) ran at 1.23-1.51x. The efficient kernel takes
# the same boolean masks. (vLLM and SGLang run their own kernels, FlashAttention / FlashInfer; an SGLang cuDNN
# backend met the same per-shape graph builds, sgl-project/sglang#4650.)
DECODING_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
                          SDPBackend.OVERRIDEABLE]


def limits_sdpa(device: torch.device | str) -> bool:
    """Whether decoding on `device` limits SDPA's backends (CUDA only: the CPU and MPS kernels have no cuDNN)."""
    return torch.device(device).type == "cuda"


def decoding_mode(device: torch.device | str):
    """The context of every decoding forward: torch.inference_mode() and, on CUDA, SDPA limited to
    DECODING_SDPA_BACKENDS (the previous backend choice is restored on exit, so the caller's own code keeps its
    settings); other devices get plain inference mode, as before."""
    return _cuda_decoding() if limits_sdpa(device) else torch.inference_mode()


@contextmanager
def _cuda_decoding():
    with torch.inference_mode(), sdpa_kernel(DECODING_SDPA_BACKENDS):
        yield


class TreeAttentionError(ValueError):
    """A model cannot run tree attention exactly (4-D masks ignored, or an attention type specpilot cannot mask)."""


# window sizes transformers reads from other config fields than sliding_window, which `model_mask` does not model:
# GPT-Neo's local layers (window_size; by cache slot), Doge's kept keys (keep_window_size), and the like
UNMODELED_WINDOWS = ("window_size", "keep_window_size", "sliding_window_size", "attention_window",
                     "attention_window_size", "local_attention_window_len")


def _positions(config) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def check_unmodeled_windows(config) -> None:
    """TreeAttentionError for an attention window `model_mask` cannot reproduce (see UNMODELED_WINDOWS) that binds
    within the model's positions: speculative output would silently differ once a sequence outgrows it. A window as
    long as the positions never binds; GPT-Neo's window_size binds only where attention_layers has local layers."""
    layers = getattr(config, "attention_layers", None)
    for name in UNMODELED_WINDOWS:
        window = getattr(config, name, None)
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            continue
        if name == "window_size" and isinstance(layers, (list, tuple)) and "local" not in layers:
            continue
        positions = _positions(config)
        if positions is None or window < int(positions):
            raise TreeAttentionError(f"{type(config).__name__} limits attention with {name}={window} (under its "
                                     f"{positions} positions), a window speculative tree attention does not model "
                                     "(it narrows tree masks by sliding_window only): output past that many tokens "
                                     "would differ from target-only decoding, so this configuration is not supported")


def context_limit(config) -> int | None:
    """Positions a cached decoder reproduces exactly: max_position_embeddings, and under LongRoPE only
    original_max_position_embeddings. Past it transformers switches every position's rotary factors to the long ones
    (from max(position_ids) + 1, which a tree forward reaches before plain decoding does), so keys cached with the
    short ones no longer match; generate() recomputes its cache there, a cached speculative decoder cannot."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    positions = _positions(config)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = [rope, *(v for v in rope.values() if isinstance(v, dict))] if isinstance(rope, dict) else []
    if any((k.get("rope_type") or k.get("type")) == "longrope" for k in kinds):
        original = next((k.get("original_max_position_embeddings") for k in kinds
                         if k.get("original_max_position_embeddings")), None)
        original = original or getattr(config, "original_max_position_embeddings", None)
        if original:
            positions = min(int(positions), int(original)) if positions else int(original)
    return int(positions) if positions else None


def layer_windows(config) -> dict[str, int | None]:
    """{layer type: sliding window or None} as transformers masks the model's layers. With `layer_types` in the
    config, "sliding_attention" layers use config.sliding_window; without it (Mistral, Mixtral, Phi-3, Starcoder2)
    every layer is windowed iff config.sliding_window is set (0 or None: no window)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    check_unmodeled_windows(config)
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if not types:
        return {"full_attention": None} if window is None else {"sliding_attention": int(window)}
    unknown = sorted(set(types) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise TreeAttentionError(f"{type(config).__name__} has {', '.join(unknown)} layers; speculative tree "
                                 f"attention supports {' and '.join(SUPPORTED_LAYER_TYPES)} layers only")
    if "sliding_attention" in types and window is None:
        raise TreeAttentionError(f"{type(config).__name__} has sliding_attention layers but no sliding_window")
    return {t: (int(window) if t == "sliding_attention" else None) for t in sorted(set(types))}


def _narrow(mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
            window: int | None) -> torch.Tensor:
    if window is None:
        return mask
    return mask & ((query_positions[:, :, None] - key_positions[:, None, :]) < window)[:, None]


class MaskLayout:
    """How a model takes a tree mask: `windows` ({layer type: sliding window or None}, `layer_windows`) and
    `additive` (None: boolean masks, as SDPA takes them; a float dtype: 0 / most negative additive masks, as eager
    attention adds them to the scores)."""

    def __init__(self, windows: dict[str, int | None], additive: torch.dtype | None = None) -> None:
        self.windows, self.additive = windows, additive
        limits = [w for w in windows.values() if w is not None]
        self.min_window = min(limits) if limits else None

    @classmethod
    def of(cls, model) -> "MaskLayout":
        config = model.config
        implementation = getattr(config, "_attn_implementation", None) or "sdpa"
        additive = None if implementation == "sdpa" else next(model.parameters()).dtype
        return cls(layer_windows(config), additive)

    def _finish(self, mask: torch.Tensor) -> torch.Tensor:
        if self.additive is None:
            return mask
        return torch.zeros(mask.shape, dtype=self.additive, device=mask.device).masked_fill_(
            ~mask, torch.finfo(self.additive).min)


FULL_ATTENTION = MaskLayout({"full_attention": None})


def model_mask(layout: MaskLayout, mask: torch.Tensor, query_positions: torch.Tensor,
               prefix: int | torch.Tensor, new_positions: torch.Tensor | None = None):
    """The attention_mask argument for a forward with 4-D boolean `mask` [B, 1, q, K] (True: may attend) at
    `query_positions` [B, q]. prefix: the committed prefix's key columns, at the front of the keys: an int n
    (columns 0..n-1 at positions 0..n-1) or a [B, n] bool tensor of which columns hold committed tokens (in order;
    the others are holes, masked already). new_positions [B, q]: the last q columns are the queries themselves at
    these positions (a batched feed of many committed tokens); otherwise the columns after the prefix are drafted
    nodes, within max_depth of their queries. Returns the mask in the model's format, narrowed for each sliding
    window that can bind: one tensor, or a {layer type: mask} dict when the model's layers differ."""
    if layout.min_window is None:
        return layout._finish(mask)
    last = int(query_positions.max())
    if last < layout.min_window:
        return layout._finish(mask)  # every key is within every window
    b, k = mask.shape[0], mask.shape[-1]
    if isinstance(prefix, int):
        head = torch.arange(prefix, device=mask.device)[None].expand(b, prefix)
    else:
        head = prefix.long().cumsum(dim=1) - 1
    # drafted nodes get a position no window can hide (their queries are at most max_depth after them)
    keys = torch.full((b, k), last, dtype=torch.long, device=mask.device)
    keys[:, :head.shape[1]] = head
    if new_positions is not None:
        keys[:, k - new_positions.shape[1]:] = new_positions
    narrowed = {w: layout._finish(_narrow(mask, query_positions, keys, w)) for w in set(layout.windows.values())}
    if len(narrowed) == 1:
        return next(iter(narrowed.values()))
    return {layer_type: narrowed[w] for layer_type, w in layout.windows.items()}


def check_tree_attention(model, what: str = "model") -> MaskLayout:
    """Probe that `model` honours a 4-D tree mask with explicit position ids: a token that may not see its sibling
    must get the logits it gets without the sibling. Returns the model's `MaskLayout`; raises TreeAttentionError
    naming the architecture and attention implementation otherwise."""
    impl = getattr(model.config, "_attn_implementation", None)
    arch = f"{type(model).__name__}, attn_implementation={impl!r}"
    if impl not in (None, "sdpa", "eager"):  # flash / flex / paged kernels take no 4-D boolean or additive mask
        raise TreeAttentionError(f"the {what} ({arch}) attends through a kernel that takes no 4-D tree mask; load "
                                 "it with attn_implementation='sdpa' (or 'eager')")
    layout = MaskLayout.of(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = int(head.weight.shape[0]) if getattr(head, "weight", None) is not None else int(model.config.vocab_size)
    device = next(model.parameters()).device
    ids = [1 % vocab, 2 % vocab, 3 % vocab]
    sibling = 4 % vocab
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool, device=device)
    try:
        with torch.inference_mode():
            plain = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float()
            masked = model(input_ids=torch.tensor([ids[:2] + [sibling, ids[2]]], device=device),
                           attention_mask=model_mask(layout, tree[None, None], torch.tensor([[0, 1, 2, 2]],
                                                                                               device=device), 0),
                           position_ids=torch.tensor([[0, 1, 2, 2]], device=device), use_cache=False).logits[0].float()
    except Exception as err:  # the architecture's forward rejects 4-D masks or explicit position ids
        raise TreeAttentionError(f"the {what} ({arch}) cannot take a 4-D attention mask with explicit position ids "
                                 f"({type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}); speculative tree "
                                 f"attention needs both, so this architecture is not supported") from None
    if not (torch.isfinite(plain).all() and torch.isfinite(masked).all()):
        # overflow, not the mask: inf - inf would read as a masked token moving the logits by nan
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        raise NonFiniteLogitsError(f"the {what} ({arch}) gives logits that are not finite (inf or nan) in {dtype} on "
                                   f"a 4-token probe{overflow_fix(dtype)}")
    expected, got = plain[[0, 1, 2]], masked[[0, 1, 3]]
    scale = 1.0 + float(expected.abs().max())
    # half precision: the two forwards round differently (other shapes), far less than a visible sibling moves them
    tolerance = (1e-4 if next(model.parameters()).dtype == torch.float32 else 3e-2) * scale
    if not torch.isfinite(got).all() or float((got - expected).abs().max()) > tolerance:
        raise TreeAttentionError(f"the {what} ({arch}) ignores 4-D attention masks or explicit position ids (a "
                                 f"masked token's logits changed by {float((got - expected).abs().max()):.3g}); "
                                 f"speculative tree attention would decode wrong tokens, so this architecture is not "
                                 f"supported (ALiBi models that build their biases from a 2-D mask, such as BLOOM, "
                                 f"are among them; flash-attention kernels take no tree mask: load with "
                                 f"attn_implementation='sdpa')")
    return layout
