"""`specpilot train size|depth|coadapt|ablation|all`: the CLI over `specpilot.train.pipeline`.

    specpilot train size --run RUN [--traces RUN/traces] [--steps 20000] [--reward dinkelbach] [--resume]
    specpilot train depth --run RUN [--steps 40000] [--static 4,12 | --grid RUN/grid.json]
    specpilot train coadapt --run RUN --rounds 3 [--steps 10000]
    specpilot train ablation --run RUN [--kind size] [--rewards throughput,acceptance,time,dinkelbach]
    specpilot train all --run RUN            # stage 1 (size, depth) + co-adaptation
    specpilot train size --run RUN --backend live --ray auto --workers 8   # one live env per Ray worker

Traces default to RUN/traces/{train,validation} (`specpilot record --suite train --out RUN/traces/train`, the same
for validation); the static baseline to RUN/grid.json (`specpilot grid`). Every PPO hyper-parameter defaults to the
paper's (scaled for small budgets, see `specpilot.train.pipeline.budget_settings`) and can be overridden.
"""
from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

from specpilot.train.cluster_cli import add_cluster_arguments, open_pool

COMMANDS = ("size", "depth", "coadapt", "ablation", "all")


def _ints(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",") if x.strip()] if text else None


def _common(p: argparse.ArgumentParser, steps: int | None) -> None:
    p.add_argument("--run", required=True, help="run directory (checkpoints, manifest, logs, policies.json)")
    p.add_argument("--traces", default=None, help="directory with train/ and validation/ traces (default RUN/traces)")
    p.add_argument("--steps", type=int, default=steps, help=f"budget in env steps (default {steps})")
    p.add_argument("--reward", default="dinkelbach", choices=["throughput", "acceptance", "time", "dinkelbach"],
                   help="reward mode of the environments (default dinkelbach: tokens - lambda*time sums to the "
                        "episode's true objective; the paper's per-cycle throughput reward favours short cycles)")
    p.add_argument("--backend", default="replay", choices=["replay", "live"],
                   help="replay (trace + profile, fast) or live (real decoder, wall-clock rewards)")
    p.add_argument("--static", default=None, help="static (depth,size), e.g. 4,12 (default: from --grid)")
    p.add_argument("--grid", default=None, help="grid.json whose best config fixes partners (default RUN/grid.json)")
    p.add_argument("--wandb", default=None, choices=["online", "offline", "disabled"],
                   help="wandb mode (default: $WANDB_MODE, else offline); TensorBoard is always written")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run; finished stages are skipped")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("PPO overrides (default: the paper's, scaled for small budgets)")
    g.add_argument("--n-steps", type=int, default=None, help="rollout length (paper 2048)")
    g.add_argument("--batch-size", type=int, default=None, help="minibatch (paper 256)")
    g.add_argument("--n-epochs", type=int, default=None, help="epochs per update (paper 20)")
    g.add_argument("--pi-arch", default=None, help="actor layers, e.g. 1024,256 (paper: size 1024,256; depth 1024)")
    g.add_argument("--vf-arch", default=None, help="value layers (paper 1024,256)")
    g.add_argument("--gamma", type=float, default=None, help="discount (paper: size 0.9, depth 0.999)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (paper 1e-3, 1%% warm-up, linear decay)")
    g.add_argument("--ent-coef", type=float, default=None, help="entropy coefficient (paper 0.01)")
    g.add_argument("--eval-every", type=int, default=None, help="validate every N env steps")
    live = p.add_argument_group("live backend")
    live.add_argument("--target", default=None, help="target model (default: the embedded pair)")
    live.add_argument("--draft", default=None, help="draft model (with --target)")
    live.add_argument("--device", default=None)
    live.add_argument("--init-from", default=None, help="start from this policy zip (e.g. fine-tune a replay policy)")
    add_cluster_arguments(p)  # --ray/--workers: live environments on Ray workers, one per worker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="train_command", metavar="STAGE")
    p = sub.add_parser("size", help="stage 1: size policy against random depths")
    _common(p, 20_000)
    p.add_argument("--depth-range", default=None, help="random partner depths low,high (default 1,max_depth)")
    p.add_argument("--size-actions", default=None, help="verification sizes to choose from, e.g. 2,4,8,16")
    p.add_argument("--stage", default="size_s1")
    p = sub.add_parser("depth", help="stage 1: depth policy with the static size")
    _common(p, 40_000)
    p.add_argument("--stage", default="depth_s1")
    p = sub.add_parser("coadapt", help="stage 2: alternate size / depth with the partner frozen")
    _common(p, 10_000)
    p.add_argument("--rounds", type=int, default=3, help="stages: size, depth, size, ...")
    p = sub.add_parser("ablation", help="reward ablation: one policy per reward mode, same budget")
    _common(p, 10_000)
    p.add_argument("--kind", default="size", choices=["size", "depth"])
    p.add_argument("--rewards", default="throughput,acceptance,time,dinkelbach")
    p = sub.add_parser("all", help="stage 1 (size, depth) then co-adaptation")
    _common(p, None)
    p.add_argument("--size-steps", type=int, default=20_000)
    p.add_argument("--depth-steps", type=int, default=40_000)
    p.add_argument("--coadapt-steps", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=3)


def _options(args, static, pair, cluster=None):
    from specpilot.train.ppo import PPOOverrides
    from specpilot.train.stages import TrainOptions

    ppo = PPOOverrides(n_steps=args.n_steps, batch_size=args.batch_size, n_epochs=args.n_epochs,
                       pi_arch=_ints(args.pi_arch), vf_arch=_ints(args.vf_arch), gamma=args.gamma,
                       learning_rate=args.lr, ent_coef=args.ent_coef, eval_every=args.eval_every)
    return TrainOptions(reward=args.reward, backend=args.backend, pair=pair, cluster=cluster, static=static,
                        resume=args.resume, seed=args.seed, ppo=ppo)


def run(args: argparse.Namespace) -> int:
    from specpilot.train.traces import TaskTraces

    cmd = getattr(args, "train_command", None)
    if cmd not in COMMANDS:
        print(f"specpilot train: choose a stage: {', '.join(COMMANDS)} (see --help)", file=sys.stderr)
        return 2
    run_dir = Path(args.run)
    try:
        traces = TaskTraces.resolve(args.traces or run_dir / "traces")
        static = tuple(_ints(args.static)) if args.static else (args.grid or None)
        if static is not None and not isinstance(static, tuple) and not Path(static).is_file():
            raise FileNotFoundError(f"--grid {static} not found")
    except (FileNotFoundError, ValueError) as err:
        print(f"specpilot train {cmd}: {err}", file=sys.stderr)
        return 2
    pair = None
    ray = getattr(args, "ray", None)
    if ray and (args.backend != "live" or cmd not in ("size", "depth", "coadapt")):
        print(f"specpilot train {cmd}: replay environments train in this process (SB3's local vectorisation); "
              "--ray only moves live environments (--backend live) onto Ray workers", file=sys.stderr)
        ray = None
    if args.backend == "live" and not ray:
        from specpilot.drafting.pair import ModelPair

        pair = ModelPair.from_pretrained(args.target, args.draft, device=args.device)
    from specpilot.train.cluster import ClusterError

    try:
        with open_pool(args) if ray else nullcontext() as pool:
            return _run_stage(cmd, args, run_dir, traces, _options(args, static, pair, pool))
    except ClusterError as err:
        print(f"specpilot train {cmd}: {err}", file=sys.stderr)
        return 2


def _run_stage(cmd: str, args, run_dir: Path, traces, options) -> int:
    from specpilot.train import pipeline as P

    try:
        common = dict(options=options, wandb=args.wandb)
        if cmd == "size":
            res = P.train_size(run_dir, traces, steps=args.steps, depth_range=_ints(args.depth_range),
                               size_actions=_ints(args.size_actions), stage=args.stage, init_from=args.init_from,
                               **common)
            out = res.to_dict()
        elif cmd == "depth":
            res = P.train_depth(run_dir, traces, steps=args.steps, stage=args.stage, init_from=args.init_from,
                                **common)
            out = res.to_dict()
        elif cmd == "coadapt":
            out = P.coadapt(run_dir, traces, rounds=args.rounds, steps=args.steps, **common)
        elif cmd == "ablation":
            out = P.reward_ablation(run_dir, traces, kind=args.kind, rewards=args.rewards.split(","),
                                    steps=args.steps, **common)
        else:
            out = P.run_pipeline(run_dir, traces, size_steps=args.size_steps, depth_steps=args.depth_steps,
                                 coadapt_steps=args.coadapt_steps, rounds=args.rounds, **common)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"specpilot train {cmd}: {err}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=1, default=str)[:4000])
    return 0
