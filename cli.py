"""The `specpilot` command line. Every sub-command lives in a module that exposes `add_arguments(parser)` and
`run(args) -> int` and calls library functions; this file only wires them together. A command's module is imported
when the parser is built (argparse needs each command's options for --help)."""
from __future__ import annotations

import argparse
import importlib
import sys

from specpilot.train.cluster_cli import CLUSTER_COMMANDS, add_cluster_arguments, with_cluster

# (command, module, one-line help)
COMMANDS: list[tuple[str, str, str]] = [
    ("demo", "specpilot.demo", "run the whole mission end to end on the embedded pair (or your own)"),
    ("generate", "specpilot.drafting.cli", "generate text with the speculative decoder"),
    ("models", "specpilot.train.build_pair", "build the embedded default model pair (`specpilot models build`)"),
    ("record", "specpilot.envs.cli", "record replay traces and a latency profile for a task"),
    ("grid", "specpilot.train.grid", "grid-search the best static (depth, size) configuration"),
    ("train", "specpilot.train.cli", "train PPO depth/size policies (stage 1) or co-adapt them (stage 2)"),
    ("eval", "specpilot.eval.cli", "evaluate methods on held-out task suites and write a report"),
    ("export", "specpilot.train.export", "export a trained run to decoder.json + safetensors + engine configs"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specpilot",
        description="Learn how much to speculate: exact tree speculative decoding steered by PPO policies.",
    )
    # dest differs from any sub-command option, so a sub-command's defaults can never overwrite it
    parser.add_argument("--threads", dest="global_threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice). Batch-1 decoding of small models often "
                             "runs as fast on 1 thread, and extra threads stall when other work shares the cores")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name, help_text in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if not (err.name or "").startswith("specpilot"):
                raise
            p.set_defaults(_handler=_not_built(name))
            continue
        module.add_arguments(p)
        if name in CLUSTER_COMMANDS:  # --ray ADDRESS --workers N; Ray is imported only when --ray is given
            add_cluster_arguments(p)
        p.set_defaults(_handler=with_cluster(name, module.run))
    return parser


def _not_built(name: str):
    def handler(args) -> int:
        print(f"specpilot {name}: not built yet in this version", file=sys.stderr)
        return 2

    return handler


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    if args.global_threads is not None:
        if args.global_threads < 1:
            parser.error(f"--threads must be >= 1, got {args.global_threads}")
        import torch

        torch.set_num_threads(args.global_threads)
    return int(args._handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
