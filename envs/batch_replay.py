"""Replay for batches: B recorded single-sequence generations decoded "together", timed by a batched latency profile.

Greedy acceptance does not depend on batching (every row of `drafting/batch.py`'s batch accepts exactly what it
would alone), so a batch's cycles are replayed from single-sequence traces: `BatchReplaySession` holds one
`ReplaySession` per row and implements the cycle's step protocol (`specpilot.drafting.cycle`) the way the live
`BatchSession` does: one decision per cycle for the batch, taken on the *lead* row's state (the first unfinished
one), every unfinished row drafting to that depth and verifying that size, each accepting its own recorded length
(`ReplaySession.verify`: the same cycle arithmetic, `drafting/cycle_math.py`), finished rows leaving the batch.
Only the time differs from single replay: one cycle of B rows costs

    draft = draft_B(d, max fed over the rows)          the first draft forward is padded to the largest catch-up
    verify = verify_B(V, max context over the rows)     one target forward of B x (V + 1) tokens (V = 0: plain step)

read from the profile's batch-size-B curves (`LatencyProfile.batch_tables`, interpolated between measured sizes as
rows finish). Modelled approximations: the live ragged caches carry holes (their length is the batch's longest
emitted run per cycle, not each row's own), which the context term does not see; tree ranking per row and policy
time are not charged (as in single replay).

`replay_batch` drives any Controller over batches of B prompts with the same `run_cycle`; `batch_static_sweep`
ranks static (depth, size) cells per batch size, with batched autoregressive decoding (depth 0) as the baseline.
`BatchOracle` costs each shared (depth, size) choice of a batch's next cycle in hindsight (every row's recorded
acceptance, the batch profile); `replay_batch_oracle` is the per-batch-size ceiling built on it.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from specpilot.drafting.control import Controller, FixedController
from specpilot.drafting.cycle import run_generation
from specpilot.drafting.types import CycleRecord, DraftState
from specpilot.envs.oracle import cell_tables, summary
from specpilot.envs.replay import ReplayModel, ReplaySession


class BatchTimes:
    """The batched cycle-time tables of one ReplayModel, per batch size (cached): draft [k, d] and verify [context, V]
    (contexts 0..the longest the trace reaches)."""

    def __init__(self, model: ReplayModel) -> None:
        self.model = model
        trace = model.trace
        self.k_max = trace.max_depth + 1
        longest = max(len(trace.prompt(i)) for i in range(trace.num_prompts)) + model.max_new_tokens + 1
        self.contexts = np.arange(longest + 1)
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def tables(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        tab = self._tables.get(batch_size)
        if tab is None:
            draft, verify = self.model.profile.batch_tables(batch_size, self.model.trace.max_size, self.contexts)
            tab = self._tables[batch_size] = (draft[: self.k_max + 1, : self.model.trace.max_depth + 1], verify)
        return tab

    def cycle(self, batch_size: int, depth: int, size: int, fed: int, context: int) -> tuple[float, float]:
        """(draft_s, verify_s) of one batched cycle (see the module docstring)."""
        draft, verify = self.tables(batch_size)
        draft_s = float(draft[min(fed, self.k_max), depth]) if depth else 0.0
        return draft_s, float(verify[min(context, len(self.contexts) - 1), size])


class BatchReplaySession:
    """Rows `indices` of a trace replayed as one batch (the `specpilot.drafting.cycle` protocol; see the module
    docstring). States and returned CycleRecords are the lead row's, with the batch's times; `cycles` holds the
    batch's records (the lead's fields, the batch's emitted total in `emitted_total`)."""

    clock = ReplaySession.clock

    def __init__(self, model: ReplayModel, indices: list[int], *, times: BatchTimes | None = None) -> None:
        if not indices:
            raise ValueError("a batch needs at least one prompt")
        self.model = model
        self.rows = [ReplaySession(model, i) for i in indices]
        self.times = times or BatchTimes(model)
        self.max_depth = model.trace.max_depth
        self.cycles: list[CycleRecord] = []
        self.batch_sizes: list[int] = []   # unfinished rows in each cycle
        self.emitted_total = 0
        self.last_emitted = self.last_accepted = 0   # the last cycle's tokens over all rows (`batch_record`)
        self.last_lead = self.rows[0]                 # the lead row of the last cycle (`verify`)

    @property
    def active(self) -> list[ReplaySession]:
        return [r for r in self.rows if not r.done]

    @property
    def lead(self) -> ReplaySession:
        return self.active[0]

    @property
    def done(self) -> bool:
        return all(r.done for r in self.rows)

    @property
    def can_draft(self) -> bool:
        return all(r.can_draft for r in self.active)

    @property
    def finished_by(self) -> str | None:
        """Once done, "eos" when every row ended with its end token, else "length" (some row's budget cut it: the
        episode is truncated, not terminated)."""
        if not self.done:
            return None
        return "eos" if all(r.finished_by == "eos" for r in self.rows) else "length"

    @property
    def tokens_emitted(self) -> int:
        return (self.lead if not self.done else self.rows[0]).tokens_emitted

    @property
    def prompt_len(self) -> int:
        return (self.lead if not self.done else self.rows[0]).prompt_len

    def _with_load(self, state: DraftState) -> DraftState:
        # the load the batch-aware controllers see, as the live BatchSession gives it: the unfinished rows and their
        # committed lengths
        rows = self.active
        lengths = [r.prompt_len + r.tokens_emitted for r in rows]
        state.batch_size, state.context_max = len(rows), max(lengths)
        state.context_mean = sum(lengths) / len(lengths)
        return state

    def cycle_state(self) -> DraftState:
        return self._with_load(self.lead.cycle_state())

    def draft_level(self) -> DraftState:
        lead, *rest = self.active
        state = lead.draft_level()
        for row in rest:
            row.draft_level()
        return self._with_load(state)

    def rank_candidates(self) -> None:
        pass

    def add_policy_time(self, seconds: float) -> None:
        pass

    def verify(self, size: int) -> CycleRecord:
        rows = self.active
        depth = rows[0].depth
        fed = max(r.n_new for r in rows)
        context = max(r.prompt_len + r.tokens_emitted for r in rows)
        records = [r.verify(size) for r in rows]       # each row: its own recorded acceptance (same arithmetic)
        self.last_lead = rows[0]                       # whose counts the cycle's record and states carry
        self.last_accepted = sum(r.accepted for r in records)
        draft_s, verify_s = self.times.cycle(len(rows), depth, records[0].size, fed, context)
        record = replace(records[0], draft_s=draft_s, verify_s=verify_s)
        self.cycles.append(record)
        self.batch_sizes.append(len(rows))
        self.last_emitted = sum(r.emitted for r in records)
        self.emitted_total += self.last_emitted
        return record

    def batch_record(self) -> CycleRecord:
        """The last cycle as the batch saw it: the lead's record with every row's emitted (and accepted) tokens
        summed, so a reward of it scores the batch's throughput (tokens of all rows per second of the cycle)."""
        last = self.cycles[-1]
        return replace(last, emitted=self.last_emitted, accepted=self.last_accepted)


