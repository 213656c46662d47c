"""Exact tree speculative decoding: model pair, tree drafting, verification/sampling, caches, the decoding loop."""
from specpilot.drafting.decoder import DecodingSession, SpeculativeDecoder, autoregressive_generate
from specpilot.drafting.pair import ModelPair, VocabularyMismatchError
from specpilot.drafting.types import CycleRecord, DraftState, GenerationOutput, TreeConfig

__all__ = ["ModelPair", "VocabularyMismatchError", "SpeculativeDecoder", "DecodingSession",
           "autoregressive_generate", "TreeConfig", "DraftState", "CycleRecord", "GenerationOutput"]
