"""What every `specpilot` command shares on the command line: the parser class (one-line errors, defaults shown in
--help), argument types that validate at parse time (so nothing runs on a bad value), and the model-pair options.

    positive_int, non_negative_int, thread_count, finite_float, positive_float, non_negative_float, probability
    utf8_text                  refuses invalid UTF-8 in argv (Python hands it over as lone surrogates)
    device, dtype              names this machine can load on / the dtypes ModelPair knows
    output_dir, output_file    refuse a read-only location, or a file where a folder belongs, before any work
    int_list, float_list       comma lists of the same checked values ("4,12", "0,0.7")
    add_pair_arguments(p)      --target / --draft / --eagle / --device / --dtype;  load_pair(args) loads them

Every type raises argparse.ArgumentTypeError with a message that names the accepted range; the parser turns it into
`specpilot <command>: argument --x: <message>` on one line, exit code 2.
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
from typing import Callable


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Argparse's defaults formatter, minus a second "(default: ...)" where the help text already states it
    ("default:" or "(default"; a help text that merely says "default", as in "the dtype's default", still gets its
    value), and with list defaults written as the comma lists the options take ("0,1", not "(0.0, 1.0)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.required:  # nothing to default to
            return text if "required" in text.lower() else f"{text} (required)"
        if "default:" in text.lower() or "(default" in text.lower():
            return text
        return super()._get_help_string(action)

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, (list, tuple)) and action.default:
            action = copy.copy(action)
            action.default = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in action.default)
        return super()._expand_help(action)


GLOBAL_OPTIONS = ("--threads", "--debug")  # `specpilot`'s own options (cli.build_parser), given before the command


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (`PROG: MESSAGE`, exit 2) and whose help shows every
    option's default. Sub-parsers made with add_subparsers() are Parsers too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        hint = ""
        if message.startswith("unrecognized arguments"):  # options of `specpilot` itself go before the command
            given = {word.split("=", 1)[0] for word in message.split()}
            misplaced = [o for o in GLOBAL_OPTIONS if o in given]
            if misplaced:
                hint = (f"; {' and '.join(misplaced)} {'is an option' if len(misplaced) == 1 else 'are options'} of "
                        f"`specpilot` itself: put {'it' if len(misplaced) == 1 else 'them'} before the command, "
                        "e.g. `specpilot --threads 1 generate ...`")
        self.exit(2, f"{self.prog}: {' '.join(message.split())}{hint} (see `{self.prog} --help`)\n")

    def _parse_optional(self, arg_string: str):
        # "-1,0" or "-0.5,1" is a value (a list with a negative number), not an unknown option: the option's type
        # then names the real problem ("expected numbers >= 0, got '-1'") instead of "expected one argument"
        if re.match(r"^-\d", arg_string) and not any(o.startswith(arg_string[:2]) for o in self._option_string_actions):
            return None
        return super()._parse_optional(arg_string)


# -- numbers ------------------------------------------------------------------------------------------------------

def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"int_at_least_{minimum}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)

def given_options(args: argparse.Namespace) -> set[str]:
    """The options the user typed (`--x` of `--x V` and `--x=V`), from the exact command `specpilot.cli.main`
    keeps on args: what tells a value given from a default equal to it (empty when called as a library)."""
    return {a.split("=", 1)[0] for a in getattr(args, "_argv", None) or [] if a.startswith("--")}


def options_config(args: argparse.Namespace, command: str, *, skip: tuple[str, ...] = ()) -> dict:
    """A command's wandb config: {"command": command} and every option's value (paths as strings, tuples as lists;
    private and callable entries and `skip` left out), as SB3's wandb integration records the hyper-parameters."""
    config: dict = {"command": command}
    for key, value in sorted(vars(args).items()):
        if key.startswith("_") or key in ("command", *skip) or callable(value):
            continue
        if hasattr(value, "__fspath__"):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        if value is None or isinstance(value, (str, int, float, bool, list)):
            config[key] = value
    return config


MAX_THREADS = 1024  # torch's thread pool crashes the process (SIGSEGV) when asked for ~100k threads


