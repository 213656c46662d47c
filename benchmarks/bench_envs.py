"""Benchmark of the environments: replay env steps/s, and replay-predicted vs live-measured throughput.

    .venv/bin/python benchmarks/bench_envs.py [--prompts 6] [--max-new-tokens 64] [--threads 1] [--out DIR]

1. Records a trace + latency profile (specpilot.envs.record) on a few prompts with the embedded default pair, or,
   when it is missing, a tiny random Llama pair whose draft is a noisy copy of the target (partial acceptance).
2. Replay speed: env steps per second of the replay size / depth envs with random actions (no PPO), raw and
   through gymnasium.make's wrappers.
3. Fidelity: for a few fixed (depth, size) configs, live throughput (SpeculativeDecoder.generate with a
   FixedController; tokens / (draft + verify time), as the environments count it) vs the replay prediction
   (replay_static) on the same prompts; the target is within +-7%. Shown for the profile measured at record time
   and for one accumulated from profile passes interleaved with the live runs (same machine load: on a shared
   CPU the load drifts by more than 7% within minutes).
4. The replay oracle (hindsight DP, per-cycle greedy) and the best static config under replay.
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch


def build_pair(seed: int = 0):
    from specpilot.drafting.pair import ModelPair

    try:
        return ModelPair.from_pretrained(device="cpu"), "default"
    except (FileNotFoundError, OSError) as err:
        warnings.warn(f"default pair unavailable ({err}); using a tiny random Llama pair with a noisy-copy draft",
                      stacklevel=2)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=512, eos_token_id=95)
    target = LlamaForCausalLM(cfg)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    return ModelPair(target, draft, name="tiny-random"), "tiny"


def get_prompts(pair, kind: str, n: int, seed: int = 0) -> list:
    if kind == "default":
        from specpilot.eval.suites import load_suite

        return [p.prompt for p in load_suite("train")[:n]]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 95, size=int(rng.integers(4, 16))).tolist() for _ in range(n)]


def replay_speed(env, steps: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    n = env.action_space.n
    actions = (rng.random(steps) < 0.35).astype(np.int64) if n == 2 else rng.integers(n, size=steps)
    env.reset(seed=seed)
    start = time.perf_counter()
    for a in actions.tolist():
        _, _, terminated, truncated, _ = env.step(a)
        if terminated or truncated:
            env.reset()
    return steps / (time.perf_counter() - start)


def live_run(pair, tree, prompt, depth: int, size: int, max_new_tokens: int) -> tuple[int, float, int]:
    """(tokens, draft + verify seconds, cycles) of one live generation with a fixed config."""
    from specpilot.drafting.decoder import SpeculativeDecoder
    from specpilot.policies import FixedController

    out = SpeculativeDecoder(pair, tree).generate(prompt, controller=FixedController(depth, size),
                                                  max_new_tokens=max_new_tokens)
    return out.num_tokens, out.draft_s + out.verify_s, len(out.cycles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--max-depth", type=int, default=8)
    parser.add_argument("--max-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 avoids spinning on a "
                                                                  "shared CPU)")
    parser.add_argument("--steps", type=int, default=100_000, help="replay steps per speed measurement")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of (profile pass, live run of every config), interleaved")
    parser.add_argument("--out", default=None, help="keep trace/profile here (default: a temporary directory)")
    args = parser.parse_args(argv)

    import gymnasium as gym

    import specpilot.envs  # noqa: F401
    from specpilot.drafting.types import TreeConfig
    from specpilot.envs.profile import collect_samples
    from specpilot.envs.record import record_task
    from specpilot.envs.environments import replay_depth_env, replay_size_env
    from specpilot.envs.oracle import replay_oracle, replay_static
    from specpilot.envs.replay import ReplayModel

    torch.set_num_threads(args.threads)
    pair, kind = build_pair()
    tree = TreeConfig(width=args.width, max_depth=args.max_depth, max_size=args.max_size)
    prompts = get_prompts(pair, kind, args.prompts)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_envs_"))
    print(f"pair: {pair.name} ({kind}) on {pair.device}, threads={torch.get_num_threads()}, tree={tree}, "
          f"{len(prompts)} prompts, max_new_tokens={args.max_new_tokens}")

    t0 = time.perf_counter()
    record_task(pair, tree, prompts, out, max_new_tokens=args.max_new_tokens)
    print(f"recorded trace + profile in {time.perf_counter() - t0:.1f}s -> {out}")

    # -- replay speed -------------------------------------------------------------------------------------------
    sizes = [s for s in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64) if s <= tree.max_size]
    print(f"\nreplay env speed ({args.steps} random-action steps, no PPO):")
    for name, make in (
        ("size env  depth~U[1,D]     ", lambda: replay_size_env(out, size_actions=sizes,
                                                                depth_controller=(1, tree.max_depth))),
        ("size env  depth=4          ", lambda: replay_size_env(out, size_actions=sizes, depth_controller=4)),
        ("depth env size=8           ", lambda: replay_depth_env(out, size_controller=8)),
        ("gym.make ReplaySize-v0     ", lambda: gym.make("specpilot/ReplaySize-v0", trace=out, size_actions=sizes,
                                                         depth_controller=(1, tree.max_depth))),
        ("gym.make ReplayDepth-v0    ", lambda: gym.make("specpilot/ReplayDepth-v0", trace=out,
                                                         size_controller=8)),
    ):
        env = make()
        replay_speed(env, 2000)  # builds the per-prompt tables
        print(f"  {name} {replay_speed(env, args.steps):>10,.0f} steps/s")

    # -- fidelity -----------------------------------------------------------------------------------------------
    configs = [(1, 4), (2, 8), (3, 8), (4, 12), (6, 16), (8, 32)]
    configs = [(min(d, tree.max_depth), min(v, tree.max_size)) for d, v in configs]
    live: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    rng = np.random.default_rng(1)
    samples = None
    live_run(pair, tree, prompts[0], 2, 4, args.max_new_tokens)  # warm-up
    totals = {c: [0, 0.0, 0] for c in configs}  # tokens, time, cycles
    for r in range(args.repeats):
        live_round = {c: [0, 0.0] for c in configs}
        for k, prompt in enumerate(prompts):
            # per prompt: a profile pass (random configs), then every config, in rotating order, so the profile
            # and the live runs see the same machine load (it drifts on a shared CPU)
            samples = collect_samples(pair, tree, [prompt], max_new_tokens=args.max_new_tokens, rng=rng,
                                      warmup_cycles=0 if samples else 16, samples=samples)
            shift = (r * len(prompts) + k) % len(configs)
            for c in configs[shift:] + configs[:shift]:
                tokens, time_s, cycles = live_run(pair, tree, prompt, *c, args.max_new_tokens)
                live_round[c][0] += tokens
                live_round[c][1] += time_s
                totals[c][0] += tokens
                totals[c][1] += time_s
                totals[c][2] += cycles
        for c in configs:
            live[c].append(live_round[c][0] / live_round[c][1])
    models = {"record-time profile": ReplayModel(out), "interleaved profile": ReplayModel(out, samples.profile())}
    print("\nreplay-predicted vs live-measured throughput (tokens / (draft + verify) s; same prompts):")
    for label, model in models.items():
        print(f"  [{label}]")
        print(f"  {'depth':>5} {'size':>5} {'tau live':>9} {'tau replay':>10} {'live tok/s':>11} "
              f"{'replay tok/s':>12} {'error':>7}")
        worst = 0.0
        for c in configs:
            pred = replay_static(model, depth=c[0], size=c[1])
            measured = totals[c][0] / totals[c][1]
            err = pred["tokens_per_s"] / measured - 1
            worst = max(worst, abs(err))
            print(f"  {c[0]:>5} {c[1]:>5} {totals[c][0] / totals[c][2]:>9.3f} {pred['mean_accepted_length']:>10.3f} {measured:>11.1f} "
                  f"{pred['tokens_per_s']:>12.1f} {err:>+7.1%}")
        print(f"  worst |error| {worst:.1%} (target <= 7%)")
    print("  live throughput spread (max-min)/mean between rounds, per config: "
          + ", ".join(f"{np.ptp(v) / np.mean(v):.1%}" for v in live.values()))
    model = models["interleaved profile"]

    # -- oracle -------------------------------------------------------------------------------------------------
    result = replay_oracle(model, sizes=sizes)
    best = result["best_static"]
    print("\nreplay ceilings:")
    print(f"  best static (d={best['depth']}, V={best['size']}): {best['tokens_per_s']:.1f} tok/s, "
          f"tau {best['mean_accepted_length']:.2f}")
    print(f"  per-cycle greedy oracle: {result['greedy_oracle']['tokens_per_s']:.1f} tok/s, "
          f"tau {result['greedy_oracle']['mean_accepted_length']:.2f}")
    print(f"  hindsight DP oracle:     {result['oracle']['tokens_per_s']:.1f} tok/s, "
          f"tau {result['oracle']['mean_accepted_length']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
