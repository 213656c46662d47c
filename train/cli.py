"""`specpilot train size|depth|coadapt|ablation|all`: the CLI over `specpilot.train.rl.pipeline`.

    specpilot train size --run RUN [--traces RUN/traces] [--steps 20000] [--reward dinkelbach] [--resume]
    specpilot train depth --run RUN [--steps 40000] [--static 4,12 | --grid RUN/grid.json]
    specpilot train coadapt --run RUN --rounds 3 [--steps 10000]
    specpilot train ablation --run RUN [--kind size] [--rewards throughput,acceptance,time,dinkelbach]
    specpilot train all --run RUN            # stage 1 (size, depth) + co-adaptation
    specpilot train all --run RUN --bc       # stage 1 cloned from the replay oracle (DAgger), then co-adaptation
    specpilot train all --run RUN --seeds 3  # 3 seeds in RUN/seed<k>/, the best on validation deployed
    specpilot train size --run RUN --backend live --ray auto --workers 8   # one live env per Ray worker

Traces default to RUN/traces/{train,validation} (`specpilot record --suite train --out RUN/traces/train`, the same
for validation); the static baseline to RUN/grid.json (`specpilot grid`). Every PPO hyper-parameter defaults to the
paper's (scaled for small budgets, see `specpilot.train.rl.pipeline.budget_settings`) and can be overridden.

Ctrl-C saves a checkpoint at the last update boundary; the command then prints where it is and the exact command
that resumes it (the same command with --resume), and exits with 130. A resumed stage says where it resumes from; it
keeps the settings its checkpoint was trained with: a changed one (--lr, --seed, --reward, --static, --depth-range,
--size-actions, the PPO options, ...) is refused before anything is loaded, naming its saved and given value. The
budget (--steps, --size-steps, ...), --eval-every, --wandb and --threads may change.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from contextlib import nullcontext
from pathlib import Path

from specpilot.artifacts.grid import GRID_FILE
from specpilot.artifacts.run import RunManifest
from specpilot.drafting.cliargs import (add_pair_arguments, batch_sizes, float_in, given_options, int_at_least,
                                        int_list, load_pair, name_list, non_negative_float, options_config,
                                        output_dir, positive_float, positive_int, seed, stage_name)
from specpilot.train.scale.cluster_cli import add_cluster_arguments, open_pool

COMMANDS = ("size", "depth", "coadapt", "ablation", "all")
REWARDS = ("throughput", "acceptance", "time", "dinkelbach")
PAIR_OPTIONS = ("target", "draft", "eagle", "device", "dtype")
# `train all` defaults, named once: the parser's, and what tells a value given (even abbreviated) from the default
DEFAULT_BC_ITERS, DEFAULT_BC_EPOCHS, DEFAULT_SEED_WORKERS = 8, 30, 1


def _static(text: str) -> tuple[int, int]:
    values = int_list(1)(text)
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected DEPTH,SIZE (two integers >= 1), got {text!r}")
    return values[0], values[1]


def _depth_range(text: str) -> list[int]:
    if text.count(",") != 1:  # (int_list would read "3-9" as the seven depths 3..9)
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH with 1 <= LOW <= HIGH (e.g. 2,6), got {text!r}")
    values = int_list(1)(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return values


def _common(p: argparse.ArgumentParser, steps: int | None) -> None:
    p.add_argument("--run", required=True, type=output_dir,
                   help="run directory (checkpoints, manifest, logs, policies.json; checked before training)")
    p.add_argument("--traces", default=None, help="directory with train/ and validation/ traces (default RUN/traces)")
    if steps is not None:  # `train all` budgets each stage (--size-steps, --depth-steps, --coadapt-steps) instead
        p.add_argument("--steps", type=positive_int, default=steps, help="budget in env steps")
    p.add_argument("--reward", default="dinkelbach", choices=REWARDS,
                   help="reward mode of the environments (default dinkelbach: tokens - lambda*time sums to the "
                        "episode's true objective; the paper's per-cycle throughput reward favours short cycles)")
    p.add_argument("--backend", default="replay", choices=["replay", "live"],
                   help="replay (trace + profile, fast) or live (real decoder, wall-clock rewards)")
    p.add_argument("--static", type=_static, default=None,
                   help="static (depth,size), e.g. 4,12 (default: from --grid)")
    p.add_argument("--grid", default=None, help="grid.json whose best config fixes partners (default RUN/grid.json)")
    p.add_argument("--wandb", default=None, choices=["online", "offline", "disabled"],
                   help="wandb mode (default: $WANDB_MODE, else offline); TensorBoard is always written")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run with the settings it was started with (a changed one is "
                        "refused; the budget may grow); finished stages are skipped")
    p.add_argument("--seed", type=seed, default=0, help="seed of PPO and of the environments")
    g = p.add_argument_group("PPO overrides (default: the paper's, scaled for small budgets)")
    g.add_argument("--n-steps", type=int_at_least(2), default=None,
                   help="rollout length (default: paper 2048, scaled)")
    g.add_argument("--batch-size", type=int_at_least(2), default=None,
                   help="minibatch, >= 2 (default: paper 256, scaled)")
    g.add_argument("--n-epochs", type=positive_int, default=None, help="epochs per update (default: paper 20)")
    g.add_argument("--pi-arch", type=int_list(1), default=None,
                   help="actor layers, e.g. 1024,256 (default: paper's, size 1024,256; depth 1024)")
    g.add_argument("--vf-arch", type=int_list(1), default=None, help="value layers (default: paper 1024,256)")
    g.add_argument("--gamma", type=float_in(0.0, 1.0, open_low=True, describe="a discount in (0, 1]"), default=None,
                   help="discount (default: paper's, size 0.9, depth 0.999)")
    g.add_argument("--lr", type=positive_float, default=None,
                   help="peak learning rate (default: paper 1e-3, 1%% warm-up, linear decay)")
    g.add_argument("--ent-coef", type=non_negative_float, default=None,
                   help="entropy coefficient (default: paper 0.01)")
    g.add_argument("--eval-every", type=positive_int, default=None,
                   help="validate every N env steps (default: per budget)")
    live = p.add_argument_group("live backend (--backend live)")
    add_pair_arguments(live)
    live.add_argument("--init-from", default=None,
                      help="start from this policy zip, e.g. fine-tune a replay policy (default: a fresh policy)")
    add_cluster_arguments(p)  # --ray/--workers: live environments on Ray workers, one per worker
    b = p.add_argument_group("batch-aware policies (replay backend)")
    b.add_argument("--batch-sizes", type=batch_sizes, default=None,
                   help="train over batches of these sizes, e.g. 1,2,4,8,16: each episode replays a batch of a drawn "
                        "size, rewarded on batch throughput; the policies observe the batch size; with --bc, stage 1 "
                        "clones the per-batch oracle (default: single sequences)")
    b.add_argument("--batch-profile", default=None,
                   help="profile.json with those batch sizes (default: RUN/grid.profile_w<W>.json from `specpilot "
                        "grid --batch-sizes`, else the trace's)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="train_command", metavar="STAGE")
    stages = {
        "size": ("stage 1: size policy against random depths", 20_000),
        "depth": ("stage 1: depth policy with the static size", 40_000),
        "coadapt": ("stage 2: alternate size / depth with the partner frozen", 10_000),
        "ablation": ("reward ablation: one policy per reward mode, same budget", 10_000),
        "all": ("stage 1 (size, depth) then co-adaptation", None),
    }
    for name, (help_text, steps) in stages.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_label=f"specpilot train {name}")
        _common(p, steps)
        _stage_arguments(name, p)


def _stage_arguments(name: str, p: argparse.ArgumentParser) -> None:
    if name == "size":
        p.add_argument("--depth-range", type=_depth_range, default=None,
                       help="random partner depths LOW,HIGH (default: 1,max_depth)")
        p.add_argument("--size-actions", type=int_list(1), default=None,
                       help="verification sizes to choose from, e.g. 2,4,8,16 (default: the device's size actions)")
        p.add_argument("--stage", type=stage_name, default="size_s1", help="stage directory name under RUN")
    elif name == "depth":
        p.add_argument("--stage", type=stage_name, default="depth_s1", help="stage directory name under RUN")
    elif name == "coadapt":
        p.add_argument("--rounds", type=positive_int, default=3, help="stages: size, depth, size, ...")
        p.add_argument("--allow-partial", action="store_true",
                       help="start from stage-1 policies whose stage was interrupted (default: refused; finish it "
                            "with --resume)")
    elif name == "ablation":
        p.add_argument("--kind", default="size", choices=["size", "depth"], help="which policy to train")
        p.add_argument("--rewards", type=name_list(REWARDS, "reward"), default=list(REWARDS),
                       help="comma list of reward modes")
    else:
        p.add_argument("--size-steps", type=positive_int, default=20_000, help="size stage budget (env steps)")
        p.add_argument("--depth-steps", type=positive_int, default=40_000, help="depth stage budget (env steps)")
        p.add_argument("--coadapt-steps", type=positive_int, default=10_000, help="budget per co-adaptation stage")
        p.add_argument("--rounds", type=positive_int, default=3, help="co-adaptation stages")
        p.add_argument("--seeds", type=positive_int, default=1,
                       help="train N seeds of the pipeline in RUN/seed<k>/ and deploy the best on validation "
                            "(RUN/seeds.json: each seed's ltd-vs-static ratio and their median/IQM)")
        p.add_argument("--seed-workers", type=positive_int, default=DEFAULT_SEED_WORKERS,
                       help="with --seeds: train this many seeds at once, each in its own process with torch "
                            "threads // N threads (replay backend; its small networks gain little from a second "
                            "thread, so on 2 cores 2 workers nearly halve the time) (default: 1, one after another)")
        p.add_argument("--bc", action="store_true",
                       help="stage 1 = behaviour cloning from the replay oracle with DAgger relabelling (instead of "
                            "PPO from scratch; --size-steps/--depth-steps unused); co-adaptation fine-tunes with PPO")
        p.add_argument("--bc-iters", type=positive_int, default=DEFAULT_BC_ITERS,
                       help=f"DAgger iterations of --bc (default {DEFAULT_BC_ITERS})")
        p.add_argument("--bc-epochs", type=positive_int, default=DEFAULT_BC_EPOCHS,
                       help=f"supervised epochs per DAgger iteration of --bc (default {DEFAULT_BC_EPOCHS})")


def _options(args, static, pair, cluster=None):
    from specpilot.train.rl.ppo import PPOOverrides
    from specpilot.train.rl.stages import TrainOptions

    ppo = PPOOverrides(n_steps=args.n_steps, batch_size=args.batch_size, n_epochs=args.n_epochs,
                       pi_arch=args.pi_arch, vf_arch=args.vf_arch, gamma=args.gamma, learning_rate=args.lr,
                       ent_coef=args.ent_coef, eval_every=args.eval_every)
    bc = dict(bc_iters=args.bc_iters, bc_epochs=args.bc_epochs) if getattr(args, "bc", False) else {}
    return TrainOptions(reward=args.reward, backend=args.backend, pair=pair, cluster=cluster, static=static,
                        resume=args.resume, seed=args.seed, ppo=ppo,
                        allow_partial=bool(getattr(args, "allow_partial", False)), **bc,
                        batch_sizes=tuple(args.batch_sizes) if args.batch_sizes else None,
                        batch_profile=args.batch_profile)


def _check(cmd: str, args: argparse.Namespace, run_dir: Path):
    """(traces, static) after the checks that need no model: options that would be ignored are refused, the
    traces and the grid result are readable."""
    from specpilot.eval.inputs import read_grid_best
    from specpilot.train.rl.traces import TaskTraces

    ray = getattr(args, "ray", None)
    if ray and cmd not in ("size", "depth", "coadapt"):
        raise ValueError(f"--ray moves the live environments of one stage (`train size`, `depth` or `coadapt` with "
                         f"--backend live) onto Ray workers; `train {cmd}` runs its stages in this process: drop "
                         "--ray, or train the live stage on its own")
    if ray and args.backend != "live":
        raise ValueError("--ray moves live environments (--backend live) onto Ray workers; replay training runs in "
                         "this process: drop --ray, or add --backend live")
    given = ", ".join(f"--{k}" for k in PAIR_OPTIONS if getattr(args, k, None) is not None)
    if args.backend != "live" and given:
        raise ValueError(f"{given} load(s) the pair of the live backend: add --backend live, or drop it (replay "
                         "training uses the traces' recorded pair)")
    if args.static is not None and args.grid is not None:
        raise ValueError("--static and --grid both fix the static partner config: give one")
    _check_ignored_options(cmd, args)
    traces = TaskTraces.resolve(args.traces or run_dir / "traces")
    _check_tree_values(args, traces)
    grid = args.grid if args.grid is not None else (run_dir / GRID_FILE if (run_dir / GRID_FILE).is_file()
                                                     else None)
    if grid is not None:
        read_grid_best(grid)
    if args.init_from is not None and not Path(args.init_from).is_file():
        raise FileNotFoundError(f"--init-from {args.init_from}: no such policy zip")
    _check_init_from(cmd, args, traces)
    _check_start_arch(cmd, args, run_dir)
    _check_outputs(cmd, args, run_dir)
    return traces, args.static if args.static is not None else args.grid


SB3_MAX_SEED = 2 ** 32 - 1  # SB3's set_random_seed seeds numpy's global generator, which takes 32 bits


def _check_ignored_options(cmd: str, args: argparse.Namespace) -> None:
    """Options this command would take and then ignore (or fail on only after creating the run): refused."""
    given = given_options(args)

    def typed(option: str, default) -> bool:  # given, or set to other than its default (an abbreviated option)
        return option in given or getattr(args, option[2:].replace("-", "_"), default) != default

    last_seed = args.seed + getattr(args, "seeds", 1) - 1  # --seeds N trains seeds seed .. seed + N - 1
    if last_seed > SB3_MAX_SEED:
        raise ValueError(f"--seed {args.seed}: training seeds SB3, which takes 0..{SB3_MAX_SEED} (2^32 - 1)"
                         f"{f' for each of the seeds up to {last_seed}' if last_seed != args.seed else ''}; give a "
                         "smaller seed")
    if args.init_from is not None and cmd not in ("size", "depth"):
        raise ValueError(f"--init-from starts one stage from a policy zip (`specpilot train size` or `train depth`); "
                         f"`train {cmd}` starts its stages from {'stage 1' if cmd == 'coadapt' else 'scratch'} and "
                         "would ignore it: drop it, or train that stage on its own")
    if args.batch_profile is not None and not args.batch_sizes:
        raise ValueError("--batch-profile gives the latencies of --batch-sizes training, but no --batch-sizes was "
                         "given: add --batch-sizes, or drop --batch-profile")
    if cmd != "all":
        return
    unused = [o for o, d in (("--bc-iters", DEFAULT_BC_ITERS), ("--bc-epochs", DEFAULT_BC_EPOCHS)) if typed(o, d)]
    if unused and not args.bc:
        raise ValueError(f"{' and '.join(unused)} set(s) the behaviour cloning of --bc, which was not given: add "
                         "--bc, or drop them")
    if typed("--seed-workers", DEFAULT_SEED_WORKERS) and args.seeds <= 1:
        raise ValueError("--seed-workers trains several --seeds at once, but one seed was asked for: add --seeds N, "
                         "or drop --seed-workers")


def _check_outputs(cmd: str, args: argparse.Namespace, run_dir: Path) -> None:
    """Every stage folder and file the command will write can take it (a file where a stage folder goes, a folder
    where policies.json goes): refused in one line before any stage trains, not after the stages before it."""
    from specpilot.train.rl import pipeline as P

    if cmd in ("size", "depth"):
        outputs = P.stage_outputs(run_dir, [args.stage])
    elif cmd == "coadapt":
        outputs = P.coadapt_outputs(run_dir, args.rounds)
    elif cmd == "ablation":
        outputs = P.stage_outputs(run_dir, ["ablation"])
    else:
        outputs = _pipeline_outputs(args, run_dir)
    P.check_outputs(outputs)


def _pipeline_outputs(args: argparse.Namespace, run_dir: Path) -> dict:
    """What `train all` writes: one pipeline in RUN, or with --seeds one per RUN/seed<k> plus the deployed copies."""
    from specpilot.train.rl import pipeline as P
    from specpilot.train.rl.seeds import SEEDS_FILE

    settings = dict(rounds=args.rounds, bc=bool(getattr(args, "bc", False)), batch=bool(args.batch_sizes))
    if getattr(args, "seeds", 1) <= 1:
        return P.pipeline_outputs(run_dir, **settings)
    outputs = {run_dir / SEEDS_FILE: "file", **P.pipeline_outputs(run_dir, rounds=0)}  # the best seed's copies
    for k in range(args.seeds):
        outputs.update(P.pipeline_outputs(run_dir / f"seed{k}", **settings))
    return outputs


def _check_tree_values(args: argparse.Namespace, traces) -> None:
    """--static / --size-actions / --depth-range beyond the training trace's tree: refused before the run folder
    is touched (train/rl/stages.py checks the same for library callers)."""
    given = (args.static, getattr(args, "size_actions", None), getattr(args, "depth_range", None))
    if all(v is None for v in given):
        return
    from specpilot.artifacts.trace import TraceHeader
    from specpilot.train.rl.stages import check_tree_options

    # the header (trace.json) is all the check needs: the arrays are read when a stage trains
    check_tree_options(TraceHeader.load(traces.train), static=args.static,
                       size_actions=getattr(args, "size_actions", None), depth_range=getattr(args, "depth_range", None))


def _check_init_from(cmd: str, args: argparse.Namespace, traces) -> None:
    """--init-from of a size / depth stage must be a readable policy zip of that kind whose shapes (observations,
    actions) fit the stage on the training trace's tree, and whose layers match --pi-arch / --vf-arch: checked here,
    before the run folder is touched, not when its weights fail to load into the stage's networks."""
    if args.init_from is None or cmd not in ("size", "depth"):
        return
    from specpilot.artifacts.trace import TraceHeader
    from specpilot.train.rl.ppo import PPOOverrides
    from specpilot.train.rl.stages import check_init_policy, fit_size_actions, stage_observation

    header = TraceHeader.load(traces.train)  # the stage's tree, as train_stage reads it (arrays not needed)
    actions = fit_size_actions(args.size_actions, header.max_size, header.device) if cmd == "size" else None
    spec = stage_observation(cmd, header.width, header.max_depth, actions, batch=bool(args.batch_sizes))
    check_init_policy(args.init_from, cmd, spec, actions, PPOOverrides(pi_arch=args.pi_arch, vf_arch=args.vf_arch))


