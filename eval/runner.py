"""`evaluate()`: run every method on the same prompts, interleaved, and aggregate rows for the report.

Protocol (what makes the numbers comparable):
- every method gets the same token ids, the same max_new_tokens, sampling parameters and per-(prompt, repeat)
  seed; `ar` (our autoregressive baseline on the same caches and clock) is always run, as the speedup reference;
- warm-up generations of every method before anything is timed;
- per prompt and repeat, all methods run back to back in a rotated order (round-robin), so drift in machine load
  or clock frequency hits every method alike;
- wall time of each call is measured here, around the call, identically for all methods (perf_counter after
  device synchronisation); the decoder's own draft/verify/policy times only split that time;
- at temperature 0 every method's tokens are compared with `ar`'s (identical_to_ar); sampled runs are not
  comparable token for token (None);
- `concurrency` N > 1 additionally runs N streams at once (threads sharing the models and the device) and reports
  the same metrics under that load. On CPU the streams share the cores, so this measures contention, not batching.

Methods come from a registry: name -> factory(ctx) returning a callable method. Methods whose requirements are
missing (no --run for trained policies, no --grid result, module not built) are skipped with a note.
"""
from __future__ import annotations

import copy
import datetime
import json
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specpilot.drafting.pair import ModelPair
from specpilot.drafting.types import TreeConfig
from specpilot.eval.metrics import RunRecord, aggregate
from specpilot.eval.suites import Prompt, prompt_mix
from specpilot.drafting.control import Controller, FixedController, default_static_config


class MethodUnavailable(RuntimeError):
    """A method's requirement is missing; the evaluation skips it and says why."""


@dataclass
class EvalContext:
    """What method factories may use. `grid` is a grid-search result JSON path, `run_dir` a trained run."""

    pair: ModelPair
    tree: TreeConfig
    grid: str | Path | None = None
    run_dir: str | Path | None = None
    _cache: dict = field(default_factory=dict)

    @property
    def device(self) -> str:
        return str(self.pair.device)


Method = Callable[..., RunRecord]


class ControllerMethod:
    """Our speculative decoder steered by a Controller (fixed, grid, heuristics, trained policies)."""

    def __init__(self, name: str, pair: ModelPair, tree: TreeConfig, controller: Controller) -> None:
        from specpilot.drafting.decoder import SpeculativeDecoder

        self.name = name
        self.controller = controller
        self.decoder = SpeculativeDecoder(pair, tree)

    def describe(self) -> dict:
        return {**self.controller.describe(), "name": self.name, "tree": vars(self.decoder.tree)}

    def __call__(self, ids: list[int], **sampling) -> RunRecord:
        out = self.decoder.generate(ids, controller=self.controller, **sampling)
        return _record(self.name, out)


class ARMethod:
    """Our autoregressive baseline: target only, same caches and clock as the decoder."""

    name = "ar"

    def __init__(self, pair: ModelPair) -> None:
        self.pair = pair

    def describe(self) -> dict:
        return {"name": self.name, "impl": "specpilot.drafting.autoregressive_generate"}

    def __call__(self, ids: list[int], **sampling) -> RunRecord:
        from specpilot.drafting.decoder import autoregressive_generate

        return _record(self.name, autoregressive_generate(self.pair, ids, **sampling))


def _record(name: str, out) -> RunRecord:
    # token_times start after the (untimed) prefill inside the call; shift them so they count from the call
    return RunRecord(
        prompt_id="", method=name, tokens=list(out.tokens), wall_s=0.0,
        token_times=[out.prefill_s + t for t in out.token_times],
        cycles=[(c.depth, c.size, c.emitted) for c in out.cycles],
        draft_s=out.draft_s, verify_s=out.verify_s, policy_s=out.policy_s,
    )


# ---- registry ------------------------------------------------------------------------------------------------
def _controller(factory: Callable[[EvalContext], tuple[Controller, TreeConfig | None]]):
    def build(ctx: EvalContext, name: str) -> Method:
        controller, tree = factory(ctx)
        return ControllerMethod(name, ctx.pair, tree or ctx.tree, controller)
    return build


def _fixed(ctx: EvalContext):
    return FixedController(device=ctx.device), None


