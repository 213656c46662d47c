"""The CUDA check (not a test; CI never needs a GPU): exactness and throughput of the decoder on a GPU.

    python benchmarks/gpu_check.py [--out DIR] [--prompts 8] [--max-new-tokens 128] [--repeats 3]
        [--sections shapes,profile,tiny,embedded,sweep,batched,agreement] [--drafters ...] [--dtypes ...]

Each section runs on its own (a failing one is reported and the others go on) and the JSON is rewritten after
each, so a run cut short by its time limit still returns what it measured. The whole default run took over 400 s
on an H200 (pick sections with --sections).

How it ran on this workplace's H200 (its image: torch 2.11+cu130, transformers 5.17, no package registry, no
gymnasium / SB3 / wandb, none of which this script imports): wheels of transformers 5.25, huggingface_hub 2.4,
kernels, tomlkit, httpx2, httpcore2, truststore and regex carried in an ignored `.whl/` folder and installed with
`pip install --no-index --no-deps --target /tmp/site .whl/*.whl`; the checkout made importable as `specpilot`
with `mkdir -p /tmp/pp && ln -sfn "$PWD" /tmp/pp/specpilot`; then
`PYTHONPATH=/tmp/site:/tmp/pp python3 benchmarks/gpu_check.py --out $OUT`.

0a. shapes: the embedded target's forward time per query length 1..60 over a 64-token cache, first call and median
    of later ones, fp32 and bf16 (a first call far above the median is a per-shape one-time cost).
0b. profile: ms per cycle of the same prompt decoded 3 times per dtype, and torch.profiler's top operators.
1. Exactness on CUDA, fp32: tiny random pairs (a draft LM and an EAGLE-3 head) decode greedily token-identical to
   the target alone over tree widths {1, 2, 4, 8} and several depths/sizes; sampled output of a 6-token vocabulary
   follows the enumerated target law (total-variation bound, sampled children with recursive rejection sampling),
   one sequence at a time and as one batch with a seed per row (`generate_batch`).
2. The embedded pair on CUDA: greedy identity against our AR decoding (fp32 and bf16: in bf16 a tree forward and a
   one-token forward round differently, so a near-tie argmax may flip; reported, not hidden) and throughput, AR vs
   transformers' generate() (the baseline must be as fast as it), transformers' assisted generation (draft LM,
   4 assistant tokens), the GPU-sized static tree W=8, D=6, V=60 and a chain, interleaved (whole calls timed,
   prefill included, the order rotated each prompt), with the draft LM and with the EAGLE-3 head.
   sweep: a small static grid (width 8, depth x size) in the first of --dtypes: which static config a GPU wants.
   batched: `generate_batch` greedy identity against per-prompt AR at --batch-sizes and throughput against
   batched AR (`autoregressive_generate_batch`), tree W8 D6 V60 and chain D4, per drafter and dtype.
3. The agreement report (`specpilot.eval.agreement`) of the embedded pair in bf16 against bf16 AR and fp32 AR on the
   held-out code prompts (--agreement-prompts, --agreement-tokens), with the near-tie guard off and on: share
   identical, first divergences, margins there, fp32 log-probs of both continuations, the guard's extra forwards.
Prints as it goes and writes DIR/<--tag>.json (default gpu_check.json).
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
from specpilot.eval.rounds import method_order
from specpilot.eval.suites import load_suite
from specpilot.policies import FixedController
from specpilot.drafting.timing import Clock, timed


CODE_SUITE = "heldout_code"  # the held-out code suite `specpilot demo` evaluates the embedded pair on


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
    """TV distance between the enumerated 2-token target law and n sampled outputs, one sequence at a time
    (`generate`, a seed each) and as one batch (`generate_batch`, a seed per row)."""
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
    bound = 0.5 * math.sqrt(len(law) / n) + 0.035
    outputs = {
        "single": [tuple(decoder.generate(prompt, controller=FixedController(3, 12), max_new_tokens=steps,
                                          temperature=1.0, seed=seed).tokens) for seed in range(n)],
        "batched": [tuple(o.tokens) for o in decoder.generate_batch(
            [prompt] * n, controller=FixedController(3, 12), max_new_tokens=steps, temperature=1.0,
            seed=list(range(n, 2 * n)), max_batch=256)],
    }
    out = {"n": n, "bound": bound}
    for mode, seqs in outputs.items():
        counts = dict.fromkeys(law, 0)
        for seq in seqs:
            counts[seq] += 1
        tv = 0.5 * sum(abs(counts[s] / n - law[s]) for s in law)
        out[mode] = {"tv": tv, "passed": tv < bound}
        say(f"  tiny sampled tree (W3 D3, recursive rejection sampling) T=1, {mode}: TV {tv:.4f} (bound {bound:.4f})")
    return out


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tokens_and_calls(out) -> tuple[list[int], int]:
    """A GenerationOutput's tokens and its target forwards (cycles; one per token for AR)."""
    return out.tokens, (len(out.cycles) or out.num_tokens)


