"""The options of the commands whose modules import torch at the top (`specpilot grid`, `specpilot export`), kept
here so that `specpilot COMMAND --help` and argument errors return without importing torch (see specpilot.cli)."""
from __future__ import annotations

import argparse


def grid_arguments(parser: argparse.ArgumentParser) -> None:
    from specpilot.drafting.cliargs import (add_pair_arguments, batch_sizes, int_list as ints, non_negative_int,
                                            output_file, positive_int)

    parser.add_argument("--traces", nargs="+", required=True,
                        help="trace dir(s) of the training task, one per beam width (or RUN/traces with train/)")
    parser.add_argument("--out", required=True, type=output_file,
                        help="grid.json path (the heat map is written next to it; checked before the sweep)")
    parser.add_argument("--depths", type=ints(0), default=None,
                        help="depths to sweep, e.g. 0-12 or 2,4,6 (default: 0..max_depth; 0 = plain target steps)")
    parser.add_argument("--sizes", type=ints(1), default=None,
                        help="sizes to sweep, e.g. 1,2,4,8 (default: 1 + the size actions)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None,
                        help="replay budget (default: the trace's)")
    parser.add_argument("--live-top", type=non_negative_int, default=3,
                        help="re-measure the top K cells live (0: replay only)")
    parser.add_argument("--live-repeats", type=positive_int, default=1, help="passes over the validation prompts")
    parser.add_argument("--val-suite", default="validation",
                        help="prompts for the live phase: a suite name or file; held-out prompts are refused (they "
                             "are never used for selection)")
    parser.add_argument("--val-limit", type=positive_int, default=None,
                        help="use only the first N validation prompts (default: all)")
    parser.add_argument("--batch-sizes", type=batch_sizes, default=None,
                        help="also find the best static config per batch size in batch replay, e.g. 1,2,4,8,16 "
                             "(grid.json per_batch_size; export turns it into the engines' per-batch-size tables; "
                             "default: none)")
    parser.add_argument("--batch-profile", default=None,
                        help="a profile.json measured at those batch sizes (default: the trace's own when it has "
                             "them, else measured now with the pair)")
    add_pair_arguments(parser, what="(live phase)")


def export_arguments(parser: argparse.ArgumentParser) -> None:
    from specpilot.drafting.cliargs import add_pair_arguments, output_dir, positive_int, run_folder

    parser.add_argument("--run", required=True, type=run_folder, help="training run directory (holds policies.json)")
    parser.add_argument("--out", required=True, type=output_dir,
                        help="output folder for decoder.json, weights and engine configs (checked before exporting)")
    parser.add_argument("--onnx", action="store_true", help="also write ONNX actors (needs the optional onnx extra)")
    add_pair_arguments(parser, dtype_option=False, what="the run was trained on",
                       target_default="none: the identity comes from the run's manifest, and the recorded pair is "
                                      "loaded when its paths exist here")
    parser.add_argument("--default-pair", action="store_true",
                        help="load the embedded default pair (the run was trained on it) instead of reading the "
                             "pair from the run's manifest")
    parser.add_argument("--trace", help="recorded trace to measure the policies' choices on (default: the run's "
                                        "validation trace, RUN/traces/validation)")
    parser.add_argument("--grid", help="grid-search result JSON with best {depth, size, width} (default: "
                                       "RUN/grid.json when present)")
    parser.add_argument("--prompts", type=positive_int, default=4, help="live generations when no trace is available")
    parser.add_argument("--max-new-tokens", type=positive_int, default=48, help="tokens per live generation")
