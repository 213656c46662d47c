"""`evaluate_batches()`: every method decoding the prompts in batches of B, for each B, interleaved (greedy or
sampled at one temperature).

The batched counterpart of `specpilot.eval.runner.evaluate`, measured by the same loop (`specpilot.eval.rounds`:
`Measurer`, `run_rounds`, `RoundPlan`) and compared by the same statistics (`specpilot.eval.compare.compare`):
- a *unit* is one batch of B prompts (the prompts in order, wrapping around so every batch is full) in one round;
  per unit every method decodes the same batch back to back, in a balanced (Williams design) order per unit
  (`rounds.method_order`);
- the reference `ar` is batched autoregressive decoding (`drafting.batch_ar.autoregressive_generate_batch`); every
  Controller method decodes through `SpeculativeDecoder.generate_batch` with its own controller and tree (one
  decision per cycle for the batch; batch-aware controllers read `DraftState.batch_size`); transformers' methods
  have no batched path here and are skipped with a note;
- throughput = all sequences' tokens / the call's wall time (prefill included, for every method alike), pooled
  over units; per-token latency = mean over the batch's sequences of (time until the sequence's last token) /
  (its tokens): what one client of the batch waits per token;
- exactness first: every method's greedy output of every sequence is compared with batched `ar`'s of the same
  unit (`identical_to_ar`, `mismatched_sequences`);
- at temperature > 0 every method samples (batched `ar` too: `autoregressive_generate_batch(temperature=...)`)
  with per-sequence seeds: sequence i of a unit with seed s draws from its own generator seeded s * B + i
  (`sequence_seeds`), the same for every method of the unit, so no sequence's draws depend on its batchmates'.
  Sampled outputs are draws, not compared token by token (`identical_to_ar` is None): exactness there is the
  target's law per sequence (SAMPLED_EXACTNESS names the tests that prove it); throughput and ms/token are
  measured and paired exactly as when greedy.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specpilot.drafting.checks import check_int
from specpilot.drafting.control import Controller
from specpilot.drafting.stopping import request_ending, stopping_options
from specpilot.drafting.types import TreeConfig
from specpilot.eval.compare import compare, unit_records
from specpilot.eval.methods import ARMethod, ControllerMethod, EvalContext, build_methods
from specpilot.eval.metrics import RunRecord
from specpilot.eval.rounds import Measurer, MemoryMonitor, RoundPlan, run_rounds

UNBATCHED = ("hf_generate", "hf_assisted")  # transformers' methods: no batched path in this evaluation
SAMPLED_EXACTNESS = ("sampled: outputs are draws, not compared token by token; every method follows the target's "
                     "law per sequence (proven by tests/test_batch_decoding.py::test_sampled_law_per_sequence)")
GREEDY_EXACTNESS = "greedy: every sequence's tokens compared with batched ar's of the same batch"


def sequence_seeds(seed: int, batch_size: int) -> list[int]:
    """Per-sequence seeds of a unit with seed `seed`: seed * B + i for row i (distinct over units and rows)."""
    return [int(seed) * batch_size + i for i in range(batch_size)]


@dataclass
class BatchRecord(RunRecord):
    """One timed batch: `tokens` all sequences' tokens concatenated (so n_tokens is the batch's), `sequences` each
    sequence's tokens, `per_token_s` the mean over sequences of (time to its last token) / (its tokens);
    `cycles` the batch's cycles (depth, size, emitted by the longest-running sequence: it took part in all)."""

    sequences: list[list[int]] = field(default_factory=list)
    per_token_s: float = math.nan
    batch_size: int = 1


class BatchMethod:
    """A method (batch of token-id lists, max_new_tokens=, temperature=, top_k=, top_p=, seed=) -> BatchRecord,
    for `Measurer`; `run(batch, max_new_tokens, sampling)` decodes, sampling {} when greedy, else temperature,
    top_k, top_p and the per-sequence seeds (`sequence_seeds`)."""

    def __init__(self, name: str, run: Callable[..., list], describe: dict) -> None:
        self.name, self._run, self._describe = name, run, describe

    def describe(self) -> dict:
        return self._describe

    def __call__(self, batch: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, **ending) -> BatchRecord:
        # ending: the stop strings / stop token ids / ignore_eos `evaluate_batches` checked once, passed on as given
        sampling = {} if temperature == 0.0 else dict(temperature=temperature, top_k=top_k, top_p=top_p,
                                                      seed=sequence_seeds(seed, len(batch)))
        sampling.update(ending)
        outs = self._run(batch, max_new_tokens, sampling)
        longest = max(outs, key=lambda o: len(o.cycles))
        waits = [(o.prefill_s + o.token_times[-1]) / len(o.tokens) for o in outs if o.tokens and o.token_times]
        return BatchRecord(prompt_id="", method=self.name, tokens=[t for o in outs for t in o.tokens], wall_s=0.0,
                           cycles=[(c.depth, c.size, c.emitted) for c in longest.cycles],
                           draft_s=longest.draft_s, verify_s=longest.verify_s, policy_s=longest.policy_s,
                           prefill_s=outs[0].prefill_s, sequences=[list(o.tokens) for o in outs],
                           per_token_s=float(np.mean(waits)) if waits else math.nan, batch_size=len(batch))


