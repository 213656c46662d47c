"""What the target's own `generation_config` asks for that specpilot's decoding does not do, said once.

transformers' `generate()` (and vLLM with `--generation-config auto`) start from the model's generation_config:
sampling settings, a length, logits processors. specpilot decodes with the arguments it is given (greedy unless a
temperature > 0 is passed; its own max_new_tokens), and reads only the end ids from that file. Exact speculative
decoding keeps the target's plain distribution, shaped only by temperature / top-k / top-p, so processors that
rewrite it from the history (repetition penalties, n-gram bans, minimum lengths, suppressed or forced tokens) are
not applied. Nothing here changes what is generated: `generation_config_note` names the differences, the CLI prints
it, and the library warns once per pair (`warn_generation_config`).
"""
from __future__ import annotations

import warnings

SAMPLING = ("temperature", "top_k", "top_p")
LENGTH = ("max_new_tokens", "max_length")
# settings whose value changes the output, with the value that leaves it unchanged (None: unset or empty)
NOT_APPLIED = {
    "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0, "min_length": 0,
    "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "sequence_bias": None, "exponential_decay_length_penalty": None, "num_beams": 1, "penalty_alpha": 0.0,
    "guidance_scale": 1.0, "diversity_penalty": 0.0,
}
CLI_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
             "max_new_tokens": "--max-new-tokens"}
_WARNED = "_specpilot_generation_note_given"


def _set(value, neutral) -> bool:
    if value is None or (isinstance(value, (list, tuple, dict)) and not value):
        return False
    return neutral is None or value != neutral


def generation_config_differences(model) -> dict[str, dict]:
    """{"sampling", "length", "not_applied", "unread_end"}: the model's generation_config settings specpilot's
    decoding does not take (sampling only when it sets do_sample=True, as generate() samples only then), and an end
    id only config.json names (generate() does not read it either)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {"sampling": {}, "length": {}, "not_applied": {}, "unread_end": {}}
    sampling = ({"do_sample": True, **{k: getattr(config, k) for k in SAMPLING if getattr(config, k, None) is not None}}
                if getattr(config, "do_sample", None) else {})
    length = {k: getattr(config, k) for k in LENGTH if getattr(config, k, None) is not None}
    not_applied = {k: getattr(config, k) for k, neutral in NOT_APPLIED.items()
                   if _set(getattr(config, k, None), neutral)}
    model_end = getattr(getattr(model, "config", None), "eos_token_id", None)
    unread_end = ({"eos_token_id": model_end} if _set(model_end, None) and not _set(config.eos_token_id, None)
                  else {})
    return {"sampling": sampling, "length": length, "not_applied": not_applied, "unread_end": unread_end}


def _pairs(values: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def generation_config_note(model, *, cli: bool = False, given: frozenset[str] | set[str] = frozenset()) -> str | None:
    """One sentence naming what the model's generation_config asks for that this decoding will not do (None when
    nothing). cli: name the command's flags; given: the settings the caller passed explicitly (their defaults from
    the file are then moot and not named)."""
    diff = generation_config_differences(model)
    parts = []
    if diff["sampling"] and "temperature" not in given:
        suggested = {"temperature": 1.0, **{k: v for k, v in diff["sampling"].items() if k in SAMPLING}}
        how = (" ".join(f"{CLI_FLAGS[k]} {v}" for k, v in suggested.items()) if cli else
               ", ".join(f"{k}={v}" for k, v in suggested.items()))
        parts.append(f"it samples ({_pairs(diff['sampling'])}) where specpilot decodes greedily unless given a "
                     f"temperature > 0: pass {how} to sample as it suggests")
    if diff["length"] and "max_new_tokens" not in given:
        parts.append(f"its length ({_pairs(diff['length'])}) is not read: specpilot's "
                     f"{'--max-new-tokens' if cli else 'max_new_tokens'} applies")
    if diff["not_applied"]:
        parts.append(f"{_pairs(diff['not_applied'])} {'is' if len(diff['not_applied']) == 1 else 'are'} not applied "
                     "(exact speculative decoding keeps the target's own distribution, shaped only by temperature, "
                     "top-k and top-p)")
    if diff["unread_end"]:
        parts.append(f"it names no end token, so decoding stops only at the length, as generate() does (config.json's "
                     f"{_pairs(diff['unread_end'])} is not read: set generation_config.eos_token_id to stop there)")
    if not parts:
        return None
    return "the target's generation_config: " + "; ".join(parts)


def warn_generation_config(pair) -> None:
    """Warn (UserWarning) once per pair when its target's generation_config asks for what decoding will not do."""
    if getattr(pair, _WARNED, False):
        return
    mark_noted(pair)
    target = getattr(pair, "target", None)
    note = generation_config_note(target) if target is not None else None
    if note:
        warnings.warn(note, UserWarning, stacklevel=3)


def mark_noted(pair) -> None:
    """Record that the pair's generation_config note was given (the CLI prints it itself)."""
    try:
        setattr(pair, _WARNED, True)
    except AttributeError:  # a pair that takes no attributes (a test double) is warned again: harmless
        pass
