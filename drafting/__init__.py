"""Exact tree speculative decoding: model pair, tree drafting, verification/sampling, caches, the decoding loop.

The names below load on first use (PEP 562): importing a light submodule such as `specpilot.drafting.cliargs`
(every command's argument parser) must not import torch and transformers.
"""
from importlib import import_module

_EXPORTS = {
    "DecodingSession": "decoder", "SpeculativeDecoder": "decoder", "autoregressive_generate": "decoder",
    "ModelPair": "pair", "VocabularyMismatchError": "pair",
    "TreeConfig": "types", "DraftState": "types", "CycleRecord": "types", "GenerationOutput": "types",
}

__all__ = ["ModelPair", "VocabularyMismatchError", "SpeculativeDecoder", "DecodingSession",
           "autoregressive_generate", "TreeConfig", "DraftState", "CycleRecord", "GenerationOutput"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(f"specpilot.drafting.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specpilot.drafting' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
