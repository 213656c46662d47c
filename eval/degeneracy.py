"""Degenerate text: measures of the target's own greedy output per prompt, and the rule that flags loops and junk.

Speculative decoding is fastest where the target is most predictable, and nothing is more predictable than a
target that loops ("# 'a' is a 'a' is a 'a' ...") or answers a prompt outside its training data with filler.
Speedups measured on such output say nothing about the text a user wants, so a report measures, for every prompt,
the target's greedy output (the `ar` run at temperature 0, which every evaluation already produces: the measure
costs no generation) and shows flagged prompts apart from the headline verdict.

Measures of one output (its new tokens, and their decoded text when a tokenizer is there):

- `repeated_ngram_share`: of the output's token NGRAM-grams, the share that repeat an earlier NGRAM-gram of the
  same output (0: no NGRAM-gram twice; near 1: the output is one short loop);
- `compression_ratio`: zlib-compressed size over raw size of the output (its decoded text as UTF-8, else its
  token ids as 4-byte integers); repetitive text compresses well, so a loop has a low ratio;
- `distinct_token_ratio`: distinct tokens over tokens.

Rule (a documented threshold, calibrated on the embedded pair's greedy output, 64 tokens: it flags 75 of the 80
prose prompts of `heldout`, whose outputs are mostly "#\n#\n..." at 95-97% repeated 4-grams, and 13 of the 66
prompts of `heldout_code`, whose flagged outputs visibly loop, e.g. `"text", "text", "text"`;
`benchmarks/degeneracy_check.py` reproduces the counts): an output of at least MIN_TOKENS tokens is
*degenerate* when `repeated_ngram_share >= MAX_REPEATED_SHARE` or `compression_ratio <= MIN_COMPRESSION_RATIO`.
Shorter outputs (the target stopped early) are not judged, never flagged, and stay in the verdicts; reports count
them apart ("too short to judge"), so "not degenerate" is said only of judged outputs. A *group* (task x language,
and a task over all its languages) is degenerate when at least GROUP_SHARE of its judged prompts are.

Everything here is pure Python on token lists and strings; `specpilot.eval.runner` feeds it and
`specpilot.eval.report` / `specpilot.eval.summary` print it.
"""
from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

NGRAM = 4                     # token n-gram length of the repetition measure
MIN_TOKENS = 16               # fewer new tokens: not judged
MAX_REPEATED_SHARE = 0.5      # at least half the 4-grams repeat an earlier one: a loop
MIN_COMPRESSION_RATIO = 0.25  # compresses to a quarter or less: a loop or filler
GROUP_SHARE = 0.5             # a group is degenerate when at least half of its measured prompts are