def _check_start_arch(cmd: str, args: argparse.Namespace, run_dir: Path) -> None:
    """--pi-arch / --vf-arch for stages that start from existing policies (co-adaptation: stage 1's; --init-from,
    `_check_init_from`) must match them: checked here, before any stage trains, not when the weights fail to load."""
    if args.pi_arch is None and args.vf_arch is None:
        return
    from specpilot.train.rl.ppo import PPOOverrides
    from specpilot.train.rl.stages import start_arch

    ppo = PPOOverrides(pi_arch=args.pi_arch, vf_arch=args.vf_arch)
    if cmd == "coadapt":
        for kind in ("size", "depth"):
            best = run_dir / f"{kind}_s1" / "best.zip"
            if best.is_file():
                start_arch(best, kind, ppo)


def run(args: argparse.Namespace) -> int:
    cmd = getattr(args, "train_command", None)
    if cmd not in COMMANDS:
        raise ValueError(f"choose a stage: {', '.join(COMMANDS)} (see `specpilot train --help`)")
    run_dir = Path(args.run)
    traces, static = _check(cmd, args, run_dir)
    ray = getattr(args, "ray", None)
    if ray and getattr(args, "resume", False) and args.workers:  # one live env per worker: checked before the pool
        from specpilot.train.rl.coadapt import coadapt_stages
        from specpilot.train.rl.ppo import check_stages_envs

        stages = ([stage for _, stage in coadapt_stages(args.rounds)] if cmd == "coadapt" else [args.stage])
        check_stages_envs(run_dir, stages, args.workers, steps=args.steps)
    from specpilot.drafting.folder_lock import output_lock
    from specpilot.train.rl.ppo import StageExistsError

    try:
        with output_lock(run_dir, what="--run"):  # before the live backend's models load
            pair = load_pair(args) if args.backend == "live" and not ray else None
            with open_pool(args) if ray else nullcontext() as pool:
                return _run_stage(cmd, args, run_dir, traces, _options(args, static, pair, pool))
    except StageExistsError as err:
        raise _stage_exists(err, args) from None
    except KeyboardInterrupt:
        print(interrupted_message(args, run_dir), file=sys.stderr)
        return 130