def _grid(ctx: EvalContext):
    if ctx.grid is None:
        raise MethodUnavailable("no grid-search result given (--grid GRID.json from `specpilot grid`)")
    try:
        best = json.loads(Path(ctx.grid).read_text())["best"]
        depth, size, width = int(best["depth"]), int(best["size"]), int(best.get("width", ctx.tree.width))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise MethodUnavailable(f"{ctx.grid}: not a grid result with best.depth/size/width ({err})") from err
    # the best static configuration may use another width or a deeper tree than the evaluation default
    tree = TreeConfig(width=width, max_depth=max(ctx.tree.max_depth, depth), max_size=max(ctx.tree.max_size, size))
    return FixedController(depth, size), tree


def _heuristic(key: str):
    def factory(ctx: EvalContext):
        try:
            from specpilot.policies.heuristics import make_heuristic
        except ImportError as err:
            raise MethodUnavailable(f"specpilot.policies.heuristics is not available ({err})") from err
        return make_heuristic(key, device=ctx.device), None
    return factory


def _trained(key: str):
    def factory(ctx: EvalContext):
        if ctx.run_dir is None:
            raise MethodUnavailable("no trained run given (--run RUN_DIR from `specpilot train`)")
        if "run_controllers" not in ctx._cache:
            try:
                from specpilot.policies.ppo import load_run_controllers
                ctx._cache["run_controllers"] = load_run_controllers(ctx.run_dir, device="cpu")
            except Exception as err:  # noqa: BLE001 - any load failure means: skip this method, say why
                ctx._cache["run_controllers"] = err
        loaded = ctx._cache["run_controllers"]
        if isinstance(loaded, Exception):
            raise MethodUnavailable(f"could not load policies from {ctx.run_dir}: {loaded}")
        if key not in loaded:
            raise MethodUnavailable(f"{ctx.run_dir} has no {key!r} policy (has: {', '.join(sorted(loaded))})")
        # each stream gets its own copy: controllers keep per-generation state
        return copy.deepcopy(loaded[key]), None
    return factory


def _hf(assisted: bool):
    def build(ctx: EvalContext, name: str) -> Method:
        from specpilot.eval.hf_baselines import HFGenerate, configure_assistant

        if assisted and "hf_assistant" not in ctx._cache:
            # same draft length as our `fixed` default, HF's default constant schedule and confidence threshold
            ctx._cache["hf_assistant"] = configure_assistant(
                ctx.pair.draft, num_assistant_tokens=default_static_config(ctx.device)[0])
        return HFGenerate(ctx.pair, assisted=assisted, name=name)
    return build


METHODS: dict[str, Callable[[EvalContext, str], Method]] = {
    "ar": lambda ctx, name: ARMethod(ctx.pair),
    "hf_generate": _hf(assisted=False),
    "hf_assisted": _hf(assisted=True),
    "fixed": _controller(_fixed),
    "grid": _controller(_grid),
    "ddd": _controller(_heuristic("ddd")),
    "svip": _controller(_heuristic("svip")),
    "confidence": _controller(_heuristic("confidence")),
    "hf_heuristic": _controller(_heuristic("hf_heuristic")),
    "ltd": _controller(_trained("ltd")),
    "depth_only": _controller(_trained("depth_only")),
    "size_only": _controller(_trained("size_only")),
}


def build_methods(names: list[str], ctx: EvalContext) -> tuple[dict[str, Method], dict[str, str]]:
    """Build the requested methods (plus `ar`, the reference); return (methods, {skipped name: reason})."""
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    methods: dict[str, Method] = {}
    skipped: dict[str, str] = {}
    for name in ["ar"] + [n for n in names if n != "ar"]:
        try:
            methods[name] = METHODS[name](ctx, name)
        except MethodUnavailable as err:
            skipped[name] = str(err)
    return methods, skipped


