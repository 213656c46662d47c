"""Argument checks shared by the constructors and `generate` (TreeConfig, the decoder's sampling arguments, token
ids) and by the commands that decode prompt suites (`check_prompt_lengths`: eval, grid, demo): each raises
TypeError / ValueError with a message naming the argument and the accepted range."""
from __future__ import annotations

import math
import operator
import numbers


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an int when it is an integer (int, numpy integer, 0-d integer tensor; never bool or float) within
    [minimum, maximum]; else TypeError / ValueError naming `name`."""
    accepted = " ".join(filter(None, ("integer", _int_range(minimum, maximum))))
    try:  # an integer scalar of any kind; a float tensor has __index__ too, but it raises
        index = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        index = None
    if index is None:
        raise TypeError(f"{name} must be an {accepted}, got {value!r} ({type(value).__name__})")
    value = int(index)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an {accepted}, got {value}")
    return value


# torch.Generator.manual_seed takes -2^63 .. 2^64 - 1 (negative seeds wrap around); outside, it fails naming nothing
SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 64 - 1


def warn_unused_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """top_k / top_p shape sampling only: at temperature 0 (greedy) they are ignored, which a library call is told
    (a UserWarning, as transformers' generate() logs it; the CLI refuses them)."""
    if temperature == 0 and (top_k != 0 or top_p != 1.0):
        import warnings

        given = ", ".join(f"{k}={v}" for k, v, off in (("top_k", top_k, 0), ("top_p", top_p, 1.0)) if v != off)
        warnings.warn(f"{given}: top_k and top_p shape sampling only, and at temperature 0 (greedy) decoding ignores "
                      "them; pass a temperature > 0 to sample", UserWarning, stacklevel=4)


def check_seed(name: str, value) -> int:
    """A torch random seed: an integer in SEED_MIN..SEED_MAX, else TypeError / ValueError naming `name`."""
    return check_int(name, value, minimum=SEED_MIN, maximum=SEED_MAX)


def check_float(name: str, value, *, minimum: float | None = None, maximum: float | None = None,
                open_low: bool = False) -> float:
    """`value` as a finite float within [minimum, maximum] ((minimum, maximum] with open_low); else TypeError /
    ValueError naming `name` and the range."""
    accepted = float_range(minimum, maximum, open_low=open_low)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {accepted}, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be {accepted}, got {value}")
    if minimum is not None and (value <= minimum if open_low else value < minimum):
        raise ValueError(f"{name} must be {accepted}, got {value:g}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be {accepted}, got {value:g}")
    return value


def float_range(minimum: float | None = None, maximum: float | None = None, *, open_low: bool = False) -> str:
    """"a finite number > 0 and <= 1" and the like: the accepted range in words."""
    bounds = ([f"{'>' if open_low else '>='} {minimum:g}"] if minimum is not None else []) + \
        ([f"<= {maximum:g}"] if maximum is not None else [])
    return " ".join(["a finite number", " and ".join(bounds)]).strip()


def _int_range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"in {minimum}..{maximum}"
    if minimum is not None:
        return f">= {minimum}"
    if maximum is not None:
        return f"<= {maximum}"
    return ""


def check_context(pair, prompt_len: int, max_new_tokens: int, lookahead: int) -> None:
    """ValueError unless the positions a generation feeds fit in the pair's context (`pair.max_context`): the
    prompt, every new token but the last (the last is output, never fed) and `lookahead` drafted tokens past them.
    `generate`, `generate_batch`, the AR baselines and `specpilot generate` take lookahead 0, as target-only
    decoding: their sessions draft shallower where the context ends (`DecodingSession.max_depth`). Recordings and
    latency profiles reserve their tree's depth (their replay verifies full-depth drafts up to the last token).
    Exact at the boundary (a GPT-2 pair, whose absolute positions fail one past it, decodes as `generate()`)."""
    if prompt_len < 1:
        raise ValueError("the prompt is empty: give at least one token")
    need = prompt_len + max_new_tokens - 1 + lookahead
    limit = pair.max_context
    if need > limit:
        raise ValueError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens}"
            + (f" (+{lookahead} draft lookahead)" if lookahead else "") + " needs "
            f"{need} positions but the models' context is {limit}{_context_reason(pair, limit)}; shorten the prompt "
            "or lower max_new_tokens" + (" or the tree's max_depth (`--max-depth`: the lookahead reserves the deepest "
                                         "draft, whatever depth a controller picks)"
                                         if lookahead > 0 and lookahead >= need - limit else "")
        )


