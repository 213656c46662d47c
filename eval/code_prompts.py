"""Code-completion prompts cut out of a user's own Python source: `specpilot prompts --from DIR --out FILE.jsonl`.

A suite file for `specpilot record --suite` / `specpilot eval --suite` whose text is what a user of a code model
writes: every public function with a docstring in the given files becomes one prompt in one of the bundled code
suites' forms (`eval/suites.py`):

    signature   decorators + `def` line(s) + docstring
    body        that, plus the first statement(s) after the docstring (at most 3 lines)

Prompts end at the cursor (the end of a source line, never after a bare newline, like the bundled suites) and are
dedented, so methods read like functions. `exclude` names suites (bundled names or paths) that the new prompts must
not overlap: a prompt for a function they define (`def` name) or sharing any line of 30+ characters with them is
dropped (the rule the bundled train / validation suites keep with the held-out ones), so held-out stays held out.

Files are decoded as Python decodes them (a UTF-8 BOM or a `# coding:` declaration, else UTF-8); files that cannot
be read, decoded or parsed give no prompts, and a refusal for finding none counts them.
The draw is deterministic for a seed and spread over the source: files are visited in a seeded order, each file
gives at most `per_file` prompts, each folder directly under a given path at most `per_folder`.
"""
from __future__ import annotations

import ast
import io
import json
import random
import re
import tokenize
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

from specpilot.eval.suites import TABLE_SUFFIXES, Prompt, SuiteError, load_suite, split_lines

FORMS = ("signature", "body")
SHARED_LINE_CHARS = 30  # a line this long shared with an excluded suite counts as overlap
DEFINED_NAME = re.compile(r"^\s*(?:async\s+)?def\s+(\w+)", re.M)
SKIPPED_DIRS = {"__pycache__", ".git", ".venv", "venv", "node_modules", "site-packages"}


def python_files(paths: Sequence[str | Path]) -> list[Path]:
    """Every .py file under `paths` (files or folders), sorted; folders like .git / __pycache__ / venvs skipped
    (unless given explicitly). Raises SuiteError when a path does not exist or holds no Python file."""
    found: list[Path] = []
    for root in map(Path, paths):
        if not root.exists():
            raise SuiteError(f"{root}: no such file or folder to take code prompts from")
        if root.is_file():
            if root.suffix != ".py":  # read as Python it would give nothing, and the error would blame docstrings
                raise SuiteError(f"{root} is not a Python file (.py): give Python source files or folders")
            found.append(root)
            continue
        found += [f for f in root.rglob("*.py")
                  if f.is_file() and not SKIPPED_DIRS.intersection(f.relative_to(root).parts[:-1])]
    if not found:
        raise SuiteError(f"no .py files under {', '.join(map(str, paths))}: give folders of Python source")
    return sorted(set(found))


def read_source(path: Path) -> str | None:
    """A Python file's text decoded as Python decodes it (a UTF-8 BOM, a `# coding:` declaration, else UTF-8), or
    None when it cannot be read or decoded."""
    try:
        raw = path.read_bytes()
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding)
    except (OSError, SyntaxError, LookupError, UnicodeDecodeError):  # SyntaxError: a bad coding declaration
        return None


def _long_lines(text: str) -> set[str]:
    """The stripped lines of `text` long enough to count as overlap when shared (>= SHARED_LINE_CHARS)."""
    return {s for s in (line.strip() for line in split_lines(text)) if len(s) >= SHARED_LINE_CHARS}


def _overlap_keys(suites: Iterable[str | Path]) -> tuple[set[str], set[str]]:
    """(names the prompts define with `def`, their `_long_lines`) over the excluded suites' prompts."""
    names, lines = set(), set()
    for suite in suites:
        for p in load_suite(suite):
            names |= set(DEFINED_NAME.findall(p.prompt))
            lines |= _long_lines(p.prompt)
    return names, lines