def load_embedded(drafter: str, dtype, device):
    kwargs = {"eagle": "embedded"} if drafter == "eagle3" else {"draft": "embedded"}
    return ModelPair.from_pretrained(device=device, dtype=dtype, **kwargs)


def interleaved(run: dict, prompts, repeats: int) -> tuple[dict, dict]:
    """Time each method's whole call on every prompt, `repeats` rounds, in eval's balanced order (`method_order`,
    a new row each prompt); returns ({name: [tokens, seconds, cycles]}, {name: [first round's token lists]})."""
    for name in run:  # warm-up (CUDA kernels, cuBLAS handles, allocator)
        run[name](prompts[0])
    totals = {name: [0, 0.0, 0] for name in run}
    first = {name: [] for name in run}
    names, turn = list(run), 0
    for r in range(max(1, int(repeats))):
        for prompt in prompts:
            for name in method_order(names, turn):
                (tokens, cycles), seconds = timed(lambda: run[name](prompt))
                t = totals[name]
                t[0], t[1], t[2] = t[0] + len(tokens), t[1] + seconds, t[2] + cycles
                if r == 0:
                    first[name].append(tokens)
            turn += 1
    return totals, first


def embedded(drafter: str, dtype, prompts, args) -> dict:
    try:
        pair = load_embedded(drafter, dtype, args.device)
    except (FileNotFoundError, ValueError) as err:
        say(f"  {drafter}: not available ({err})")
        return {"error": str(err)}
    from specpilot.eval.hf_baselines import HFGenerate, configure_assistant

    n = args.max_new_tokens
    configs = {"tree W8 D6 V60": (TreeConfig(width=8, max_depth=6, max_size=60), FixedController(6, 60)),
               "chain D4": (TreeConfig(width=1, max_depth=4, max_size=4), FixedController(4, 4))}
    decoders = {name: (SpeculativeDecoder(pair, tree), ctrl) for name, (tree, ctrl) in configs.items()}
    hf = HFGenerate(pair, assisted=False, name="hf_generate")

    def theirs(method, prompt):
        record = method(pair.encode(prompt), max_new_tokens=n, temperature=0.0, top_k=0, top_p=1.0, seed=None)
        # the streamer stamps every token of one generate() step with the same time: distinct stamps = steps
        return record.tokens, max(1, len(set(record.token_times)))

    run = {"ar": lambda p: tokens_and_calls(autoregressive_generate(pair, p, max_new_tokens=n)),
           "hf_generate": lambda p: theirs(hf, p)}
    if pair.draft is not None:
        assistant = copy.deepcopy(pair.draft)
        configure_assistant(assistant, num_assistant_tokens=4)
        assisted = HFGenerate(pair, assisted=True, name="hf_assisted", assistant=assistant)
        run["hf_assisted"] = lambda p: theirs(assisted, p)
    for name, (decoder, ctrl) in decoders.items():
        run[name] = lambda p, d=decoder, c=ctrl: tokens_and_calls(d.generate(p, controller=c, max_new_tokens=n))
    totals, first = interleaved(run, prompts, args.repeats)
    ar_tps = totals["ar"][0] / totals["ar"][1]
    rows = {}
    label = f"{drafter} {dtype_name(dtype)}"
    for name, (tokens, seconds, cycles) in totals.items():
        same = sum(a == b for a, b in zip(first[name], first["ar"]))
        rows[name] = {"tokens_per_s": tokens / seconds, "speedup_vs_ar": tokens / seconds / ar_tps,
                      "tokens_per_target_call": tokens / cycles, "identical_to_ar": f"{same}/{len(prompts)}"}
        say(f"  {label} {name:>15}: {tokens / seconds:8.1f} tok/s, {rows[name]['speedup_vs_ar']:.2f}x our AR, "
            f"{tokens / cycles:.2f} tokens/target call, {same}/{len(prompts)} prompts identical to our AR")
    return rows