def batches_of(num_prompts: int, batch_size: int, prompts: list[int] | None = None) -> list[list[int]]:
    """Prompt indices in consecutive batches of `batch_size` (the list cycled to fill the last batch)."""
    order = list(range(num_prompts)) if prompts is None else list(prompts)
    return [[order[(k + j) % len(order)] for j in range(batch_size)] for k in range(0, len(order), batch_size)]


def _run_one(model: ReplayModel, batch: list[int], controller: Controller, times: BatchTimes) -> tuple[int, float,
                                                                                                        int, int]:
    """One batch of prompts through `controller` (an oracle controller is bound to the batch's session first):
    (tokens, seconds, batch cycles, row cycles)."""
    session = BatchReplaySession(model, batch, times=times)
    if isinstance(controller, BatchOracleController):
        controller.session = session
    run_generation(session, controller)
    return (session.emitted_total, sum(r.cycle_s for r in session.cycles), len(session.cycles),
            sum(session.batch_sizes))


def replay_batch(model: ReplayModel, controller: Controller | None = None, *, batch_size: int,
                 prompts: list[int] | None = None, times: BatchTimes | None = None) -> dict:
    """Predicted {tokens, time_s, cycles, tokens_per_s, mean_accepted_length, batch_size} of a Controller deciding
    once per cycle for batches of `batch_size` prompts (`batches_of`), through `run_cycle` as in
    `SpeculativeDecoder.generate_batch`. tokens_per_s is the batch's total throughput; cycles counts batch cycles
    (mean_accepted_length: tokens per row-cycle)."""
    controller = controller or FixedController()
    times = times or BatchTimes(model)
    tokens = time_s = cycles = row_cycles = 0
    for batch in batches_of(model.num_prompts, batch_size, prompts):
        t, s, c, rc = _run_one(model, batch, controller, times)
        tokens, time_s, cycles, row_cycles = tokens + t, time_s + s, cycles + c, row_cycles + rc
    out = summary(tokens, time_s, row_cycles)
    return {**out, "cycles": int(cycles), "batch_size": int(batch_size)}