@dataclass(frozen=True)
class Degeneracy:
    """The measures of one output and the rule's verdict on it (`reason` names the measure that fired)."""

    n_tokens: int
    repeated_ngram_share: float
    compression_ratio: float
    distinct_token_ratio: float
    degenerate: bool
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def repeated_ngram_share(tokens: Sequence[int], n: int = NGRAM) -> float:
    """Share of the n-grams of `tokens` that equal an earlier n-gram of `tokens` (0.0 with fewer than n tokens)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def compression_ratio(data: bytes) -> float:
    """len(zlib.compress(data, 9)) / len(data); 1.0 for empty data. Short data carries zlib's fixed overhead
    (about 11 bytes), which only raises the ratio: a short output is never flagged by it by accident."""
    if not data:
        return 1.0
    return len(zlib.compress(data, 9)) / len(data)


def measure(tokens: Sequence[int], text: str | None = None) -> Degeneracy:
    """The measures and the rule's verdict for one output (module docstring). `text` is its decoded text; without
    it the compression ratio is taken over the token ids."""
    tokens = list(tokens)
    data = text.encode("utf-8") if text else struct.pack(f"<{len(tokens)}i", *tokens)
    share = repeated_ngram_share(tokens)
    ratio = compression_ratio(data)
    distinct = len(set(tokens)) / len(tokens) if tokens else 1.0
    reasons = []
    if len(tokens) >= MIN_TOKENS:
        if share >= MAX_REPEATED_SHARE:
            reasons.append(f"{share:.0%} of {NGRAM}-grams repeat")
        if ratio <= MIN_COMPRESSION_RATIO:
            reasons.append(f"compresses to {ratio:.0%}")
    return Degeneracy(n_tokens=len(tokens), repeated_ngram_share=share, compression_ratio=ratio,
                      distinct_token_ratio=distinct, degenerate=bool(reasons), reason="; ".join(reasons))


def degeneracy_report(outputs: dict[str, Sequence[int]], prompts: Iterable, *,
                      decode: Callable[[list[int]], str | None] | None = None) -> dict:
    """Per prompt and per (task, language) group: the measures of each prompt's greedy output and the rule's flags.

    outputs: prompt id -> the target's greedy new tokens (prompts without one are not measured); prompts: objects
    with `id`, `task`, `language` (`specpilot.eval.suites.Prompt`); decode: token ids -> text (e.g.
    `ModelPair.decode`; None or a None result: measure the ids). Returns a JSON-able dict:
    {"rule", "n_prompts", "n_measured", "n_judged", "n_too_short", "too_short": [prompt ids: fewer than MIN_TOKENS
    new tokens, not judged], "flagged": [prompt ids], "prompts": {id: measures}, "groups": [...]}."""
    per: dict[str, dict] = {}
    groups: dict[tuple[str, str], list[str]] = {}
    n_prompts = 0
    for p in prompts:
        n_prompts += 1
        groups.setdefault((p.task, p.language), []).append(p.id)
        if p.id not in outputs:
            continue
        tokens = list(outputs[p.id])
        text = decode(tokens) if decode is not None else None
        per[p.id] = {**measure(tokens, text).to_dict(), "task": p.task, "language": p.language,
                     "sample": (text or "")[:80]}
    for task in sorted({t for t, _ in groups}):  # (task, "all") for a task in several languages, as the report has
        langs = [k for k in groups if k[0] == task]
        if len(langs) > 1:
            groups[(task, "all")] = [i for k in langs for i in groups[k]]
    group_rows = []
    for (task, language), ids in sorted(groups.items()):
        measured = [i for i in ids if i in per]
        judged = [i for i in measured if per[i]["n_tokens"] >= MIN_TOKENS]
        flagged = [i for i in judged if per[i]["degenerate"]]
        group_rows.append({"task": task, "language": language, "n_prompts": len(ids), "n_measured": len(measured),
                           "n_judged": len(judged), "n_flagged": len(flagged),
                           "degenerate": bool(judged) and len(flagged) >= GROUP_SHARE * len(judged)})
    too_short = [i for i, m in per.items() if m["n_tokens"] < MIN_TOKENS]
    return {"rule": rule_text(), "n_prompts": n_prompts, "n_measured": len(per), "n_judged": len(per) - len(too_short),
            "n_too_short": len(too_short), "too_short": too_short,
            "flagged": [i for i, m in per.items() if m["degenerate"]], "prompts": per, "groups": group_rows}


def judged_count(degeneracy: dict) -> int:
    """Prompts whose output the rule judged (a report written before `n_judged` existed: every measured one)."""
    return int(degeneracy.get("n_judged", degeneracy.get("n_measured", 0)))


def too_short_count(degeneracy: dict) -> int:
    """Prompts whose output was too short to judge (0 in a report written before they were counted)."""
    return int(degeneracy.get("n_too_short", len(degeneracy.get("too_short") or [])))


def too_short_note(n: int) -> str:
    """"; N too short to judge (< MIN_TOKENS new tokens, kept in the verdicts)", or "" when N is 0."""
    return f"; {n} too short to judge (< {MIN_TOKENS} new tokens, kept in the verdicts)" if n else ""


def nothing_judged(n_short: int) -> str:
    """The line for a report whose every output was too short to judge."""
    return (f"no output long enough to judge: all {n_short} are under {MIN_TOKENS} new tokens (kept in the "
            "verdicts)")


def rule_text() -> str:
    """The flagging rule in one sentence, for reports."""
    return (f"the target's greedy output (>= {MIN_TOKENS} new tokens) is degenerate when >= "
            f"{MAX_REPEATED_SHARE:.0%} of its token {NGRAM}-grams repeat an earlier one or zlib compresses it to <= "
            f"{MIN_COMPRESSION_RATIO:.0%} of its size; a group is degenerate when >= {GROUP_SHARE:.0%} of its "
            "prompts are")


def greedy_outputs(records: Iterable) -> dict[str, list[int]]:
    """prompt id -> the new tokens of the target's own greedy output: the `ar` run at temperature 0 and
    concurrency 1 of the earliest round (`specpilot.eval.metrics.RunRecord`s; at T=0 every round is the same)."""
    best: dict[str, tuple[int, list[int]]] = {}
    for r in records:
        if r.method == "ar" and r.temperature == 0.0 and r.concurrency == 1:
            if r.prompt_id not in best or r.repeat < best[r.prompt_id][0]:
                best[r.prompt_id] = (r.repeat, list(r.tokens))
    return {k: v for k, (_, v) in best.items()}