def sweep(drafter: str, prompts, args) -> dict:
    """A small static grid on the GPU (width-8 tree, the first of --dtypes): tokens/s of each (depth, size),
    interleaved."""
    dtype = getattr(torch, args.dtypes.split(",")[0])
    try:
        pair = load_embedded(drafter, dtype, args.device)
    except (FileNotFoundError, ValueError) as err:
        return {"error": str(err)}
    decoder = SpeculativeDecoder(pair, TreeConfig(width=8, max_depth=8, max_size=64))
    n = args.sweep_tokens
    run = {"ar": lambda p: tokens_and_calls(autoregressive_generate(pair, p, max_new_tokens=n))}
    for depth, size in itertools.product((1, 2, 3, 4, 6, 8), (4, 8, 16, 32, 64)):
        if size >= depth:
            run[f"d{depth} V{size}"] = lambda p, c=FixedController(depth, size): tokens_and_calls(
                decoder.generate(p, controller=c, max_new_tokens=n))
    totals, _ = interleaved(run, prompts, 1)
    ar_tps = totals["ar"][0] / totals["ar"][1]
    rows = {name: {"speedup_vs_ar": t[0] / t[1] / ar_tps, "tau": t[0] / t[2]} for name, t in totals.items()}
    best = sorted((r["speedup_vs_ar"], name) for name, r in rows.items())[::-1][:5]
    say(f"  {drafter} {dtype_name(dtype)} static sweep ({len(prompts)} prompts, {n} tokens), best: "
        + ", ".join(f"{name} {x:.2f}x (tau {rows[name]['tau']:.2f})" for x, name in best))
    return rows


def batched(drafter: str, dtype, prompts, args) -> dict:
    """generate_batch on the GPU: greedy identity with per-prompt AR and throughput against batched AR."""
    from specpilot.drafting.batch_ar import autoregressive_generate_batch

    try:
        pair = load_embedded(drafter, dtype, args.device)
    except (FileNotFoundError, ValueError) as err:
        return {"error": str(err)}
    label = f"{drafter} {dtype_name(dtype)}"
    n = args.batch_tokens
    trees = {"tree W8 D6 V60": (SpeculativeDecoder(pair, TreeConfig(width=8, max_depth=6, max_size=60)),
                                FixedController(6, 60)),
             "chain D4": (SpeculativeDecoder(pair, TreeConfig(width=1, max_depth=4, max_size=4)),
                          FixedController(4, 4))}
    single = {i: autoregressive_generate(pair, p, max_new_tokens=n).tokens for i, p in enumerate(prompts)}
    out = {}
    for size in args.batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(size)]
        run = {"ar": lambda b: autoregressive_generate_batch(pair, b, max_new_tokens=n)}
        for name, (decoder, ctrl) in trees.items():
            run[name] = lambda b, d=decoder, c=ctrl: d.generate_batch(b, controller=c, max_new_tokens=n)
        for name in run:
            run[name](batch)  # warm-up at this size
        seconds = {name: 0.0 for name in run}
        tokens = {name: 0 for name in run}
        identical = {}
        names = list(run)
        for r in range(args.repeats):
            for name in method_order(names, r):
                outs, sec = timed(lambda: run[name](batch))
                seconds[name] += sec
                tokens[name] += sum(o.num_tokens for o in outs)
                if r == 0:
                    identical[name] = sum(o.tokens == single[i % len(prompts)] for i, o in enumerate(outs))
        ar_tps = tokens["ar"] / seconds["ar"]
        out[size] = {name: {"tokens_per_s": tokens[name] / seconds[name],
                            "speedup_vs_batched_ar": tokens[name] / seconds[name] / ar_tps,
                            "identical_to_single_ar": f"{identical[name]}/{size}"} for name in run}
        say(f"  {label} batch {size:3d}: batched AR {ar_tps:8.1f} tok/s; "
            + "; ".join(f"{name} {out[size][name]['speedup_vs_batched_ar']:.2f}x "
                        f"({out[size][name]['identical_to_single_ar']} identical to one-by-one AR)"
                        for name in trees)
            + f"; batched AR {out[size]['ar']['identical_to_single_ar']} identical")
    return out


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