def batch_static_sweep(model: ReplayModel, cells: list[tuple[int, int]], batch_sizes: list[int], *,
                       prompts: list[int] | None = None) -> list[dict]:
    """Every static (depth, size) cell (depth 0: batched autoregressive decoding, always included as the baseline)
    at every batch size under batch replay: rows {"batch_size", "depth", "size", "tokens_per_s", ...,
    "speedup_vs_ar"} (speedup over batched AR at the same batch size, in the model)."""
    times = BatchTimes(model)
    cells = [(0, 0)] + [(int(d), int(v)) for d, v in cells if int(d) > 0]
    rows = []
    for b in batch_sizes:
        ar = replay_batch(model, FixedController(0, 0), batch_size=b, prompts=prompts, times=times)
        for depth, size in cells:
            res = ar if depth == 0 else replay_batch(model, FixedController(min(depth, model.trace.max_depth), size),
                                                     batch_size=b, prompts=prompts, times=times)
            rows.append({"batch_size": int(b), "depth": depth, "size": size, **res,
                         "speedup_vs_ar": res["tokens_per_s"] / ar["tokens_per_s"]})
    return rows


def best_per_batch_size(rows: list[dict]) -> list[dict]:
    """The best row per batch size of `batch_static_sweep` (ties: the first, i.e. the shallower cell)."""
    out = []
    for b in sorted({r["batch_size"] for r in rows}):
        out.append(max((r for r in rows if r["batch_size"] == b), key=lambda r: r["tokens_per_s"]))
    return out


def learned_batch_table(model: ReplayModel, controller: Controller, batch_sizes: list[int], *,
                        prompts: list[int] | None = None) -> list[dict]:
    """A policy's own per-batch-size table: at each batch size, the depth and size it chose most often (ties: the
    shallower / smaller) over the batch replay of `model`'s prompts, with its tokens/s there. Rows have the keys
    of `best_per_batch_size`'s ({"batch_size", "depth", "size", "tokens_per_s"}, plus "depth_share": the modal
    depth's share of the cycles), so the engines' table writers take either."""
    from specpilot.drafting.control import DecisionLog

    times = BatchTimes(model)
    rows = []
    for b in sorted({int(b) for b in batch_sizes}):
        logged = DecisionLog(controller)
        res = replay_batch(model, logged, batch_size=b, prompts=prompts, times=times)
        depths = np.bincount([d for d, _ in logged.log], minlength=1)
        depth = int(np.argmax(depths))
        sizes = [v for d, v in logged.log if d == depth]
        size = int(np.argmax(np.bincount(sizes))) if sizes else 0
        rows.append({"batch_size": b, "depth": depth, "size": size, "tokens_per_s": res["tokens_per_s"],
                     "depth_share": float(depths[depth] / max(depths.sum(), 1))})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# the per-batch-size oracle ceiling


class BatchOracle:
    """Hindsight cost of every shared (depth, size) choice for the next cycle of a `BatchReplaySession`: each
    unfinished row's recorded acceptance under that choice (`oracle.cell_tables` at the row's position) summed over
    the rows, and the batch's cycle time (`BatchTimes.cycle`: draft_B(d, max fed), verify_B(V, max context)).

    `costs(session)` [nd, nv]: with `rate` None, the cycle's seconds per emitted token (the reciprocal of its
    throughput); with a `rate` (tokens/s), time - tokens / rate (Dinkelbach: the choice that gains most over that
    rate this cycle, so a cycle with few tokens is not preferred for a ratio a whole generation cannot keep). inf
    where the choice is none (drafting where a row cannot draft). `choice(session)` is the argmin (ties: the
    shallower / smaller): per cycle, the hindsight-best shared decision. depths: the choices (0: a plain batched
    target step); sizes: the verification sizes (clipped per depth as the decoder clips them)."""

    def __init__(self, model: ReplayModel, depths, sizes, *, times: BatchTimes | None = None,
                 rate: float | None = None) -> None:
        self.model, self.times, self.rate = model, times or BatchTimes(model), rate
        self.depths = np.array(sorted({min(int(d), model.trace.max_depth) for d in depths}))
        self.sizes = np.array(sorted({int(v) for v in sizes}))
        self.clipped = model.clip_size(self.depths[:, None], self.sizes[None, :])          # [nd, nv]
        self._cells = lambda i: cell_tables(model, i, self.depths, self.sizes)[0]         # emitted [n, nd, nv]
        self._emitted: dict[int, np.ndarray] = {}

    def emitted(self, row: ReplaySession) -> np.ndarray:
        """[nd, nv] tokens `row` emits this cycle under each choice (its recorded acceptance)."""
        tab = self._emitted.get(row.index)
        if tab is None:
            tab = self._emitted[row.index] = self._cells(row.index)
        return tab[row.t]

    def tokens_and_time(self, session: BatchReplaySession) -> tuple[np.ndarray, np.ndarray]:
        """([nd, nv] tokens of all unfinished rows, [nd, nv] cycle seconds) of each choice for the next cycle."""
        rows = session.active
        draft, verify = self.times.tables(len(rows))
        fed = min(max(r.n_new for r in rows), self.times.k_max)
        context = min(max(r.prompt_len + r.tokens_emitted for r in rows), len(self.times.contexts) - 1)
        tokens = sum(self.emitted(r) for r in rows)
        time_s = np.where(self.depths[:, None] > 0, draft[fed, self.depths][:, None], 0.0) + \
            verify[context, self.clipped]
        return tokens, time_s

    def costs(self, session: BatchReplaySession) -> np.ndarray:
        tokens, time_s = self.tokens_and_time(session)
        out = time_s / tokens if self.rate is None else time_s - tokens / self.rate
        if not session.can_draft:
            out = np.where(self.depths[:, None] > 0, np.inf, out)
        return out

    def choice(self, session: BatchReplaySession) -> tuple[int, int]:
        costs = self.costs(session)
        d_i, v_i = np.unravel_index(int(costs.argmin()), costs.shape)
        return int(self.depths[d_i]), int(self.sizes[v_i])


