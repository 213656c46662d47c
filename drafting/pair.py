"""ModelPair: a target causal LM and its drafter (a separate LM sharing its vocabulary, or an EAGLE-3 head reading
its hidden states), plus their tokenizer.

`ModelPair.from_pretrained()` with no arguments loads the small code-model target embedded in the package with its
default embedded drafter, `DEFAULT_DRAFTER` (built by `specpilot models build`); `from_pretrained(target=...,
draft=...)` loads any pair of `AutoModelForCausalLM` checkpoints (hub ids or local paths) and refuses pairs whose
vocabularies differ; `from_pretrained(target=..., eagle=HEAD_DIR)` loads a released EAGLE-3 head and refuses one
that does not fit.
"""
from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specpilot.drafting.attention import check_tree_attention
from specpilot.drafting.cache import check_transformers
from specpilot.drafting.checks import check_int
from specpilot.drafting.errors import InputFileError
from specpilot.drafting.files import damaged_weights, model_files_fix, not_enough_memory, out_of_memory, read_json
from specpilot.drafting.linear_kernels import enable_small_row_linears, wanted

DEFAULT_PAIR_DIR = Path(__file__).resolve().parent / "default_pair"
# The embedded drafter `ModelPair.from_pretrained()` uses: the EAGLE-3 head when it is shipped, else the separate
# draft. On CPU the two tie in speed on the mixed held-out suite; the head accepts more and is better calibrated
# (README, "The embedded pair", with the measurements).
DEFAULT_DRAFTER = "eagle" if (DEFAULT_PAIR_DIR / "eagle" / "config.json").exists() else "draft"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # torch dtypes a pair may run in


class VocabularyMismatchError(ValueError):
    """The target and draft do not share a vocabulary, so draft tokens would mean other things to the target."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


DEVICE_KINDS = ("cpu", "cuda", "mps")


def check_device(device: str | torch.device | None) -> str:
    """The device to load on: `device` when this machine has it ("cpu", "cuda", "cuda:N", "mps"), the default
    (`default_device()`) for None; else ValueError saying what is available."""
    if device is None:
        return default_device()
    text = str(device).strip()
    kind, _, index = text.partition(":")
    if kind not in DEVICE_KINDS or (index and not index.isdigit()):
        raise ValueError(f"device {text!r} is not supported: use cpu, cuda, cuda:N or mps")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {text!r} needs CUDA, but torch sees no CUDA GPU here (torch "
                             f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); use cpu")
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {text!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {text!r} needs Apple's MPS backend, which torch does not see here; use cpu")
    return text


def _cuda_bf16(device, *, including_emulation: bool = True) -> bool:
    """torch.cuda.is_bf16_supported for `device` itself: torch asks the current device, which on a machine with
    mixed GPUs need not be the pair's."""
    if not torch.cuda.is_available():
        return False
    with torch.cuda.device(torch.device(device)):
        return torch.cuda.is_bf16_supported(including_emulation=including_emulation)


def _cuda_name(device) -> str:
    return torch.cuda.get_device_name(torch.device(device))


def default_dtype(device: str) -> torch.dtype:
    """fp32 on CPU (exact and fastest for small models there); bf16 on CUDA when supported, else fp16."""
    if str(device).startswith("cuda"):
        return torch.bfloat16 if _cuda_bf16(device) else torch.float16
    return torch.float32


def check_dtype(dtype, device: str) -> torch.dtype:
    """The torch floating dtype named by `dtype` (a DTYPES name, "auto" or a torch.dtype), the device's default for
    None; else ValueError listing the accepted names. "auto" without a model to measure is `resolve_dtype`'s choice
    from the device and CPU features alone (fp32 on a bf16-capable CPU until measured)."""
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str):
        if dtype.strip().lower() == AUTO:
            return resolve_dtype(AUTO, device)[0]
        if dtype.strip().lower() not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPE_CHOICES)}")
        return DTYPES[dtype.strip().lower()]
    if not isinstance(dtype, torch.dtype) or dtype not in COMPUTE_DTYPES:
        # float8 and the like are storage formats: models do not compute in them (torch cannot even build one)
        raise ValueError(f"dtype {dtype!r} is not a dtype models compute in; choose one of "
                         f"{', '.join(DTYPE_CHOICES)} (or torch.float64)")
    return dtype


