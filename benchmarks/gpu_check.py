"""The CUDA check (not a test; CI never needs a GPU): exactness and throughput of the decoder on a GPU.

    python benchmarks/gpu_check.py [--out DIR] [--prompts 8] [--max-new-tokens 128] [--repeats 3]

1. Exactness on CUDA, fp32: tiny random pairs (a draft LM and an EAGLE-3 head) decode greedily token-identical to
   the target alone over tree widths {1, 2, 4, 8} and several depths/sizes; sampled output of a 6-token vocabulary
   follows the enumerated target law (total-variation bound, sampled children with recursive rejection sampling).
2. The embedded pair on CUDA: greedy identity against our AR decoding (fp32 and bf16: in bf16 a tree forward and a
   one-token forward round differently, so a near-tie argmax may flip; reported, not hidden) and throughput, AR vs
   the GPU-sized static tree W=8, D=6, V=60 and a chain, interleaved, with the draft LM and with the EAGLE-3 head.
3. The agreement report (`specpilot.eval.agreement`) of the embedded pair in bf16 against bf16 AR and fp32 AR on the
   held-out code prompts (--agreement-prompts, --agreement-tokens), with the near-tie guard off and on: share
   identical, first divergences, margins there, fp32 log-probs of both continuations, the guard's extra forwards.
Prints as it goes and writes DIR/gpu_check.json.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import platform
from pathlib import Path

import torch

from specpilot.drafting import ModelPair, SpeculativeDecoder, TreeConfig, autoregressive_generate
from specpilot.drafting.eagle import Eagle3Config, Eagle3Head
from specpilot.drafting.sampling import sampling_probs
from specpilot.eval.suites import load_suite
from specpilot.policies import FixedController
from specpilot.drafting.timing import timed


def say(*parts) -> None:
    print(*parts, flush=True)


def tiny_target(vocab=96, hidden=32, layers=4, seed=0, sharpness=4.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                         num_attention_heads=2, intermediate_size=2 * hidden,
                                         max_position_embeddings=512, eos_token_id=None, tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(sharpness)
    return model.eval()


def tiny_pairs(device):
    target = tiny_target().to(device)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.5 * p.std() * torch.randn_like(p))
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=48), target)
    head.set_draft_vocab(torch.arange(48) * 2)
    return {"draft_lm": ModelPair(target, draft), "eagle3": ModelPair(target, eagle=head.to(device).eval())}


def tiny_exactness(device) -> dict:
    out = {}
    for kind, pair in tiny_pairs(device).items():
        checked = identical = 0
        for width, (depth, size) in itertools.product((1, 2, 4, 8), ((1, 1), (2, 3), (4, 8), (6, 40))):
            decoder = SpeculativeDecoder(pair, TreeConfig(width=width, max_depth=6, max_size=64))
            for prompt in ([7], [1, 2, 3, 4, 5], list(range(10, 43))):
                ref = autoregressive_generate(pair, prompt, max_new_tokens=24).tokens
                got = decoder.generate(prompt, controller=FixedController(depth, size), max_new_tokens=24).tokens
                checked, identical = checked + 1, identical + (got == ref)
        out[kind] = {"checked": checked, "identical": identical}
        say(f"  tiny {kind} fp32 greedy: {identical}/{checked} identical to the target alone")
    return out


def tiny_sampled_law(device, n: int = 1500) -> dict:
    target = tiny_target(vocab=6, hidden=16, seed=3).to(device)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(2.0 * p.std() * torch.randn_like(p))
    pair, prompt, sampling, steps = ModelPair(target, draft), [1, 2], (1.0, 0, 1.0), 2
    law = {}
    with torch.inference_mode():
        for seq in itertools.product(range(6), repeat=steps):
            logits = target(input_ids=torch.tensor([prompt + list(seq)], device=device)).logits[0]
            law[seq] = math.prod(float(sampling_probs(logits[len(prompt) - 1 + i], *sampling)[t])
                                 for i, t in enumerate(seq))
    decoder = SpeculativeDecoder(pair, TreeConfig(width=3, max_depth=3, max_size=12))
    counts = dict.fromkeys(law, 0)
    for seed in range(n):
        out = decoder.generate(prompt, controller=FixedController(3, 12), max_new_tokens=steps, temperature=1.0,
                               seed=seed)
        counts[tuple(out.tokens)] += 1
    tv = 0.5 * sum(abs(counts[s] / n - law[s]) for s in law)
    bound = 0.5 * math.sqrt(len(law) / n) + 0.035
    say(f"  tiny sampled tree (W3 D3, recursive rejection sampling) T=1: TV {tv:.4f} (bound {bound:.4f})")
    return {"tv": tv, "bound": bound, "n": n, "passed": tv < bound}


def embedded(drafter: str, dtype, prompts, args) -> dict:
    kwargs = {"eagle": "embedded"} if drafter == "eagle3" else {"draft": "embedded"}
    try:
        pair = ModelPair.from_pretrained(device=args.device, dtype=dtype, **kwargs)
    except (FileNotFoundError, ValueError) as err:
        say(f"  {drafter}: not available ({err})")
        return {"error": str(err)}
    configs = {"tree W8 D6 V60": (TreeConfig(width=8, max_depth=6, max_size=60), FixedController(6, 60)),
               "chain D4": (TreeConfig(width=1, max_depth=4, max_size=4), FixedController(4, 4))}
    decoders = {name: (SpeculativeDecoder(pair, tree), ctrl) for name, (tree, ctrl) in configs.items()}
    run = {"ar": lambda p: autoregressive_generate(pair, p, max_new_tokens=args.max_new_tokens)}
    for name, (decoder, ctrl) in decoders.items():
        run[name] = lambda p, d=decoder, c=ctrl: d.generate(p, controller=c, max_new_tokens=args.max_new_tokens)
    for name in run:  # warm-up
        run[name](prompts[0])
    totals = {name: [0, 0.0, 0] for name in run}
    identical = {name: 0 for name in decoders}
    names, turn = list(run), 0
    for r in range(args.repeats):
        for prompt in prompts:
            outs = {}
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                out, seconds = timed(lambda: run[name](prompt))
                outs[name] = out
                t = totals[name]
                t[0], t[1], t[2] = t[0] + out.num_tokens, t[1] + seconds, t[2] + (len(out.cycles) or out.num_tokens)
            if r == 0:
                for name in decoders:
                    identical[name] += outs[name].tokens == outs["ar"].tokens
            turn += 1
    ar_tps = totals["ar"][0] / totals["ar"][1]
    rows = {"ar": {"tokens_per_s": ar_tps}}
    label = f"{drafter} {str(dtype).replace('torch.', '')}"
    say(f"  {label}: AR {ar_tps:.1f} tok/s")
    for name in decoders:
        tokens, seconds, cycles = totals[name]
        rows[name] = {"tokens_per_s": tokens / seconds, "speedup": tokens / seconds / ar_tps, "tau": tokens / cycles,
                      "identical_to_ar": f"{identical[name]}/{len(prompts)}"}
        say(f"  {label} {name}: {rows[name]['speedup']:.2f}x over AR, tau {rows[name]['tau']:.2f}, "
            f"{rows[name]['identical_to_ar']} prompts identical to AR")
    return rows


def agreement(prompts, args) -> dict:
    """Section 3: bf16 vs bf16-AR and fp32-AR, guard off and on (NEAR_TIE_ON rounding scales)."""
    from specpilot.drafting.types import NEAR_TIE_ON
    from specpilot.eval.agreement import agreement_report, describe

    out = {}
    try:
        reference = ModelPair.from_pretrained(device=args.device, dtype=torch.float32)
        half = ModelPair.from_pretrained(device=args.device, dtype=torch.bfloat16)
    except (FileNotFoundError, ValueError) as err:
        say(f"  agreement: not available ({err})")
        return {"error": str(err)}
    for guard, units in (("off", 0.0), ("on", NEAR_TIE_ON)):
        report = agreement_report(half, prompts, reference=reference, near_tie=units,
                                  max_new_tokens=args.agreement_tokens)
        say(f"  {describe(report)}")
        out[f"guard_{guard}"] = report
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu for a dry run of the script itself")
    ap.add_argument("--sampled-n", type=int, default=1500)
    ap.add_argument("--agreement-prompts", type=int, default=16, help="held-out code prompts for section 3")
    ap.add_argument("--agreement-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    import transformers

    device = torch.device(args.device)
    result = {"gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "none (dry run)",
              "torch": torch.__version__,
              "transformers": transformers.__version__, "python": platform.python_version()}
    say(f"{result['gpu']}, torch {result['torch']}, transformers {result['transformers']}")
    say("1. exactness on CUDA (tiny random pairs, fp32)")
    result["tiny_greedy"] = tiny_exactness(device)
    result["tiny_sampled"] = tiny_sampled_law(device, args.sampled_n)
    code = [p.prompt for p in load_suite("heldout") if p.task == "code"]
    prompts = code[: args.prompts]
    say(f"2. embedded pair on {args.device}: {len(prompts)} held-out code prompts x {args.repeats}, "
        f"{args.max_new_tokens} new tokens, greedy")
    for drafter in ("eagle3", "draft_lm"):
        for dtype in (torch.bfloat16, torch.float32):
            key = f"{drafter}_{str(dtype).replace('torch.', '')}"
            result[key] = embedded(drafter, dtype, prompts, args)
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "gpu_check.json").write_text(json.dumps(result, indent=1))
    say(f"3. agreement of the embedded pair in bf16 on {args.device}: {min(len(code), args.agreement_prompts)} "
        f"held-out code prompts, {args.agreement_tokens} new tokens, guard off / on")
    code_items = [p for p in load_suite("heldout") if p.task == "code"][: args.agreement_prompts]
    result["agreement_bf16"] = agreement(code_items, args)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