class BatchOracleController(Controller):
    """Decides every cycle as `BatchOracle.choice` on the bound `session` (hindsight: it reads the rows' recorded
    futures), through `run_cycle` like any controller. Bind the session before each batch (`replay_batch_oracle`)."""

    name = "batch_oracle"

    def __init__(self, oracle: BatchOracle) -> None:
        self.oracle, self.session, self._choice = oracle, None, (0, 0)

    def skip_drafting(self, state: DraftState) -> bool:
        self._choice = self.oracle.choice(self.session)
        return self._choice[0] == 0

    def should_stop(self, state: DraftState) -> bool:
        return state.depth >= self._choice[0]

    def choose_size(self, state: DraftState) -> int:
        return self._choice[1]


def batch_oracle_batch(model: ReplayModel, batch: list[int], *, depths=None, sizes=None,
                       times: BatchTimes | None = None, dinkelbach_iters: int = 2) -> dict:
    """The per-batch oracle ceiling of one batch: the least time (its tokens are fixed: every row emits its recorded
    generation) over, in hindsight, every static (depth, size) cell, the per-cycle greedy `BatchOracle` (rate None)
    and `dinkelbach_iters` Dinkelbach rounds of it (rate = the best throughput found so far). Returns {tokens,
    time_s, cycles, row_cycles, source} (source: "static dV", "greedy" or "dinkelbach")."""
    trace = model.trace
    times = times or BatchTimes(model)
    depths = list(range(0, trace.max_depth + 1)) if depths is None else [int(d) for d in depths]
    sizes = list(range(1, trace.max_size + 1)) if sizes is None else [int(v) for v in sizes]
    best = None
    cells = [(0, 0)] + [(d, v) for d in depths if d > 0 for v in sizes]
    for d, v in cells:
        out = _run_one(model, batch, FixedController(d, v), times)
        if best is None or out[1] < best[0][1]:
            best = (out, f"static d{d}V{v}")
    for it in range(1 + dinkelbach_iters):
        rate = None if it == 0 else best[0][0] / best[0][1]
        out = _run_one(model, batch, BatchOracleController(BatchOracle(model, depths, sizes, times=times, rate=rate)),
                       times)
        if out[1] < best[0][1]:
            best = (out, "greedy" if it == 0 else "dinkelbach")
    (tokens, time_s, cycles, row_cycles), source = best
    return {"tokens": tokens, "time_s": time_s, "cycles": cycles, "row_cycles": row_cycles, "source": source}


def replay_batch_oracle(model: ReplayModel, *, batch_size: int, depths=None, sizes=None,
                        prompts: list[int] | None = None, times: BatchTimes | None = None) -> dict:
    """`replay_batch`'s totals for the per-batch oracle ceiling (`batch_oracle_batch`) over the same batches at
    `batch_size`. depths default 0..max_depth (plain steps included), sizes 1..max_size. "sources" counts which
    candidate was best per batch."""
    times = times or BatchTimes(model)
    tokens = time_s = cycles = row_cycles = 0
    sources: dict[str, int] = {}
    for batch in batches_of(model.num_prompts, batch_size, prompts):
        res = batch_oracle_batch(model, batch, depths=depths, sizes=sizes, times=times)
        tokens, time_s = tokens + res["tokens"], time_s + res["time_s"]
        cycles, row_cycles = cycles + res["cycles"], row_cycles + res["row_cycles"]
        kind = res["source"].split()[0]
        sources[kind] = sources.get(kind, 0) + 1
    return {**summary(tokens, time_s, row_cycles), "cycles": int(cycles), "batch_size": int(batch_size),
            "sources": sources}