def _stage_exists(err, args: argparse.Namespace) -> FileExistsError:
    """The library's message names resume=True; on the command line the flag is --resume."""
    return FileExistsError(f"stage {err.stage_dir} already has checkpoints: add --resume to continue it "
                           f"({resume_command(args)}), or use another --run / delete {err.stage_dir} to start over")


def resume_command(args: argparse.Namespace) -> str:
    """The exact command the user ran, with --resume added."""
    argv = list(getattr(args, "_argv", None) or sys.argv[1:])
    if "--resume" not in argv:
        argv.append("--resume")
    return shlex.join(["specpilot", *argv])


def interrupted_message(args: argparse.Namespace, run_dir: Path) -> str:
    """Where the interrupted stages' checkpoints are (train_policy saved them and recorded them in the manifest: the
    run's, and with --seeds each RUN/seed<k>/'s) and the command that resumes them."""
    checkpoints = []
    for folder in [run_dir, *sorted(run_dir.glob("seed[0-9]*"))]:
        prefix = "" if folder == run_dir else f"{folder.name}/"
        try:
            checkpoints += [f"{prefix}{name}: {stage.checkpoint}"
                            for name, stage in RunManifest.load(folder).stages.items()
                            if stage.status == "interrupted" and stage.checkpoint]
        except (OSError, ValueError):
            pass
    where = (f"checkpoint saved ({'; '.join(checkpoints)})" if checkpoints
             else "no checkpoint of the running stage yet (finished stages are kept)")
    return f"{args._label}: interrupted; {where}. Resume with:\n  {resume_command(args)}"


