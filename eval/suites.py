"""Task suites: the prompts `specpilot eval` (and policy training) run on.

Bundled suites live in `eval/suites/<split>.jsonl`, one JSON object per line with fields
`id`, `task`, `language`, `split`, `prompt`:

- `train` and `validation`: Python code-completion prompts (77 / 21) over varied domains, in the three forms of
  `heldout_code` (its `form` field) and, like it, ending at the cursor; no line of 30+ characters shared with the
  held-out suites. Used for policy training and checkpoint selection.
- `heldout`: never used for training or selection. Code on topics unlike the standard library, and natural-
  language tasks (instruction following, question answering, math word problems, conversation) in English,
  Italian, Spanish and Chinese; the same items translated, so prompt lengths are comparable across languages.
  The held-out suite for general-purpose targets.
- `heldout_code`: never used for training or selection. 66 Python prompts written for this suite (none from the
  standard library, none in `train`/`validation`), 11 in each of six task groups (`task`): numerics, text,
  datastruct, io_parsing, tests (pytest style) and classes, in three forms (an extra `form` field: `signature`
  = signature + docstring, `docstring` = a module or class docstring then the start of the code, `body` = a
  partial function body). The held-out suite for code models such as the embedded pair, whose target only saw
  the CPython standard library (`drafting/default_pair/corpus_manifest.json`): prose prompts make it emit junk.
  Its prompts end at the cursor, never after a bare newline: the embedded tokenizer merges a newline with the
  next line's indentation ("\n   " + " return"), so a prompt ending in a lone "\n" token tells the model the
  next line starts at column 0, and it answers with a new top-level `class`/`def` or a "#\n#\n" loop.

Which held-out suite matches a pair (`default_heldout_suite`, what `specpilot eval` and `specpilot demo` use unless
--suite says otherwise): `heldout_code` for the embedded pair and for targets whose name marks a code model,
`heldout` for any other (general-purpose) target.

Prompts are sent as a user of the model would send them (`with_chat_template`, `--chat-template` on `eval` and
`demo`): with `auto`, natural-language prompts go through the target tokenizer's chat template when it has one
(an instruct model answers a bare question as text to continue, not as a request), while code-completion prompts
(a programming `language`, or a `task` starting with "code") stay raw text ending at the cursor; `on` templates
every prompt, `off` none. The report says how many prompts were templated.

Users add their own suite by path: a `.jsonl` file whose objects have at least a `prompt` field (`id`, `task`,
`language`, `split` are optional; a bare JSON string is a prompt too), a `.json` file holding one array of such
objects or strings (or {"prompts": [...]}), or a plain-text file (`.txt`, or no extension) with one prompt per
line (blank lines skipped; a literal `\\n` inside a line stands for a newline, so multi-line prompts fit on one
line; a prompt that holds a backslash followed by n, as code with "\\\\n" strings does, needs .jsonl or .json).
Any other extension (.yaml, .py, a table) is refused rather than read line by line as text. Fields a user suite
has beyond these are named in a warning (a misspelt one with the field it likely meant) and not read.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

SUITES_DIR = Path(__file__).resolve().parent / "suites"
BUNDLED_SUITES = ("train", "validation", "heldout", "heldout_code")
REQUIRED_BUNDLED_FIELDS = ("id", "task", "language", "split", "prompt")
# a target whose name (hub id or folder, case-insensitive) has a word starting with "code" (CodeLlama,
# Qwen2.5-Coder, granite-3b-code-base, codegen) or names one of these families is a code model ("decoder" is not)
CODE_MODEL_NAME = re.compile(r"(?<![a-z])code|starcoder|santacoder|wizardcoder|magicoder|incoder"
                             r"|(?<![a-z])phi-1(?![._\d])")  # phi-1 (Python only), not phi-1.5 / phi-1_5


CHAT_TEMPLATE_MODES = ("auto", "on", "off")
# a prompt in one of these languages is a completion ending at the cursor: `auto` leaves it raw
CODE_LANGUAGES = frozenset({"python", "c", "cpp", "c++", "csharp", "java", "javascript", "typescript", "go", "rust",
                            "ruby", "php", "shell", "bash", "sql", "kotlin", "swift", "scala", "r", "julia", "code"})


class SuiteError(ValueError):
    """A suite could not be loaded; the message names the file (and line) and says what to fix."""


@dataclass(frozen=True)
class Prompt:
    """One evaluation prompt. `task` and `language` group results; `split` says what the prompt may be used for."""

    id: str
    task: str
    language: str
    split: str
    prompt: str

    def to_dict(self) -> dict:
        return asdict(self)


def _refuse_nul(path: Path, lines: list[str]) -> None:
    """SuiteError naming the first line with a NUL character. Text never holds one; UTF-16 saved without a
    byte-order mark does (every ASCII character decodes as itself plus a NUL), and so do binary files: taken as
    prompts, they would record garbage like "d\\x00e\\x00f\\x00" without a word of warning."""
    for lineno, line in enumerate(lines, start=1):
        if "\x00" in line:
            raise SuiteError(f"{path}:{lineno}: NUL characters in the text: the file looks like UTF-16 without a "
                             "byte-order mark, or binary; save it as UTF-8 (or UTF-16 with a byte-order mark)")


def read_lines(path: Path) -> list[str]:
    """The lines of a text file as editors write it: UTF-8 with or without a byte-order mark, UTF-16 with one;
    LF, CRLF or CR line endings. Anything else is a SuiteError naming the file and the byte, or the line with NUL
    characters (UTF-16 without a byte-order mark, or a binary file)."""
    data = path.read_bytes()
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        encoding = "utf-16"  # the BOM says which byte order
    else:
        encoding = "utf-8-sig"  # strips a UTF-8 BOM when present
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as err:
        if b"\x00" in data:  # UTF-16 without a BOM or binary: say so rather than name one odd byte
            _refuse_nul(path, split_lines(data.decode(encoding, errors="replace")))
        raise SuiteError(f"{path}: not UTF-8 text (byte {err.start}: {data[err.start:err.start + 1]!r}); save it as "
                         "UTF-8 (or UTF-16 with a byte-order mark)") from None
    lines = split_lines(text)
    _refuse_nul(path, lines)
    return lines


LINE_BREAK = re.compile(r"\r\n|\r|\n")


def split_lines(text: str) -> list[str]:
    """`text` cut at LF, CRLF and CR only, as `str.splitlines` minus its other breaks: U+2028, U+0085, a form feed
    and the like are characters inside a line (JSON holds them raw in strings; Python's parser counts only these
    three), so a suite or source line stays whole. A final line break ends the last line, as in splitlines."""
    lines = LINE_BREAK.split(text)
    return lines[:-1] if lines and lines[-1] == "" else lines


def _check_encodable(value, where: str, key: str) -> None:
    """A JSON \\ud800-style escape decodes to a lone surrogate, which no tokenizer can encode: refused here, naming the
    line, not later by the tokenizer with no file named."""
    if not isinstance(value, str):
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise SuiteError(f"{where}: field \"{key}\" holds a lone surrogate ({value[err.start]!r} at character "
                         f"{err.start}): a \\uD800-\\uDFFF escape must be half of a surrogate pair") from None


def _loads(text: str, where: str, form: str):
    """json.loads with every failure a SuiteError naming `where` and showing the expected `form`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        at = "" if err.msg.endswith(" at") else " at"  # json's "Unterminated string starting at"
        raise SuiteError(f"{where}: invalid JSON ({err.msg}{at} column {err.colno}); {form}") from err
    except (ValueError, RecursionError) as err:  # json's own limits: an integer of 4300+ digits, deep nesting
        raise SuiteError(f"{where}: JSON this loader cannot read ({type(err).__name__}: "
                         f"{str(err).split(';')[0] if str(err) else 'nested too deeply'}); {form}") from None


