"""ModelPair: a target and a draft causal LM that share one vocabulary, plus their tokenizer.

`ModelPair.from_pretrained()` with no arguments loads the small code-model pair embedded in the package
(built by `specpilot models build`); `ModelPair.from_pretrained(target=..., draft=...)` loads any pair of
`AutoModelForCausalLM` checkpoints (hub ids or local paths) and refuses pairs whose vocabularies differ.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_PAIR_DIR = Path(__file__).resolve().parent / "default_pair"


class VocabularyMismatchError(ValueError):
    """The target and draft do not share a vocabulary, so draft tokens would mean other things to the target."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """fp32 on CPU (exact and fastest for small models there); bf16 on CUDA when supported, else fp16."""
    if str(device).startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def check_same_vocabulary(target, draft, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Raise VocabularyMismatchError unless both models (and tokenizers, when given) share one vocabulary."""
    t_size, d_size = _vocab_size(target), _vocab_size(draft)
    if t_size != d_size:
        raise VocabularyMismatchError(
            f"target and draft output vocabularies differ ({t_size} vs {d_size} logits); speculative decoding "
            "needs a draft that uses the target's tokenizer. Pick a draft from the same model family."
        )
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise VocabularyMismatchError(
                "target and draft tokenizers map tokens to different ids; a draft token id would mean another "
                "string to the target. Use a draft trained with the target's tokenizer."
            )


def model_digest(model, sample: int = 65_536) -> str:
    """Content hash of a model's weights (names, shapes, and up to `sample` evenly strided values per tensor),
    independent of where it was loaded from and of the thread count: only bytes are hashed, never a floating-point
    reduction (a sum's rounding depends on how many threads computed it). Strided sampling keeps it fast for
    multi-GB checkpoints while any retraining or different checkpoint still changes it."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // sample)
        h.update(flat[::step][:sample].to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _load_tokenizer(explicit, model_path):
    """The explicit tokenizer, else the one beside the model (its folder, or a sibling `tokenizer/` folder), else
    None: a checkpoint shipped without tokenizer files still works on token ids."""
    from transformers import AutoTokenizer

    if explicit is not None:
        return AutoTokenizer.from_pretrained(str(explicit))
    candidates = [str(model_path)]
    if Path(str(model_path)).is_dir():
        candidates.append(str(Path(str(model_path)).parent / "tokenizer"))
    for candidate in candidates:
        try:
            return AutoTokenizer.from_pretrained(candidate)
        except (OSError, ValueError):
            continue
    return None


@dataclass
class ModelPair:
    """A target/draft pair on one device. `target` and `draft` are Hugging Face causal LMs; `tokenizer` is
    the shared transformers tokenizer (optional when callers pass token ids)."""

    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        check_same_vocabulary(self.target, self.draft)
        self.target.eval()
        self.draft.eval()
        if self.device != next(self.draft.parameters()).device:
            raise ValueError("target and draft must live on the same device; move both with pair.to(device)")

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return _vocab_size(self.target)

    @property
    def eos_token_id(self) -> int | None:
        eos = getattr(self.target.generation_config, "eos_token_id", None) or self.target.config.eos_token_id
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return eos

    @property
    def max_context(self) -> int:
        return int(getattr(self.target.config, "max_position_embeddings", 1 << 30))

    def to(self, device=None, dtype=None) -> "ModelPair":
        self.target.to(device=device, dtype=dtype)
        self.draft.to(device=device, dtype=dtype)
        return self

    def identity(self) -> dict:
        """Names and content hashes, for manifests, reports and export validation."""
        return {
            "name": self.name,
            "target": getattr(self.target.config, "_name_or_path", "") or "in-memory",
            "draft": getattr(self.draft.config, "_name_or_path", "") or "in-memory",
            "target_hash": model_digest(self.target),
            "draft_hash": model_digest(self.draft),
            "vocab_size": self.vocab_size,
        }

    def encode(self, prompt: str | list[int] | torch.Tensor) -> list[int]:
        """Prompt text or ids -> list of token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this ModelPair has no tokenizer: pass token ids, or build it with tokenizer=")
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, torch.Tensor):
            return [int(t) for t in prompt.reshape(-1).tolist()]
        return [int(t) for t in prompt]

    def decode(self, tokens: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        *,
        tokenizer: str | Path | None = None,
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> "ModelPair":
        """Load a pair. No arguments: the embedded default pair. Otherwise both `target` and `draft` are needed."""
        from transformers import AutoModelForCausalLM

        if target is None and draft is None:
            root = DEFAULT_PAIR_DIR
            if not (root / "target" / "config.json").exists():
                raise FileNotFoundError(
                    f"the embedded default pair is missing under {root}; build it with `specpilot models build`"
                )
            target, draft, tokenizer, name = root / "target", root / "draft", root / "tokenizer", "specpilot-default"
        elif target is None or draft is None:
            raise ValueError("give both target= and draft= (or neither, for the embedded default pair)")
        else:
            name = f"{Path(str(target)).name}+{Path(str(draft)).name}"
        device = device or default_device()
        if isinstance(dtype, str):
            dtype = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                     "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
        dtype = dtype or default_dtype(device)
        target_model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype)
        draft_model = AutoModelForCausalLM.from_pretrained(str(draft), dtype=dtype)
        tok = _load_tokenizer(tokenizer, target)
        draft_tok = _load_tokenizer(None, draft) if tokenizer is None else None
        check_same_vocabulary(target_model, draft_model, tok, draft_tok)
        return cls(target_model.to(device), draft_model.to(device), tok, name=name)

    @staticmethod
    def default_metrics() -> dict | None:
        path = DEFAULT_PAIR_DIR / "metrics.json"
        return json.loads(path.read_text()) if path.exists() else None
