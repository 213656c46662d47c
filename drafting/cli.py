"""`specpilot generate`: generate text with the speculative decoder and print a one-line summary."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--target", help="target model (hub id or path); default: the embedded pair")
    parser.add_argument("--draft", help="draft model (hub id or path); default: the embedded pair")
    parser.add_argument("--config", help="an exported decoder directory (decoder.json): use its policies")
    parser.add_argument("--depth", type=int, help="draft depth (static controller)")
    parser.add_argument("--size", type=int, help="verification size: drafted candidates verified per cycle")
    parser.add_argument("--width", type=int, default=None, help="tree width W (1 = chain)")
    parser.add_argument("--max-depth", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--compare", action="store_true", help="also run target-only decoding and print speedup")


def run(args: argparse.Namespace) -> int:
    import torch

    from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
    from specpilot.policies import FixedController

    if args.config:
        decoder = SpeculativeDecoder.from_config(args.config)
        pair, controller = decoder.pair, decoder.default_controller
    else:
        pair = ModelPair.from_pretrained(args.target, args.draft, device=args.device)
        controller = FixedController(args.depth, args.size, device=str(pair.device))
        width = args.width or (8 if pair.device.type == "cuda" else 4)
        tree = TreeConfig(width=width, max_depth=max(args.max_depth, controller.depth),
                          max_size=max(64, controller.size))
        decoder = SpeculativeDecoder(pair, tree)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed)
    decoder.generate(args.prompt, controller=controller, **{**sampling, "max_new_tokens": 4})  # warm-up
    out = decoder.generate(args.prompt, controller=controller, **sampling)
    print(out.text if out.text is not None else out.tokens)
    line = (f"[{len(out.tokens)} tokens, {out.tokens_per_s:.1f} tok/s, tau {out.mean_accepted_length:.2f}, "
            f"{len(out.cycles)} cycles, {pair.device.type} {str(pair.dtype).replace('torch.', '')}, "
            f"threads {torch.get_num_threads()}]")
    if args.compare:
        autoregressive_generate(pair, args.prompt, **{**sampling, "max_new_tokens": 4})
        ref = autoregressive_generate(pair, args.prompt, **sampling)
        same = "identical to target-only" if ref.tokens == out.tokens else "differs from target-only (sampling)"
        line += f" speedup {out.tokens_per_s / ref.tokens_per_s:.2f}x vs " \
                f"target-only ({ref.tokens_per_s:.1f} tok/s), {same}"
    print(line)
    return 0
