"""Argument checks shared by the constructors and `generate` (TreeConfig, the decoder's sampling arguments, token
ids): each raises TypeError / ValueError with a message naming the argument and the accepted range."""
from __future__ import annotations

import math
import numbers


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an int when it is an integer (int, numpy integer, 0-d integer tensor; never bool or float) within
    [minimum, maximum]; else TypeError / ValueError naming `name`."""
    accepted = _int_range(minimum, maximum)
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an integer {accepted}, got {value!r} ({type(value).__name__})")
    value = int(value.__index__())
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an integer {accepted}, got {value}")
    return value


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
    """ValueError unless a prompt of `prompt_len` tokens, `max_new_tokens` and the deepest draft `lookahead` fit in
    the pair's context (`pair.max_context`); the one rule `generate`, `generate_batch` and the CLI apply."""
    if prompt_len < 1:
        raise ValueError("the prompt is empty: give at least one token")
    need = prompt_len + max_new_tokens + lookahead
    limit = pair.max_context
    if need > limit:
        raise ValueError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} (+{lookahead} draft lookahead) needs "
            f"{need} positions but the models' context is {limit}; shorten the prompt or lower max_new_tokens"
            + (" or the draft depth (max_depth)" if lookahead > 1 and lookahead > need - limit else "")
        )