def batch_methods(ctx: EvalContext, methods: list[str] | None, controllers: dict | None
                  ) -> tuple[dict[str, BatchMethod], dict[str, str]]:
    """The batched form of the registry's methods (`build_methods`: `ar` first) and of extra `controllers`
    ({name: Controller or (Controller, TreeConfig)}); returns (methods, {skipped name: reason})."""
    from specpilot.drafting.batch_ar import autoregressive_generate_batch

    names = [n for n in (methods if methods is not None else []) if n not in UNBATCHED]
    built, skipped = build_methods(names, ctx)
    skipped.update({n: "no batched implementation (transformers' generate)" for n in (methods or [])
                    if n in UNBATCHED})
    for name, entry in (controllers or {}).items():
        controller, tree = entry if isinstance(entry, tuple) else (entry, ctx.tree)
        if not isinstance(controller, Controller):
            raise TypeError(f"controllers[{name!r}] is a {type(controller).__name__}, not a Controller")
        built[name] = ControllerMethod(name, ctx.pair, tree, controller)
    out = {}
    for name, method in built.items():
        if isinstance(method, ARMethod):
            out[name] = BatchMethod(name, lambda batch, n, sampling: autoregressive_generate_batch(
                ctx.pair, batch, max_new_tokens=n, **sampling),
                                    {"name": name, "impl": "specpilot.drafting.batch_ar.autoregressive_generate_batch"})
        elif isinstance(method, ControllerMethod):
            out[name] = BatchMethod(name, lambda batch, n, sampling, m=method: m.decoder.generate_batch(
                batch, controller=m.controller, max_new_tokens=n, **sampling), {**method.describe(), "batched": True})
        else:
            skipped[name] = "no batched implementation"
    return out, skipped


def batch_units(ids: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """The prompts in batches of `batch_size`, in order, wrapping around so every batch is full and every prompt
    is decoded at least once: ceil(n / B) batches."""
    n = len(ids)
    return [[ids[(j * batch_size + i) % n] for i in range(batch_size)] for j in range(math.ceil(n / batch_size))]


def evaluate_batches(ids: list[list[int]], *, pair, batch_sizes: list[int], tree: TreeConfig,
                     methods: list[str] | None = None, controllers: dict | None = None, max_new_tokens: int = 64,
                     plan: RoundPlan | None = None, warmup: int = 1, seed: int = 0, grid=None, run_dir=None,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, stop_strings=None,
                     stop_token_ids=None, ignore_eos: bool = False,
                     progress: Callable[[str], None] | None = None) -> dict:
    """Every method on `ids` (token-id lists) in batches of each B in `batch_sizes`, greedy (temperature 0) or
    sampled at `temperature` (with top_k / top_p; per-sequence seeds), interleaved (module docstring).
    `methods`: registry names (None: none but `ar`, which always runs); `controllers`: more methods by name,
    {name: Controller or (Controller, TreeConfig)}. `plan` (default one round) applies per batch size;
    its time budget is shared evenly by the batch sizes still to run. stop_strings, stop_token_ids, ignore_eos: where
    each sequence ends, as `generate_batch` takes them, alike for every method.
    Returns {"batch_sizes": [section per B], "methods": {name: describe}, "skipped": {...},
    "records": {B: [BatchRecord]}}: each section holds its temperature and how exactness stands there
    (`exactness`), per method tokens/s, per-token latency, speedup over batched `ar` with its 95% paired interval
    and verdict, identical_to_ar (None when sampling), and the comparisons between the per-batch-size methods
    (BATCH_PAIRS)."""
    if isinstance(batch_sizes, (str, bytes)):
        raise TypeError(f"batch_sizes must be a list of integers, got the string {batch_sizes!r}")
    sizes = [check_int("batch size", b, minimum=1) for b in batch_sizes]  # 1.5 is refused, not run as 1
    if not ids or not sizes:
        raise ValueError("evaluate_batches needs prompts and batch sizes >= 1")
    if len(set(sizes)) != len(sizes):  # each size is one section of the report
        raise ValueError(f"batch_sizes {sizes} names a size twice")
    plan = plan or RoundPlan.make(1)
    say = progress or (lambda msg: None)
    ctx = EvalContext(pair=pair, tree=tree, grid=grid, run_dir=run_dir)
    built, skipped = batch_methods(ctx, methods, controllers)
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    # on the pair before any method runs: a method failing on them would be skipped, not refused
    ending = stopping_options(stop_strings, stop_token_ids, ignore_eos)
    request_ending(pair, **ending)
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, **ending)
    if temperature > 0:
        sampling.update(top_k=top_k, top_p=top_p)
    failed: dict[str, str] = {}
    sections, all_records = [], {}
    started = time.perf_counter()
    with MemoryMonitor(pair.device) as memory:
        for j, size in enumerate(sizes):
            units = batch_units(ids, size)
            records: list[RunRecord] = []
            measurer = Measurer(built, units, [f"B{size}/u{k}" for k in range(len(units))], pair.device, memory,
                                seed, failed, records)
            deadline = (None if plan.time_budget_s is None else time.perf_counter()
                        + (started + plan.time_budget_s - time.perf_counter()) / (len(sizes) - j))
            measurer.warmup(list(built), sampling, warmup)
            rounds = run_rounds(measurer, list(built), sampling, plan, deadline=deadline,
                                say=lambda msg, b=size: say(f"batch size {b}: {msg}"))
            records = [r for r in records if r.method not in failed]
            all_records[size] = records
            sections.append({"batch_size": size, "temperature": temperature, "units": len(units), "rounds": rounds,
                             "exactness": SAMPLED_EXACTNESS if temperature > 0 else GREEDY_EXACTNESS,
                             **batch_section(records, [n for n in built if n not in failed], seed=seed,
                                             temperature=temperature)})
    return {"batch_sizes": sections, "methods": {n: m.describe() for n, m in built.items()},
            "skipped": {**skipped, **failed}, "records": all_records,
            "protocol": {"max_new_tokens": max_new_tokens, "warmup": warmup, "temperature": temperature,
                         **({"top_k": top_k, "top_p": top_p, "seeds": "per sequence: unit seed * B + row"}
                            if temperature > 0 else {}),
                         **ending,
                         "rounds": plan.describe(), "seconds": round(time.perf_counter() - started, 1)}}