def progress_logger(run_dir: Path, args: argparse.Namespace, *, every_s: float = 10.0):
    """The run's RunLogger, also printing progress on stderr: every validation (replay tokens/s, speedup), and the
    training rollouts at most every `every_s` seconds (env steps, mean reward, replay tokens/s of the cycles)."""
    import time

    from specpilot.train.rl.logging import RunLogger

    class ProgressLogger(RunLogger):
        last = 0.0

        def note(self, text: str) -> None:  # e.g. a stage resuming from its checkpoint
            super().note(text)
            print(f"  {text}", file=sys.stderr, flush=True)

        def log(self, metrics: dict, step: int) -> None:
            super().log(metrics, step)
            stage = next(iter(metrics), "").split("/", 1)[0]
            val = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if "/val/" in k and v is not None}
            if "tokens_per_s" in val:  # (the stage's own "val/score" record repeats the number: not printed)
                shown = [f"{val['tokens_per_s']:.1f} tok/s"]  # (a validation without an AR reference has no ratio)
                if val.get("speedup") is not None and math.isfinite(val["speedup"]):
                    shown.append(f"{val['speedup']:.2f}x AR")
                if val.get("mean_accepted_length"):
                    shown.append(f"tau {val['mean_accepted_length']:.2f}")
                print(f"  {stage}: step {step}, validation {', '.join(shown)} (replay)", file=sys.stderr, flush=True)
            elif "batch_score" in val:  # a batch-aware stage: geometric-mean speedup over batched AR
                print(f"  {stage}: step {step}, validation {val['batch_score']:.3f}x batched AR (geometric mean over "
                      "batch sizes, batch replay)", file=sys.stderr, flush=True)
            elif not val and time.monotonic() - self.last >= every_s:
                self.last = time.monotonic()
                get = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if not isinstance(v, (list, tuple))}
                parts = [f"step {step}"]
                if get.get("reward_mean") is not None:
                    parts.append(f"reward {get['reward_mean']:.3g}")
                if get.get("tokens_per_s") is not None:
                    parts.append(f"{get['tokens_per_s']:.1f} tok/s in training cycles")
                print(f"  {stage}: {', '.join(parts)}", file=sys.stderr, flush=True)

    return ProgressLogger(run_dir, run_config(args), mode=args.wandb)