# -- half precision: what this machine supports natively, and what "auto" picks ------------------------------------
AUTO = "auto"
DTYPE_CHOICES = ("bfloat16", "float16", "float32", AUTO)  # what --dtype offers (DTYPES' short aliases work too)
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")   # /proc/cpuinfo flags of CPUs with bf16 matmul instructions
CPU_FP16_FLAGS = ("amx_fp16", "avx512_fp16")
AUTO_PROBE_TOKENS = (1, 16)  # auto's micro-benchmark: a plain step and a typical verification block
AUTO_PROBE_REPEATS = 9  # interleaved fp32/bf16 repeats of the micro-benchmark
AUTO_BF16_MAX_RATIO = 0.9  # auto takes bf16 on a CPU only when its forward takes <= 90% of fp32's time
_CPU_FLAGS: set[str] | None = None
_AUTO_MEASURED: dict[tuple, tuple[torch.dtype, str]] = {}  # per process: (model, device, threads) -> choice


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none: macOS, Windows); read once."""
    global _CPU_FLAGS
    if _CPU_FLAGS is None:
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            text = ""
        lines = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("flags", "Features")]
        _CPU_FLAGS = set(lines[0].split(":", 1)[1].split()) if lines else set()
    return _CPU_FLAGS


def half_support(dtype: torch.dtype, device: str) -> tuple[str, str]:
    """("native" | "emulated" | "none", why) for computing in `dtype` on `device`: native when the hardware has the
    instructions (CUDA bf16: compute capability >= 8; CPU: amx/avx512 bf16 or fp16 flags), emulated when torch runs
    it by converting (correct rounding of the dtype, no speed), none when torch cannot run it there."""
    if dtype == torch.float32:
        return "native", "fp32"
    kind = str(device).split(":")[0]
    name = str(dtype).removeprefix("torch.")
    if kind == "cuda":
        if dtype == torch.bfloat16 and not _cuda_bf16(device, including_emulation=False):
            return "none", f"this GPU has no bf16 ({_cuda_name(device)}); use float16 or float32"
        return "native", f"{name} on {_cuda_name(device) if torch.cuda.is_available() else 'CUDA'}"
    if kind != "cpu":
        return "native", f"{name} on {kind}"
    wanted = CPU_BF16_FLAGS if dtype == torch.bfloat16 else CPU_FP16_FLAGS
    have = sorted(cpu_flags() & set(wanted))
    if have:
        return "native", f"this CPU has {'/'.join(have)}"
    return "emulated", f"this CPU has no {' or '.join(wanted)} (/proc/cpuinfo): torch emulates {name}, slowly"


def _forward_timer(model, tokens: int, *, prefix: int = 128):
    """A callable timing (ms) one target forward over `tokens` new tokens after a `prefix`-token cache (no
    autograd); the cache is cropped back after each call, so every call times the same work."""
    import time

    from specpilot.drafting.cache import crop_to, new_cache

    device = next(model.parameters()).device
    cache = new_cache(model)
    gen = torch.Generator().manual_seed(0)
    vocab = _vocab_size(model)
    model(input_ids=torch.randint(0, vocab, (1, prefix), generator=gen).to(device), cache=cache, use_cache=True)
    ids = torch.randint(0, vocab, (1, tokens), generator=gen).to(device)

    def forward_ms() -> float:
        t0 = time.perf_counter()
        model(input_ids=ids, cache=cache, use_cache=True)
        elapsed = time.perf_counter() - t0
        crop_to(cache, prefix)
        return elapsed * 1e3

    forward_ms()  # warm-up, not timed
    return forward_ms


def measure_half(model, dtype: torch.dtype = torch.bfloat16, *, repeats: int = AUTO_PROBE_REPEATS) -> dict:
    """ms of the target forward at AUTO_PROBE_TOKENS tokens in fp32 and in `dtype` (a copy), for "auto": the two
    interleaved (order alternating per repeat), each the fastest of `repeats` (on a shared machine other jobs only
    ever add time, so the minimum is the least disturbed reading, as `timeit` advises). Returns those ms per dtype
    and token count, and `ratio`: the dtype's summed ms over fp32's."""
    import copy

    half_name = str(dtype).removeprefix("torch.")
    with torch.inference_mode():
        half = copy.deepcopy(model).to(dtype)  # for timing only: the decoding copy is loaded as transformers loads it
        full = model if model.dtype == torch.float32 else copy.deepcopy(model).to(torch.float32)
        timers = {name: {n: _forward_timer(m, n) for n in AUTO_PROBE_TOKENS}
                  for name, m in (("float32", full), (half_name, half))}
        fastest = {name: dict.fromkeys(AUTO_PROBE_TOKENS, float("inf")) for name in timers}
        for r in range(repeats):
            for n in AUTO_PROBE_TOKENS:
                for name in (("float32", half_name) if r % 2 == 0 else (half_name, "float32")):
                    fastest[name][n] = min(fastest[name][n], timers[name][n]())
    out = {name: {n: round(ms, 3) for n, ms in per.items()} for name, per in fastest.items()}
    out["ratio"] = round(sum(fastest[half_name].values()) / sum(fastest["float32"].values()), 4)
    return out


def resolve_dtype(dtype, device: str, model=None) -> tuple[torch.dtype, str]:
    """(dtype, why) for a --dtype value. A name or torch.dtype is taken as asked; None is the device's default;
    "auto" picks bf16 on CUDA (fp16 where the GPU lacks bf16), fp32 on MPS, and on a CPU bf16 only when it has
    AMX-BF16 or AVX512-BF16 *and* a one-off micro-benchmark of `model`'s forward at 1 and 16 tokens (summed; fp32
    and bf16 interleaved, the fastest of AUTO_PROBE_REPEATS each) runs clearly faster in bf16 (time ratio <=
    AUTO_BF16_MAX_RATIO; cached per process); fp32 otherwise, and fp32 when no model is given to measure."""
    device = str(device)
    if dtype is None:
        chosen = default_dtype(device)
        return chosen, f"{str(chosen).removeprefix('torch.')}: the default on {device.split(':')[0]}"
    if not (isinstance(dtype, str) and dtype.strip().lower() == AUTO):
        chosen = check_dtype(dtype, device)
        support, why = half_support(chosen, device) if chosen in (torch.bfloat16, torch.float16) else ("native", "")
        # an emulated dtype rounds as asked but runs slowly: speedups measured in it are not the hardware's
        return chosen, f"{str(chosen).removeprefix('torch.')}: asked for" + (f" ({why})" if support != "native" else "")
    kind = device.split(":")[0]
    if kind == "cuda":
        chosen = default_dtype(device)
        return chosen, f"auto: {str(chosen).removeprefix('torch.')} on CUDA"
    if kind != "cpu":
        return torch.float32, f"auto: float32 on {kind}"
    support, why = half_support(torch.bfloat16, "cpu")
    if support != "native":
        return torch.float32, f"auto: float32, {why}"
    if model is None:
        return torch.float32, f"auto: float32 ({why}; no model given to measure bf16 against fp32)"
    key = (getattr(model.config, "_name_or_path", ""), model_digest(model, sample=4096), device,
           torch.get_num_threads())
    if key not in _AUTO_MEASURED:
        ms = measure_half(model, torch.bfloat16)
        # bf16 only when clearly faster: a near tie would flip between runs on a shared machine (and with it the
        # rounding, so the text), for a speed difference too small to matter
        chosen = torch.bfloat16 if ms["ratio"] <= AUTO_BF16_MAX_RATIO else torch.float32
        shown = ", ".join(f"{n} tok {ms['float32'][n]:.2f} vs {ms['bfloat16'][n]:.2f} ms" for n in AUTO_PROBE_TOKENS)
        _AUTO_MEASURED[key] = (chosen, f"auto: {str(chosen).removeprefix('torch.')}, {why}; target forward fp32 vs "
                                       f"bf16 ({shown}, fastest of {AUTO_PROBE_REPEATS} interleaved, "
                                       f"{torch.get_num_threads()} threads: bf16/fp32 {ms['ratio']:.2f}, bf16 "
                                       f"taken at <= {AUTO_BF16_MAX_RATIO})")
    return _AUTO_MEASURED[key]


def _vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def check_text(name: str, text: str) -> None:
    """Refuse text that is not valid Unicode: lone surrogates are what Python makes of invalid UTF-8 bytes in argv
    (surrogateescape); tokenizers would drop or mangle them silently."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start:err.end].encode("utf-8", "surrogateescape")
        raise ValueError(f"{name} is not valid UTF-8: bytes {bad!r} at character {err.start} do not decode; pass "
                         "UTF-8 text (re-encode the input, e.g. `iconv -t UTF-8`)") from None