# the per-batch-size questions beside "each method vs batched ar" (when both ran)
BATCH_PAIRS = (("batch_table", "grid"), ("ltd", "batch_table"), ("ltd_guarded", "batch_table"), ("ltd", "grid"),
               ("batch_table", "fixed"))


def batch_section(records: list[RunRecord], names: list[str], *, seed: int = 0, temperature: float = 0.0) -> dict:
    """One batch size's numbers at one temperature (see `evaluate_batches`): per method rows and the BATCH_PAIRS
    comparisons; sequences are compared with batched ar's only when greedy."""
    by_method = unit_records(records, temperature=temperature)
    greedy = temperature == 0.0
    reference = {k: r.sequences for k, r in by_method.get("ar", {}).items()} if greedy else {}
    rows = []
    for name in names:
        units = by_method.get(name, {})
        recs = list(units.values())
        if not recs:
            continue
        tokens, wall = sum(r.n_tokens for r in recs), sum(r.wall_s for r in recs)
        mismatched = sum(a != b for k, r in units.items() if k in reference
                         for a, b in zip(r.sequences, reference[k]))
        cycles = [c for r in recs for c in r.cycles]
        c = compare(by_method, name, "ar", temperature=temperature, seed=seed) if name != "ar" else None
        # the interval over batches (each batch's rounds together) when there are >= 2 batches, else over rounds
        by_batches = c is not None and c["n_prompts"] >= 2
        rows.append({"method": name, "tokens": tokens, "time_s": wall,
                     "tokens_per_s": tokens / wall if wall > 0 else math.nan,
                     "per_token_ms": 1e3 * float(np.mean([r.per_token_s for r in recs])),
                     "speedup": c["ratio"] if c else (1.0 if name == "ar" else math.nan),
                     "speedup_ci": (c["ci"] if by_batches else c["ci_units"]) if c else [None, None],
                     "interval": ("batches" if by_batches else "rounds") if c else None,
                     "verdict": (c["verdict"] if by_batches else _verdict(c["ci_units"])) if c else None,
                     "identical_to_ar": mismatched == 0 if greedy else None,
                     "mismatched_sequences": mismatched if greedy else None,
                     "depth_mean": float(np.mean([x[0] for x in cycles])) if cycles else None,
                     "size_mean": float(np.mean([x[1] for x in cycles])) if cycles else None,
                     "n_units": len(units)})
    comparisons = [c for m, b in BATCH_PAIRS if m in by_method and b in by_method
                   if (c := compare(by_method, m, b, temperature=temperature, seed=seed)) is not None]
    return {"methods": rows, "comparisons": comparisons}


def _verdict(ci) -> str:
    from specpilot.eval.stats import Interval, verdict

    return verdict(Interval(math.nan, *(math.nan if v is None else v for v in ci), 0))
