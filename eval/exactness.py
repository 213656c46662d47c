"""Why greedy speculative output may differ from target-only (`ar`) greedy output: one rule for `specpilot generate
--compare`, and for `specpilot eval`'s console, report.md and report.json (one sequence at a time and batched).

In fp32 greedy speculative decoding equals target-only greedy decoding token for token (tests/test_decoder_exact.py):
a difference there is a bug. In bf16 / fp16 the verification forward computes the same positions with other kernel
shapes than one-token steps do, so the two round differently and a near tie can flip: a difference there is
half-precision rounding, expected, not a bug (`specpilot agreement` measures how often).
"""
from __future__ import annotations

HALF_DTYPES = ("bfloat16", "float16")
ROUNDING, BUG = "rounding", "bug"  # report.json greedy_identity.cause
BUG_ADVICE = "this is a bug, please report it"


def dtype_name(dtype) -> str:
    """"bfloat16" for torch.bfloat16, its string or its name."""
    return str(dtype).removeprefix("torch.")


def difference_cause(dtype) -> str:
    """What a greedy difference in `dtype` is: ROUNDING in half precision, BUG in any other dtype."""
    return ROUNDING if dtype_name(dtype) in HALF_DTYPES else BUG


def rounding_explanation(dtype) -> str:
    return (f"{dtype_name(dtype)} rounding: a tree forward and a one-token forward round differently; "
            "`specpilot agreement` measures how often")


def differing_cell(dtype, detail: str = "") -> str:
    """report.md's cell for output that is not identical to ar's: quiet "no (bfloat16 rounding)" in half precision,
    loud "NO" otherwise. detail: e.g. "2 sequences"."""
    if difference_cause(dtype) == ROUNDING:
        return f"no ({', '.join(filter(None, [detail, f'{dtype_name(dtype)} rounding']))})"
    return f"NO ({detail})" if detail else "NO"


def greedy_identity(identical_by_method: dict[str, bool | None], dtype) -> dict | None:
    """report.json's `greedy_identity` block: which methods' greedy output differs from ar's, and why.
    identical_by_method: {method: identical_to_ar} (None: not compared, e.g. sampled only). None when no method's
    greedy output was compared."""
    compared = {m: same for m, same in identical_by_method.items() if same is not None}
    if not compared:
        return None
    differing = sorted(m for m, same in compared.items() if not same)
    cause = difference_cause(dtype) if differing else None
    block = {"dtype": dtype_name(dtype), "differing": differing, "cause": cause,
             "expected": None if cause is None else cause == ROUNDING}
    block["note"] = identity_line(block)
    return block


def identity_line(block: dict | None) -> str | None:
    """The console / report line of a `greedy_identity` block: a note for half-precision rounding, a WARNING for a
    difference in fp32 (a bug); None when every greedy output was identical."""
    if not block or not block.get("differing"):
        return None
    methods, dtype = ", ".join(block["differing"]), block["dtype"]
    if block["cause"] == ROUNDING:
        return (f"note: greedy output of {methods} differs from ar in {dtype}, expected in half precision, not a bug "
                f"({rounding_explanation(dtype)})")
    return f"WARNING: greedy output of {methods} differs from ar in {dtype}: {BUG_ADVICE}"
