"""`specpilot generate`: generate text with the speculative decoder and print a one-line summary.

Either a static configuration (--depth/--size on a --width tree) or an exported decoder (--config DIR: its policies
decide depth and size on the tree decoder.json fixes, so the static options are refused with it instead of being
ignored). The pair comes from --target/--draft/--eagle (the embedded pair by default); with --config the pair
decoder.json names is loaded unless one is given (its content hashes are checked either way).
"""
from __future__ import annotations

import argparse
import sys

from specpilot.drafting.cliargs import (add_pair_arguments, add_stop_arguments, dtype_label, given_options, load_pair,
                                       non_negative_float, non_negative_int, pair_given, positive_int, probability,
                                       say, seed, utf8_text)

# the tree/controller options an exported decoder fixes itself: given with --config they are refused
STATIC_OPTIONS = ("depth", "size", "width", "max_depth")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, type=utf8_text, help="prompt text (UTF-8)")
    add_pair_arguments(parser)
    parser.add_argument("--config", help="an exported decoder directory (decoder.json): its policies decide depth "
                                         "and size (default: none, a static configuration)")
    parser.add_argument("--allow-pair-mismatch", action="store_true",
                        help="with --config: decode a pair other than the one its policies were exported for "
                             "(still lossless; speed may suffer) (default: refuse it)")
    parser.add_argument("--depth", type=non_negative_int, default=None,
                        help="draft depth of the static controller, 0 = no drafting (default: 4 on CPU, 8 on CUDA)")
    parser.add_argument("--size", type=positive_int, default=None,
                        help="verification size: drafted candidates verified per cycle (default: 12 on CPU, 60 on "
                             "CUDA)")
    parser.add_argument("--width", type=positive_int, default=None,
                        help="tree width W, 1 = a chain (default: 8, the width `record` and `eval` use by default, "
                             "so a static run here measures the tree they measure; the demo's policies use 4)")
    parser.add_argument("--max-depth", type=positive_int, default=None,
                        help="deepest tree (default: 12, raised to --depth when that is deeper; a smaller "
                             "one also caps the default --depth)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate at most")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="top-k when sampling (0: off)")
    parser.add_argument("--top-p", type=probability, default=1.0, help="top-p when sampling (1: off)")
    parser.add_argument("--seed", type=seed, default=None, help="sampling seed (default: random)")
    add_stop_arguments(parser)
    parser.add_argument("--stream", action="store_true",
                        help="print the text as each cycle emits it (transformers' TextStreamer) instead of at the "
                             "end")
    parser.add_argument("--compare", action="store_true", help="also run target-only decoding and print the speedup")


def _decoder(args: argparse.Namespace):
    """(decoder, controller) for --config or for the static options."""
    from specpilot.drafting import SpeculativeDecoder, TreeConfig
    from specpilot.drafting.cycle_math import num_candidates
    from specpilot.policies import FixedController

    if args.config:
        given = [f"--{name.replace('_', '-')}" for name in STATIC_OPTIONS if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} conflict(s) with --config: the exported policies decide depth and "
                             "size on the tree decoder.json fixes; drop them, or drop --config for a static "
                             "configuration")
        pair = load_pair(args) if pair_given(args) else None
        decoder = SpeculativeDecoder.from_config(args.config, pair=pair, device=args.device, dtype=args.dtype,
                                                 allow_pair_mismatch=args.allow_pair_mismatch)
        return decoder, decoder.default_controller
    if args.allow_pair_mismatch:
        raise ValueError("--allow-pair-mismatch applies only with --config (an exported decoder's recorded pair); "
                         "drop it")
    if args.depth is not None and args.max_depth is not None and args.depth > args.max_depth:
        raise ValueError(f"--depth {args.depth} is deeper than --max-depth {args.max_depth}: raise --max-depth, or "
                         "drop it (the tree then grows to --depth)")
    if args.depth == 0 and args.size is not None:
        raise ValueError(f"--size {args.size} applies only when drafting, but --depth 0 runs plain target steps: drop "
                         "--size, or give --depth >= 1")
    pair = load_pair(args)
    depth = args.depth
    if depth is None and args.max_depth is not None:  # the default depth, no deeper than the tree asked for
        depth = min(FixedController(device=str(pair.device)).depth, args.max_depth)
    controller = FixedController(depth, args.size, device=str(pair.device))
    width = args.width if args.width is not None else TreeConfig().width
    if args.size is not None and controller.depth > 0 and args.size > num_candidates(width, controller.depth):
        # verified sizes are clipped to the candidates drafted: the run would verify fewer than asked, silently
        raise ValueError(f"--size {args.size} is more than the {num_candidates(width, controller.depth)} candidates "
                         f"a width-{width} tree drafts in {controller.depth} levels: give --size "
                         f"{num_candidates(width, controller.depth)} or less, or a larger --width or --depth")
    max_depth = args.max_depth if args.max_depth is not None else TreeConfig().max_depth
    tree = TreeConfig(width=width, max_depth=max(max_depth, controller.depth), max_size=max(64, controller.size))
    return SpeculativeDecoder(pair, tree), controller


def check_sampling_options(args: argparse.Namespace) -> None:
    """--top-k / --top-p shape sampling only: at --temperature 0 (greedy) they would be ignored, so refuse them."""
    if args.temperature == 0:
        given = [o for o, v, off in (("--top-k", args.top_k, 0), ("--top-p", args.top_p, 1.0)) if v != off]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise ValueError(f"{' and '.join(given)} {verb} only when sampling, but --temperature is 0 (greedy): add "
                             "--temperature T > 0, or drop them")


