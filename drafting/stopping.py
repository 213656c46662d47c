"""Where a generation ends: end ids, the token budget, stop token ids and stop strings, one rule for every loop.

    truncate_emitted       the tokens of a cycle (or an autoregressive step) that reach the output, and why it ends
    StopStrings            transformers' generate(stop_strings=...) / vLLM's `stop`: end once the generated text
                           holds one of the strings
    check_stop_token_ids   vLLM's `stop_token_ids`: ids that end the generation as the model's end ids do (kept in
                           the output), reported as "stop"
    end_ids                the pair's end ids, or none with vLLM's `ignore_eos` (benchmarks that want full budgets)
    request_ending         the three of one request, checked against the pair (what each decoding loop holds)
    stopping_options       the three options as generate() keyword arguments, checked once (what eval passes on)

A speculative cycle emits several tokens at once; each is cut exactly where target-only decoding would have stopped,
so speculative, batched and target-only decoding return the same tokens for the same request. As vLLM checks stop
strings, only the generated text is searched (never the prompt), and the output keeps the tokens up to and
including the one that completes the string (transformers keeps it too; vLLM trims the string from its text).
"""
from __future__ import annotations

from collections.abc import Sequence

from specpilot.drafting.checks import check_int
from specpilot.drafting.cycle_math import emitted_count, first_end

# tokens decoded before a cycle's new ones, beyond the longest stop string's length in UTF-8 bytes (a token of a
# byte-level or byte-fallback vocabulary holds at least one byte): room for a cut multi-byte character at the start.
# Tokens that decode to nothing (special tokens) can leave that window short of text: it then grows (`_tail`).
LOOKBACK_MARGIN = 8


class StopStrings:
    """Stop strings checked on decoded text. stops: one string or a sequence of non-empty strings; tokenizer: the
    pair's (text is decoded as `ModelPair.decode` gives output text, special tokens left out)."""

    def __init__(self, stops: str | Sequence[str], tokenizer) -> None:
        stops = check_stop_strings(stops)
        if tokenizer is None:
            raise ValueError("stop_strings need the pair's tokenizer to read the generated text: load the pair with "
                             "ModelPair.from_pretrained, or give ModelPair(tokenizer=...)")
        self.stops = stops
        self.tokenizer = tokenizer
        self.lookback = max(len(s.encode("utf-8")) for s in self.stops) + LOOKBACK_MARGIN
        self.longest = max(len(s) for s in self.stops)

    @classmethod
    def of(cls, stops, tokenizer) -> "StopStrings | None":
        """None for no stop strings (None or an empty list), else the checked StopStrings."""
        if stops is None or (not isinstance(stops, str) and isinstance(stops, Sequence) and len(stops) == 0):
            return None
        return cls(stops, tokenizer)

    def _text(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def _tail(self, generated: Sequence[int]) -> tuple[list[int], str]:
        """The last generated tokens and their text, enough of it for a stop string begun there: the byte bound
        (`lookback` tokens), doubled while special tokens leave it holding fewer characters than a stop string and
        a margin for a multi-byte character cut at its start."""
        n = self.lookback
        while True:
            tail = list(generated[-n:])
            text = self._text(tail)
            if len(text) >= self.longest + 4 or len(tail) == len(generated):
                return tail, text
            n *= 2

    def cut(self, generated: Sequence[int], emitted: Sequence[int]) -> int | None:
        """How many of `emitted` (the tokens about to follow the `generated` ones) to keep when one of them completes
        a stop string: the first i + 1 whose text holds a stop string that the text before it did not; None when
        none does."""
        tail, before = self._tail(generated)
        for i in range(len(emitted)):
            text = self._text(tail + list(emitted[: i + 1]))
            if any(s in text and s not in before for s in self.stops):
                return i + 1
        return None


def check_stop_strings(stops) -> tuple[str, ...]:
    """The checked stop strings, once each: one non-empty string or a sequence of them, valid UTF-8 (ValueError)."""
    from specpilot.drafting.pair import check_text

    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, Sequence) or not stops or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {stops!r}")
    for stop in stops:
        check_text("a stop string", stop)  # lone surrogates: named here, not as a UnicodeEncodeError
    return tuple(dict.fromkeys(stops))


