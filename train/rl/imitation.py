"""Behaviour cloning from the replay oracle, with DAgger relabelling: a warm start for both PPO policies.

The hindsight oracle (`specpilot.envs.oracle.replay_oracle`) knows, for every position of a recorded generation, the
least time still needed to finish it (a dynamic programme over (position, tokens the drafter must catch up)). From
that cost-to-go, every question the cycle asks has an exact best answer in hindsight:

    skip (depth 0)     STOP (do not draft) iff the best cell from here is a plain target step
    stop (depth l)     STOP iff, among the cells drafting >= l levels, the best drafts exactly l (earlier levels'
                       draft time is spent either way)
    size (depth l)     the size action minimising verify time + cost-to-go at the l levels drafted

`imitate` trains the SB3 policy networks themselves on those labels by cross-entropy against the set of actions tied
for the least cost (so PPO fine-tunes the same weights afterwards): iteration 0 rolls the oracle itself, every later one rolls the current policies and labels the
states THEY visit (DAgger: the policy learns to recover from its own mistakes), aggregating all labelled states.
Rollouts replay the train trace through `run_cycle`, the cycle `generate()` runs; the iteration that validates best
(replay tokens/s on the validation trace, both policies deciding) is kept.

    RUN/bc_depth/best.zip, RUN/bc_size/best.zip   SB3 PPO zips (stage results: co-adaptation starts from them)
    RUN/bc/policies.json                          the cloned policies as a run index (`load_run_controllers`)
    RUN/bc/imitation.json                         per iteration: samples, label agreement, validation tokens/s
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specpilot.drafting.control import Controller, FixedController
from specpilot.drafting.cycle import run_generation
from specpilot.drafting.types import CycleRecord, DraftState
from specpilot.envs.oracle import cell_tables, next_fed_capped
from specpilot.envs.replay import ReplayModel, ReplaySession
from specpilot.policies.learned import CONTINUE, STOP, LearnedController
from specpilot.policies.observation import ObservationSpec, depth_observation, size_observation

BC_DEPTH_STAGE, BC_SIZE_STAGE, BC_DIR = "bc_depth", "bc_size", "bc"


# ---------------------------------------------------------------------------------------------------------------
# the oracle's answers


class OracleTables:
    """One prompt's hindsight Q-values: q(t, k) [nd, nv] = time of cell (depth, size) at position t with k tokens to
    catch up, plus the optimal time to finish from where it lands (`cost`)."""

    def __init__(self, model: ReplayModel, index: int, depths: np.ndarray, sizes: np.ndarray) -> None:
        self.depths, self.sizes = depths, sizes
        self.k_max = model.trace.max_depth + 1
        self.draft = model.draft[:, depths]                                                # [k_max + 1, nd]
        self.emitted, self.verify = cell_tables(model, index, depths, sizes)              # [n, nd, nv]
        n = self.emitted.shape[0]
        ks = np.arange(1, self.k_max + 1)
        self.cost = np.zeros((n + 1, self.k_max + 1))
        for t in range(n - 1, -1, -1):  # the same recursion as the oracle's, keeping the whole cost-to-go table
            self.cost[t, 1:] = self._q(t, ks).reshape(len(ks), -1).min(axis=1)

    def _q(self, t: int, ks: np.ndarray) -> np.ndarray:
        e = self.emitted[t]                                                                # [nd, nv]
        nxt = next_fed_capped(self.depths[None, :, None], ks[:, None, None], e[None], self.k_max)
        return self.draft[ks][:, :, None] + self.verify[t][None] + self.cost[t + e[None], nxt]

    def q(self, t: int, fed: int) -> np.ndarray:
        """[nd, nv] hindsight time to finish the generation choosing each cell now."""
        return self._q(t, np.array([min(max(int(fed), 1), self.k_max)]))[0]


class OracleLabels:
    """The oracle's answer to each cycle question of a replayed generation (`ReplaySession`'s position and fed
    tokens index the Q table). depths: the depth choices (0 included when skipping is allowed); size_actions: the
    size policy's choices."""

    def __init__(self, model: ReplayModel, size_actions: Sequence[int], *, allow_skip: bool = True) -> None:
        self.model = model
        d_max = model.trace.max_depth
        self.depths = np.arange(0 if allow_skip else 1, d_max + 1)
        self.sizes = np.asarray([int(v) for v in size_actions])
        self._tables: dict[int, OracleTables] = {}

    def tables(self, index: int) -> OracleTables:
        tab = self._tables.get(index)
        if tab is None:
            tab = self._tables[index] = OracleTables(self.model, index, self.depths, self.sizes)
        return tab

    def _q(self, session: ReplaySession) -> np.ndarray:
        return self.tables(session.index).q(session.t, session.n_new)

    def depth_costs(self, session: ReplaySession, depth: int) -> np.ndarray:
        """Hindsight time to finish after answering [CONTINUE, STOP] at `depth` levels drafted (0: the skip
        question, where STOP is a plain target step; STOP costs inf when it is not a choice)."""
        best = self._q(session).min(axis=1)                                                # [nd]
        costs = np.full(2, np.inf)
        costs[CONTINUE] = best[self.depths > depth].min(initial=np.inf)
        costs[STOP] = best[self.depths == depth].min(initial=np.inf)
        return costs

    def size_costs(self, session: ReplaySession, depth: int) -> np.ndarray:
        """Hindsight time to finish after verifying each size action at `depth` levels drafted."""
        return self._q(session)[int(np.searchsorted(self.depths, depth))]

    def depth_costs_continuing(self, session: ReplaySession, depth: int, stops) -> np.ndarray:
        """`depth_costs` with CONTINUE valued as the controller itself would continue (AggreVaTe-style): the cycle
        drafts on until `stops(state)` says STOP (or max_depth), then verifies the best size, the oracle continuing
        from the next cycle. The oracle's own continuation stops exactly at the last level that will be accepted
        (knowledge no causal policy has), which makes every CONTINUE look cheap and biases the labels deep."""
        costs = self.depth_costs(session, depth)
        if not np.isfinite(costs[CONTINUE]):
            return costs
        tab, d_max = session.tables, session.max_depth
        stop_at = d_max
        for level in range(max(depth, 0) + 1, d_max):
            if stops(tab.state(session.t, level, *session.prev, acceptance=session.acceptance)):
                stop_at = level
                break
        row = self._q(session)[int(np.searchsorted(self.depths, stop_at))]
        costs[CONTINUE] = row.min()
        return costs

    def depth(self, session: ReplaySession, depth: int) -> int:
        """CONTINUE / STOP at `depth` levels drafted (0: the skip question); CONTINUE on exact ties."""
        return int(self.depth_costs(session, depth).argmin())

    def size(self, session: ReplaySession, depth: int) -> int:
        """Index into size_actions of the best size at `depth` levels drafted (the first of equal ones)."""
        return int(self.size_costs(session, depth).argmin())