def check_token_ids(ids: list[int], vocab_size: int, *, what: str = "prompt token id") -> list[int]:
    """`ids` when every id is in 0..vocab_size-1; else ValueError naming the first bad id and its position."""
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise ValueError(f"{what} {token} at position {position} is outside the vocabulary: token ids must be "
                             f"in 0..{vocab_size - 1} (the target has {vocab_size} tokens)")
    return ids


def check_same_vocabulary(target, draft, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Raise VocabularyMismatchError unless both models (and tokenizers, when given) share one vocabulary. Output
    sizes may differ by padding rows (Qwen2.5-0.5B has 151,936 logits, Qwen2.5-7B 152,064, for one tokenizer) when
    the target's tokenizer is known and all its ids lie below the smaller size: the draft then drafts those ids."""
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise VocabularyMismatchError(
                "target and draft tokenizers map tokens to different ids; a draft token id would mean another "
                "string to the target. Use a draft trained with the target's tokenizer."
            )
    t_size, d_size = _vocab_size(target), _vocab_size(draft)
    if t_size == d_size:
        return
    shared = min(t_size, d_size)
    if target_tokenizer is None:
        raise VocabularyMismatchError(
            f"target and draft output vocabularies differ ({t_size} vs {d_size} logits); speculative decoding needs "
            "a draft that uses the target's tokenizer. When both do and the extra rows are padding (as Qwen2.5's "
            "151936 vs 152064), give the pair its tokenizer (ModelPair(..., tokenizer=...), or tokenizer files in "
            f"the target's folder) so that its ids can be checked to lie below {shared}")
    tokens = len(target_tokenizer)
    if tokens > shared:
        raise VocabularyMismatchError(
            f"target and draft output vocabularies differ ({t_size} vs {d_size} logits) and the tokenizer has "
            f"{tokens} tokens, more than the smaller model's {shared} rows: the rows are not just padding. Use a "
            "draft trained with the target's tokenizer.")


def model_digest(model, sample: int = 65_536) -> str:
    """Content hash of a model's weights (names, shapes, and up to `sample` evenly strided values per tensor),
    independent of where it was loaded from and of the thread count: only bytes are hashed, never a floating-point
    reduction (a sum's rounding depends on how many threads computed it). Strided sampling keeps it fast for
    multi-GB checkpoints while any retraining or different checkpoint still changes it."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // sample)
        h.update(flat[::step][:sample].to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


def _has_tokenizer(folder: Path) -> bool:
    """A folder with tokenizer files (transformers builds an empty tokenizer from a folder without them)."""
    return folder.is_dir() and any((folder / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(model_path):
    """The tokenizer beside a model (its folder, a sibling `tokenizer/` folder, or its hub id), else None; the
    embedded pair's for None or "embedded"."""
    if model_path in (None, "embedded"):
        model_path = DEFAULT_PAIR_DIR / "target"
    return _load_tokenizer(None, model_path)


def _load_tokenizer(explicit, model_path):
    """The explicit tokenizer, else the one beside the model (its folder, or a sibling `tokenizer/` folder), else
    None: a checkpoint shipped without tokenizer files still works on token ids."""
    from transformers import AutoTokenizer

    if explicit is not None:
        return AutoTokenizer.from_pretrained(str(checked_source(explicit, "tokenizer")))
    local = Path(str(model_path))
    if local.exists():
        for folder in (local, local.parent / "tokenizer"):
            if _has_tokenizer(folder):
                return _read_local_tokenizer(folder)
        return None
    try:  # a hub id
        return AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError):
        return None