def stopping_options(stop_strings=None, stop_token_ids=None, ignore_eos: bool = False) -> dict:
    """The given ending options as `generate()` keyword arguments, their form checked ({} when none is given): what
    an evaluation hands every method alike. The tokenizer and the vocabulary are checked where the pair is
    (`StopStrings`, `check_stop_token_ids`)."""
    out: dict = {}
    empty = isinstance(stop_strings, Sequence) and not isinstance(stop_strings, str) and len(stop_strings) == 0
    if stop_strings is not None and not empty:  # None or [] mean none, as generate() takes them
        out["stop_strings"] = list(check_stop_strings(stop_strings))
    if stop_token_ids is not None:
        ids = check_stop_token_ids(stop_token_ids, vocab_size=None)  # the form here; the range on the pair
        if ids:
            out["stop_token_ids"] = list(ids)
    if not isinstance(ignore_eos, bool):
        raise TypeError(f"ignore_eos must be True or False, got {ignore_eos!r}")
    if ignore_eos:
        out["ignore_eos"] = True
    return out


def check_stop_token_ids(ids, vocab_size: int | None) -> tuple[int, ...]:
    """The checked stop token ids: None or an empty list for none, one id, or a list / array / tensor of ids, each
    in 0..vocab_size-1 (ValueError / TypeError naming the bad one; vocab_size None: any id >= 0, the form only)."""
    if ids is None:
        return ()
    if isinstance(ids, (str, bool)) or not (hasattr(ids, "__iter__") or hasattr(ids, "__index__")):
        raise TypeError(f"stop_token_ids must be token ids (an int or a list of them), got {ids!r}")
    if getattr(ids, "ndim", None) == 0 or not hasattr(ids, "__iter__"):  # one id: an int, numpy or 0-d tensor
        ids = [ids]
    top = None if vocab_size is None else vocab_size - 1
    return tuple(dict.fromkeys(check_int("stop token id", i, minimum=0, maximum=top) for i in ids))


def end_ids(pair, ignore_eos: bool = False) -> tuple[int, ...]:
    """The ids that end a generation: the pair's `eos_token_ids`, or none when `ignore_eos` (vLLM's option: decode
    the whole budget, for benchmarks; the end token is then text like any other)."""
    if not isinstance(ignore_eos, bool):
        raise TypeError(f"ignore_eos must be True or False, got {ignore_eos!r}")
    return () if ignore_eos else pair.eos_token_ids


def request_ending(pair, stop_strings=None, stop_token_ids=None,
                   ignore_eos: bool = False) -> tuple[tuple[int, ...], StopStrings | None, tuple[int, ...]]:
    """(end ids, stop strings, stop token ids) of one request, checked against the pair (its tokenizer, its
    vocabulary): what every decoding loop hands `truncate_emitted`, and what an evaluation checks before any method
    runs."""
    return (end_ids(pair, ignore_eos), StopStrings.of(stop_strings, pair.tokenizer),
            check_stop_token_ids(stop_token_ids, pair.vocab_size))


def truncate_emitted(emitted: list[int], generated: Sequence[int], max_new_tokens: int, eos: tuple[int, ...],
                     stops: StopStrings | None = None,
                     stop_ids: tuple[int, ...] = ()) -> tuple[list[int], str | None]:
    """(the tokens of `emitted` that reach the output, why the generation ends: "eos", "length", "stop" or None to go
    on). Never past an end id or a stop token id (kept, as generate() keeps its end id), the budget, or the token
    completing a stop string; `generated`: the tokens already output."""
    left = max_new_tokens - len(generated)
    finished_by = None
    end = first_end(emitted[:left], eos + stop_ids if stop_ids else eos)
    if end is not None:
        finished_by, left = "eos" if emitted[end] in eos else "stop", end + 1
    elif len(emitted) >= left:
        finished_by = "length"
    kept = emitted[: emitted_count(len(emitted) - 1, left)]  # accepted drafts + the bonus token, within `left`
    if stops is not None:
        cut = stops.cut(generated, kept)
        # an end id whose own text completes a stop string ended the generation first (vLLM checks it first too)
        if cut is not None and not (finished_by == "eos" and cut == len(kept)):
            return kept[:cut], "stop"
    return kept, finished_by