def thread_count(text: str) -> int:
    """--threads: 1..MAX_THREADS (the cores are those of the machine that runs the work: on Ray, the workers')."""
    value = positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_THREADS} threads, got {text!r} (this process may "
                                         f"use {usable_cores()} CPU cores; more threads than cores only wait for each "
                                         "other)")
    return value


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity (`taskset`, a scheduler's cpuset) and a cgroup v2 CPU
    quota (a container's --cpus) bound it, where os.cpu_count() counts every core of the machine."""
    import math
    import os
    from pathlib import Path

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    try:  # this process's own cgroup (v2: the "0::" line), and every cgroup above it, may cap its CPU time
        own = next(line[3:] for line in Path("/proc/self/cgroup").read_text(encoding="ascii").splitlines()
                   if line.startswith("0::"))
        group = Path("/sys/fs/cgroup") / own.strip().lstrip("/")
    except (OSError, StopIteration):  # not Linux, or cgroup v1 only
        group = None
    root = Path("/sys/fs/cgroup")
    for folder in ([group, *group.parents] if group is not None else []):
        if folder != root and root not in folder.parents:
            break
        try:
            quota, period = (folder / "cpu.max").read_text(encoding="ascii").split()[:2]
            if quota != "max":
                cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
        except (OSError, ValueError):  # no limit file at this level
            continue
    return max(1, cores)


def float_in(low: float | None = None, high: float | None = None, *, open_low: bool = False,
             describe: str | None = None) -> Callable[[str], float]:
    """A finite float in [low, high] ((low, high] with open_low)."""
    from specpilot.drafting.checks import check_float, float_range

    accepted = describe or float_range(low, high, open_low=open_low)

    def parse(text: str) -> float:
        try:
            return check_float("value", float(text), minimum=low, maximum=high, open_low=open_low)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}") from None

    parse.__name__ = "number"
    return parse


finite_float = float_in()
positive_float = float_in(0.0, open_low=True)
non_negative_float = float_in(0.0)
probability = float_in(0.0, 1.0, open_low=True, describe="a probability in (0, 1]")


def _comma_list(item: Callable[[str], object], what: str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}")
        return [item(p) for p in parts]

    parse.__name__ = "list"
    return parse


def int_list(minimum: int = 0) -> Callable[[str], list[int]]:
    """"4,12" -> [4, 12] (each >= minimum); "2-5" ranges expand to 2,3,4,5."""
    one = int_at_least(minimum)

    def item(part: str) -> list[int]:
        if "-" in part and not part.startswith("-"):
            lo, hi = part.split("-", 1)
            values = list(range(one(lo), one(hi) + 1))
            if not values:
                raise argparse.ArgumentTypeError(f"empty range {part!r}: write LOW-HIGH with LOW <= HIGH")
            return values
        return [one(part)]

    inner = _comma_list(item, f"integers >= {minimum}")

    def parse(text: str) -> list[int]:
        return [v for chunk in inner(text) for v in chunk]

    parse.__name__ = "int_list"
    return parse


def _refuse_repeats(values: list, text: str) -> list:
    """`values` parsed from `text`, or ArgumentTypeError naming those given more than once."""
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{', '.join(f'{v:g}' for v in repeated)} given more than once in {text!r}")
    return list(values)


def batch_sizes(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]: batch sizes >= 1, ascending; one given twice is refused, as --temperatures refuses a
    repeated value (each size is one measurement and one table row)."""
    return sorted(_refuse_repeats(int_list(1)(text), text))


def float_list(item: Callable[[str], float] = non_negative_float) -> Callable[[str], tuple[float, ...]]:
    """"0,0.7" -> (0.0, 0.7); a value given twice is refused (it would only run the same setting twice)."""
    inner = _comma_list(item, "numbers")

    def parse(text: str) -> tuple[float, ...]:
        return tuple(_refuse_repeats(inner(text), text))

    parse.__name__ = "float_list"
    return parse


def name_list(choices, what: str) -> Callable[[str], list[str]]:
    """"a,b" -> ["a", "b"], each one of `choices` (`what`: the plural noun the error names, e.g. "method")."""
    def parse(text: str) -> list[str]:
        names = [m.strip() for m in text.split(",") if m.strip()]
        unknown = [m for m in names if m not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {', '.join(unknown) or repr(text)}; choose from "
                                             f"{', '.join(choices)}")
        return names

    parse.__name__ = f"{what}_list"
    return parse


# -- text, devices, paths -------------------------------------------------------------------------------------------

def _valid_utf8(text: str) -> str:
    """`text` when it is valid UTF-8 (invalid bytes in argv arrive as lone surrogates). Under a locale that is not
    UTF-8 (LC_ALL=C with PYTHONUTF8=0) Python decodes argv as ASCII, so UTF-8 text arrives as surrogates too: its
    bytes are decoded again as UTF-8 and the text returned."""
    import os

    from specpilot.drafting.pair import check_text

    try:
        check_text("the text", text)
    except ValueError as err:
        try:
            return os.fsencode(text).decode("utf-8")
        except UnicodeDecodeError:
            raise argparse.ArgumentTypeError(str(err).replace("the text ", "", 1)) from None
    return text


def utf8_text(text: str) -> str:
    """Text that is valid UTF-8 and not empty. Whitespace alone is text like any other (an indentation a code model
    continues, as vLLM and transformers take it)."""
    if not (text := _valid_utf8(text)):
        raise argparse.ArgumentTypeError("expected non-empty text, got an empty string")
    return text


def stop_text(text: str) -> str:
    """A stop string: valid UTF-8 and not empty; whitespace is a stop string like any other ("\n\n")."""
    if not (text := _valid_utf8(text)):
        raise argparse.ArgumentTypeError("expected a non-empty stop string, got an empty string")
    return text


def add_stop_arguments(parser: argparse.ArgumentParser, *, what: str = "the generation") -> None:
    """--stop TEXT, --stop-token-id ID (both repeatable) and --ignore-eos: where `what` ends, as generate() takes
    them (`specpilot.drafting.stopping`); one declaration for `generate` and `eval`."""
    parser.add_argument("--stop", action="append", type=stop_text, default=None, metavar="TEXT",
                        help=f"end {what} with the token that completes TEXT in the generated text (repeat for "
                             "several; whitespace counts: --stop $'\\n\\n' in bash; the output keeps it, as "
                             "transformers' stop_strings) (default: none)")
    parser.add_argument("--stop-token-id", action="append", type=non_negative_int, default=None, metavar="ID",
                        help=f"end {what} at token ID as at the model's end token (repeat for several; vLLM's "
                             "stop_token_ids) (default: none)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="decode past the model's end token, to --max-new-tokens (vLLM's ignore_eos, for "
                             "benchmarks)")


def device(text: str) -> str:
    from specpilot.drafting.pair import check_device

    try:
        return check_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def dtype(text: str) -> str:
    """A dtype name: bfloat16, float16, float32 (or bf16, fp16, fp32) or auto (`pair.resolve_dtype`)."""
    from specpilot.drafting.pair import AUTO, DTYPE_CHOICES, DTYPES

    if text.strip().lower() not in DTYPES and text.strip().lower() != AUTO:
        raise argparse.ArgumentTypeError(f"dtype {text!r} is not supported; choose one of "
                                         f"{', '.join(DTYPE_CHOICES)}")
    return text.strip().lower()


MAX_SEED = 2 ** 63 - 1  # torch.Generator.manual_seed takes a signed 64-bit integer


def seed(text: str) -> int:
    """A random seed: an integer in 0..2^63 - 1 (numpy's generators refuse negative seeds, torch's larger ones)."""
    value = non_negative_int(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer in 0..{MAX_SEED} (2^63 - 1), got {text!r}")
    return value


def stage_name(text: str) -> str:
    """A folder name (a stage under the run): no path separators, not '.' or '..'."""
    if not text.strip() or "/" in text or "\\" in text or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"expected a folder name without '/', got {text!r}")
    return text


def _output(kind: str) -> Callable[[str], str]:
    from specpilot.drafting.errors import OutputPathError
    from specpilot.drafting.files import check_writable

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError("expected a path, got an empty string")
        try:
            path = check_writable(text, kind=kind)
        except OutputPathError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return str(path)  # "~/runs" quoted past the shell: the folder checked is the folder written

    parse.__name__ = f"output_{kind}"
    return parse


def run_folder(text: str) -> str:
    """A trained run's folder (it holds policies.json): a file or a missing path is named as such here, instead of
    as "RUN/policies.json/policies.json: policies index not found" later."""
    from pathlib import Path

    if not text.strip():
        raise argparse.ArgumentTypeError("expected a run folder, got an empty string")
    path = Path(text).expanduser()
    try:
        is_file, exists = path.is_file(), path.exists()
    except OSError as err:  # a name too long, a folder this user may not enter
        raise argparse.ArgumentTypeError(f"{text}: {err.strerror or err}") from None
    if is_file:
        hint = f" (give its folder, {path.parent})" if path.name == "policies.json" else ""
        raise argparse.ArgumentTypeError(f"{text} is a file, not a run folder{hint}")
    if not exists:
        raise argparse.ArgumentTypeError(f"{text}: no such run folder (train one with `specpilot train all --run "
                                         f"{text}` or `specpilot demo --out {text}`)")
    return str(path)


output_dir = _output("dir")    # a folder that can be created/written (checked before any work starts)
output_file = _output("file")  # a file that can be written (its folder exists or can be created)


# -- the model pair -------------------------------------------------------------------------------------------------

def model_source(text: str) -> str:
    """A model folder or hub id: an empty one is refused (as a path it would silently mean the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a model folder or hub id, got an empty string")
    return text


def add_pair_arguments(parser, *, dtype_option: bool = True, what: str = "",
                       target_default: str = "the embedded target") -> None:
    """--target / --draft / --eagle / --device (/ --dtype) as every command that loads a pair takes them."""
    suffix = f" {what}" if what else ""
    parser.add_argument("--target", type=model_source, default=None,
                        help=f"target model{suffix}: a local folder or hub id (default: {target_default})")
    parser.add_argument("--draft", type=model_source, default=None,
                        help="draft model: a causal LM sharing the target's vocabulary (folder or hub id), or "
                             "'embedded' (default: the embedded pair's drafter)")
    parser.add_argument("--eagle", type=model_source, default=None, metavar="PATH",
                        help="EAGLE-3 head folder (released layout) drafting from the target's hidden states, or "
                             "'embedded' (default: none; give --draft or --eagle, not both)")
    parser.add_argument("--device", type=device, default=None,
                        help="cpu, cuda, cuda:N or mps (default: cuda when available, else cpu)")
    if dtype_option:
        parser.add_argument("--dtype", type=dtype, default=None,
                            help="bfloat16, float16, float32 or auto (bf16 on CUDA; on a CPU with AMX/AVX512-BF16 "
                                 "where it measures clearly faster, else fp32) (default: float32 on CPU, bfloat16 on "
                                 "CUDA)")


def pair_given(args: argparse.Namespace) -> bool:
    return any(getattr(args, k, None) is not None for k in ("target", "draft", "eagle"))


def check_pair_arguments(args: argparse.Namespace) -> None:
    """--draft and --eagle exclude each other, and --target needs one of them; a --target that does not exist is
    said first (adding a drafter would not help)."""
    draft, eagle = getattr(args, "draft", None), getattr(args, "eagle", None)
    if draft is not None and eagle is not None:
        raise ValueError("give --draft (a separate draft LM) or --eagle (an EAGLE-3 head), not both")
    target = getattr(args, "target", None)
    if target is not None and target != "embedded":
        from specpilot.drafting.pair import checked_source

        checked_source(target, "target")
    if target is not None and draft is None and eagle is None:
        raise ValueError("--target needs its drafter: add --draft PATH (a draft LM) or --eagle PATH (an EAGLE-3 "
                         "head)")


def load_pair(args: argparse.Namespace):
    """The ModelPair the pair options name (the embedded pair when none is given)."""
    from specpilot.drafting.pair import ModelPair

    check_pair_arguments(args)
    draft, eagle = getattr(args, "draft", None), getattr(args, "eagle", None)
    extra = {"eagle": eagle} if eagle is not None else {}
    return ModelPair.from_pretrained(getattr(args, "target", None), draft, device=getattr(args, "device", None),
                                     dtype=getattr(args, "dtype", None),
                                     dtype_source=getattr(args, "dtype_source", None), **extra)


def dtype_label(dtype, reason: str | None) -> str:
    """"float32: asked for", "auto: bfloat16, this CPU has avx512_bf16; ...": the pair's dtype with why it was
    chosen (`ModelPair.dtype_reason`, which names the dtype itself), or the dtype alone when no reason is known (a
    pair built in code, an older report)."""
    return reason or str(dtype).removeprefix("torch.")


def say(message: str) -> None:
    """A note on stderr. Notes inform, so a stderr that cannot take them (closed, /dev/full) never stops the work."""
    if sys.stderr is None:  # closed at start: print(file=None) would write the note to stdout
        return
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