def agreement_note(tokens: list[int], reference: list[int], *, temperature: float, dtype) -> str:
    """How speculative output compares with target-only output of the same request, and why they may differ:
    sampling draws differ; greedy, `specpilot.eval.exactness` says (half-precision rounding, or a bug in fp32)."""
    if list(tokens) == list(reference):
        return "identical to target-only"
    if temperature > 0:
        return "differs from target-only (sampling)"
    from specpilot.eval.exactness import BUG_ADVICE, ROUNDING, difference_cause, dtype_name, rounding_explanation

    at = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    if difference_cause(dtype) == ROUNDING:
        return f"differs from target-only greedy from token {at} ({rounding_explanation(dtype)})"
    return f"DIFFERS from target-only greedy from token {at} in {dtype_name(dtype)}: {BUG_ADVICE}"


def no_end_note(pair) -> str:
    """For a target whose generation_config and config.json name no end token: decoding stops only at the length
    (as generate() does), and the tokenizer's end token, when it has one, is what --stop-token-id would stop at."""
    tokenizer = getattr(pair, "tokenizer", None)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    hint = (f"; its tokenizer's end token {tokenizer.eos_token!r} is id {eos}: pass --stop-token-id {eos} to stop "
            "there" if isinstance(eos, int) else "; pass --stop or --stop-token-id to end earlier")
    return ("the target names no end token (neither its generation_config nor config.json), so decoding stops only "
            f"at --max-new-tokens, as generate() does{hint}")


def print_text(text, end: str | None = "\n") -> None:
    """The generated text on stdout, written through at once. A stdout that cannot take it (a full disk behind
    `> out.txt`, /dev/full) is named: the bare OS error (Errno 28) did not say what failed, and the text is lost."""
    from specpilot.drafting.errors import OutputPathError

    try:
        print(text, end=end, flush=True)
    except BrokenPipeError:  # its reader left (`| head`): the CLI stops quietly
        raise
    except OSError as err:
        raise OutputPathError(f"cannot write the generated text to stdout: {err.strerror or err}; give stdout room, "
                              "or send it elsewhere") from err


def run(args: argparse.Namespace) -> int:
    import torch

    from specpilot.drafting import autoregressive_generate
    from specpilot.drafting.checks import check_context
    from specpilot.drafting.generation_defaults import generation_config_note, mark_noted

    check_sampling_options(args)
    if sys.stdout is None:  # started with stdout closed (`>&-`): the text would go nowhere, and exit 0
        from specpilot.drafting.errors import OutputPathError

        raise OutputPathError("stdout is closed, and the generated text is printed there: give the command a stdout "
                              "(`> out.txt` to keep the text in a file)")
    decoder, controller = _decoder(args)
    pair = decoder.pair
    given = {flag.removeprefix("--").replace("-", "_") for flag in given_options(args)}
    note = generation_config_note(pair.target, cli=True, given=given)
    mark_noted(pair)  # said here, once: the library's warning would repeat it
    if note:
        print(f"note: {note}", file=sys.stderr)
    elif not pair.eos_token_ids and not args.ignore_eos:  # nothing names an end: said, as a missing one would be
        print(f"note: {no_end_note(pair)}", file=sys.stderr)
    if (args.stop or args.stream) and pair.tokenizer is None:
        raise ValueError(f"{'--stop' if args.stop else '--stream'} needs the pair's tokenizer, and this pair has none: "
                         "keep the tokenizer files in the target's folder, or drop the option")
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, stop_strings=args.stop, stop_token_ids=args.stop_token_id,
                    ignore_eos=args.ignore_eos)
    # the real request must fit before the warm-up runs (else its error would name the warm-up's 4 tokens)
    check_context(pair, len(pair.encode(args.prompt)), args.max_new_tokens, 0)
    # why this dtype (asked for, the device's default, or auto's measurement): on stderr, so that stdout stays the
    # text and the summary line scripts parse
    say(f"dtype {dtype_label(pair.dtype, getattr(pair, 'dtype_reason', ''))}")
    warmup = {**sampling, "max_new_tokens": min(4, args.max_new_tokens)}
    decoder.generate(args.prompt, controller=controller, **warmup)
    streamer = None
    if args.stream:
        from transformers import TextStreamer

        class StdoutStreamer(TextStreamer):  # the text goes where print_text puts it, stdout's failure named
            def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
                print_text(text, end="" if not stream_end else None)

        sys.stdout.flush()
        streamer = StdoutStreamer(pair.tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = decoder.generate(args.prompt, controller=controller, streamer=streamer, **sampling)
    if streamer is None:
        print_text(out.text if out.text is not None else out.tokens)
    if decoder.dtype_note:
        print(f"note: {decoder.dtype_note}", file=sys.stderr)
    line = (f"[{len(out.tokens)} tokens, {out.tokens_per_s:.1f} tok/s, tau {out.mean_accepted_length:.2f}, "
            f"{len(out.cycles)} cycles, {pair.device.type} {str(pair.dtype).replace('torch.', '')}, "
            f"threads {torch.get_num_threads()}]")
    if args.compare:
        autoregressive_generate(pair, args.prompt, **warmup)
        ref = autoregressive_generate(pair, args.prompt, **sampling)
        same = agreement_note(out.tokens, ref.tokens, temperature=args.temperature, dtype=pair.dtype)
        line += f" speedup {out.tokens_per_s / ref.tokens_per_s:.2f}x vs " \
                f"target-only ({ref.tokens_per_s:.1f} tok/s), {same}"
    print(line)
    return 0