def run_config(args: argparse.Namespace) -> dict:
    """The wandb config of a train command: the command and every option's value (PPO settings, budgets, the
    static config, the traces and the pair as given), as SB3's wandb integration records the hyper-parameters."""
    return options_config(args, f"train {args.train_command}", skip=("train_command",))


def summary_lines(out: dict, run_dir: Path, *, batched: bool = False) -> list[str]:
    """The result of a train command as lines: one per stage (its best validation and policy), then the indexes.
    batched: the stages trained over batch sizes, whose validation score is the geometric-mean speedup over batched
    AR (`train.rl.validation.evaluate_batches`), not tokens/s."""
    stages = []

    def walk(node) -> None:
        if isinstance(node, dict):
            if "stage" in node and "kind" in node and "best" in node:
                stages.append(node)
                return
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(out)
    lines = []
    for st in stages:
        score = st.get("score")
        shown = (f"{score:.3f}x batched AR (geometric mean over batch sizes, batch replay)" if batched
                 else f"{score:.1f} tok/s (replay)")
        how = (f"best validation {shown}" if isinstance(score, (int, float))
               else "no validation ran (budget below --eval-every): final policy kept")
        note = "; already trained to this budget, nothing trained (--resume)" if st.get("skipped") else ""
        kept = "; its starting policy validated better and is kept" if (st.get("validation") or {}).get("kept_init") \
            else ""
        lines.append(f"{st['stage']} ({st['kind']} policy): {how} -> {st['best']}{note}{kept}")
    for key in ("stage1_policies", "policies"):
        if isinstance(out, dict) and out.get(key):
            lines.append(f"{key.replace('_', ' ')}: {out[key]}")
    if isinstance(out, dict) and not stages:  # e.g. the reward ablation: a table of numbers
        lines += [f"{k}: {json.dumps(v, default=str)[:300]}" for k, v in out.items()]
    lines.append(f"run: {run_dir} (manifest.json, tb/ for TensorBoard)")
    return lines