def _read_local_tokenizer(folder: Path):
    """The tokenizer saved in `folder`; its files damaged (a cut tokenizer.json is a JSONDecodeError, a garbled one
    the tokenizers library's own Exception) is an InputFileError naming the folder, the error and the fix."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:  # the folder's files are the only input here: any failure means they cannot be read
        raise InputFileError(f"the tokenizer files in {folder} cannot be read ({type(err).__name__}: "
                             f"{' '.join(str(err).split())[:200]}): damaged or incomplete; "
                             f"{model_files_fix(folder)}") from err


def checked_source(source, what: str):
    """A local path that exists, or something shaped like a hub id ("org/name"); else a clear FileNotFoundError."""
    text = str(source)
    path = Path(text).expanduser()
    if path.exists():  # absolute: manifests and exports name it, and are read from other working directories
        return path.absolute()
    parts = text.split("/")
    looks_like_hub_id = len(parts) == 2 and all(parts) and not text.startswith((".", "~")) and "\\" not in text
    if not looks_like_hub_id:
        raise FileNotFoundError(f"{what} path {text!r} does not exist (give a local folder or a hub id like "
                                "'org/name')")
    return text


def _check_model_folder(folder: Path, what: str) -> None:
    """Refuse, before transformers reads it, a local path that cannot be a model: a file, or a folder without
    config.json (transformers would say "Unrecognized model ... should have a model_type key")."""
    if not folder.is_dir():
        raise InputFileError(f"the {what} model {folder} is a file, not a model folder: give the folder holding its "
                             "config.json and weights")
    if not (folder / "config.json").is_file():
        raise InputFileError(f"the {what} model {folder} is not a model folder: no config.json in it; give the "
                             "folder a model was saved to (`save_pretrained` writes config.json and the weights) or "
                             "a hub id")
    try:  # an EAGLE-3 head is no causal LM: transformers would fail on its weights with a long traceback
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return  # transformers' own reading names what is wrong with the file
    if any("eagle3" in str(a).lower() for a in archs):
        fix = ("pass it as the drafter with --eagle (eagle=) beside its target" if what == "draft" else
               "give the target LM it drafts for as --target (target=) and the head as --eagle (eagle=)")
        raise InputFileError(f"the {what} model {folder} is an EAGLE-3 head (architectures {archs}), not a causal "
                             f"LM: {fix}")


def _config_problem(folder: Path, what: str) -> InputFileError | None:
    """Why transformers could not tell what model a folder's config.json describes (no model_type, or one this
    transformers does not know), or None when the config is not the reason."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = folder / "config.json"
    config = read_json(path, what=f"{what} model config", fix=model_files_fix(folder))
    model_type = config.get("model_type")
    if not model_type:
        return InputFileError(f"{path} has no model_type key: the {what} model {folder} is not a model folder "
                              f"transformers can load; {model_files_fix(folder)}")
    if model_type not in CONFIG_MAPPING:
        return InputFileError(f"{path}: model_type {model_type!r} is unknown to transformers "
                              f"{transformers.__version__}: fix config.json's model_type or upgrade transformers")
    return None


def auto_probe_too_big(source, *, available: int | None = None) -> str | None:
    """Why auto's CPU micro-benchmark must be skipped for the model folder `source`, or None. It holds the target in
    fp32 and a bf16 copy at once (6 bytes a parameter), which for a 7B checkpoint is ~42 GB: more than a machine
    that runs the model in bf16 (14 GB) may have. Parameters are counted from the weight files' sizes and the
    dtype config.json stores; a hub id or a folder without them is not judged (None)."""
    folder = Path(str(source))
    weights = [f for pattern in ("*.safetensors", "*.bin") for f in folder.glob(pattern)]
    if not weights or not (folder / "config.json").is_file():
        return None
    stored = _stored_dtype(folder) or "float32"
    params = sum(f.stat().st_size for f in weights) / {"float32": 4, "float64": 8}.get(stored, 2)
    needed = 6 * params
    available = available_memory() if available is None else available
    if available is None or needed <= 0.8 * available:
        return None
    return (f"fp32 and bf16 copies of this target to time would need ~{needed / 2**30:.1f} GiB, over 80% of the "
            f"{available / 2**30:.1f} GiB available")