class BatchOracleLabels(OracleLabels):
    """The per-batch oracle's answer to each cycle question of a replayed batch (`BatchReplaySession`): the same
    questions as `OracleLabels`, costed by `envs.batch_replay.BatchOracle` on the batch's rows instead of one
    sequence's cost-to-go. `rates` {batch size: tokens/s} makes the costs Dinkelbach's (time - tokens / rate, the
    rate of the largest key <= the unfinished rows; the best static cell's batch throughput is the natural rate:
    each label is then the choice gaining most over the per-batch-size table this cycle); None: seconds per token.
    tie_s: answers within this many seconds of the best are all labelled optimal (Dinkelbach costs sit near 0, where
    a relative tolerance means nothing; 0.1 us is far below any measured cycle time). exact_single: a batch down
    to one unfinished row (batch size 1 included) is labelled by the exact single-sequence hindsight optimum
    (`OracleLabels`: cost-to-go, timed by the model's single-sequence profile) instead of the per-cycle oracle.
    """

    tie_s = 1e-7

    def __init__(self, model: ReplayModel, size_actions: Sequence[int], *, allow_skip: bool = True, times=None,
                 rates: dict[int, float] | None = None, exact_single: bool = False) -> None:
        from specpilot.envs.batch_replay import BatchTimes

        super().__init__(model, size_actions, allow_skip=allow_skip)
        self.times, self.exact_single = times or BatchTimes(model), bool(exact_single)
        self.rates = {int(b): float(r) for b, r in (rates or {}).items()}
        self._oracles: dict = {}

    def oracle(self, batch_size: int):
        """The BatchOracle costing cycles of `batch_size` unfinished rows."""
        from specpilot.envs.batch_replay import BatchOracle

        keys = [b for b in sorted(self.rates) if b <= batch_size] or sorted(self.rates)[:1]
        rate = self.rates[keys[-1]] if keys else None
        oracle = self._oracles.get(rate)
        if oracle is None:
            oracle = self._oracles[rate] = BatchOracle(self.model, self.depths, self.sizes, times=self.times,
                                                       rate=rate)
        return oracle

    def _q(self, session) -> np.ndarray:
        rows = session.active
        if self.exact_single and len(rows) == 1:  # one row left: the exact single-sequence cost-to-go
            return super()._q(rows[0])
        return self.oracle(len(rows)).costs(session)


