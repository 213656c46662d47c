"""`specpilot prompts`: write a code-completion suite cut out of your own Python source (the library is
eval/code_prompts.py); record it with `specpilot record --suite FILE` to train or evaluate on code like yours."""
from __future__ import annotations

import argparse
import shlex
from collections import Counter

from specpilot.drafting.cliargs import output_file, positive_int, say, seed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="sources", nargs="+", required=True, metavar="PATH",
                        help="folders (searched recursively) or .py files to cut prompts from")
    parser.add_argument("--out", required=True, type=output_file,
                        help="suite .jsonl to write (checked before reading any source)")
    parser.add_argument("--limit", type=positive_int, default=None, help="at most N prompts (default: all found)")
    parser.add_argument("--split", default="train",
                        help="the prompts' `split` field: what they may be used for (default: train)")
    parser.add_argument("--exclude", nargs="*", default=["heldout_code", "heldout"], metavar="SUITE",
                        help="suites (names or paths) the prompts must not overlap: a function they define (`def` "
                             "name) or a shared line of 30+ characters (default: the bundled held-out suites)")
    parser.add_argument("--forms", default="signature,body",
                        help="prompt forms, comma-separated: signature (def + docstring) and/or body (plus the first "
                             "lines of the body) (default: signature,body)")
    parser.add_argument("--per-file", type=positive_int, default=3, help="most prompts from one file (default: 3)")
    parser.add_argument("--per-folder", type=positive_int, default=12,
                        help="most prompts from one folder directly under a --from folder (default: 12)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the file order and of the forms drawn")


def run(args: argparse.Namespace) -> int:
    from specpilot.drafting.folder_lock import output_lock
    from specpilot.eval.code_prompts import check_suite_path

    check_suite_path(args.out)  # before reading any source
    with output_lock(args.out, what="--out", kind="file"):  # two runs writing one suite file: the second refused
        return _write(args)


def _write(args: argparse.Namespace) -> int:
    from specpilot.eval.code_prompts import extract_code_prompts, write_suite

    if not args.split.strip():
        raise ValueError("--split must name a split (for example train or validation), got an empty string")
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    stats: dict = {}
    prompts = extract_code_prompts(args.sources, limit=args.limit, seed=args.seed, split=args.split,
                                   exclude=args.exclude, per_file=args.per_file, per_folder=args.per_folder,
                                   forms=forms, stats=stats)
    left_out = ([f"{stats['unreadable']} of {stats['files']} .py file(s) could not be read or decoded"]
                if stats.get("unreadable") else []) + (
        [f"{stats['unparsable']} of {stats['files']} .py file(s) could not be parsed as Python"]
        if stats.get("unparsable") else []) + (
        [f"{stats['excluded']} function(s) overlapped the excluded suites"] if stats.get("excluded") else [])
    if left_out:
        say(f"note: {'; '.join(left_out)}")
    out = write_suite(prompts, args.out)
    forms_used = Counter(p.task for p in prompts)
    print(f"wrote {len(prompts)} prompts to {out} ({', '.join(f'{k} {v}' for k, v in sorted(forms_used.items()))}); "
          f"record them with `specpilot record --suite {shlex.quote(str(out))} --out DIR`")  # a command to paste
    return 0