# ---- measurement -----------------------------------------------------------------------------------------------
class MemoryMonitor:
    """Peak memory per call: the CUDA allocator's peak on GPU; on CPU the process RSS, sampled every
    `interval_s` by one background thread (plus before and after each call, so short calls are not missed)."""

    def __init__(self, device: torch.device, interval_s: float = 0.02) -> None:
        self.cuda = device.type == "cuda"
        self.interval_s = interval_s
        self._peak = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if not self.cuda:
            import psutil
            self._proc = psutil.Process()

    def _rss_mb(self) -> float:
        return self._proc.memory_info().rss / 2**20

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = self._rss_mb()
            with self._lock:
                self._peak = max(self._peak, rss)

    def __enter__(self) -> "MemoryMonitor":
        if not self.cuda:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def begin(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            with self._lock:
                self._peak = self._rss_mb()

    def end(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        rss = self._rss_mb()
        with self._lock:
            return max(self._peak, rss)


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _timed(method: Method, ids: list[int], sampling: dict, device: torch.device,
           memory: MemoryMonitor | None) -> RunRecord:
    if memory is not None:
        memory.begin()
    t0 = _sync(device)
    rec = method(ids, **sampling)
    rec.wall_s = _sync(device) - t0
    if memory is not None:
        rec.peak_mem_mb = memory.end()
    return rec


# ---- controllers measured with the same loop and clock (grid re-measure, training-time live evaluation) --------
def measure_controllers(pair: ModelPair, controllers: dict[str, Controller], prompts, *, tree: TreeConfig,
                        trees: dict[str, TreeConfig] | None = None, max_new_tokens: int = 64, repeats: int = 1,
                        warmup: int = 1, seed: int = 0, progress: bool = False) -> dict[str, dict]:
    """Live throughput of each controller and of `ar` on `prompts` (strings or token ids), greedy, with the
    evaluation protocol: warm-up first, then per (prompt, repeat) every method once in a rotated order, each call
    timed around the call (perf_counter after device synchronisation, prefill included) as `evaluate()` times it.
    trees: per-controller TreeConfig (default `tree`). Returns {name: {tokens, time_s, tokens_per_s, speedup,
    mean_accepted_length, policy_s, policy_overhead, depth_mean, size_mean}}."""
    methods: dict[str, Method] = {"ar": ARMethod(pair)}
    for name, controller in controllers.items():
        methods[name] = ControllerMethod(name, pair, (trees or {}).get(name, tree), controller)
    ids = [pair.encode(getattr(p, "prompt", p)) for p in prompts]
    if not ids:
        raise ValueError("measure_controllers needs at least one prompt")
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "top_k": 0, "top_p": 1.0}
    for name in methods:
        for w in range(warmup):
            methods[name](ids[w % len(ids)], **sampling, seed=seed)
    names, records = list(methods), {name: [] for name in methods}
    turn, started = 0, time.perf_counter()
    for r in range(repeats):
        for i, prompt in enumerate(ids):
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                records[name].append(_timed(methods[name], prompt, {**sampling, "seed": seed + turn}, pair.device,
                                            None))
            turn += 1
            if progress:
                print(f"  live: repeat {r + 1}/{repeats} prompt {i + 1}/{len(ids)} "
                      f"({time.perf_counter() - started:.0f}s)", flush=True)
    out = {name: _throughput(recs) for name, recs in records.items()}
    for row in out.values():
        row["speedup"] = row["tokens_per_s"] / out["ar"]["tokens_per_s"]
    return out


def _throughput(recs: list[RunRecord]) -> dict:
    tokens, time_s = sum(r.n_tokens for r in recs), sum(r.wall_s for r in recs)
    cycles = [c for r in recs for c in r.cycles]
    policy_s = sum(r.policy_s for r in recs)
    return {"tokens": tokens, "time_s": time_s, "tokens_per_s": tokens / time_s if time_s > 0 else float("nan"),
            "mean_accepted_length": tokens / len(cycles) if cycles else 1.0, "policy_s": policy_s,
            "policy_overhead": policy_s / time_s if time_s > 0 else float("nan"),
            "depth_mean": sum(c[0] for c in cycles) / len(cycles) if cycles else None,
            "size_mean": sum(c[1] for c in cycles) / len(cycles) if cycles else None}


# ---- the evaluation ------------------------------------------------------------------------------------------
@dataclass
class EvalResult:
    results: list[dict]
    meta: dict
    records: list[RunRecord]


def _encode_all(prompts: list[Prompt], encode: Callable[[str], list[int]], limit: int) -> tuple[list[list[int]], int]:
    """Token ids per prompt, keeping the last `limit` tokens (the end of a prompt is what the model continues)."""
    out, truncated = [], 0
    for p in prompts:
        ids = list(encode(p.prompt))
        if not ids:
            raise ValueError(f"prompt {p.id!r} encodes to no tokens")
        if len(ids) > limit:
            ids, truncated = ids[-limit:], truncated + 1
        out.append(ids)
    return out, truncated


def evaluate(prompts: list[Prompt], *, pair: ModelPair, methods: list[str] | None = None,
             temperatures: tuple[float, ...] = (0.0, 1.0), top_k: int = 0, top_p: float = 1.0,
             max_new_tokens: int = 128, repeats: int = 1, warmup: int = 1, concurrency: int = 1,
             tree: TreeConfig | None = None, grid: str | Path | None = None, run_dir: str | Path | None = None,
             seed: int = 0, encode: Callable[[str], list[int]] | None = None,
             progress: Callable[[str], None] | None = None,
             sampled_methods: list[str] | None = None) -> EvalResult:
    """Evaluate `methods` (default: every registered one that is available) on `prompts`; see the module
    docstring for the protocol. Returns result rows (one per task x language x method x temperature x
    concurrency), a meta block and the raw per-run records. `sampled_methods`: the methods run at temperatures
    > 0 (default: all; `ar` always runs, it is the reference)."""
    if not prompts:
        raise ValueError("no prompts to evaluate")
    if repeats < 1 or warmup < 0 or concurrency < 1:
        raise ValueError("repeats and concurrency must be >= 1 and warmup >= 0")
    tree = tree or TreeConfig()
    ctx = EvalContext(pair=pair, tree=tree, grid=grid, run_dir=run_dir)
    built, skipped = build_methods(list(methods or METHODS), ctx)
    names = list(built)
    device = pair.device
    say = progress or (lambda msg: None)

    # leave room for the generation and the deepest draft lookahead of any method's tree
    max_depth = max([tree.max_depth] + [getattr(getattr(m, "decoder", None), "tree", tree).max_depth
                                        for m in built.values()])
    context = pair.max_context
    limit = context - max_new_tokens - max_depth - 2
    if limit < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in a {context}-token context")
    all_ids, n_truncated = _encode_all(prompts, encode or pair.encode, limit)

    failed: dict[str, str] = {}
    records: list[RunRecord] = []
    sampled_names = names if sampled_methods is None else [n for n in names if n == "ar" or n in sampled_methods]
    with MemoryMonitor(device) as memory:
        for temperature in temperatures:
            sampling = dict(max_new_tokens=max_new_tokens, temperature=float(temperature), top_k=top_k, top_p=top_p)
            running = names if temperature == 0 else sampled_names
            for name in running:  # warm-up: kernels, allocator, caches; not timed or recorded
                for w in range(warmup if name not in failed else 0):
                    try:
                        built[name](all_ids[w % len(all_ids)], **sampling, seed=seed)
                    except Exception as err:  # noqa: BLE001 - a broken method must not sink the others
                        if name == "ar":
                            raise
                        failed[name] = f"{type(err).__name__}: {err}"
                        break
            for i, ids in enumerate(all_ids):
                for r in range(repeats):
                    k = i * repeats + r
                    order = running[k % len(running):] + running[: k % len(running)]
                    for name in order:
                        if name in failed:
                            continue
                        try:
                            rec = _timed(built[name], ids, {**sampling, "seed": seed + k}, device, memory)
                        except Exception as err:  # noqa: BLE001 - a broken method must not sink the others
                            if name == "ar":
                                raise
                            failed[name] = f"{type(err).__name__}: {err}"
                            continue
                        rec.prompt_id, rec.repeat = prompts[i].id, r
                        rec.temperature, rec.concurrency = float(temperature), 1
                        records.append(rec)
                say(f"T={temperature:g} prompt {i + 1}/{len(all_ids)} done")
            if concurrency > 1:
                records.extend(_run_concurrent(ctx, running, failed, prompts, all_ids, sampling, seed, concurrency,
                                               device, memory))
                say(f"T={temperature:g} concurrency {concurrency} done")

    records = [r for r in records if r.method not in failed]
    results = _aggregate(records, prompts, [n for n in names if n not in failed], temperatures, concurrency)
    method_info = {n: (built[n].describe() if hasattr(built[n], "describe") else {"name": n}) for n in names}
    meta = build_meta(pair, tree=tree, prompts=prompts, temperatures=temperatures, top_k=top_k, top_p=top_p,
                      max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup, concurrency=concurrency,
                      seed=seed, methods=method_info, skipped={**skipped, **failed}, n_truncated=n_truncated,
                      prompt_token_limit=limit)
    if sampled_methods is not None:
        meta["sampled_methods"] = sampled_names
    return EvalResult(results=results, meta=meta, records=records)


def _run_concurrent(ctx: EvalContext, names: list[str], failed: dict, prompts: list[Prompt],
                    all_ids: list[list[int]], sampling: dict, seed: int, n: int, device: torch.device,
                    memory: MemoryMonitor) -> list[RunRecord]:
    """N streams at once: prompts in batches of N, one thread per prompt; methods rotated per batch. Every thread
    builds its own method instance (decoders and controllers keep per-generation state)."""
    out: list[RunRecord] = []
    active = [m for m in names if m not in failed]
    instances = {m: [METHODS[m](ctx, m) for _ in range(n)] for m in active}
    batches = [list(range(s, min(s + n, len(all_ids)))) for s in range(0, len(all_ids), n)]
    for b, batch in enumerate(batches):
        order = active[b % len(active):] + active[: b % len(active)]
        for name in order:
            got: list[RunRecord | None] = [None] * len(batch)
            errors: list[BaseException] = []

            def work(slot: int, idx: int) -> None:
                try:
                    got[slot] = _timed(instances[name][slot], all_ids[idx], {**sampling, "seed": seed + idx},
                                       device, None)
                except Exception as err:  # noqa: BLE001 - reported below
                    errors.append(err)

            memory.begin()
            threads = [threading.Thread(target=work, args=(s, idx)) for s, idx in enumerate(batch)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            peak = memory.end()
            if errors:
                if name == "ar":
                    raise errors[0]
                failed[name] = f"under concurrency {n}: {type(errors[0]).__name__}: {errors[0]}"
                continue
            for slot, idx in enumerate(batch):
                rec = got[slot]
                rec.prompt_id, rec.peak_mem_mb = prompts[idx].id, peak
                rec.temperature, rec.concurrency = sampling["temperature"], n
                out.append(rec)
    return out


def _aggregate(records: list[RunRecord], prompts: list[Prompt], names: list[str],
               temperatures: tuple[float, ...], concurrency: int) -> list[dict]:
    by_id = {p.id: p for p in prompts}
    groups: dict[tuple, list[RunRecord]] = {}
    for r in records:
        p = by_id[r.prompt_id]
        groups.setdefault((p.task, p.language, r.method, r.temperature, r.concurrency), []).append(r)
    # greedy reference tokens: ar's first repeat of each prompt
    ar_tokens = {r.prompt_id: r.tokens for r in records
                 if r.method == "ar" and r.temperature == 0.0 and r.concurrency == 1 and r.repeat == 0}
    split_of = {}
    for p in prompts:
        split_of.setdefault((p.task, p.language), set()).add(p.split)
    rows = []
    levels = [1] + ([concurrency] if concurrency > 1 else [])
    for temperature in temperatures:
        for c in levels:
            for task, lang in sorted({(p.task, p.language) for p in prompts}):
                ar = groups.get((task, lang, "ar", float(temperature), c))
                for name in names:
                    recs = groups.get((task, lang, name, float(temperature), c))
                    if not recs:
                        continue
                    identical = (all(r.tokens == ar_tokens.get(r.prompt_id) for r in recs)
                                 if float(temperature) == 0.0 else None)
                    row = {"task": task, "language": lang, "split": "/".join(sorted(split_of[(task, lang)])),
                           "method": name, "temperature": float(temperature), "concurrency": c}
                    row.update(aggregate(recs, ar, identical=identical))
                    rows.append(row)
    return rows


# ---- meta ---------------------------------------------------------------------------------------------------
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:  # noqa: BLE001 - a missing package is reported as None
        return None


def build_meta(pair: ModelPair, *, tree: TreeConfig, prompts: list[Prompt], temperatures, top_k: int,
               top_p: float, max_new_tokens: int, repeats: int, warmup: int, concurrency: int, seed: int,
               methods: dict, skipped: dict, n_truncated: int = 0, prompt_token_limit: int | None = None) -> dict:
    """Everything a reader needs to know what the numbers were measured on."""
    device = pair.device
    import os
    return {
        "models": pair.identity(),
        "dtype": str(pair.dtype).replace("torch.", ""),
        "device": str(device),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": _version("transformers"), "specpilot": _version("specpilot")},
        "sampling": {"temperatures": [float(t) for t in temperatures], "top_k": top_k, "top_p": top_p,
                     "max_new_tokens": max_new_tokens, "seed": seed},
        "protocol": {"repeats": repeats, "warmup": warmup, "concurrency": concurrency,
                     "interleaving": "round-robin per prompt and repeat, order rotated",
                     "speedup": "pooled tokens/s of the method over pooled tokens/s of ar on the same prompts",
                     "itl": "gaps between successive token deliveries (a cycle's tokens are one delivery)",
                     "peak_mem": "CUDA allocator peak" if device.type == "cuda" else "process RSS, sampled"},
        "tree": {"width": tree.width, "max_depth": tree.max_depth, "max_size": tree.max_size},
        "methods": methods,
        "skipped": skipped,
        "prompt_mix": prompt_mix(prompts),
        "prompts_truncated": n_truncated,
        "prompt_token_limit": prompt_token_limit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
