"""KV-cache helpers over transformers' DynamicCache: create, crop to a length, keep selected positions.

After every cycle the caches must hold exactly the accepted prefix: rejected tree branches are dropped and the
accepted path is compacted to contiguous positions (`keep_positions`), or the tail is cut (`crop_to`). Speculative
caches therefore keep every position (`new_cache`); only target-only decoding uses the model's own layout.
"""
from __future__ import annotations

import torch
from packaging.version import Version
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from specpilot.drafting.errors import DependencyError

# transformers 5.24 renamed the forward keyword `past_key_values` to `cache`, which every decoding forward passes.
# Older 5.x models take `cache=` into **kwargs without a word and decode with no cache: the first crop then fails
# ("cannot crop a cache of 0 positions") or attention meets masks of the wrong width (seen on 5.17).
MIN_TRANSFORMERS = "5.24"


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers release whose models do not take the `cache=` keyword (before any model is loaded)."""
    if version is None:
        import transformers  # the module sys.modules holds now (transformers can replace its lazy module object)

        version = transformers.__version__
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise DependencyError(f"specpilot needs transformers >= {MIN_TRANSFORMERS} (its models take the cache= keyword "
                           f"every decoding forward passes); this environment has transformers {version}: "
                           f"pip install 'transformers>={MIN_TRANSFORMERS},<6'")


def new_cache(model) -> DynamicCache:
    """A cache of full layers for speculative decoding. Not the model's own layout: a sliding-window layer drops
    keys as it grows and keeps a running length, so crop / keep_positions could not restore the accepted prefix;
    windows are applied by the masks instead (`drafting.attention.model_mask`)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    return cache


def generation_cache(model) -> DynamicCache:
    """The cache transformers' generate() builds for `model` (sliding-window layers keep only their window): for
    target-only decoding, which never crops, so the baseline is as fast as generate()."""
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop_to(cache: DynamicCache, length: int) -> None:
    """Drop every cached position at index >= length."""
    excess = cache.get_seq_length() - length
    if excess < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if excess:
        cache.crop(-excess)


def keep_positions(cache: DynamicCache, prefix_len: int, extra: torch.Tensor) -> None:
    """Keep positions [0, prefix_len) plus the cache indices in `extra` (ascending), in that order; drop the rest.

    When `extra` is the contiguous run prefix_len..prefix_len+k-1 this is a plain crop (no copy).
    """
    k = int(extra.numel())
    total = cache.get_seq_length()
    if k == 0:
        crop_to(cache, prefix_len)
        return
    first, last = int(extra[0]), int(extra[-1])
    if first == prefix_len and last == prefix_len + k - 1:
        crop_to(cache, prefix_len + k)
        return
    keep = torch.cat([torch.arange(prefix_len, device=extra.device), extra])
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        keep_dev = keep.to(layer.keys.device)
        assert layer.keys.shape[-2] == total, "cache layers disagree on length"
        layer.keys = layer.keys.index_select(-2, keep_dev)
        layer.values = layer.values.index_select(-2, keep_dev)