def batch_rates(model: ReplayModel, size_actions: Sequence[int], batch_sizes: Sequence[int]) -> dict[int, float]:
    """{batch size: the best static cell's batch-replay tokens/s} over depths 0..max_depth x `size_actions` on
    `model`'s trace (the per-batch-size table's rate, `BatchOracleLabels`' Dinkelbach rates)."""
    from specpilot.envs.batch_replay import batch_static_sweep, best_per_batch_size

    cells = [(d, int(v)) for d in range(1, model.trace.max_depth + 1) for v in size_actions]
    rows = batch_static_sweep(model, cells, [int(b) for b in batch_sizes])
    return {int(r["batch_size"]): float(r["tokens_per_s"]) for r in best_per_batch_size(rows)}


# ---------------------------------------------------------------------------------------------------------------
# rollouts


@dataclass
class Dataset:
    """Labelled observations of one policy (aggregated over DAgger iterations)."""

    obs: list[np.ndarray] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    best: list[np.ndarray] = field(default_factory=list)  # per sample, the actions tied for the least cost
    regret: list[np.ndarray] = field(default_factory=list)  # per sample and action, hindsight seconds lost
    actions: list[int] = field(default_factory=list)  # per sample, the action the rolled-out controller took
    agreed: int = 0  # decisions the rolled-out controller answered as the oracle would (this iteration)
    asked: int = 0
    tie_s: float = 0.0  # costs within this many seconds of the least also count as optimal (besides exact ties)

    def add(self, obs: np.ndarray, costs: np.ndarray, action: int) -> int:
        """Record a question: its observation and the oracle's costs per action; returns the label (the first
        least-cost action)."""
        label = int(costs.argmin())
        # exact ties are common (sizes above the candidates drafted verify the same tree): all count as right
        tied = costs <= costs[label] + max(1e-12 * max(abs(float(costs[label])), 1.0), self.tie_s)
        self.obs.append(obs)
        self.labels.append(label)
        self.best.append(tied)
        regret = np.where(tied, 0.0, costs - costs[label])
        self.regret.append(np.where(np.isfinite(regret), regret, np.nan))
        self.actions.append(int(action))
        self.asked += 1
        self.agreed += int(bool(tied[action]))
        return label

    def extend(self, other: "Dataset") -> None:
        self.obs += other.obs
        self.labels += other.labels
        self.best += other.best
        self.regret += other.regret
        self.actions += other.actions

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.stack(self.obs).astype(np.float32), np.asarray(self.labels, dtype=np.int64)

    def best_mask(self) -> np.ndarray:
        return np.stack(self.best)

    def regrets(self) -> np.ndarray:
        """[n, actions] hindsight regret of each action, scaled to mean 1 over the non-zero ones (an action that was
        no choice costs the largest regret)."""
        r = np.stack(self.regret)
        r = np.where(np.isnan(r), np.nanmax(r) if np.isfinite(np.nanmax(r)) else 1.0, r)
        positive = r[r > 0]
        return r / (positive.mean() if positive.size else 1.0)