def _prompt_text(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef, form: str) -> str:
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    doc_end = node.body[0].end_lineno
    end = doc_end if form == "signature" else min(node.body[1].end_lineno, doc_end + 3)
    block = lines[start:end]
    # the def's own indentation comes off every line that has it (a method reads like a function); textwrap.dedent
    # would remove nothing when a multi-line string inside holds a line at column 0
    indent = block[0][: len(block[0]) - len(block[0].lstrip())]
    return "\n".join("" if not line.strip() else line[len(indent):] if line.startswith(indent) else line
                     for line in block).rstrip()


def _parse(source: str) -> ast.Module | None:
    """The module's syntax tree, or None when it does not parse."""
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # the last two: nesting the parser cannot hold
        return None


def _text_name(name: str) -> str:
    """A file name as text an id can hold: Python gives undecodable bytes of a name as lone surrogates, which
    load_suite refuses (no tokenizer encodes them); they become U+FFFD."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _line_prefixes(text: str) -> set[str]:
    """The text cut at each of its line ends, itself excluded: the shorter prompts it extends."""
    lines = text.split("\n")
    return {"\n".join(lines[:n]).rstrip() for n in range(1, len(lines))}


def _has_body_cut(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A `body` prompt holds the first statement after the docstring: it must begin within the 3 lines the form
    takes (blank or comment lines in between would leave the prompt without it)."""
    return len(node.body) >= 2 and node.body[1].lineno <= node.body[0].end_lineno + 3


def prompts_from_source(source: str, *, origin: str, rng: random.Random, forms: Sequence[str] = FORMS,
                        min_doc: int = 20, max_doc: int = 500, min_chars: int = 60,
                        max_chars: int = 900) -> list[tuple[str, str, str]]:
    """(id, form, prompt) for each public function with a docstring in one file's `source` (the form drawn
    from `forms` by `rng`); a file that does not parse gives none. A `body` prompt needs a statement within 3
    lines of the docstring; functions without one give a `signature` prompt."""
    tree = _parse(source)
    return [] if tree is None else _prompts_in(tree, source, origin=origin, rng=rng, forms=forms, min_doc=min_doc,
                                               max_doc=max_doc, min_chars=min_chars, max_chars=max_chars)


def _prompts_in(tree: ast.Module, source: str, *, origin: str, rng: random.Random, forms: Sequence[str] = FORMS,
                min_doc: int = 20, max_doc: int = 500, min_chars: int = 60,
                max_chars: int = 900) -> list[tuple[str, str, str]]:
    """`prompts_from_source` for a source already parsed into `tree`."""
    lines = split_lines(source)  # the lines ast numbers: a form feed or U+2028 inside a line does not end it
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or not min_doc <= len(doc) <= max_doc:
            continue
        form = rng.choice(list(forms))
        if form == "body" and not _has_body_cut(node):
            form = "signature"
        if form not in forms:
            continue
        text = _prompt_text(lines, node, form)
        if not min_chars <= len(text) <= max_chars:
            continue
        out.append((f"{origin}:{node.name}", form, text))
    return out