def _context_reason(pair, limit: int) -> str:
    """Why the context is shorter than the models' positions, when it is (LongRoPE: `attention.context_limit`)."""
    from specpilot.drafting.attention import context_limit

    models = [m for m in (getattr(pair, "target", None), getattr(pair, "draft", None)) if m is not None]
    if any(context_limit(m.config) == limit < (getattr(m.config, "max_position_embeddings", None) or 0)
           for m in models):
        return (f" (LongRoPE: exact only within original_max_position_embeddings={limit}, where a cached decoder "
                "keeps its rotary factors)")
    limits = {name: context_limit(m.config) for name, m in (("target", getattr(pair, "target", None)),
                                                             ("draft", getattr(pair, "draft", None))) if m is not None}
    if len(limits) == 2 and all(limits.values()) and len(set(limits.values())) == 2:  # the shorter one limits
        short = min(limits, key=limits.get)
        other = "draft" if short == "target" else "target"
        return f" (the {short}'s; the {other} takes {limits[other]})"
    return ""


def prompt_room(context: int, max_new_tokens: int, max_depth: int) -> int:
    """The longest prompt (tokens) `check_context` takes in a `context`-token window with max_new_tokens and the
    deepest draft lookahead (max_depth): what the runner keeps of a prompt, and the length `check_prompt_lengths`
    refuses beyond."""
    return context - max_new_tokens - max_depth + 1


def check_prompt_lengths(prompts, lengths: dict[str, int], *, context: int, max_new_tokens: int, max_depth: int,
                         truncate: bool, options: tuple[str, ...] = ("--max-new-tokens", "--truncate-prompts"),
                         bundled: str | None = None) -> list[str]:
    """Prompts too long for the context (room for max_new_tokens and the deepest draft lookahead, as the runner
    keeps) are refused, naming the first and the real numbers (`lengths`: token count per prompt text, e.g. from
    `executor.prompt_lengths`); with truncate=True they are kept (the runner keeps their last tokens) and the
    returned note says how many and to what length. options: the command's options the refusal may offer
    (--max-new-tokens, --truncate-prompts). bundled: the name of the bundled suite the prompts come from, which
    the user cannot shorten: the refusal names the context the models need instead."""
    limit = prompt_room(context, max_new_tokens, max_depth)
    long = [(p, lengths[p.prompt]) for p in prompts if lengths[p.prompt] > limit]
    if not long:
        return []
    first, n = long[0]
    if limit < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} with draft depth {max_depth} leaves no room for a "
                         f"prompt in the models' {context}-token context: lower --max-new-tokens")
    if not truncate:
        more = f" ({len(long) - 1} more prompts too)" if len(long) > 1 else ""
        fix = _fixes(options) if bundled is None else (
            f"the {bundled} prompts are bundled with specpilot: use models whose context holds at least "
            f"{max(k for _, k in long) + context - limit} tokens")
        raise ValueError(f"prompt {first.id!r} is {n} tokens{more}: with --max-new-tokens "
                         f"{max_new_tokens} and draft depth {max_depth} a prompt fits in {limit} tokens of the "
                         f"models' {context}-token context; " + fix)
    return [f"note: {len(long)} prompt(s) truncated to their last {limit} tokens (--truncate-prompts; the longest "
            f"had {max(k for _, k in long)}): they are recorded in report.json meta.prompts_truncated"]


def _fixes(options: tuple[str, ...]) -> str:
    fixes = ["shorten them"] + [{"--max-new-tokens": "lower --max-new-tokens",
                                 "--truncate-prompts": "add --truncate-prompts to keep their last tokens"}[o]
                                for o in options]
    return fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + ", or " + fixes[-1]