def _run_stage(cmd: str, args, run_dir: Path, traces, options) -> int:
    with progress_logger(run_dir, args) as log:  # RunLogger is a context manager: closed however the stage ends
        out = _run_command(cmd, args, run_dir, traces, options, log)
    print("\n".join(summary_lines(out, run_dir, batched=bool(getattr(args, "batch_sizes", None)))))
    return 0


def _run_command(cmd: str, args, run_dir: Path, traces, options, logger) -> dict:
    from specpilot.train.rl import pipeline as P

    common = dict(options=options, wandb=args.wandb, logger=logger)
    if cmd == "size":
        res = P.train_size(run_dir, traces, steps=args.steps, depth_range=args.depth_range,
                           size_actions=args.size_actions, stage=args.stage, init_from=args.init_from, **common)
        out = res.to_dict()
    elif cmd == "depth":
        res = P.train_depth(run_dir, traces, steps=args.steps, stage=args.stage, init_from=args.init_from, **common)
        out = res.to_dict()
    elif cmd == "coadapt":
        out = P.coadapt(run_dir, traces, rounds=args.rounds, steps=args.steps, **common)
    elif cmd == "ablation":
        out = P.reward_ablation(run_dir, traces, kind=args.kind, rewards=args.rewards, steps=args.steps, **common)
    elif args.seeds > 1:
        from specpilot.train.rl.seeds import run_seeds

        out = run_seeds(run_dir, traces, seeds=args.seeds, workers=args.seed_workers, size_steps=args.size_steps,
                        depth_steps=args.depth_steps, coadapt_steps=args.coadapt_steps, rounds=args.rounds,
                        progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True), **common)
    else:
        out = P.run_pipeline(run_dir, traces, size_steps=args.size_steps, depth_steps=args.depth_steps,
                             coadapt_steps=args.coadapt_steps, rounds=args.rounds, **common)
    return out