JSONL_FORM = "each line must be one JSON object like {\"id\": \"q1\", \"prompt\": \"...\"}"


SUITE_FIELDS = ("prompt", "id", "task", "language", "split")


def _prompt_from_json(obj, where: str, default_id: str, stem: str, *, strict: bool,
                      unread: set[str] | None = None) -> Prompt:
    """One suite entry: an object with a "prompt" field (optional id, task, language, split), or, in a user suite,
    a bare string (the prompt itself). unread: collects the entry's other field names."""
    if isinstance(obj, str) and not strict:
        obj = {"prompt": obj}
    if not isinstance(obj, dict):
        raise SuiteError(f"{where}: expected a JSON object with a \"prompt\" field, got {type(obj).__name__}")
    if unread is not None:
        unread.update(k for k in obj if k not in SUITE_FIELDS)
    required = REQUIRED_BUNDLED_FIELDS if strict else ("prompt",)
    missing = [k for k in required if k not in obj]
    if missing:
        raise SuiteError(f"{where}: missing field(s) {', '.join(missing)}; "
                         f"required: {', '.join(required)}")
    text = obj["prompt"]
    if not isinstance(text, str):
        raise SuiteError(f"{where}: \"prompt\" must be a string, got {type(text).__name__} {json.dumps(text)[:40]}")
    if not text.strip():
        raise SuiteError(f"{where}: empty prompt (\"prompt\" must be a non-empty string)")
    for key in ("id", "task", "language", "split"):
        if key in obj and not isinstance(obj[key], (str, int)):
            raise SuiteError(f"{where}: field \"{key}\" must be a string")
    for key in ("prompt", "id", "task", "language", "split"):
        _check_encodable(obj.get(key), where, key)
    return Prompt(id=str(obj.get("id", default_id)), task=str(obj.get("task", stem)),
                  language=str(obj.get("language", "unknown")), split=str(obj.get("split", "custom")), prompt=text)