def available_memory() -> int | None:
    """Bytes of memory available to new work (MemAvailable in /proc/meminfo), None where there is no such file."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _stored_dtype(source) -> str | None:
    """The dtype a model folder's config.json says its weights are stored in ("bfloat16"), None when it names none
    or there is no readable config (a hub id)."""
    try:
        config = json.loads((Path(str(source)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    stored = config.get("dtype") or config.get("torch_dtype")
    return stored.removeprefix("torch.") if isinstance(stored, str) else None


def _stored_dtype_note(source, dtype: torch.dtype, whose: str = "the checkpoint") -> str:
    """"; the checkpoint stores X" when a model folder's config.json names a dtype other than the one it runs in (a
    lossless upcast or a lossy conversion: either way the user should know), else "". `whose` names the model
    ("the EAGLE-3 head's checkpoint" for a drafter, which runs in the target's dtype as vLLM runs it)."""
    stored = _stored_dtype(source)
    if stored is None or stored == str(dtype).removeprefix("torch."):
        return ""
    return f"; {whose} stores {stored}, converted on loading"


def _load_lm(source, what: str, dtype):
    """The causal LM at `source` (a local folder or a hub id). A folder that is no model, damaged weights or a
    config transformers cannot place are InputFileErrors naming the folder or file and the fix; other failures of
    transformers keep their own error (they are ours to fix, not the user's)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    source = checked_source(source, what)
    local = isinstance(source, Path)
    if local:
        _check_model_folder(source, what)
    try:
        return AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    except (SafetensorError, OSError, EOFError, RuntimeError, pickle.UnpicklingError, MemoryError) as err:
        # what reading a cut, empty or garbage weights file raises (safetensors, or torch.load for .bin files);
        # translated only when a weights file is found damaged: any other failure keeps its own error
        if out_of_memory(err):  # an mmap refused under `ulimit -v`: the files are not at fault
            raise not_enough_memory(f"the {what} model {str(source)!r}", err) from err
        damaged = damaged_weights(source, what=f"{what} model", fix=model_files_fix(source)) if local else None
        if damaged is not None:
            raise damaged from err
        if local and isinstance(err, RuntimeError) and _shape_mismatch_error(err):
            mismatch = _first_shape_mismatch(source, dtype) or "some tensors have other shapes"
            raise InputFileError(f"the {what} model {source}: its weights do not fit the model its config.json "
                                 f"describes ({mismatch}); {model_files_fix(source)}") from err
        if isinstance(err, SafetensorError) and not local:
            raise InputFileError(f"the {what} model {source!r}: its downloaded weights are damaged or incomplete "
                                 f"({' '.join(str(err).split())}); delete its copy in the Hugging Face cache "
                                 "(~/.cache/huggingface/hub) and download it again") from err
        if not isinstance(err, OSError):
            raise
        where = "the local folder" if local else \
            f"the hub as a model id (no local path {str(source)!r} exists; offline here?)"
        raise FileNotFoundError(f"cannot load the {what} model {str(source)!r} from {where}: "
                                f"{str(err).splitlines()[0]}") from err
    except (ValueError, KeyError) as err:
        # transformers' "Unrecognized model" / unknown model type; any other ValueError is a bug and stands
        problem = _config_problem(source, what) if local else None
        if problem is None:
            raise
        raise problem from err


def _shape_mismatch_error(err: BaseException) -> bool:
    """Whether transformers refused weights whose shapes differ from the config's model (its size-mismatch report:
    "size mismatch for ..." / "ignore_mismatched_sizes")."""
    text = str(err)
    return "ignore_mismatched_sizes" in text or "size mismatch" in text


def _first_shape_mismatch(folder: Path, dtype) -> str | None:
    """"tensor NAME has shape [...] in the weights, the config builds [...]" for the first safetensors tensor whose
    shape differs from the config's model (built on the meta device: no memory), or None when none is found."""
    try:
        import torch
        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=dtype)
        expected = {name: list(t.shape) for name, t in model.state_dict().items()}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    got = list(f.get_slice(name).get_shape())
                    want = expected.get(name)
                    if want is not None and want != got:
                        return f"tensor {name!r} has shape {got} in {file.name}, the config builds {want}"
    except Exception:  # noqa: BLE001 - naming the tensor is a courtesy: the error stands without it
        return None
    return None


def tokenizer_rows(encoding) -> list:
    """The prompts of a tokenizer's output (a BatchEncoding or any mapping with "input_ids", e.g.
    `tokenizer(texts, padding=True, return_tensors="pt")` or `apply_chat_template(..., return_dict=True)`): one
    row of ids per prompt, each without the positions its attention_mask marks as padding (left or right), as
    transformers' `generate(**encoding)` reads them."""
    ids = encoding["input_ids"]
    mask = encoding.get("attention_mask")
    rows = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if rows and not isinstance(rows[0], (list, tuple)):
        rows = [rows]  # one prompt: [n]
    if mask is None:
        return [list(r) for r in rows]
    masks = mask.tolist() if hasattr(mask, "tolist") else list(mask)
    if masks and not isinstance(masks[0], (list, tuple)):
        masks = [masks]
    if [len(r) for r in rows] != [len(m) for m in masks]:
        raise ValueError("the tokenizer output's attention_mask does not match its input_ids in shape")
    return [[t for t, keep in zip(r, m) if keep] for r, m in zip(rows, masks)]


def padded_rows(rows: list[list[int]], pad_ids) -> list[int]:
    """Indices of the rows of a 2-D id tensor/array that start or end with one of `pad_ids` (the tokenizer's pad id
    and the end ids, which tokenizers without a pad token are given as one) while another row does not there: a
    padded batch passed without its attention_mask (the padding would be decoded as prompt text)."""
    pads = {int(i) for i in pad_ids if i is not None}
    if not pads or len(rows) < 2:
        return []
    starts = [bool(r) and r[0] in pads for r in rows]
    ends = [bool(r) and r[-1] in pads for r in rows]
    return [i for i in range(len(rows)) if (starts[i] and not all(starts)) or (ends[i] and not all(ends))]


def _one_row(ids, shape: tuple[int, ...]):
    """A prompt tensor/array as one row of ids: [n] or [1, n] (as a tokenizer returns it). More rows are several
    prompts, which one generation must not silently join."""
    if len(shape) == 1 or len(shape) == 2 and shape[0] == 1:
        return ids.reshape(-1)
    raise ValueError(f"a prompt is one sequence of token ids ([n] or [1, n]), got shape {list(shape)}: for several "
                     "prompts call generate_batch (one row each) or generate once per prompt")