def extract_code_prompts(paths: Sequence[str | Path], *, limit: int | None = None, seed: int = 0,
                         split: str = "train", exclude: Sequence[str | Path] = (), per_file: int = 3,
                         per_folder: int = 12, forms: Sequence[str] = FORMS, stats: dict | None = None) -> list[Prompt]:
    """Up to `limit` prompts (None: all) from the Python files under `paths`, as `Prompt`s with task "code-<form>",
    language "python" and the given `split` (module docstring: forms, overlap rule, spread). Raises SuiteError when
    nothing usable is found. stats: a dict filled with what was left out ({"files", "unreadable", "unparsable",
    "excluded"}: .py files found, files that could not be read or decoded, files that are not valid Python,
    functions dropped for overlapping `exclude`)."""
    unknown = [f for f in forms if f not in FORMS]
    if unknown or not forms:
        raise SuiteError(f"unknown prompt form(s) {unknown or '(none given)'}: choose from {', '.join(FORMS)}")
    if limit is not None and limit < 1:
        raise SuiteError(f"limit must be a positive number of prompts, got {limit}")
    avoid_names, avoid_lines = _overlap_keys(exclude)
    rng = random.Random(seed)
    roots = [Path(p) for p in paths]
    files = python_files(roots)
    rng.shuffle(files)

    def folder_of(f: Path) -> str:
        for root in roots:
            if root.is_dir() and f.is_relative_to(root):
                rel = f.relative_to(root).parts
                return f"{root}/{rel[0]}" if len(rel) > 1 else str(root)
        return str(f.parent)

    per_folder_count: Counter = Counter()
    seen_text: set[str] = set()
    seen_heads: set[str] = set()  # every taken prompt cut at each of its line ends
    prompts: list[Prompt] = []
    unreadable, unparsable, excluded = 0, 0, 0
    for f in files:
        folder = folder_of(f)
        if per_folder_count[folder] >= per_folder:
            continue
        source = read_source(f)
        if source is None:
            unreadable += 1
            continue
        origin = _text_name(f.stem if f.parent == Path(folder) else f"{Path(folder).name}/{f.stem}")
        taken = 0
        tree = _parse(source)
        if tree is None:
            unparsable += 1
            continue
        for pid, form, text in _prompts_in(tree, source, origin=origin, rng=rng, forms=forms):
            name = pid.rsplit(":", 1)[-1]
            if name in avoid_names or _long_lines(text) & avoid_lines:
                excluded += 1
                continue
            # a copy of a function already taken (an identical or vendored file) repeats it, or, in the other
            # form, extends it or is cut from it: one prompt a prefix of another at a line end
            heads = _line_prefixes(text)
            if text in seen_text or text in seen_heads or heads & seen_text:
                continue
            seen_text.add(text)
            seen_heads |= heads
            prompts.append(Prompt(id=f"{split}-{pid}-{len(prompts)}", task=f"code-{form}", language="python",
                                  split=split, prompt=text))
            taken += 1
            per_folder_count[folder] += 1
            if taken >= per_file or per_folder_count[folder] >= per_folder:
                break
        if limit is not None and len(prompts) >= limit:
            break
    if stats is not None:
        stats.update(files=len(files), unreadable=unreadable, unparsable=unparsable, excluded=excluded)
    if not prompts:
        where = ", ".join(map(str, paths))
        if excluded:
            raise SuiteError(f"all {excluded} usable function(s) under {where} overlap the excluded suites (a `def` "
                             f"name or a line of {SHARED_LINE_CHARS}+ characters in common with "
                             f"{', '.join(map(str, exclude))}): give other source, or fewer suites to exclude")
        skipped = [f"{unreadable} of {len(files)} .py file(s) could not be read or decoded"] if unreadable else []
        if unparsable:
            skipped.append(f"{unparsable} of {len(files)} .py file(s) could not be parsed (a syntax error, NUL bytes, "
                           "or nesting too deep)")
        skipped = f" ({'; '.join(skipped)})" if skipped else ""
        raise SuiteError(f"no function with a docstring of the usable size found under {where}{skipped}")
    return prompts[:limit]


def check_suite_path(out: str | Path) -> Path:
    """A suite is written as JSON lines, which `load_suite` reads back only from a .jsonl (or .json) file: any
    other name would read back as plain text, one raw JSON line per prompt (ValueError)."""
    out = Path(out)
    if out.suffix.lower() not in (".jsonl", ".json"):
        read_as = ("are refused as tables" if out.suffix.lower() in TABLE_SUFFIXES else
                   "are read back as plain text, one prompt per line")
        raise ValueError(f"{out}: a suite is written as JSON lines, so its name must end in .jsonl (suites named "
                         f"{out.suffix or 'without a suffix'} {read_as})")
    return out


def write_suite(prompts: Sequence[Prompt], out: str | Path) -> Path:
    """Write `prompts` as a suite .jsonl (atomically: an interrupted write leaves no half file)."""
    from specpilot.drafting.files import atomic_write_text

    out = check_suite_path(out)
    atomic_write_text(out, "".join(json.dumps(p.to_dict()) + "\n" for p in prompts))
    return out