def shapes(args) -> dict:
    """Where the time of a target forward goes per dtype: the embedded target's forward over a 64-token cached
    prefix for query lengths 1..60 (the shapes tree verification takes), the first call of each length and the
    median of later ones. A first call far above the median is a one-time cost (kernel loading, GEMM heuristics)
    that a decoder meeting a new length every cycle keeps paying until every length has been seen."""
    from specpilot.drafting.cache import crop_to, generation_cache

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        pair = load_embedded("eagle3", dtype, args.device)
        clock = Clock(pair.device)
        cache = generation_cache(pair.target)
        ids = torch.arange(100, 164, device=pair.device)[None]
        rows = {}
        with torch.inference_mode():
            pair.target(input_ids=ids, cache=cache, use_cache=True)
            for m in (1, 2, 3, 5, 8, 13, 21, 34, 60):
                times = []
                for _ in range(6):
                    query = torch.arange(200, 200 + m, device=pair.device)[None]
                    t0 = clock.now()
                    pair.target(input_ids=query, cache=cache, use_cache=True)
                    times.append(clock.now() - t0)
                    crop_to(cache, 64)
                rows[m] = {"first_ms": 1e3 * times[0], "median_ms": 1e3 * sorted(times[1:])[2]}
        label = str(dtype).replace("torch.", "")
        out[label] = rows
        say(f"  {label} target forward ms (first / median of 5 later) by query length: "
            + ", ".join(f"{m}: {r['first_ms']:.1f}/{r['median_ms']:.2f}" for m, r in rows.items()))
    return out


def profile(prompts, args) -> dict:
    """The same prompt decoded 3 times per dtype (tree W8 D6 V60, EAGLE-3 head), each call timed (a fall from the
    first to the third is a one-time cost per new shape), then torch.profiler's top operators of a fourth call."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        pair = load_embedded("eagle3", dtype, args.device)
        decoder = SpeculativeDecoder(pair, TreeConfig(width=8, max_depth=6, max_size=60))
        label = str(dtype).replace("torch.", "")
        calls = []
        for prompt in prompts[:2]:
            for _ in range(3):
                o, sec = timed(lambda: decoder.generate(prompt, controller=FixedController(6, 60), max_new_tokens=64))
                calls.append(round(1e3 * sec / max(1, len(o.cycles)), 2))
        say(f"  {label} ms per cycle, 2 prompts x 3 calls each: {calls}")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if pair.device.type == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            decoder.generate(prompts[0], controller=FixedController(6, 60), max_new_tokens=64)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48)
        say(table)
        out[label] = {"ms_per_cycle_calls": calls, "top_self_cpu": table}
        if pair.device.type == "cuda":
            device_table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=10,
                                                     max_name_column_width=48)
            say(device_table)
            out[label]["top_self_device"] = device_table
    return out


def guarded(name: str, fn):
    """fn(), or its error and traceback: one failing section must not cost the others their (device) time."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 (reported, and the run goes on)
        import traceback

        say(f"  {name} FAILED: {type(err).__name__}: {err}")
        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