class LabellingController(Controller):
    """Answers like `policy` (or, where the policy is None or a draw under `expert_share` says so, like the oracle)
    and records every question's observation with the oracle's label. `session` is the ReplaySession being run."""

    name = "dagger"

    def __init__(self, labels: OracleLabels, depth_spec: ObservationSpec, size_spec: ObservationSpec,
                 size_actions: Sequence[int], policy: LearnedController | None, *, expert_share: float = 0.0,
                 rng: np.random.Generator | None = None, continuation: str = "oracle") -> None:
        self.labels, self.depth_spec, self.size_spec = labels, depth_spec, size_spec
        self.continuation = continuation
        self.size_actions = [int(v) for v in size_actions]
        self.policy, self.expert_share = policy, float(expert_share)
        self.rng = rng or np.random.default_rng(0)
        tie = float(getattr(labels, "tie_s", 0.0))
        self.depth_data, self.size_data = Dataset(tie_s=tie), Dataset(tie_s=tie)
        self.session: ReplaySession | None = None

    def _expert(self) -> bool:
        return self.policy is None or (self.expert_share > 0 and self.rng.random() < self.expert_share)

    def _depth(self, state: DraftState, ask) -> bool:
        if self.continuation == "policy" and self.policy is not None:
            costs = self.labels.depth_costs_continuing(self.session, state.depth, self.policy.should_stop)
        else:
            costs = self.labels.depth_costs(self.session, state.depth)
        action = int(costs.argmin()) if self._expert() else (STOP if ask(state) else CONTINUE)
        self.depth_data.add(depth_observation(state, self.depth_spec), costs, action)
        return action == STOP

    def skip_drafting(self, state: DraftState) -> bool:
        return self._depth(state, lambda s: self.policy.skip_drafting(s))

    def should_stop(self, state: DraftState) -> bool:
        return self._depth(state, lambda s: self.policy.should_stop(s))

    def choose_size(self, state: DraftState) -> int:
        costs = self.labels.size_costs(self.session, state.depth)
        action = int(costs.argmin()) if self._expert() else \
            self.size_actions.index(int(self.policy.choose_size(state)))
        self.size_data.add(size_observation(state, self.size_spec), costs, action)
        return self.size_actions[action]

    def reset(self) -> None:
        if self.policy is not None:
            self.policy.reset()

    def observe(self, record: CycleRecord) -> None:
        if self.policy is not None:
            self.policy.observe(record)


def rollout(model: ReplayModel, controller: LabellingController, prompts: Sequence[int] | None = None) -> dict:
    """Replay every prompt with `controller` deciding (through `run_generation`, the decoder's cycle); returns the
    replay totals {tokens, time_s, tokens_per_s}."""
    tokens, time_s = 0, 0.0
    for i in range(model.num_prompts) if prompts is None else prompts:
        controller.session = ReplaySession(model, i)
        records = run_generation(controller.session, controller)
        tokens += sum(r.emitted for r in records)
        time_s += sum(r.draft_s + r.verify_s for r in records)
    return {"tokens": tokens, "time_s": time_s, "tokens_per_s": tokens / time_s if time_s > 0 else float("nan")}


def rollout_batches(model: ReplayModel, controller: LabellingController, batch_sizes: Sequence[int], *, times=None,
                    rng: np.random.Generator | None = None) -> dict:
    """`rollout` over batches: at every batch size, the trace's prompts (shuffled by `rng` when given) in batches
    of that size (`envs.batch_replay.batches_of`), each a `BatchReplaySession` the controller decides for through
    `run_generation`; returns the totals over all batches."""
    from specpilot.envs.batch_replay import BatchReplaySession, BatchTimes, batches_of

    times = times or BatchTimes(model)
    tokens, time_s = 0, 0.0
    for b in batch_sizes:
        order = list(range(model.num_prompts)) if rng is None else rng.permutation(model.num_prompts).tolist()
        for batch in batches_of(model.num_prompts, int(b), order):
            controller.session = BatchReplaySession(model, batch, times=times)
            run_generation(controller.session, controller)
            tokens += controller.session.emitted_total
            time_s += sum(r.draft_s + r.verify_s for r in controller.session.cycles)
    return {"tokens": tokens, "time_s": time_s, "tokens_per_s": tokens / time_s if time_s > 0 else float("nan")}


# ---------------------------------------------------------------------------------------------------------------
# supervised training of the SB3 policy network


