"""The `specpilot` command line. Every sub-command lives in a module that exposes `add_arguments(parser)` and
`run(args) -> int` and calls library functions; this file only wires them together and owns the one error path:

- bad input (see `specpilot.drafting.errors.is_user_error`: the package's own error classes, ValueError /
  TypeError raised by its validation, OSError about paths) prints ONE line, `specpilot <command>: <message>`, on
  stderr and exits with code 2; bad arguments are refused by the parser the same way before anything runs;
- Ctrl-C prints one line and exits with 130 (`specpilot train` adds where its checkpoint is and the exact
  `--resume` command); SIGTERM (`kill`, `timeout`, a scheduler preempting the job) stops a command the same way
  and exits with 143; a second SIGTERM ends it at once;
- text that stdout / stderr cannot encode (an ASCII or Latin-1 locale) is printed escaped, never lost to a
  UnicodeEncodeError after the work;
- anything else is a bug and keeps its traceback; `specpilot --debug COMMAND ...` shows tracebacks for bad input
  too.

Only the command being run has its options added (its module, or the light module ARGUMENTS names, is imported
then), and its module's `run` is imported when it runs: `specpilot --help` and argument errors never import torch
or transformers. `cli_reference()` builds every command's options and renders the README's CLI table from them
(tests/test_cli_docs.py keeps them equal).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from specpilot.drafting.cliargs import Parser, thread_count
from specpilot.train.scale.cluster_cli import CLUSTER_COMMANDS, add_cluster_arguments, with_cluster

# (command, module, one-line help)
COMMANDS: list[tuple[str, str, str]] = [
    ("demo", "specpilot.demo", "run the whole mission end to end on the embedded pair (or your own)"),
    ("generate", "specpilot.drafting.cli", "generate text with the speculative decoder"),
    ("models", "specpilot.train.models.build_pair", "build the embedded default model pair (`specpilot models build`)"),
    ("prompts", "specpilot.eval.prompts_cli", "write a code-completion suite cut out of your own Python source"),
    ("record", "specpilot.envs.cli", "record replay traces and a latency profile for a task"),
    ("grid", "specpilot.train.grid.search", "grid-search the best static (depth, size) configuration"),
    ("train", "specpilot.train.cli", "train PPO depth/size policies (stage 1) or co-adapt them (stage 2)"),
    ("eval", "specpilot.eval.cli", "evaluate methods on held-out task suites and write a report"),
    ("export", "specpilot.train.export.writer", "export a trained run to decoder.json + safetensors + engine configs"),
    ("agreement", "specpilot.eval.agreement", "greedy speculative vs AR output in half precision: agreement report"),
]
# commands whose module imports torch at the top keep their options in a light module ("module:function")
ARGUMENTS: dict[str, str] = {
    "grid": "specpilot.train.cli_args:grid_arguments",
    "export": "specpilot.train.cli_args:export_arguments",
}
INTERRUPTED = 130  # the shell's code for a process ended by SIGINT
TERMINATED = 143  # the shell's code for a process ended by SIGTERM
_terminated: list[bool] = []  # set when SIGTERM stopped the command (its exit code is TERMINATED)
BROKEN_PIPE = 141  # the shell's code for a process ended by SIGPIPE (its reader closed the pipe)


def _command_in(argv: list[str]) -> str | None:
    """The command named in argv (the first word after the global options), if any."""
    i = 0
    while i < len(argv):
        if argv[i] == "--threads":
            i += 2
        elif argv[i].startswith("-"):
            i += 1
        else:
            return argv[i]
    return None


def _add_arguments(name: str, module_name: str, parser: argparse.ArgumentParser) -> None:
    target = ARGUMENTS.get(name)
    if target is not None:
        module_path, function = target.split(":")
        getattr(importlib.import_module(module_path), function)(parser)
    else:
        importlib.import_module(module_name).add_arguments(parser)


def _lazy_run(module_name: str):
    def run(args) -> int:
        return importlib.import_module(module_name).run(args)

    return run


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with `argv`, only the command it names gets its options (None: every command, for the docs)."""
    parser = Parser(prog="specpilot",
                    description="Learn how much to speculate: exact tree speculative decoding steered by PPO "
                                "policies.")
    # dest differs from any sub-command option, so a sub-command's defaults can never overwrite it
    parser.add_argument("--threads", dest="global_threads", type=thread_count, default=None, metavar="N",
                        help="torch CPU threads (default: torch's choice). Batch-1 decoding of small models often "
                             "runs as fast on 1 thread, and extra threads stall when other work shares the cores")
    parser.add_argument("--debug", action="store_true",
                        help="print the full traceback of every error (default: one line for bad input)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = None if argv is None else _command_in(argv)
    for name, module_name, help_text in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_label=f"specpilot {name}")
        if argv is not None and name != wanted:
            continue  # not run: its options are not needed (and its module is not imported)
        _add_arguments(name, module_name, p)  # a broken import is a bug: it raises with its traceback
        if name in CLUSTER_COMMANDS:  # --ray ADDRESS --workers N; Ray is imported only when --ray is given
            add_cluster_arguments(p)
        p.set_defaults(_handler=with_cluster(name, _lazy_run(module_name)))
    return parser


# what an interrupted command kept, for the commands that do not say it themselves (record and train do)
INTERRUPT_HINTS = {
    "demo": "finished stages are kept: run the same command again to resume (an interrupted recording or training "
            "resumes where it stopped)",
    "eval": "the report is written at the end, so nothing was kept: run the command again",
    "grid": "the result (--out) is written at the end, so nothing was kept: run the command again",
    "agreement": "agreement.json is written at the end, so nothing was kept: run the command again",
}