def _parse_jsonl(path: Path, *, strict: bool, lines: list[str] | None = None) -> list[Prompt]:
    """strict=True (bundled suites) demands every field; user suites need only `prompt`. lines: the file's, when
    already read."""
    prompts: list[Prompt] = []
    unread: set[str] = set()
    for lineno, line in enumerate(read_lines(path) if lines is None else lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        prompts.append(_prompt_from_json(_loads(line, where, JSONL_FORM), where, f"{path.stem}-{lineno}",
                                         path.stem, strict=strict, unread=None if strict else unread))
    _note_unread(path, unread)
    return prompts


def _note_unread(path: Path, unread: set[str]) -> None:
    """A user suite's fields other than SUITE_FIELDS are kept out of decoding (HumanEval's `test` and
    `canonical_solution` rightly so): said once, with the field a misspelt name most likely meant."""
    if not unread:
        return
    import difflib
    import warnings

    meant = {k: difflib.get_close_matches(k.lower(), SUITE_FIELDS, n=1, cutoff=0.75) for k in sorted(unread)}
    typos = [f"{k!r} (did you mean {m[0]!r}?)" for k, m in meant.items() if m]
    warnings.warn(f"{path}: field(s) {', '.join(sorted(unread))} are not read (a suite reads "
                  f"{', '.join(SUITE_FIELDS)})" + (f"; {', '.join(typos)}" if typos else ""), UserWarning,
                  stacklevel=4)


def _parse_json(path: Path) -> list[Prompt]:
    """A .json user suite: one JSON array of prompt objects (or of prompt strings), the form most prompt sets are
    shared in, or one object ({"prompt": ...}, or {"prompts": [...]}); a .json file holding JSON lines is read as
    .jsonl."""
    lines = read_lines(path)
    text = "\n".join(lines)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # JSON lines under a .json name (its errors are named line by line)
        if text.lstrip()[:1] == "[":  # an array that does not parse: say so as one document
            _loads(text, str(path), "a .json suite is one array like [{\"id\": \"q1\", \"prompt\": \"...\"}, ...] "
                   "(or write JSON lines to a .jsonl file)")
        return _parse_jsonl(path, strict=False, lines=lines)
    if isinstance(data, dict) and isinstance(data.get("prompts"), list) and "prompt" not in data:
        data = data["prompts"]
    items = data if isinstance(data, list) else [data]
    unread: set[str] = set()
    prompts = [_prompt_from_json(obj, f"{path}: item {i}", f"{path.stem}-{i}", path.stem, strict=False,
                                 unread=unread) for i, obj in enumerate(items, start=1)]
    _note_unread(path, unread)
    return prompts


def _parse_text(path: Path) -> list[Prompt]:
    lines = read_lines(path)
    stem = path.stem
    prompts = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines separate prompts
        text = line.replace("\\n", "\n")
        if not text.strip():  # a line of escaped newlines only: blank once unescaped, as .jsonl refuses it
            raise SuiteError(f"{path}:{lineno}: empty prompt (the line holds only escaped newlines)")
        prompts.append(Prompt(id=f"{stem}-{lineno}", task=stem, language="unknown", split="custom", prompt=text))
    return prompts


TABLE_SUFFIXES = (".csv", ".tsv", ".parquet", ".xlsx", ".xls")
TEXT_SUFFIXES = ("", ".txt", ".text", ".prompts")  # "" : a file named without an extension is read as text


def load_suite(name_or_path: str | Path, split: str | None = None) -> list[Prompt]:
    """Load a bundled suite by name ("train", "validation", "heldout", "heldout_code") or a user suite by path.

    `split` keeps only prompts of that split (for a user suite whose lines carry a `split` field).
    Raises SuiteError naming the file and line for bad JSON, missing fields, empty prompts, duplicate ids,
    unknown names, empty suites and unknown splits.
    """
    name = str(name_or_path)
    bundled = name in BUNDLED_SUITES
    if bundled:
        path = SUITES_DIR / f"{name}.jsonl"
        if not path.exists():
            raise SuiteError(f"bundled suite {name!r} is missing ({path}); reinstall specpilot")
    else:
        path = Path(name).expanduser()
        if not path.exists():
            if path.suffix or len(path.parts) > 1:  # written as a path: say that the file is missing
                raise SuiteError(f"{path}: no such file (a suite is a bundled name, {', '.join(BUNDLED_SUITES)}, or "
                                 "a path to a .jsonl / .json / .txt file)")
            raise SuiteError(f"unknown suite {name!r}: not a bundled suite ({', '.join(BUNDLED_SUITES)}) and no "
                             "such file. Pass a bundled name or a path to a .jsonl / .json / .txt file")
        if path.is_dir():
            raise SuiteError(f"{path}: is a directory; pass a .jsonl, .json or .txt file")
    if path.suffix.lower() in TABLE_SUFFIXES:  # read as text, its header and every cell would become prompts
        raise SuiteError(f"{path}: a {path.suffix} table is not a suite; write JSON lines (.jsonl, one "
                         '{"prompt": ...} object per line, optional "id", "task", "language", "split") or plain text '
                         "(.txt, one prompt per line, \\n for a newline)")
    suffix = path.suffix.lower()
    if suffix == ".json":
        prompts = _parse_json(path)
    elif suffix in (".jsonl", ".ndjson") or bundled:
        prompts = _parse_jsonl(path, strict=bundled)
    elif suffix in TEXT_SUFFIXES:
        prompts = _parse_text(path)
    else:  # read as text, a YAML, TOML or Python file's every line would become a prompt without a word
        hint = (" (to cut completion prompts out of Python source, run `specpilot prompts`)" if suffix == ".py"
                else "")
        raise SuiteError(f"{path}: a {path.suffix} file is not a suite format; write JSON lines (.jsonl), a JSON "
                         "array (.json) or plain text (.txt, one prompt per line, \\n for a newline)" + hint)
    if not prompts:
        raise SuiteError(f"{path}: no prompts found (empty file?)")
    # Duplicate ids would merge distinct prompts in the per-prompt comparisons (identical_to_ar, speedup).
    dupes = [i for i, n in Counter(p.id for p in prompts).items() if n > 1]
    if dupes:
        raise SuiteError(f"{path}: duplicate id(s) {', '.join(sorted(dupes)[:5])}; ids must be unique")
    if split is not None:
        kept = [p for p in prompts if p.split == split]
        if not kept:
            have = sorted({p.split for p in prompts})
            raise SuiteError(f"{path}: no prompts with split {split!r} (splits present: {', '.join(have)})")
        prompts = kept
    return prompts


def is_code_model(target: str | Path | None) -> bool:
    """True for the embedded pair (target None or "embedded": its target saw only the CPython standard library),
    for a target folder of a pair `specpilot models build` made (the embedded one given by its path included: the
    build's corpus_manifest.json sits beside target/), and for a target whose name matches CODE_MODEL_NAME (e.g.
    "bigcode/starcoder2-3b", "Qwen/Qwen2.5-Coder-0.5B")."""
    if target is None or str(target) == "embedded":
        return True
    if _built_pair_target(target):
        return True
    return CODE_MODEL_NAME.search(str(target).lower()) is not None


def _built_pair_target(target: str | Path) -> bool:
    """A target folder of a pair `specpilot models build` wrote: corpus_manifest.json beside it (a hub id is no
    folder, so a manifest in the working directory does not make "gpt2" one)."""
    folder = Path(str(target)).expanduser()
    return folder.is_dir() and (folder.parent / "corpus_manifest.json").is_file()


def default_heldout_suite(target: str | Path | None) -> str:
    """The bundled held-out suite that matches the pair's target: "heldout_code" for a code model (`is_code_model`:
    prose prompts make such a model loop or emit junk, which drafts trivially), else "heldout" (prose in four
    languages and some code, for general-purpose targets)."""
    return "heldout_code" if is_code_model(target) else "heldout"


def choose_suite(suite: str | Path | None, target: str | Path | None) -> dict:
    """The suite an evaluation runs and why, for its report: {"name", "chosen_by"}. `suite` (--suite) when given,
    else `default_heldout_suite(target)`."""
    if suite is not None:
        return {"name": str(suite), "chosen_by": "--suite"}
    name = default_heldout_suite(target)
    built = target is not None and _built_pair_target(target)
    what = ("the embedded pair, a code model: its target saw only the standard library" if target in (None, "embedded")
            else f"target {target}, a code model: a pair `specpilot models build` made, trained on Python source"
            if built else f"target {target}, " + ("a code model by its name" if name == "heldout_code" else
                                                  "a general-purpose model: its name marks no code model"))
    return {"name": name, "chosen_by": f"default for {what}"}


def prompt_mix(prompts: list[Prompt]) -> dict:
    """Counts per task, per language, per split and per (task, language): the report's prompt-mix label."""
    return {
        "n_prompts": len(prompts),
        "by_task": dict(Counter(p.task for p in prompts)),
        "by_language": dict(Counter(p.language for p in prompts)),
        "by_split": dict(Counter(p.split for p in prompts)),
        "by_task_language": {f"{t}/{lang}": n for (t, lang), n in Counter((p.task, p.language)
                                                                            for p in prompts).items()},
    }


def load_prompts(suite: str, split: str | None = None, limit: int | None = None) -> list[str]:
    """The prompt texts of a bundled suite name or a .jsonl/.json/.txt path, the first `limit` (all when None)."""
    prompts = [p.prompt for p in load_suite(suite, split=split)]
    return prompts[:limit] if limit else prompts


def is_completion(prompt: Prompt) -> bool:
    """A code-completion prompt (it ends at the cursor): a programming `language` or a `task` starting "code"."""
    return prompt.language.lower() in CODE_LANGUAGES or prompt.task.lower().startswith("code")


def with_chat_template(prompts: list[Prompt], tokenizer, mode: str = "auto") -> tuple[list[Prompt], dict]:
    """The prompts as a user of the model sends them (module docstring): each templated prompt's text becomes the
    chat template's rendering of one user turn plus the assistant header (`add_generation_prompt`), which
    `ModelPair.encode` tokenizes without a second BOS. Returns (prompts, {"mode", "applied", "of"}) for the report.
    mode "on" with a tokenizer that has no chat template is a ValueError (nothing to apply)."""
    if mode not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"chat template mode {mode!r}: choose one of {', '.join(CHAT_TEMPLATE_MODES)}")
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if mode == "on" and not template:
        raise ValueError("--chat-template on: the target's tokenizer has no chat template (a base model, or no "
                         "tokenizer files); use --chat-template auto or off")
    out, applied = [], 0
    for p in prompts:
        if template and mode != "off" and (mode == "on" or not is_completion(p)):
            text = tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            p, applied = replace(p, prompt=str(text)), applied + 1
        out.append(p)
    return out, {"mode": mode, "applied": applied, "of": len(prompts)}


def chat_template_note(suite: dict) -> str:
    """", chat template on 80 of 96 prompts (--chat-template auto)" when any prompt was templated, else ""."""
    chat = suite.get("chat_template") if isinstance(suite, dict) else None
    if not isinstance(chat, dict) or not chat.get("applied"):
        return ""
    return f", chat template on {chat['applied']} of {chat['of']} prompts (--chat-template {chat['mode']})"
