"""Throughput under replay: any Controller (`replay_controller`), a static config (`replay_static`), and the
ceilings no policy can beat (`replay_oracle`).

`replay_controller` drives `ReplaySession`s with the same `run_cycle` the live decoder's `generate()` uses.
`replay_oracle` computes, per prompt, the exact hindsight optimum by dynamic programming and every static
(depth, size) cell at once (vectorised: the grid search ranks hundreds of cells with it); `tests/test_replay_oracle.py`
checks both against brute force and against `replay_controller`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specpilot.drafting.control import Controller, FixedController
from specpilot.drafting.cycle import run_cycle, run_generation
from specpilot.drafting.cycle_math import FED_AT_START, emitted_count, next_fed
from specpilot.envs.profile import LatencyProfile
from specpilot.envs.record import Trace
from specpilot.envs.replay import ReplayModel, ReplaySession


def _model(trace, profile, max_new_tokens) -> ReplayModel:
    if isinstance(trace, ReplayModel):
        return trace
    return ReplayModel(trace, profile, max_new_tokens=max_new_tokens)


def summary(tokens: int, time_s: float, cycles: int, decision_s: float = 0.0) -> dict:
    return {"tokens": int(tokens), "time_s": float(time_s), "cycles": int(cycles),
            "tokens_per_s": tokens / time_s if time_s > 0 else float("nan"),
            "mean_accepted_length": tokens / cycles if cycles else float("nan"), "decision_s": float(decision_s)}


def replay_controller(trace: str | Path | Trace | ReplayModel, profile: str | Path | LatencyProfile | None = None,
                      controller: Controller | None = None, *, max_new_tokens: int | None = None,
                      prompts: list[int] | None = None) -> dict:
    """Predicted {tokens, time_s, cycles, tokens_per_s, mean_accepted_length, decision_s} of any Controller under
    replay: it decides on the recorded DraftStates through `run_cycle`, exactly as in `SpeculativeDecoder.generate`,
    and observes the replayed CycleRecords. time_s is the modelled draft + verify time plus decision_s, the
    profile's measured decision time charged to each question the controller answers with a policy network
    (`Controller.actor_questions`; 0 for rules, fixed configs and profiles that did not time decisions), as the
    live clock charges it: a learned controller and a fixed one compared in replay pay what they pay live."""
    model = _model(trace, profile, max_new_tokens)
    controller = controller or FixedController()
    asks = getattr(controller, "actor_questions", None)  # (a duck-typed controller answers without a network)
    charges = model.profile.decision_charges(asks() if asks is not None else ())
    tokens = time_s = cycles = decision_s = 0
    for i in range(model.num_prompts) if prompts is None else prompts:
        records = run_generation(ReplaySession(model, i, charges=charges), controller)
        tokens += sum(r.emitted for r in records)
        decision_s += sum(r.policy_s for r in records)
        time_s += sum(r.cycle_s + r.policy_s for r in records)
        cycles += len(records)
    return summary(tokens, time_s, cycles, decision_s)


def replay_static(trace, profile=None, depth: int = 4, size: int = 12, *, max_new_tokens: int | None = None,
                  prompts: list[int] | None = None) -> dict:
    """`replay_controller` of FixedController(depth, size) (depth clipped to the trace's max_depth)."""
    model = _model(trace, profile, max_new_tokens)
    controller = FixedController(min(int(depth), model.trace.max_depth), int(size))
    return replay_controller(model, controller=controller, prompts=prompts)


def cell_tables(model: ReplayModel, index: int, depths: np.ndarray, sizes: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(emitted [n, nd, nv], verify time [n, nd, nv]) of every (depth, size) cell at every position."""
    tab = model.tables(index)
    n = tab.n
    clipped = model.clip_size(depths[:, None], sizes[None, :])                      # [nd, nv]; depth 0 verifies 0
    acc = tab.acc[:, np.maximum(depths, 1) - 1, :] * (depths[None, :, None] > 0)        # [n, nd, max_size+1]
    index_ = np.broadcast_to(clipped, (n,) + clipped.shape)
    emitted = emitted_count(np.take_along_axis(acc, index_, axis=2).astype(np.int64),
                            (n - np.arange(n))[:, None, None])
    return emitted, tab.verify[:, clipped]


def next_fed_capped(depths: np.ndarray, fed: np.ndarray, emitted: np.ndarray, k_max: int) -> np.ndarray:
    """`cycle_math.next_fed`, capped at k_max (larger counts cost like the largest: the DP's state space)."""
    return np.minimum(next_fed(depths, fed, emitted), k_max)


def _hindsight(model: ReplayModel, emitted: np.ndarray, verify: np.ndarray, depths: np.ndarray
               ) -> tuple[float, int]:
    """Least total time (and its cycle count) to emit the prompt's tokens from position 0 with 1 token to catch up.

    cost[t, k] = min over cells of draft(k, d) + verify + cost[t + e, k'], k = tokens the drafter must catch up
    (1..max_depth + 1, larger counts cost like the largest)."""
    n, k_max = emitted.shape[0], model.trace.max_depth + 1
    draft = model.draft[:, depths]                                                  # [k_max + 1, nd]
    ks = np.arange(1, k_max + 1)
    cost = np.zeros((n + 1, k_max + 1))
    cycles = np.zeros((n + 1, k_max + 1), dtype=np.int64)
    for t in range(n - 1, -1, -1):
        e = emitted[t]                                                              # [nd, nv]
        nxt = next_fed_capped(depths[None, :, None], ks[:, None, None], e[None], k_max)   # [k, nd, nv]
        total = draft[ks][:, :, None] + verify[t][None] + cost[t + e[None], nxt]    # [k, nd, nv]
        flat = total.reshape(len(ks), -1).argmin(axis=1)
        d_i, v_i = np.unravel_index(flat, e.shape)
        cost[t, 1:] = total[np.arange(len(ks)), d_i, v_i]
        e_best = e[d_i, v_i]
        cycles[t, 1:] = 1 + cycles[t + e_best, nxt[np.arange(len(ks)), d_i, v_i]]
    return float(cost[0, FED_AT_START]), int(cycles[0, FED_AT_START])


def _static_sweep(model: ReplayModel, emitted: np.ndarray, verify: np.ndarray, depths: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, time, cycles) [nd, nv] of every static cell, walking all cells in lock-step."""
    n, k_max = emitted.shape[0], model.trace.max_depth + 1
    grid = emitted.shape[1:]
    di, vi = np.indices(grid)
    d = depths[di]
    tokens, time_s, cycles = np.zeros(grid), np.zeros(grid), np.zeros(grid, dtype=np.int64)
    t = np.zeros(grid, dtype=np.int64)
    fed = np.full(grid, FED_AT_START, dtype=np.int64)
    while (active := t < n).any():
        tt = np.minimum(t, n - 1)
        e = emitted[tt, di, vi]
        step = model.draft[np.minimum(fed, k_max), d] + verify[tt, di, vi]
        time_s += np.where(active, step, 0.0)
        tokens += np.where(active, e, 0)
        cycles += active
        fed = np.where(active, next_fed_capped(d, fed, e, k_max), fed)
        t = np.where(active, t + e, t)
    return tokens, time_s, cycles


class _HindsightGreedy(Controller):
    """Per cycle, the (depth, size) with the best emitted/time of that cycle alone, read from the session's tables
    (hindsight): the myopic "oracle" often reported; it runs through run_cycle like any controller."""

    name = "greedy_oracle"

    def __init__(self, model: ReplayModel, index: int, session: ReplaySession, depths: np.ndarray,
                 sizes: np.ndarray) -> None:
        self.session, self.depths, self.sizes = session, depths, sizes
        self.emitted, self.verify = cell_tables(model, index, depths, sizes)
        self.choice = (1, 1)

    def skip_drafting(self, state) -> bool:
        t = self.session.tokens_emitted
        ratio = self.emitted[t] / (self.session.draft_time(self.depths)[:, None] + self.verify[t])
        d_i, v_i = np.unravel_index(int(ratio.argmax()), ratio.shape)
        self.choice = (int(self.depths[d_i]), int(self.sizes[v_i]))
        return self.choice[0] == 0

    def should_stop(self, state) -> bool:
        return state.depth >= self.choice[0]

    def choose_size(self, state) -> int:
        return self.choice[1]


def _greedy_oracle(model: ReplayModel, indices: list[int], depths: np.ndarray, sizes: np.ndarray) -> dict:
    tokens = time_s = cycles = 0
    for i in indices:
        session = ReplaySession(model, i)
        controller = _HindsightGreedy(model, i, session, depths, sizes)
        while not session.done:
            record = run_cycle(session, controller)
            tokens, time_s, cycles = tokens + record.emitted, time_s + record.cycle_s, cycles + 1
    return summary(tokens, time_s, cycles)


def replay_oracle(trace, profile=None, depths: list[int] | None = None, sizes: list[int] | None = None, *,
                  max_new_tokens: int | None = None, prompts: list[int] | None = None) -> dict:
    """The ceiling any (depth, size) policy can reach on the trace, in hindsight.

    Returns {"oracle": ..., "greedy_oracle": ..., "best_static": {..., "depth", "size"}, "static": [...]}:
      oracle         exact hindsight optimum: per prompt, the cycle sequence minimising the total time to emit the
                     prompt's (fixed, greedy) tokens, by dynamic programming over (position, tokens to catch up);
                     maximising throughput = minimising time, as the token count is fixed
      greedy_oracle  per-cycle greedy: each cycle picks the (d, V) with the best emitted/time of that cycle alone
      best_static    the best fixed (d, V) over `depths` x `sizes` (a grid search under replay)
      per_prompt_static  each prompt with its own best fixed (d, V), chosen in hindsight: the most a policy that
                     only recognises the kind of prompt (one config per prompt) could gain over best_static; the
                     oracle's gain beyond it is the within-prompt, cycle-by-cycle part
    Choices range over `depths` (default 0..max_depth: a plain target step is one of every policy's actions, and
    the ceiling must cover it, or a pair whose drafter rarely helps reports a ceiling below its controllers) and
    `sizes` (default 1..max_size).
    """
    model = _model(trace, profile, max_new_tokens)
    d_max, max_size = model.trace.max_depth, model.trace.max_size
    depths = np.array(sorted({min(int(d), d_max) for d in (range(0, d_max + 1) if depths is None else depths)}))
    sizes = np.array(sorted({int(s) for s in (sizes or range(1, max_size + 1))}))
    indices = list(range(model.num_prompts)) if prompts is None else list(prompts)
    grid = (len(depths), len(sizes))
    best_tokens, best_time, best_cycles = 0, 0.0, 0
    static_tokens, static_time, static_cycles = np.zeros(grid), np.zeros(grid), np.zeros(grid, dtype=np.int64)
    own = np.zeros(3)  # tokens, time, cycles of each prompt at its own best static cell
    for i in indices:
        emitted, verify = cell_tables(model, i, depths, sizes)
        time_i, cycles_i = _hindsight(model, emitted, verify, depths)
        best_tokens, best_time, best_cycles = best_tokens + emitted.shape[0], best_time + time_i, best_cycles + cycles_i
        tok, tim, cyc = _static_sweep(model, emitted, verify, depths)
        static_tokens, static_time, static_cycles = static_tokens + tok, static_time + tim, static_cycles + cyc
        cell = np.unravel_index(int(np.argmax(tok / np.maximum(tim, 1e-12))), grid)
        own += (tok[cell], tim[cell], cyc[cell])
    static = [{"depth": int(depths[a]), "size": int(sizes[b]),
               **summary(static_tokens[a, b], static_time[a, b], static_cycles[a, b])}
              for a in range(grid[0]) for b in range(grid[1])]
    return {"oracle": summary(best_tokens, best_time, best_cycles),
            "greedy_oracle": _greedy_oracle(model, indices, depths, sizes),
            "best_static": max(static, key=lambda r: r["tokens_per_s"]), "static": static,
            "per_prompt_static": summary(*own)}