def _terminate_as_interrupt():
    """SIGTERM stops the command as Ctrl-C does (KeyboardInterrupt): training saves its checkpoint, the demo keeps
    its finished stages, temporary files are removed, Ray is shut down. Once: a second SIGTERM ends the process at
    once. A process that ignores SIGTERM, or has its own handler, keeps it. Returns what restores the handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _terminated.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _printable_stdio() -> None:
    """stdout / stderr escape what their encoding cannot write (a generated Greek letter under LANG=C with
    PYTHONUTF8=0, or PYTHONIOENCODING=ascii) instead of failing with UnicodeEncodeError after the work."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a closed or detached stream
                pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _printable_stdio()
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except OSError as err:  # a path option's check met the machine (a name too long, a folder it may not enter)
        from specpilot.drafting.errors import one_line

        print(f"specpilot: {one_line(err)}", file=sys.stderr)
        return 2
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    args._argv = argv  # the exact command, for messages such as train's `--resume` hint
    label = getattr(args, "_label", f"specpilot {args.command}")
    if not args.debug:
        _quiet_third_party()
        _warnings_as_notes(label)
    _terminated.clear()
    restore_sigterm = _terminate_as_interrupt()
    try:
        if args.global_threads is not None:
            import torch

            torch.set_num_threads(args.global_threads)
        code = int(args._handler(args) or 0)
        if not _stdout_flushed(label):
            return 2
        return TERMINATED if _terminated and code == INTERRUPTED else code  # a command that said it itself
    except KeyboardInterrupt:
        if args.debug:
            raise
        hint = INTERRUPT_HINTS.get(args.command)
        how = " (SIGTERM)" if _terminated else ""
        print(f"{label}: interrupted{how}" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return TERMINATED if _terminated else INTERRUPTED
    except BrokenPipeError:  # the reader of stdout left (`specpilot generate ... | head`): stop quietly, as a shell
        # tool killed by SIGPIPE does; stdout goes to devnull so the interpreter's last flush cannot fail again
        _drop_stdout()
        return BROKEN_PIPE
    except Exception as err:  # noqa: BLE001 - sorted into bad input (one line) and bugs (re-raised) right here
        from specpilot.drafting.errors import is_user_error, one_line

        if args.debug or not is_user_error(err):
            raise
        print(f"{label}: {one_line(err)}", file=sys.stderr)
        return 2
    finally:
        restore_sigterm()


def _stdout_flushed(label: str) -> bool:
    """What the command left buffered on stdout is written now, so that a stdout that cannot take it (a full disk
    behind `> out.txt`, /dev/full) is one line naming stdout; at exit it would be Python's "Exception ignored" and
    exit 120. A reader that left (BrokenPipeError) is the caller's quiet case."""
    from specpilot.drafting.errors import one_line

    if sys.stdout is None or getattr(sys.stdout, "closed", False):  # (a stream some library put in its place)
        return True
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as err:
        print(f"{label}: cannot write to stdout: {one_line(err)}; what was printed there is lost", file=sys.stderr)
        _drop_stdout()
        return False
    return True


def _drop_stdout() -> None:
    """Point stdout at devnull, so that the interpreter's last flush of what it could not write cannot fail again."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no descriptor (a test's captured stdout): nothing flushes later
        pass


def _warnings_as_notes(label: str) -> None:
    """A UserWarning (the library's way of saying something the caller should know, e.g. a suite field it does not
    read) is printed as one `LABEL: note: ...` line, as the commands' own notes are, not as Python's two-line warning
    with a source line; other categories keep Python's format. --debug keeps Python's format for all."""
    import warnings

    from specpilot.drafting.errors import one_line

    python_format = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if category is UserWarning:
            print(f"{label}: note: {one_line(message)}", file=sys.stderr if file is None else file)
        else:
            python_format(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def _quiet_third_party() -> None:
    """Keep other libraries' noise off stderr (it carries our messages: an error is one line); --debug keeps it:
    transformers' / the hub's progress bars (the weight-loading bar), matplotlib's tight-layout warning, and Ray's
    token-authentication notice on starting a local cluster, and transformers' warnings. Set before those libraries are imported."""
    import logging
    import os
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers reads it when imported
    # transformers' warnings (e.g. generate()'s generation_config deprecation notice, printed per call by the
    # hf_generate baseline) are for its API users, not ours; errors still show
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r".*[Tt]ight[ _]layout", category=UserWarning)
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


# -- the README's CLI table -----------------------------------------------------------------------------------------

def _commands(parser: argparse.ArgumentParser, prefix: str = "specpilot"):
    """(command line prefix, its parser, its help) for every leaf command (train's stages included)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
                if nested:
                    yield from _commands(sub, f"{prefix} {name}")
                else:
                    yield f"{prefix} {name}", sub, helps.get(name, "")


def _usage(command: str, parser: argparse.ArgumentParser) -> str:
    parts = [command]
    for a in parser._actions:
        if not a.option_strings and not isinstance(a, argparse._SubParsersAction):
            parts.append("|".join(a.choices) if a.choices else (a.metavar or a.dest).upper())
        elif a.required:
            parts.append(f"{a.option_strings[-1]} {a.metavar or a.dest.upper()}")
    return " ".join(parts)


def cli_reference() -> str:
    """The README's CLI table: one row per command with its required arguments and every option it takes."""
    rows = ["| command | does | options |", "|---|---|---|"]
    top = build_parser()
    rows.append("| `specpilot [--threads N] [--debug] COMMAND ...` | global options, before the command | "
                "`--threads`, `--debug` |")
    for command, parser, help_text in _commands(top):
        options = [a.option_strings[-1] for a in parser._actions
                   if a.option_strings and not a.required and a.dest != "help"]
        rows.append(f"| `{_usage(command, parser)}` | {help_text} | {', '.join(f'`{o}`' for o in options)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
