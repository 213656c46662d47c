"""Latency profile: what draft levels and verifications cost on this hardware, for the replay environments.

Measured with the decoder's own steps (`session.draft_level()`, `session.verify(size)`) on live generations whose
depth and size are drawn at random each cycle, so every level index and a spread of sizes and contexts is seen;
a drawn depth 0 starts a streak of 1..max_depth+1 plain steps, as a policy that stops drafting runs them.

Model of one cycle's time (seconds) with depth d, verified size V, context length L, n tokens caught up:

    draft(d, n)  = first(n) + sum_{l=2..d} level(l)
        first(n)  time of a cycle's first draft forward when it feeds n new tokens (catch-up + root): the tokens
                  emitted by plain steps are caught up here, charged to the next cycle that drafts
        level(l)  time of the l-th draft forward (it attends to (l-1)*W fed tree nodes)
    verify(V, L) = m(V') + o(bucket(L))              V >= 1: one target forward over the root and V candidates
        m(V)      verify time at size V pooled over contexts
        V'        V, or width - 1 where the target's CPU linears pad V + 1 rows to `width` (meta "row_plan":
                  13 rows cost what 16 do, so V = 12 is priced at the measured V = 15, not between 8 and 15)
        o(b)      mean residual of the samples in context bucket b (edges `context_edges`); 0 for empty buckets
    verify(0, L) = plain(L)                          a plain step (depth 0): one target forward on the root alone
        plain(L)  fitted on plain steps only, over context length (`plain`): the decoder takes them on the
                  autoregressive path (no tree block, mask or cache compaction), so they are not a point on the
                  m(V) line (on CPU a plain step costs well below the line's intercept); constant outside the
                  measured contexts. Without plain steps (a profile of --profile-cycles 0, or an older one) a
                  plain step is priced at the AR reference timed with the profile (meta ar_seconds_per_token: the
                  same one-token target forward), else at m(0) + o(bucket(L)).

Each curve (first over n, level over l, m over V) is a weighted least-squares line through the per-key means plus
each key's residual shrunk by count / (count + `shrink`) and by its noise (`_kept_share`: empirical Bayes, the
residuals' spread beyond the key means' sampling noise): keys seen often keep their own mean where the curve has real
steps (GPU kernels), rarely seen keys and bumps within the noise lean on the line (a few noisy samples do not make a
bump, and a policy trained in replay cannot chase one). Between measured keys the
values are interpolated, outside they follow the line. Means, not medians: replay predicts sums of times, i.e.
throughput. Standard deviations are kept for optional noise. Saved as JSON (`LatencyProfile.save/load`).

Decisions: each profile cycle also asks a probe policy (`policies.learned.probe_controller`: random actors of the
demo's [64, 64] layers) every question a learned controller is asked, right after the step that precedes it, and
times its answer (the answer is not used). `decision` keeps those times per question ("skip", "stop", "size"): replay
charges them to the questions a controller answers with a policy network (`Controller.actor_questions`), as the live
decoder's clock does; a profile without them (older files) charges nothing.

On a shared machine time drifts with load: measure the profile close in time to what it should predict
(`collect_samples` can accumulate several passes interleaved with other work).
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from specpilot.drafting.errors import InputFileError
from specpilot.drafting.files import atomic_write_text, read_json

# one definition each, beside the file name
from specpilot.artifacts.profile import DEFAULT_PROFILE_CYCLES, PROFILE_VERSION, PROFILE_VERSIONS_READ  # noqa: E402, F401


def _stats(samples: dict) -> dict:
    keys = sorted(samples)
    return {"keys": keys,
            "mean": [float(np.mean(samples[k])) for k in keys],
            "std": [float(np.std(samples[k])) for k in keys],
            "count": [len(samples[k]) for k in keys]}


def _curve(stats: dict, x: np.ndarray, shrink: float) -> np.ndarray:
    """Line fit through the per-key means + shrunk residuals (see the module docstring), evaluated at x."""
    keys = np.asarray(stats["keys"], dtype=float)
    mean = np.asarray(stats["mean"], dtype=float)
    count = np.asarray(stats["count"], dtype=float)
    x = np.asarray(x, dtype=float)
    if keys.size == 0:
        raise ValueError("the latency profile has no samples for this step; measure it again with more prompts")
    if keys.size == 1:
        return np.full(x.shape, mean[0])
    slope, intercept = np.polyfit(keys, mean, 1, w=np.sqrt(count))
    line_at_keys = intercept + slope * keys
    residual = mean - line_at_keys
    values = line_at_keys + residual * _kept_share(residual, count, stats.get("std"), shrink)
    inside = (x >= keys[0]) & (x <= keys[-1])
    return np.where(inside, np.interp(x, keys, values), intercept + slope * x)


def _kept_share(residual: np.ndarray, count: np.ndarray, std, shrink: float) -> np.ndarray:
    """How much of each key's residual from the line a curve keeps: count / (count + shrink) (a rarely seen key leans
    on the line), and at most tau^2 / (tau^2 + se^2) (empirical Bayes): se^2 is the key mean's sampling variance (its
    samples' variance, shrunk towards the pooled one by the same pseudo-count, over its count) and tau^2 the
    residuals' spread beyond that noise. A curve whose bumps are within the noise follows its line (600 profile
    cycles give 9-80 per verification size: a V=12 slower than V=16 in one profile and faster in the next), one with
    real steps (GPU kernels, tiles) keeps them."""
    by_count = count / (count + shrink)
    if std is None:  # (no spread recorded: the count share alone)
        return by_count
    std = np.asarray(std, dtype=float)
    pooled = float(np.sum(count * std ** 2) / np.sum(count))
    se2 = (count * std ** 2 + shrink * pooled) / (count + shrink) / count
    tau2 = max(0.0, float(np.mean(residual ** 2 - se2)))
    by_noise = np.divide(tau2, tau2 + se2, out=np.zeros_like(se2), where=(tau2 + se2) > 0)
    return np.minimum(by_count, by_noise)


@dataclass
class LatencyProfile:
    """Per-step latencies (see the module docstring). Dict fields hold {"keys", "mean", "std", "count"} lists."""

    max_depth: int
    width: int
    first_level: dict            # keys: tokens fed by the first draft forward
    levels: dict                 # keys: level index 2..max_depth
    verify_size: dict            # keys: verified size V (pooled over contexts)
    context_edges: list[int]     # bucket b covers [edges[b], edges[b+1]); the last bucket is open
    context_offset: list[float]  # o(b) per bucket
    plain: dict = field(default_factory=dict)  # keys: context length of plain steps; {} = m(0) + o (old profiles)
    meta: dict = field(default_factory=dict)
    shrink: float = 10.0         # pseudo-count of the line in each key's estimate
    version: int = PROFILE_VERSION
    batch: dict = field(default_factory=dict)  # {"<B>": batch-B curves (see "Batches" below)}; {} = batch 1 only
    decision: dict = field(default_factory=dict)  # keys: question; a probe policy's decision time; {} = not measured

    # -- lookups ------------------------------------------------------------------------------------------------------
    def first_time(self, n_new: np.ndarray | int) -> np.ndarray:
        return np.maximum(_curve(self.first_level, n_new, self.shrink), 1e-9)

    def level_time(self, level: int) -> float:
        return float(max(_curve(self.levels, np.array([level]), self.shrink)[0], 1e-9))

    def draft_table(self) -> np.ndarray:
        """[max_depth + 2, max_depth + 1] cumulative draft time: table[n, d] = draft(d, n) (row/col 0 unused)."""
        d_max = self.max_depth
        n = np.arange(d_max + 2)
        first = self.first_time(np.maximum(n, 1))
        levels = np.array([0.0, 0.0] + [self.level_time(l) for l in range(2, d_max + 1)])
        cumulative = np.cumsum(levels)  # cumulative[d] = sum_{l=2..d} level(l)
        table = first[:, None] + cumulative[None, :]
        table[:, 0] = 0.0
        return table

    def bucket(self, context_len: np.ndarray | int) -> np.ndarray:
        edges = np.asarray(self.context_edges)
        return np.clip(np.searchsorted(edges, context_len, side="right") - 1, 0, len(edges) - 1)

    def plain_time(self, context_lens: np.ndarray | int) -> np.ndarray | None:
        """plain(L): a plain step's time at each context length; without a plain model the AR reference's seconds
        per token when the profile has one (a plain step is one AR step), else None."""
        if not self.plain or not self.plain.get("keys"):
            ar = (self.meta or {}).get("ar_seconds_per_token")
            if ar is not None and float(ar) > 0:
                return np.full(np.shape(context_lens), float(ar))
            return None
        keys = self.plain["keys"]
        # no extrapolation of the context slope: a few noisy plain steps must not make long contexts free or dear
        at = np.clip(np.asarray(context_lens, dtype=float), keys[0], keys[-1])
        return np.maximum(_curve(self.plain, at, self.shrink), 1e-9)

    def verify_table(self, max_size: int, context_lens: np.ndarray) -> np.ndarray:
        """[len(context_lens), max_size + 1] verify time by (context, V); V = 0 is a plain target step (the root
        alone: one token, no draft), priced by `plain_time` when it has a price (a plain model or the AR reference)."""
        context_lens = np.asarray(context_lens)
        m = _curve(self.verify_size, self.priced_sizes(max_size), self.shrink)
        offset = np.asarray(self.context_offset)[self.bucket(context_lens)]
        table = np.maximum(m[None, :] + offset[:, None], 1e-9)
        plain = self.plain_time(context_lens)
        if plain is not None:
            table[:, 0] = plain
        return table

    def priced_sizes(self, max_size: int) -> np.ndarray:
        """The size whose time each V = 0..max_size costs: V itself, or where the target's CPU linears pad a verify
        block of V + 1 rows to `width` rows (meta "row_plan", `linear_kernels`' plan when the profile was measured),
        width - 1: a block of 13 rows padded to 16 costs what 15 candidates do, not a point on the line between the
        measured sizes around it (a profile without a plan, e.g. on GPU, prices V as V)."""
        widths = {int(r): int(w) for r, w in (self.meta or {}).get("row_plan") or ()}
        return np.array([widths.get(v + 1, v + 1) - 1 if v else 0 for v in range(max_size + 1)])

    def verify_time(self, size: int, context_len: int) -> float:
        return float(self.verify_table(size, np.array([context_len]))[0, size])

    def decision_time(self, question: str) -> float:
        """Mean seconds a policy network took to answer `question` ("skip", "stop", "size") on this machine; 0.0
        where the profile did not time it."""
        stats = self.decision or {}
        keys = list(stats.get("keys", []))
        return float(stats["mean"][keys.index(question)]) if question in keys else 0.0

    def decision_charges(self, questions) -> dict[str, float]:
        """{question: seconds} replay charges for each of `questions` (`Controller.actor_questions()`)."""
        return {q: t for q in sorted(questions) if (t := self.decision_time(q)) > 0}

    # -- batches -------------------------------------------------------------------------------------------------------
    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes measured with the batched decoder (`measure_batch_profile`); [] for a batch-1 profile."""
        return sorted(int(b) for b in self.batch)

    def for_batch(self, batch_size: int) -> "LatencyProfile":
        """The profile of one measured batch size: the same curves, each step being ONE batched forward of
        `batch_size` sequences (verify size V = V candidates per sequence, B * (V + 1) tokens verified; context =
        the batch's longest sequence; fed = the batch's largest catch-up)."""
        entry = self.batch.get(str(int(batch_size)))
        if entry is None:
            raise ValueError(f"the latency profile has no batch size {batch_size} (measured: "
                             f"{self.batch_sizes or 'batch size 1 only'}); measure it with `measure_batch_profile`")
        keep = {k: v for k, v in entry.items() if k in self.__dataclass_fields__ and k not in ("batch", "version")}
        return LatencyProfile(**{"max_depth": self.max_depth, "width": self.width, "shrink": self.shrink, **keep})

    def batch_tables(self, batch_size: int, max_size: int, context_lens: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        """(draft_table [max_depth + 2, max_depth + 1], verify_table [len(context_lens), max_size + 1]) of one
        batched cycle with `batch_size` sequences (see `draft_table` / `verify_table`), interpolated linearly in
        the batch size between the measured sizes (below the smallest: the smallest). A batch larger than every
        measured size is refused: its cost is not extrapolated."""
        sizes = self.batch_sizes
        if not sizes:
            raise ValueError("the latency profile was measured at batch size 1 only; measure batch sizes with "
                             "`specpilot.envs.profile.measure_batch_profile`")
        b = max(int(batch_size), sizes[0])
        if b > sizes[-1]:
            raise ValueError(f"batch size {batch_size} is above the profile's largest measured batch size "
                             f"{sizes[-1]} (measured: {sizes})")
        hi = next(s for s in sizes if s >= b)
        lo = max(s for s in sizes if s <= b)
        tables = []
        for s in sorted({lo, hi}):
            part = self.for_batch(s)
            tables.append((part.draft_table(), part.verify_table(max_size, context_lens)))
        if hi == lo:
            return tables[0]
        w = (b - lo) / (hi - lo)
        return tuple((1 - w) * a + w * c for a, c in zip(tables[0], tables[1]))

    def with_batch(self, parts: dict[int, "LatencyProfile"]) -> "LatencyProfile":
        """A copy of this profile carrying per-batch-size profiles {B: profile} (replacing those sizes)."""
        batch = dict(self.batch)
        for b, part in parts.items():
            batch[str(int(b))] = {k: v for k, v in part.to_dict().items() if k not in ("batch", "version")}
        return LatencyProfile(**{**{k: getattr(self, k) for k in self.__dataclass_fields__}, "batch": batch})

    # -- noise ---------------------------------------------------------------------------------------------------------
    def draft_std(self) -> float:
        """Typical std of one draft forward (pooled over levels), for optional replay noise."""
        stds = self.levels["std"] + self.first_level["std"]
        return float(np.mean(stds)) if stds else 0.0

    def verify_std(self) -> float:
        return float(np.mean(self.verify_size["std"])) if self.verify_size["std"] else 0.0

    # -- io ------------------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON, atomically (a crash never leaves a half-written file)."""
        return atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "LatencyProfile":
        """A saved profile; FileNotFoundError / InputFileError name the file when it is missing, truncated, garbage
        or lacks a field."""
        path = Path(path)
        fix = "measure it again with `specpilot record --out DIR` (it writes profile.json)"
        data = read_json(path, what="latency profile", fix=fix)
        if data.get("version") not in PROFILE_VERSIONS_READ:
            raise InputFileError(f"{path}: latency profile version {data.get('version')!r} is not one of "
                                 f"{', '.join(map(str, PROFILE_VERSIONS_READ))}; {fix}")
        required = ("max_depth", "width", "first_level", "levels", "verify_size", "context_edges", "context_offset")
        missing = [k for k in required if k not in data]
        curves = ("first_level", "levels", "verify_size")
        bad = [k for k in curves if k in data and not (isinstance(data[k], dict)
                                                        and {"keys", "mean", "std", "count"} <= set(data[k]))]
        for optional in ("plain", "decision"):
            if data.get(optional) and not (isinstance(data[optional], dict)
                                           and {"keys", "mean", "std", "count"} <= set(data[optional])):
                bad.append(optional)
        batch = data.get("batch") or {}
        if not isinstance(batch, dict) or not all(str(k).isdigit() and int(k) >= 1 and isinstance(v, dict)
                                                  and {"first_level", "levels", "verify_size"} <= set(v)
                                                  for k, v in batch.items()):
            bad.append("batch")
        if missing or bad:
            raise InputFileError(f"{path} is not a complete latency profile (missing {missing or 'nothing'}, "
                                 f"malformed {bad or 'nothing'}); {fix}")
        data = {**data, "version": PROFILE_VERSION}  # read as the current version (older: no batch part)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    @classmethod
    def from_samples(cls, first: dict, levels: dict, verify: list[tuple[int, int, float]], *, max_depth: int,
                     width: int, context_edges: list[int] | None = None, meta: dict | None = None,
                     shrink: float = 10.0, decisions: dict | None = None) -> "LatencyProfile":
        """Aggregate raw samples: first {n_new: [s]}, levels {level: [s]}, verify [(size, context_len, s)]; size 0
        entries are plain steps: they make the plain model and stay out of m(V) and the context offsets (with
        no size-0 entry the profile has no plain model and prices V = 0 as m(0) + o)."""
        if context_edges is None:
            top = max([c for _, c, _ in verify] + [1])
            context_edges = [0] + [2 ** k for k in range(6, max(7, int(np.ceil(np.log2(top + 1))) + 1))]
        plain_steps = defaultdict(list)
        for v, c, s in verify:
            if v == 0:
                plain_steps[int(c)].append(s)
        if plain_steps and any(v != 0 for v, _, _ in verify):  # (plain steps alone: m(V) is their mean, as before)
            verify = [x for x in verify if x[0] != 0]
        sizes = defaultdict(list)
        for v, _, s in verify:
            sizes[v].append(s)
        by_size = _stats(sizes)
        profile = cls(max_depth=max_depth, width=width, first_level=_stats(first), levels=_stats(levels),
                      verify_size=by_size, context_edges=[int(e) for e in context_edges],
                      context_offset=[0.0] * len(context_edges), plain=_stats(plain_steps) if plain_steps else {},
                      meta=dict(meta or {}), shrink=float(shrink),
                      decision=_stats({q: v for q, v in (decisions or {}).items() if v}) if decisions else {})
        if verify:
            v = np.array([x[0] for x in verify])
            c = np.array([x[1] for x in verify])
            s = np.array([x[2] for x in verify])
            residual = s - _curve(by_size, v, shrink)
            b = profile.bucket(c)
            # shrunk towards 0 like the curves: a bucket with few samples barely moves the prediction
            profile.context_offset = [float(residual[b == i].sum() / (np.count_nonzero(b == i) + shrink))
                                      for i in range(len(context_edges))]
        return profile


@dataclass
class ProfileSamples:
    """Raw timings, accumulated over one or more `collect_samples` passes; `.profile()` aggregates them."""

    max_depth: int
    width: int
    first: dict = field(default_factory=lambda: defaultdict(list))      # tokens fed -> [s]
    levels: dict = field(default_factory=lambda: defaultdict(list))     # level index -> [s]
    verify: list = field(default_factory=list)                          # [(size, context_len, s)]
    meta: dict = field(default_factory=dict)
    decisions: dict = field(default_factory=lambda: defaultdict(list))  # question -> [s] (the probe's answers)

    def profile(self, context_edges: list[int] | None = None, shrink: float = 10.0) -> LatencyProfile:
        meta = {**self.meta, "cycles": len(self.verify)}
        if meta.get("ar_tokens"):  # AR generations timed between the profile's prompts (`collect_samples_with_ar`)
            meta["ar_seconds_per_token"] = float(meta["ar_s"]) / int(meta["ar_tokens"])
        return LatencyProfile.from_samples(self.first, self.levels, self.verify, max_depth=self.max_depth,
                                           width=self.width, context_edges=context_edges, meta=meta, shrink=shrink,
                                           decisions=self.decisions)


_PROBE_METHODS = {"skip": "skip_drafting", "stop": "should_stop", "size": "choose_size"}  # question -> method


class _RandomConfigs:
    """Profiling controller: each cycle a depth ~ U{0..max_depth} and a size drawn from `sizes`, so every level
    index and a spread of sizes and contexts are timed. Depth 0 starts a streak of U{1..max_depth+1} plain target
    steps: plain steps come in streaks when a policy stops drafting (and a FixedController(0) takes nothing else),
    the streak's tokens are caught up by the next cycle's first draft forward (first(n) for larger n), and the
    plain model gets enough samples."""

    def __init__(self, rng: np.random.Generator, max_depth: int, sizes: list[int], probe=None) -> None:
        self.rng, self.max_depth, self.sizes = rng, max_depth, sizes
        self.depth = self.size = 1
        self.plain_left = 0
        # probe: a Controller asked each question first (right after the decoder's step, as a policy is) and timed;
        # times go to `decisions` (None: not kept, e.g. during warm-up)
        self.probe, self.decisions = probe, None

    def _ask_probe(self, question: str, state) -> None:
        if self.probe is None:
            return
        ask = getattr(self.probe, _PROBE_METHODS[question])
        t0 = time.perf_counter()
        ask(state)
        seconds = time.perf_counter() - t0
        if self.decisions is not None:
            self.decisions[question].append(seconds)

    def reset(self) -> None:
        pass

    def skip_drafting(self, state) -> bool:
        self._ask_probe("skip", state)
        if self.plain_left > 0:
            self.plain_left -= 1
            self.depth = 0
            return True
        self.depth = int(self.rng.integers(0, self.max_depth + 1))
        self.size = int(self.rng.choice(self.sizes))
        if self.depth == 0:
            self.plain_left = int(self.rng.integers(0, self.max_depth + 1))  # this step + 0..max_depth more
        return self.depth == 0

    def should_stop(self, state) -> bool:
        self._ask_probe("stop", state)
        return state.depth >= self.depth

    def choose_size(self, state) -> int:
        self._ask_probe("size", state)
        return self.size

    def observe(self, record) -> None:
        pass


def collect_samples(pair, tree, prompts, *, max_new_tokens: int = 128, sizes: list[int] | None = None,
                    rng: np.random.Generator | int | None = 0, warmup_cycles: int = 16, min_cycles: int = 0,
                    samples: ProfileSamples | None = None, probe_decisions: bool = True,
                    progress: bool = False) -> ProfileSamples:
    """Run live greedy generations with a random (depth, size) per cycle through `run_cycle` and keep every step's
    time (appending to `samples` when given): the draft levels' times and the verification time the decoder itself
    records in each CycleRecord (`level_s`, `fed`, `verify_s`; device-synchronised clock); with `probe_decisions`,
    also the time a probe policy takes to answer each question (module docstring, "Decisions").

    depth ~ U{0..tree.max_depth}; size ~ uniform over `sizes` (default: 1, W, the device's size actions, max_size;
    clipped to tree.max_size). A warm-up pass of `warmup_cycles` cycles on the first prompt is run but not kept
    (allocator/kernel warm-up). The prompts are decoded again (new random configs) until this call has kept at
    least `min_cycles` cycles: one pass over a few short prompts gives ~20 cycles per key of a 10-size, 9-depth
    grid, and the policies exploit cost differences of a few percent between sizes.
    """
    from specpilot.drafting.cycle import run_cycle
    from specpilot.drafting.decoder import SpeculativeDecoder
    from specpilot.drafting.linear_kernels import target_row_plan
    from specpilot.policies.observation import default_size_actions

    decoder = SpeculativeDecoder(pair, tree)
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    if sizes is None:
        sizes = sorted({1, tree.width, tree.max_size, *default_size_actions(str(pair.device))})
    sizes = sorted({min(int(s), tree.max_size) for s in sizes})
    if samples is None:
        samples = ProfileSamples(max_depth=tree.max_depth, width=tree.width,
                                 meta={"device": str(pair.device), "dtype": str(pair.dtype), "sizes": sizes,
                                       "row_plan": target_row_plan(pair.target),
                                       "max_new_tokens": max_new_tokens, "measured_s": 0.0,
                                       "created": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())})
    probe = None
    if probe_decisions:
        from specpilot.policies.learned import probe_controller

        probe = probe_controller(tree.width, tree.max_depth, default_size_actions(str(pair.device)))
    configs = _RandomConfigs(rng, tree.max_depth, sizes, probe)
    started = time.perf_counter()
    prompt_ids = [pair.encode(p) for p in prompts]
    order = [prompt_ids[0]] + prompt_ids  # a warm-up pass on the first prompt, then every prompt
    kept_before = len(samples.verify)
    i = 0
    while i < len(order) or len(samples.verify) - kept_before < min_cycles:
        prompt = order[i] if i < len(order) else prompt_ids[(i - 1) % len(prompt_ids)]  # further passes
        i += 1
        if i == 1 and warmup_cycles <= 0:
            continue
        warmup = i == 1
        configs.decisions = None if warmup else samples.decisions
        session = decoder.start(prompt, max_new_tokens=max_new_tokens)
        seen = 0
        while not session.done and (not warmup or seen < warmup_cycles):
            record = run_cycle(session, configs)
            seen += 1
            if not warmup:  # the warm-up pass keeps nothing
                _add(samples, record)
        if i > len(order) and seen == 0:  # a further pass that adds nothing would never reach min_cycles
            break
        if progress:
            print(f"  profile: prompt {i - 1}/{len(prompt_ids)}, {len(samples.verify)} cycles, "
                  f"{time.perf_counter() - started:.1f}s", flush=True)
    samples.meta["measured_s"] = samples.meta.get("measured_s", 0.0) + time.perf_counter() - started
    return samples


def collect_samples_with_ar(pair, tree, prompts, *, max_new_tokens: int = 128, sizes: list[int] | None = None,
                            rng: np.random.Generator | int | None = 0, warmup_cycles: int = 16, min_cycles: int = 0,
                            samples: ProfileSamples | None = None, ar_warmup: bool = True,
                            progress: bool = False) -> ProfileSamples:
    """`collect_samples`, prompt by prompt, each prompt followed by a timed autoregressive generation of it: the
    reference of replay speedups (meta "ar_s" / "ar_tokens"; `.profile()` gives meta["ar_seconds_per_token"],
    prefill excluded like the profile's cycles) then shares the machine's state with the profile, so a change of
    load between the recording and the profile cancels in replay / AR. Each prompt keeps its share of
    `min_cycles`. One AR generation per prompt more than `collect_samples`, and an untimed warm-up one
    (`ar_warmup`; skip it where the AR path has just run)."""
    from specpilot.drafting.decoder import autoregressive_generate

    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    prompt_ids = [pair.encode(p) for p in prompts]
    if not prompt_ids:
        raise ValueError("collect_samples_with_ar needs at least one prompt")
    if ar_warmup:
        autoregressive_generate(pair, prompt_ids[0], max_new_tokens=max_new_tokens)  # not timed
    for k, prompt in enumerate(prompt_ids):
        samples = collect_samples(pair, tree, [prompt], max_new_tokens=max_new_tokens, sizes=sizes, rng=rng,
                                  warmup_cycles=warmup_cycles if k == 0 else 0, samples=samples,
                                  min_cycles=share_of(min_cycles, 1, len(prompt_ids)), progress=progress)
        out = autoregressive_generate(pair, prompt, max_new_tokens=max_new_tokens)
        samples.meta["ar_s"] = samples.meta.get("ar_s", 0.0) + out.total_s
        samples.meta["ar_tokens"] = samples.meta.get("ar_tokens", 0) + out.num_tokens
    return samples


def _add(samples: ProfileSamples, record) -> None:
    if record.depth:
        samples.first[record.fed].append(record.level_s[0])
        for level, seconds in enumerate(record.level_s[1:], start=2):
            samples.levels[level].append(seconds)
    samples.verify.append((record.size, record.context_len, record.verify_s))


def share_of(min_cycles: int, part: int, whole: int) -> int:
    """The cycles `part` of `whole` profile prompts keep at least so that all of them keep `min_cycles` (rounded up:
    shards, or prompts measured one at a time, each take their share)."""
    return -(-int(min_cycles) * int(part) // max(1, int(whole)))


def measure_profile(pair, tree, prompts, *, max_new_tokens: int = 128, sizes: list[int] | None = None,
                    seed: int = 0, warmup_cycles: int = 16, min_cycles: int = 0, context_edges: list[int] | None = None,
                    progress: bool = False, ar: bool = False) -> LatencyProfile:
    """`collect_samples` over `prompts` (seeded random configs; at least `min_cycles` cycles) and aggregate into a
    LatencyProfile; with `ar`, `collect_samples_with_ar` (meta["ar_seconds_per_token"], the AR reference of replay
    speedups, timed between the prompts)."""
    collect = collect_samples_with_ar if ar else collect_samples
    samples = collect(pair, tree, prompts, max_new_tokens=max_new_tokens, sizes=sizes, rng=seed,
                      warmup_cycles=warmup_cycles, min_cycles=min_cycles, progress=progress)
    samples.meta["seed"] = seed
    return samples.profile(context_edges)


# ---------------------------------------------------------------------------------------------------------------------
# Batches: the same curves per batch size, measured with the batched decoder (`specpilot.drafting.batch`)


def collect_batch_samples(pair, tree, prompts, batch_sizes: list[int], *, max_new_tokens: int = 128,
                          sizes: list[int] | None = None, rng: np.random.Generator | int | None = 0,
                          warmup_cycles: int = 8, min_batches: int = 1,
                          progress: bool = False) -> dict[int, ProfileSamples]:
    """{B: raw samples} of live batched greedy generations: for each B, the prompts go in batches of B (cycled to fill
    the last) through `BatchSession` with a random (depth, size) per cycle (`_RandomConfigs`, one decision per cycle
    for the batch, as the batched decoder takes them), each step timed by the session's own clock (its CycleRecord:
    `level_s`, `verify_s`). Only cycles with exactly B unfinished sequences are kept (rows finish at different
    times; a shrunken batch is not the size being measured). Keys: fed = the largest catch-up of the batch's rows
    (the first draft forward is padded to it), context = the longest row. A warm-up of `warmup_cycles` cycles per
    B is run first and not kept; at least `min_batches` batches run per B (the prompts cycled), so that large batch
    sizes, which fit few batches into the prompts, still get cycles. Measuring only: the decoding is
    drafting/batch.py's."""
    from specpilot.drafting.batch import BatchSession
    from specpilot.drafting.batch_ar import batch_inputs
    from specpilot.drafting.cycle import run_cycle
    from specpilot.drafting.decoder import SpeculativeDecoder
    from specpilot.drafting.linear_kernels import target_row_plan
    from specpilot.policies.observation import default_size_actions

    decoder = SpeculativeDecoder(pair, tree)
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    if sizes is None:
        sizes = sorted({1, tree.width, tree.max_size, *default_size_actions(str(pair.device))})
    sizes = sorted({min(int(s), tree.max_size) for s in sizes})
    ids, _ = batch_inputs(pair, list(prompts), max_new_tokens, lookahead=tree.max_depth + 1)
    configs = _RandomConfigs(rng, tree.max_depth, sizes)
    out: dict[int, ProfileSamples] = {}
    for b in sorted({int(x) for x in batch_sizes}):
        started = time.perf_counter()
        samples = out[b] = ProfileSamples(max_depth=tree.max_depth, width=tree.width,
                                          meta={"device": str(pair.device), "dtype": str(pair.dtype), "sizes": sizes,
                                                "batch_size": b, "max_new_tokens": max_new_tokens})
        batches = [[ids[(k + j) % len(ids)] for j in range(b)] for k in range(0, max(len(ids), min_batches * b), b)]
        for i, batch in enumerate([batches[0]] + batches):  # a warm-up batch first, not kept
            session = BatchSession(decoder, batch, max_new_tokens=max_new_tokens)
            session.prefill_draft()  # not the first drafting cycle's: its catch-up would be a whole prompt
            seen = 0
            while not session.done and (i > 0 or seen < warmup_cycles):
                rows = list(session.active)
                width = len(rows)
                fed = max(len(r.committed) - r.draft_committed for r in rows)
                context = max(len(r.committed) for r in rows)
                record = run_cycle(session, configs)
                seen += 1
                if i > 0 and width == b:
                    _add(samples, replace(record, fed=fed if record.depth else 0, context_len=context))
        samples.meta["measured_s"] = time.perf_counter() - started
        if progress:
            print(f"  batch profile: B={b}, {len(samples.verify)} cycles, {samples.meta['measured_s']:.1f}s",
                  flush=True)
    return out


def measure_batch_profile(pair, tree, prompts, batch_sizes: list[int], *, base: LatencyProfile | None = None,
                          max_new_tokens: int = 128, sizes: list[int] | None = None, seed: int = 0,
                          warmup_cycles: int = 8, min_batches: int = 1, context_edges: list[int] | None = None,
                          progress: bool = False) -> LatencyProfile:
    """A LatencyProfile carrying one batched profile per size in `batch_sizes` (`collect_batch_samples`, seeded).
    Its top-level curves are `base`'s (the single-sequence profile) when given, else the smallest batch size's."""
    samples = collect_batch_samples(pair, tree, prompts, batch_sizes, max_new_tokens=max_new_tokens, sizes=sizes,
                                    rng=seed, warmup_cycles=warmup_cycles, min_batches=min_batches,
                                    progress=progress)
    parts = {}
    for b, s in samples.items():
        if not s.verify:
            raise ValueError(f"no cycle ran with all {b} sequences unfinished: give more prompts or a larger "
                             "max_new_tokens")
        s.meta["seed"] = seed
        parts[b] = s.profile(context_edges)
    base = base if base is not None else parts[min(parts)]
    return base.with_batch(parts)