SECTIONS = ("tiny", "embedded", "sweep", "batched", "agreement", "shapes", "profile")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu for a dry run of the script itself")
    ap.add_argument("--sampled-n", type=int, default=1500)
    ap.add_argument("--sweep-prompts", type=int, default=4)
    ap.add_argument("--sweep-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--batch-tokens", type=int, default=64)
    ap.add_argument("--agreement-prompts", type=int, default=16, help="held-out code prompts for section 3")
    ap.add_argument("--agreement-tokens", type=int, default=128)
    ap.add_argument("--drafters", default="eagle3,draft_lm")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--tag", default="gpu_check", help="the JSON file's name (without .json)")
    args = ap.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    sections = set(args.sections.split(","))
    import transformers

    device = torch.device(args.device)
    result = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (dry run)",
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "transformers": transformers.__version__, "python": platform.python_version(),
              "float32_matmul_precision": torch.get_float32_matmul_precision(),
              "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "sections": sorted(sections)}
    out_file = Path(args.out) / f"{args.tag}.json"
    out_file.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out_file.write_text(json.dumps(result, indent=1, default=str))

    say(f"{result['gpu']}, torch {result['torch']} (CUDA {result['cuda']}), transformers {result['transformers']}, "
        f"fp32 matmul precision {result['float32_matmul_precision']}, TF32 {result['tf32_matmul']}")
    if "shapes" in sections:
        say(f"0a. target forward latency by query length and dtype on {args.device}")
        result["shapes"] = guarded("shapes", lambda: shapes(args))
        save()
    if "profile" in sections:
        say(f"0b. per-cycle time by call and profiler on {args.device}")
        result["profile"] = guarded("profile", lambda: profile([p.prompt for p in load_suite(CODE_SUITE)], args))
        save()
    if "tiny" in sections:
        say(f"1. exactness on {args.device} (tiny random pairs, fp32)")
        result["tiny_greedy"] = guarded("tiny greedy", lambda: tiny_exactness(device))
        save()
        result["tiny_sampled"] = guarded("tiny sampled", lambda: tiny_sampled_law(device, args.sampled_n))
        save()
    code = [p.prompt for p in load_suite(CODE_SUITE)]
    prompts = code[: args.prompts]
    if "embedded" in sections:
        say(f"2. embedded pair on {args.device}: {len(prompts)} held-out code prompts x {args.repeats}, "
            f"{args.max_new_tokens} new tokens, greedy")
        for drafter in args.drafters.split(","):
            for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
                key = f"{drafter}_{dtype_name(dtype)}"
                result[key] = guarded(key, lambda: embedded(drafter, dtype, prompts, args))
                save()
    if "sweep" in sections:
        say(f"2b. static sweep on {args.device}")
        for drafter in ("eagle3", "draft_lm"):
            result[f"sweep_{drafter}"] = guarded(f"sweep {drafter}", lambda: sweep(drafter, code[: args.sweep_prompts],
                                                                              args))
            save()
    if "batched" in sections:
        say(f"2c. batched decoding on {args.device}: {args.batch_tokens} new tokens, batch sizes {args.batch_sizes}")
        for drafter, dtype in itertools.product(args.drafters.split(","), [getattr(torch, d) for d in
                                                                             args.dtypes.split(",")]):
            key = f"batched_{drafter}_{dtype_name(dtype)}"
            result[key] = guarded(key, lambda: batched(drafter, dtype, code, args))
            save()
    if "agreement" in sections:
        say(f"3. agreement of the embedded pair in bf16 on {args.device}: {min(len(code), args.agreement_prompts)} "
            f"held-out code prompts, {args.agreement_tokens} new tokens, guard off / on")
        code_items = list(load_suite(CODE_SUITE))[: args.agreement_prompts]
        result["agreement_bf16"] = guarded("agreement", lambda: agreement(code_items, args))
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