@dataclass
class ModelPair:
    """A target and its drafter on one device. `target` is a Hugging Face causal LM; the drafter is either `draft`,
    a separate causal LM sharing the target's vocabulary, or `eagle`, an EAGLE-3 head reading the target's hidden
    states (`specpilot.drafting.eagle.Eagle3Head`); the decoder uses the head when there is one. `tokenizer` is the
    shared transformers tokenizer (optional when callers pass token ids)."""

    target: torch.nn.Module
    draft: torch.nn.Module | None = None
    tokenizer: object | None = None
    name: str = "custom"
    eagle: torch.nn.Module | None = None
    dtype_reason: str = ""  # why the pair runs in its dtype (`resolve_dtype`): for reports and manifests
    # on CPU, few-row linears (steps, verify blocks, draft levels) by a measured row plan (`linear_kernels`); None:
    # yes unless SPECPILOT_SMALL_ROW_LINEARS=0
    small_row_linears: bool | None = None

    def __post_init__(self) -> None:
        check_transformers()
        if self.draft is None and self.eagle is None:
            raise ValueError("a ModelPair needs a drafter: draft= (a causal LM) or eagle= (an EAGLE-3 head)")
        if self.draft is not None and self.eagle is not None:  # as from_pretrained: one drafter, said
            raise ValueError("give draft= (a separate LM) or eagle= (an EAGLE-3 head), not both: the decoder drafts "
                             "with one")
        if self.eagle is not None:
            from specpilot.drafting.eagle import Eagle3Head

            if not isinstance(self.eagle, Eagle3Head):
                raise TypeError(f"eagle must be an EAGLE-3 head (specpilot.drafting.eagle.Eagle3Head, e.g. from "
                                f"ModelPair.from_pretrained(target, eagle=PATH)), got {type(self.eagle).__name__}; a "
                                "separate draft LM goes in draft=")
        for name, module in (("target", self.target), ("draft", self.draft)):
            if module is not None and not (isinstance(module, torch.nn.Module)
                                           and hasattr(module, "get_output_embeddings")):
                raise TypeError(f"{name} must be a transformers causal LM (AutoModelForCausalLM), got "
                                f"{type(module).__name__}; to load from a folder or hub id use "
                                "ModelPair.from_pretrained(...)")
        if self.tokenizer is not None and not callable(self.tokenizer):
            raise TypeError(f"tokenizer must be a transformers tokenizer object, got {type(self.tokenizer).__name__}; "
                            "load it with AutoTokenizer.from_pretrained(...), or use ModelPair.from_pretrained")
        training = [name for name, m in (("target", self.target), ("draft", self.draft), ("eagle", self.eagle))
                    if m is not None and m.training]
        if training:  # decoding needs dropout off; say so, since the caller's own models change mode
            import warnings

            warnings.warn(f"ModelPair puts the {' and '.join(training)} in eval mode (decoding needs dropout off); "
                          "call .train() on them to go on training", UserWarning, stacklevel=3)
        self.target.eval()
        for name, module in (("draft", self.draft), ("eagle", self.eagle)):
            if module is None:
                continue
            module.eval()
            if self.device != next(module.parameters()).device:
                raise ValueError(f"target and {name} must live on the same device; move them with pair.to(device)")
        if self.draft is not None:
            check_same_vocabulary(self.target, self.draft, self.tokenizer)
        # refuse, before any decoding, a model whose forward would not honour tree masks (see drafting/attention.py)
        check_tree_attention(self.target, "target")
        if self.draft is not None:
            check_tree_attention(self.draft, "draft")
        if self.eagle is not None:
            from specpilot.drafting.eagle import check_fits_target

            check_fits_target(self.eagle.config, self.target)
        self.small_row_linears = wanted(self.small_row_linears)
        self._turn_small_rows()
        if not self.dtype_reason:  # built from models in memory: their dtype is the caller's
            self.dtype_reason = f"{str(self.dtype).removeprefix('torch.')}: the models as given"
            if self.drafter_dtype != self.dtype:  # decoding stays exact (the target verifies); reports say it
                self.dtype_reason += (f" (the {'EAGLE-3 head' if self.eagle is not None else 'draft LM'} in "
                                      f"{str(self.drafter_dtype).removeprefix('torch.')})")

    @property
    def drafter_kind(self) -> str:
        """"eagle3" (an EAGLE-3 head drafts) or "draft_lm" (a separate LM drafts)."""
        return "eagle3" if self.eagle is not None else "draft_lm"

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    @property
    def drafter_dtype(self) -> torch.dtype:
        """The dtype the drafter (the EAGLE-3 head, else the draft LM) computes in; `from_pretrained` loads it in the
        target's, a pair built in memory keeps the caller's."""
        drafter = self.eagle if self.eagle is not None else self.draft
        return next(drafter.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return _vocab_size(self.target)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation, as transformers' generate() stops at any of them: the target's
        generation_config eos_token_id, an int or a list (Llama-3 Instruct lists three). Like generate(), a
        generation_config that names none stops nowhere, whatever config.json names (the CLI and a warning say so:
        `generation_defaults`); config.json is read only for a model without a generation_config."""
        def as_list(eos) -> list:  # an int, numpy or tensor scalar, or a list of them
            if eos is None:
                return []
            return list(eos) if isinstance(eos, (list, tuple)) else np.asarray(eos).reshape(-1).tolist()

        generation = getattr(self.target, "generation_config", None)
        ids = as_list(generation.eos_token_id if generation is not None else self.target.config.eos_token_id)
        return tuple(dict.fromkeys(int(i) for i in ids))

    @property
    def eos_token_id(self) -> int | None:
        """The first end id (the pad id for baselines, a trace's header); decoding stops at any `eos_token_ids`."""
        ids = self.eos_token_ids
        return ids[0] if ids else None

    @property
    def max_context(self) -> int:
        """Positions both models can take exactly (an EAGLE head's RoPE extends: only the target and a draft LM
        limit; LongRoPE models only up to their original context: `attention.context_limit`)."""
        from specpilot.drafting.attention import context_limit

        limits = [context_limit(m.config) for m in (self.target, self.draft) if m is not None]
        return int(min([v for v in limits if v] or [1 << 30]))

    def to(self, device=None, dtype=None) -> "ModelPair":
        before = self.dtype, self.drafter_dtype
        for module in (self.target, self.draft, self.eagle):
            if module is not None:
                module.to(device=device, dtype=dtype)
        if (self.dtype, self.drafter_dtype) != before:  # reports quote the reason: it must name this conversion
            self.dtype_reason = f"{str(self.dtype).removeprefix('torch.')}: converted with ModelPair.to"
        self._turn_small_rows()  # layers moved to the CPU or to another dtype: measured now, not in a timed step
        return self

    def _turn_small_rows(self) -> None:
        """Turn the models' CPU linears into SmallRowLinear when `small_row_linears` (drafting/linear_kernels.py)."""
        if self.small_row_linears:
            for module in (self.target, self.draft, self.eagle):
                if module is not None:
                    enable_small_row_linears(module)

    def identity(self) -> dict:
        """Names and content hashes, for manifests, reports and export validation ("draft"/"draft_hash" name the
        drafter in use: the EAGLE-3 head when there is one)."""
        drafter = self.eagle if self.eagle is not None else self.draft
        source = getattr(drafter, "source", None) or getattr(getattr(drafter, "config", None), "_name_or_path", "")
        return {
            "name": self.name,
            "target": getattr(self.target.config, "_name_or_path", "") or "in-memory",
            "draft": str(source or "in-memory"),
            "drafter": self.drafter_kind,
            "target_hash": model_digest(self.target),
            "draft_hash": model_digest(drafter),
            "vocab_size": self.vocab_size,
        }

    @property
    def drafter_vocab_size(self) -> int:
        """Tokens the drafter can propose: an EAGLE head's reduced draft vocabulary, else the ids the draft LM and
        the target both have logits for (their rows may be padded differently)."""
        if self.eagle is not None:
            return int(self.eagle.config.draft_vocab_size)
        return min(_vocab_size(self.draft), self.vocab_size)

    def encode(self, prompt: str | list[int] | torch.Tensor) -> list[int]:
        """Prompt text or ids -> list of token ids, every id checked against the target's vocabulary. Text is
        tokenized as `tokenizer(text)` does, with the special tokens the tokenizer adds (Llama's and Mistral's BOS,
        which those models need; GPT-2 and Qwen add none), except that a text already starting with the BOS (a
        chat-templated prompt, `eval.suites.with_chat_template`) gets no second one."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"this ModelPair has no tokenizer (none of {', '.join(TOKENIZER_FILES)} in the "
                                 "target's folder or a sibling tokenizer/ folder): copy the target's tokenizer files "
                                 "there, pass token ids, or load the pair with "
                                 "ModelPair.from_pretrained(..., tokenizer=PATH)")
            check_text("the prompt", prompt)
            bos = getattr(self.tokenizer, "bos_token", None)
            specials = not (isinstance(bos, str) and bos and prompt.startswith(bos))
            ids = list(self.tokenizer(prompt, add_special_tokens=specials)["input_ids"])
            return check_token_ids(ids, self.vocab_size, what="the tokenizer's id")
        if isinstance(prompt, (bytes, bytearray)):
            raise TypeError("the prompt is bytes: decode it to text (str) first, or pass a list of token ids")
        if isinstance(prompt, Mapping) and "input_ids" in prompt:  # a tokenizer's output, padding dropped
            rows = tokenizer_rows(prompt)
            if len(rows) != 1:
                raise ValueError(f"the tokenizer output holds {len(rows)} prompts: call generate_batch with it (one "
                                 "row each) or generate once per prompt")
            prompt = rows[0]
        if isinstance(prompt, torch.Tensor):
            if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
                raise TypeError(f"prompt token ids must be integers, got a tensor of {prompt.dtype}")
            prompt = _one_row(prompt, tuple(prompt.shape)).tolist()
        elif isinstance(prompt, np.ndarray):
            if not np.issubdtype(prompt.dtype, np.integer):
                raise TypeError(f"prompt token ids must be integers, got an array of {prompt.dtype}")
            prompt = _one_row(prompt, prompt.shape).tolist()
        elif not isinstance(prompt, (list, tuple, range)):
            raise TypeError(f"the prompt must be text (str), a list of token ids or a tokenizer's output (with "
                            f"input_ids), got {type(prompt).__name__}")
        ids = [t if type(t) is int else check_int(f"prompt token id at position {i}", t)
               for i, t in enumerate(prompt)]
        return check_token_ids(ids, self.vocab_size)

    def decode(self, tokens: list[int], *, skip_special_tokens: bool = True) -> str | None:
        """The text of `tokens` (None without a tokenizer). Special tokens (the end token a generation stops at) are
        left out by default, as transformers' text-generation pipeline and vLLM leave them out of output text; the
        token ids keep them."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        *,
        eagle: str | Path | None = None,
        tokenizer: str | Path | None = None,
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
        dtype_source: str | None = None,
    ) -> "ModelPair":
        """Load a target and one drafter: `draft` (a causal LM: hub id or path) or `eagle` (an EAGLE-3 head folder
        in the released layout). With no arguments: the embedded target with its default embedded drafter
        (`DEFAULT_DRAFTER`); draft="embedded" / eagle="embedded" pick the embedded one explicitly. `dtype_source`:
        where an explicit `dtype` came from, for `dtype_reason` (default "asked for"; e.g. a run's recorded dtype)."""
        if draft is not None and eagle is not None:
            raise ValueError("give draft= (a separate LM) or eagle= (an EAGLE-3 head), not both")
        check_transformers()  # before any weights load
        device = check_device(device)
        asked = dtype
        dtype, dtype_reason = resolve_dtype(dtype, device)
        if dtype_source:  # an explicit dtype someone else chose (a run's contract, decoder.json): say whose
            dtype_reason = dtype_reason.replace(": asked for", f": {dtype_source}", 1)
        embedded = target is None
        if embedded:
            root = DEFAULT_PAIR_DIR
            if not (root / "target" / "config.json").exists():
                raise FileNotFoundError(f"the embedded default pair is missing under {root}; build it with "
                                        "`specpilot models build`")
            target, tokenizer = root / "target", tokenizer or root / "tokenizer"
            if draft is None and eagle is None:
                draft, eagle = (None, "embedded") if DEFAULT_DRAFTER == "eagle" else ("embedded", None)
        elif draft is None and eagle is None:
            raise ValueError("give a drafter with target=: draft= (a causal LM) or eagle= (an EAGLE-3 head)")
        for name, value in (("draft", draft), ("eagle", eagle)):
            if value == "embedded" and not embedded:
                raise ValueError(f"{name}='embedded' (--{name} embedded) belongs to the embedded target: leave "
                                 "target= (--target) unset")
        if eagle == "embedded" and not (DEFAULT_PAIR_DIR / "eagle" / "config.json").exists():
            raise FileNotFoundError(f"the embedded pair ships no EAGLE-3 head ({DEFAULT_PAIR_DIR / 'eagle'} is "
                                    "missing): use its draft (draft='embedded', --draft embedded) or give a head "
                                    "folder")
        measure = isinstance(asked, str) and asked.strip().lower() == AUTO and device == "cpu" and \
            half_support(torch.bfloat16, device)[0] == "native"
        too_big = auto_probe_too_big(target) if measure else None
        if too_big:  # measuring would hold fp32 and bf16 copies at once: decide by the CPU's features alone
            measure, dtype = False, torch.bfloat16
            dtype_reason = f"auto: bfloat16, {half_support(torch.bfloat16, device)[1]}; not measured: {too_big}"
        target_model = _load_lm(target, "target", dtype)
        if measure:  # measure this target, then load the choice
            dtype, dtype_reason = resolve_dtype(asked, device, model=target_model)
            if dtype != target_model.dtype:
                # loaded again, not converted with .to(): transformers keeps RoPE buffers and the modules a model
                # lists in _keep_in_fp32_modules in fp32 when it loads in half precision, and .to() would not
                del target_model
                target_model = _load_lm(target, "target", dtype)
        dtype_reason += _stored_dtype_note(target, dtype)
        tok = _load_tokenizer(tokenizer, target)
        draft_model = head = None
        if draft is not None:
            draft_model = _load_lm(DEFAULT_PAIR_DIR / "draft" if draft == "embedded" else draft, "draft", dtype)
            # the draft's own tokenizer files, when it has them, are compared with the pair's even when that one is
            # given explicitly: a draft trained with another id map would draft other strings
            draft_tok = _load_tokenizer(None, DEFAULT_PAIR_DIR / "draft" if draft == "embedded" else draft)
            check_same_vocabulary(target_model, draft_model, tok, draft_tok)
        if eagle is not None:
            from specpilot.drafting.eagle import Eagle3Head

            folder = DEFAULT_PAIR_DIR / "eagle" if eagle == "embedded" else checked_source(eagle, "eagle head")
            head = Eagle3Head.from_pretrained(folder, target_model.to(device))
            head.source = str(folder)
        if draft not in (None, "embedded"):
            dtype_reason += _stored_dtype_note(draft, dtype, "the draft LM's checkpoint")
        if eagle not in (None, "embedded"):
            dtype_reason += _stored_dtype_note(folder, dtype, "the EAGLE-3 head's checkpoint")
        drafter_name = "eagle" if head is not None else "draft"
        name = ("specpilot-default" if embedded else f"{Path(str(target)).name}+{Path(str(draft or eagle)).name}")
        if embedded and drafter_name != DEFAULT_DRAFTER:
            name += f"+{drafter_name}"
        return cls(target_model.to(device), draft_model.to(device) if draft_model is not None else None, tok,
                   name=name, eagle=head.to(device) if head is not None else None, dtype_reason=dtype_reason)

    @staticmethod
    def default_metrics() -> dict | None:
        path = DEFAULT_PAIR_DIR / "metrics.json"
        return json.loads(path.read_text()) if path.exists() else None