def _set_nll(logits: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """-log P(an optimal action): cross-entropy against the set of actions tied for the least cost."""
    return (torch.logsumexp(logits, dim=1) - torch.logsumexp(logits.masked_fill(~best, -torch.inf), dim=1)).mean()


LOSSES = ("set", "regret", "cost", "soft")
SOFT_TEMPERATURE = 0.5  # "soft" targets: softmax(-regret / T), regrets scaled to mean 1 over the non-zero ones


def _loss(logits: torch.Tensor, best: torch.Tensor, regret: torch.Tensor | None, mode: str) -> torch.Tensor:
    """The supervised loss of one batch: "set" -P(optimal) NLL; "regret" that plus the expected regret; "cost" the
    expected regret alone (the Bayes-optimal answer under the observation); "soft" cross-entropy against
    softmax(-regret / SOFT_TEMPERATURE) (every action weighted by how little it loses in hindsight)."""
    if regret is None or mode == "set":
        return _set_nll(logits, best)
    expected = (torch.softmax(logits, dim=1) * regret).sum(dim=1).mean()
    if mode == "cost":
        return expected
    if mode == "soft":
        target = torch.softmax(-regret / SOFT_TEMPERATURE, dim=1)
        return -(target * torch.log_softmax(logits, dim=1)).sum(dim=1).mean()
    return _set_nll(logits, best) + expected


def fit_policy(policy, obs: np.ndarray, labels: np.ndarray, *, best: np.ndarray | None = None,
               regret: np.ndarray | None = None, epochs: int = 30, batch_size: int = 256, lr: float = 1e-3,
               weight_decay: float = 0.0, seed: int = 0, mode: str = "regret") -> dict:
    """Cross-entropy of `policy`'s action distribution (an SB3 ActorCriticPolicy, trained in place) on (obs, label)
    pairs, or, with `best` ([n, actions] bool: the actions tied for the least cost), on the probability of any
    optimal action; with `regret` ([n, actions], scaled hindsight regrets) the policy's expected regret is added
    (cost-sensitive: where the observation cannot tell the future, the answer that is cheapest on average wins,
    not the most frequent hindsight label); only the actor's weights receive gradients. Returns {"loss", "accuracy"} after training
    (accuracy: the argmax is one of the optimal actions)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.as_tensor(obs, dtype=torch.float32, device=policy.device)
    y = torch.as_tensor(labels, dtype=torch.int64, device=policy.device)
    b = torch.nn.functional.one_hot(y, policy.action_net.out_features).bool() if best is None else \
        torch.as_tensor(best, dtype=torch.bool, device=policy.device)
    r = None if regret is None else torch.as_tensor(regret, dtype=torch.float32, device=policy.device)
    params = list(policy.mlp_extractor.policy_net.parameters()) + list(policy.action_net.parameters())
    optim = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    policy.set_training_mode(True)
    n = len(y)
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size].to(policy.device)
            logits = policy.action_net(policy.mlp_extractor.forward_actor(policy.extract_features(x[idx])))
            loss = _loss(logits, b[idx], None if r is None else r[idx], mode)
            optim.zero_grad()
            loss.backward()
            optim.step()
    policy.set_training_mode(False)
    with torch.no_grad():
        logits = policy.action_net(policy.mlp_extractor.forward_actor(policy.extract_features(x)))
        chosen = b.gather(1, logits.argmax(dim=1, keepdim=True)).squeeze(1)
        return {"loss": float(_set_nll(logits, b)), "accuracy": float(chosen.float().mean())}


# ---------------------------------------------------------------------------------------------------------------
# the DAgger loop


@dataclass
class ImitationSettings:
    """iters: DAgger iterations (1: plain behaviour cloning on the oracle's own rollouts). epochs / batch_size / lr:
    the supervised fit after each iteration (from the previous iteration's weights); loss: "set" (cross-entropy on
    the optimal actions), "regret" (plus the expected hindsight regret), "cost" (the expected regret alone) or "soft"
    (cross-entropy on softmax(-regret / SOFT_TEMPERATURE)), see `_loss`; weight_decay: Adam's. 8 iterations by default
    (was 4): on held-out code replay (3 seeds, README) the share of the oracle's gain rose from 47.4% to 53.5% (BC
    only, medians), while "set"/"cost" collapsed and "soft", weight decay or continuation="policy" did not help.
    continuation: "oracle" (CONTINUE valued with the oracle stopping after it) or "policy" (as the rolled-out
    policy would continue, `OracleLabels.depth_costs_continuing`). expert_share: after iteration
    0, the share of decisions the oracle still takes in rollouts (0: pure DAgger relabelling of the policy's own
    states). exact_single: batch imitation labels one-row batches by the exact single-sequence oracle
    (`BatchOracleLabels`)."""

    iters: int = 8
    epochs: int = 30
    loss: str = "regret"
    batch_size: int = 256
    lr: float = 1e-3
    expert_share: float = 0.0
    exact_single: bool = False
    weight_decay: float = 0.0
    continuation: str = "oracle"


# the options naming a cloning's settings in refusals (other ImitationSettings fields have no option: named by field)
BC_OPTIONS = {"iters": "--bc-iters", "epochs": "--bc-epochs", "exact_single": "bc_exact_single", "seed": "--seed",
              "batch_sizes": "--batch-sizes"}


def imitation_settings(options) -> ImitationSettings:
    """The cloning a pipeline's TrainOptions ask for (options.bc_iters > 0)."""
    return ImitationSettings(iters=options.bc_iters, epochs=options.bc_epochs, exact_single=options.bc_exact_single)


def imitation_setup(options) -> dict:
    """The TrainOptions besides ImitationSettings that define a cloning (JSON values), as imitation.json records
    them: the seed draws its rollouts and fits, the batch sizes its states."""
    return {"seed": int(options.seed), "batch_sizes": list(options.batch_sizes) if options.batch_sizes else None}


def _finished_imitation(run_dir: Path) -> dict | None:
    """RUN/bc/imitation.json (written last: the cloning finished), or None."""
    from specpilot.drafting.files import read_json

    path = run_dir / BC_DIR / "imitation.json"
    if not path.is_file():
        return None
    return read_json(path, what="behaviour cloning record", fix=f"delete {path.parent} to clone again")


def _trained_ppo_stage1(run_dir: Path) -> bool:
    from specpilot.artifacts.run import RunManifest

    stages = RunManifest.load(run_dir).stages
    return "size_s1" in stages or "depth_s1" in stages


def check_imitation_resume(run_dir: str | Path, options, settings: ImitationSettings | None) -> None:
    """Before any work of a resumed pipeline: its stage 1 is the kind asked for (behaviour cloning with `settings`,
    or PPO when None), and a finished cloning was made with the settings given. ResumeSettingsError otherwise,
    naming each changed option with its saved and given value (a resumed run used to keep its cloning silently, or
    to train stage 1 with PPO before co-adaptation refused its starting policies)."""
    from specpilot.train.rl.ppo import ResumeSettingsError, changed_settings, show_value

    run_dir = Path(run_dir)
    record = _finished_imitation(run_dir)
    fix = "or start a new --run to train with the new ones (nothing was changed)"
    if settings is None:
        if record is not None and not _trained_ppo_stage1(run_dir):
            saved = record.get("settings") or {}
            raise ResumeSettingsError(
                f"cannot resume {run_dir} without --bc: its stage 1 is behaviour cloning ({run_dir / BC_DIR}, --bc "
                f"--bc-iters {saved.get('iters', '?')} --bc-epochs {saved.get('epochs', '?')}); resume with those, "
                f"{fix}")
        return
    if record is None:
        if _trained_ppo_stage1(run_dir):
            raise ResumeSettingsError(f"cannot resume {run_dir} with --bc: its stage 1 was trained with PPO "
                                      f"(size_s1, depth_s1); resume without --bc, {fix}")
        return
    saved = {**(record.get("settings") or {}), **(record.get("setup") or {})}
    given = {**settings.__dict__, **imitation_setup(options)}
    changes = changed_settings(saved, given, sorted(saved))
    if changes:
        listed = "; ".join(f"{BC_OPTIONS.get(k, f'ImitationSettings.{k}')} saved {show_value(a)}, given "
                           f"{show_value(b)}" for k, a, b in changes)
        raise ResumeSettingsError(f"cannot resume the behaviour cloning of {run_dir} with changed settings "
                                  f"({listed}): {run_dir / BC_DIR / 'imitation.json'} records the saved values; "
                                  f"resume with those, {fix}")


def _ppo_model(kind: str, source, size_actions, options, seed_offset: int, partner: Controller):
    """A fresh SB3 PPO with exactly the settings the PPO stages use (so their init_from loads it exactly)."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    from specpilot.train.rl.ppo import build_model
    from specpilot.train.rl.stages import StageSpec, make_env, budget_settings

    settings = budget_settings(kind, 1 << 15, seed=options.seed + seed_offset, ppo=options.ppo)
    spec = StageSpec(kind, f"bc_{kind}", 1, partner=partner, val_partner=partner, size_actions=size_actions)
    env = make_env(source, spec, size_actions, reward=options.reward, max_context=options.max_context,
                    skip_decisions=options.skip_decisions)
    return build_model(DummyVecEnv([lambda: env]), settings)


def imitate(run_dir: str | Path, traces, *, size_actions: Sequence[int] | None = None, options=None,
            settings: ImitationSettings | None = None, logger=None) -> dict:
    """Behaviour cloning + DAgger of both policies from the replay oracle on the train trace (see the module
    docstring). Writes RUN/bc_depth/best.zip, RUN/bc_size/best.zip (+ best.json, manifest stage setups, so
    `coadapt(size_stage="bc_size", depth_stage="bc_depth")` fine-tunes them) and RUN/bc/policies.json. Returns
    {"depth": StageResult, "size": StageResult, "iterations": [...], "policies": path}."""
    from specpilot.envs.environments import ReplaySource
    from specpilot.policies.ppo import PPOController
    from specpilot.train.rl.coadapt import write_index
    from specpilot.train.rl.ppo import update_manifest, write_json
    from specpilot.policies.observation import BATCH_FEATURES, DEFAULT_FEATURES, DEFAULT_SIZE_FEATURES
    from specpilot.train.rl.stages import (StageResult, TaskTraces, TrainOptions, batch_profile_for, size_actions_for,
                                        static_config)
    from specpilot.train.rl.validation import evaluate_batches, evaluate_replay, replay_ar

    run_dir, options = Path(run_dir), options or TrainOptions()
    settings = settings or ImitationSettings()
    if settings.iters < 1:
        raise ValueError(f"imitation needs iters >= 1, got {settings.iters}")
    if settings.loss not in LOSSES:
        raise ValueError(f"unknown imitation loss {settings.loss!r}; choose one of {LOSSES}")
    traces = TaskTraces.resolve(traces)
    done = run_dir / BC_DIR / "imitation.json"
    if options.resume:
        check_imitation_resume(run_dir, options, settings)
    if options.resume and done.is_file():  # a resumed pipeline keeps its finished behaviour cloning
        from specpilot.train.rl.stages import stage_result

        return {"depth": stage_result(run_dir, BC_DEPTH_STAGE), "size": stage_result(run_dir, BC_SIZE_STAGE),
                "iterations": json.loads(done.read_text())["iterations"], "policies": run_dir / BC_DIR / "policies.json"}
    batch_sizes = options.batch_sizes
    profile = batch_profile_for(run_dir, ReplayModel(traces.train).trace, options) if batch_sizes else None
    source = ReplaySource(traces.train, profile, batch_sizes=batch_sizes)
    model, val_model = source.model, ReplayModel(traces.validation, profile)
    trace = model.trace
    features = DEFAULT_FEATURES + (BATCH_FEATURES if batch_sizes else ())
    actions = size_actions_for(model, size_actions)
    static = static_config(run_dir, options.static)
    fallback = FixedController(*static)
    depth_spec = ObservationSpec.for_depth(trace.width, trace.max_depth, max_context=options.max_context,
                                           features=features)
    size_spec = ObservationSpec.for_size(trace.width, trace.max_depth, size_actions=actions,
                                         max_context=options.max_context, features=features + DEFAULT_SIZE_FEATURES)
    depth_ppo = _ppo_model("depth", source, actions, options, 0, fallback)
    size_ppo = _ppo_model("size", source, actions, options, 1, fallback)
    if batch_sizes:  # batches: the per-batch oracle, Dinkelbach at the best static cell's rate per batch size
        labels = BatchOracleLabels(model, actions, allow_skip=options.skip_decisions, times=source.times,
                                   rates=batch_rates(model, actions, batch_sizes),
                                   exact_single=settings.exact_single)
        batch_ar = evaluate_batches(FixedController(0, 0), val_model, batch_sizes)["ar"]
    else:
        labels = OracleLabels(model, actions, allow_skip=options.skip_decisions)
        ar = replay_ar(val_model)
    depth_all, size_all = Dataset(), Dataset()
    rng = np.random.default_rng(options.seed)
    history, best = [], None
    dirs = {k: run_dir / s for k, s in (("depth", BC_DEPTH_STAGE), ("size", BC_SIZE_STAGE))}
    for it in range(settings.iters):
        policy = None if it == 0 else PPOController(depth_ppo, size_ppo, depth_spec=depth_spec, size_spec=size_spec,
                                                    size_actions=actions, fallback=fallback)
        labeller = LabellingController(labels, depth_spec, size_spec, actions, policy,
                                       expert_share=settings.expert_share, rng=rng,
                                       continuation=settings.continuation)
        if not options.skip_decisions:  # the partner's answer to the skip question: always draft
            labeller.skip_drafting = lambda state: False
        rolled = rollout_batches(model, labeller, batch_sizes, times=source.times, rng=rng) if batch_sizes else \
            rollout(model, labeller)
        depth_all.extend(labeller.depth_data)
        size_all.extend(labeller.size_data)
        fits = {}
        for kind, ppo, data in (("depth", depth_ppo, depth_all), ("size", size_ppo, size_all)):
            if not data.labels:  # never asked (e.g. the oracle never drafts): the policy keeps its weights
                fits[kind] = {"loss": None, "accuracy": None}
                continue
            obs, y = data.arrays()
            fits[kind] = fit_policy(ppo.policy, obs, y, best=data.best_mask(), epochs=settings.epochs,
                                    regret=data.regrets() if settings.loss != "set" else None, mode=settings.loss,
                                    batch_size=settings.batch_size,
                                    lr=settings.lr, weight_decay=settings.weight_decay, seed=options.seed + it)
        ctrl = PPOController(depth_ppo, size_ppo, depth_spec=depth_spec, size_spec=size_spec, size_actions=actions,
                             fallback=fallback, name="bc")
        if batch_sizes:  # the batch stages' validation score: geometric-mean speedup over batched AR
            res = evaluate_batches(ctrl, val_model, batch_sizes, batch_ar)
            val = {"tokens_per_s": res["score"], "speedup": res["score"],
                   "per_batch_size": {b: r["speedup"] for b, r in res["per_batch_size"].items()}}
        else:
            val = evaluate_replay(ctrl, val_model, ar["tokens_per_s"])
        entry = {"iteration": it, "rollout": "oracle" if policy is None else "policy",
                 "rollout_tokens_per_s": rolled["tokens_per_s"],
                 "agreement": {"depth": labeller.depth_data.agreed / max(labeller.depth_data.asked, 1),
                               "size": labeller.size_data.agreed / max(labeller.size_data.asked, 1)},
                 "samples": {"depth": len(depth_all.labels), "size": len(size_all.labels)},
                 "fit": fits, "val_tokens_per_s": val["tokens_per_s"], "val_speedup": val.get("speedup"),
                 **({"val_per_batch_size": val["per_batch_size"]} if batch_sizes else {})}
        history.append(entry)
        if logger is not None:
            # a batch validation scores a geometric-mean speedup over batched AR, not tokens/s: logged under the name
            # the PPO stages' batch validation uses
            score = ({"bc/val/batch_score": val["speedup"]} if batch_sizes
                     else {"bc/val/tokens_per_s": val["tokens_per_s"]})
            logger.log({**score,
                        **{f"bc/fit/{k}_accuracy": f["accuracy"] for k, f in fits.items() if f["accuracy"] is not None}},
                       step=it)
        if best is None or val["tokens_per_s"] > best:
            best = val["tokens_per_s"]
            for kind, ppo in (("depth", depth_ppo), ("size", size_ppo)):
                dirs[kind].mkdir(parents=True, exist_ok=True)
                ppo.save(dirs[kind] / "best.zip")
                write_json(dirs[kind] / "best.json", {"score": best, "iteration": it, "stage": dirs[kind].name})
    results = {
        "depth": StageResult(BC_DEPTH_STAGE, "depth", dirs["depth"] / "best.zip", depth_spec, None, best),
        "size": StageResult(BC_SIZE_STAGE, "size", dirs["size"] / "best.zip", size_spec, actions, best)}
    setup = {"backend": "replay", "reward": options.reward, "imitation": True, "temperature": 0.0,
             **({"batch_sizes": list(batch_sizes), "batch_profile": str(profile or "")} if batch_sizes else {})}
    update_manifest(run_dir, traces={"train": str(traces.train), "validation": str(traces.validation),
                                     "train_pair": trace.header.get("pair")},
                    seeds={BC_DEPTH_STAGE: options.seed, BC_SIZE_STAGE: options.seed + 1},
                    stage_setup={BC_DEPTH_STAGE: {**setup, "kind": "depth", "spec": depth_spec.to_dict(),
                                                  "size_actions": None},
                                 BC_SIZE_STAGE: {**setup, "kind": "size", "spec": size_spec.to_dict(),
                                                 "size_actions": actions}},
                    imitation={"settings": settings.__dict__, "iterations": history})
    policies = write_index(run_dir / BC_DIR, results["depth"], results["size"], static, copy=True)
    write_json(run_dir / BC_DIR / "imitation.json", {"settings": settings.__dict__, "setup": imitation_setup(options),
                                                    "iterations": history, "best_val_tokens_per_s": best})
    return {**results, "iterations": history, "policies": policies}
