"""`specpilot demo`: the whole mission end to end — record, grid search, train two PPO policies, co-adapt, evaluate
on held-out tasks, export, summarise — in one run directory, reusing finished stages when re-run.

    specpilot demo [--quick] [--out runs/demo] [--target T --draft D] [--ray auto --workers 8]

Budgets (`DemoBudget`) are sized for the embedded pair on a 2-core CPU: the full run aims at <= 25 minutes,
`--quick` at <= 6 minutes with every stage still present. With `executor` (a `specpilot.train.scale.cluster.WorkerPool`,
`--ray`), recording, the grid's live phases and the evaluation run on the Ray workers, through the same
orchestrators and into the same files (plus which worker ran what); the cost-model check, training (replay) and
the export stay in this process.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from tqdm.auto import tqdm

from specpilot.artifacts.common import json_digest
from specpilot.artifacts.grid import GRID_FILE, GridResult
from specpilot.artifacts.profile import DEFAULT_PROFILE_CYCLES, profile_path
from specpilot.artifacts.report import read_report
from specpilot.drafting.cliargs import usable_cores
from specpilot.drafting.files import atomic_write_json, read_json
from specpilot.drafting.folder_lock import LOCK_SUFFIX, holds_output

PROFILE_CHECK = "profile_check.json"  # the demo's check of the profile behind the grid search and training


@dataclass
class DemoBudget:
    """How much work each stage does.

    train_prompts / val_prompts / heldout_prompts: prompts used per split (0 = all of the bundled suite);
    max_new_tokens: tokens per recorded / evaluated generation;
    width / max_depth / max_size: the draft tree recorded and searched;
    size_steps / depth_steps / coadapt_steps / rounds: PPO budgets in env steps (replay backend). coadapt_steps
        40k (was 20k): the seeds of three demos, each retrained on its own traces at both budgets, took on their
        held-out traces +2.3 / +0.4 / +2.5, -1.7 / +3.1 / +1.9 and -0.4 / -2.7 / +0.9 points of the oracle's gain
        with 40k (mean +0.7, within seed noise; the deployed seed +3.1, 0 and +1.7); the seeds' train stage takes
        ~240 s instead of ~140-190 s (README, "A longer PPO fine-tune");
    n_steps / batch_size / n_epochs: PPO rollout settings (the paper's 2048/256; 10 epochs instead of 20, so the
        budget buys more environment steps: on replay, steps are cheap and the updates are the cost);
    pi_arch / vf_arch: actor and critic layers. The paper's [1024, 256] actor costs ~0.1-0.5 ms per decision on
        a CPU, several percent of a ~35 ms CPU cycle (the depth policy runs every level), so the CPU demo uses a
        small actor, and a [256, 256] critic (not used at inference) to keep the updates cheap;
    reward: PPO reward. "dinkelbach" (tokens - lambda * time) by default: summed over an episode it is total tokens
        minus lambda * total time, so it optimises long-run tokens/s. The paper's per-cycle "throughput" reward
        sums tokens/time ratios, which favours many short cycles and collapses the depth policy to depth 1;
    live_top: grid configs re-measured live; temperatures: evaluation settings; sampled_methods: the
        methods also evaluated at temperatures > 0 (HF's assisted generation, the grid config and LTD; each
        further method costs one generation per held-out prompt, ~0.4 minutes at 30 prompts);
    eval_budget_s / eval_rounds / eval_full_rounds: the eval stage's wall-time budget (trace, profile, live
        rounds, replay, report), its rounds ("auto": until ltd vs grid is resolved to +-1.5% or the budget is
        spent, at least 2) and how many rounds run every method (later rounds run ar, ltd and grid only);
    eval_sampled_min_rounds: the least rounds at T > 0 (the headline is greedy; intervals resample prompts);
    eval_replay_only: controller methods evaluated in exact replay of the held-out trace instead of live (the
        ablations and the default config: not in the verdicts, and replay costs no generation);
    check_rounds: rounds of the live measurement that checks the latency profile before the grid search;
    profile_cycles: cycles each latency profile keeps at least (train, validation and the evaluation's re-measured
        one; `collect_samples(min_cycles=...)`): one pass over 8 prompts kept only 130-180;
    sampled_depth_steps / sampled_size_steps: live PPO steps of the policies fine-tuned at each temperature > 0 of
        `temperatures` (replay models greedy decoding only; the grid measures its candidates live there too);
    bc_iters / bc_epochs: stage 1 is behaviour cloning from the replay oracle with this many DAgger iterations
        (`specpilot.train.rl.imitation`; co-adaptation then fine-tunes with PPO, and size_steps / depth_steps are
        unused); bc_iters = 0 trains stage 1 with PPO from scratch instead. Measured in replay on held-out code
        at equal co-adaptation budgets: BC + PPO captured 63% of the oracle's gain over AR, PPO alone 45%. 8
        iterations of 20 epochs (was 4 of 30; validation keeps picking the later ones), replayed on the last full
        demo's held-out code trace, BC alone: 54.3 / 53.5 / 50.3% per seed (was 48.3 / 47.4 / 45.2%), BC + PPO
        54.6 / 53.9 / 54.6% (was 50.6 / 44.4 / 48.7%); behaviour cloning takes ~42 s a seed instead of ~18 (CPU
        seconds, one thread, two runs each, shared machine): ~+75 s over 3 seeds in the train stage.
    seeds: whole training pipelines (BC + co-adaptation, replay) with seeds seed, seed + 1, ...
        (`specpilot.train.rl.seeds.run_seeds`); the one best on validation is deployed and is the only one
        fine-tuned live at T > 0 and evaluated live; every seed's ltd vs grid is replayed on the held-out trace.
        `--quick` trains 1 seed (no aggregate over seeds).
    trace_workers: processes that record the greedy traces side by side (the record stage's train and validation
        traces, the evaluation's held-out trace; `specpilot.train.scale.processes.ProcessPool`, one torch thread
        each), while the latency profiles, the AR timing and every live measurement run in this process alone;
        None: one per usable core on a CPU where the copies of the pair fit half the available memory
        (`trace_worker_count`), 0 or 1: none (this process records). Not with an executor (Ray's workers record
        there). A trace prompt took 3.5 s on one thread and 3.7 s on two on the 2-core AMD EPYC; two one-thread
        processes side by side 3.97 s each: 1.8x the prompts a second. Not part of any stage's key: the traces are
        the same either way (greedy tokens and ranks; draft scores to float round-off);
    seed_workers: seeds trained at once, each in its own process (`run_seeds(workers=...)`; None:
        `seeds.seed_worker_count(seeds, usable cores)`, the count whose schedule ends first: 3 on 2 cores, all
        seeds at once, not two waves with a core idle in the second). On the 2-core machine one seed took 169 s
        alone on 2 threads, two seeds side by side on one thread each 143 s together: the small replay networks
        do not use a second thread; 3 seeds on 3 processes took 0.81x the time of 2 processes in two waves.

    Time (the full run must fit ~25 minutes on a quiet 2-core CPU). Unit costs of the embedded pair (fp32, 2
    threads), read from the quiet parts of the 06ba190 run's log: a recorded trace prompt (48 positions of the full
    W=4 depth-8 tree, its greedy continuation included) ~2.35 s, a 48-token generation ~0.75 s at T=0 and ~0.8 s
    at T=1, PPO in replay ~500-1000 env steps/s. The evaluation's floor is not eval_budget_s: every prompt runs at
    least two rounds at T=0 (the first with every live method) and eval_sampled_min_rounds at T > 0, so its cost
    grows with heldout_prompts x max_new_tokens x methods. Quiet-machine estimates in brackets:
    - record: 77 train + 21 validation prompts x 48 positions [98 x 2.35 s + two profiles ~0.4 min: ~4.3 min
      before the traces were recorded side by side (`trace_workers`) and one profile shared by the splits;
      ar.json's live AR timing is taken from the recording's own greedy generations (it was a second AR pass over
      every prompt, ~1.2 min)]. More prompts, fewer tokens each: more varied training states for the same cost;
      the prefill is ~5% of a 48-token generation and dilutes every method's speedup alike;
    - grid: the cost-model check (re-measured when stale), live_top 3 over the 21 validation prompts at T=0 and
      the sampled candidates at T=1 [2.8 min measured: 0.5 + 0.85 + 1.45];
    - train: 3 seeds x (BC ~10 s + 3 rounds x coadapt_steps 40k) in replay + the deployed seed's live T=1
      fine-tuning, 2048 depth + 512 size live cycles, and its off-switch check [8.4 min measured with the seeds
      one after another; 7.5 min (447 s) with them on 2 worker processes (seed_workers), eda45ea];
    - eval: 30 held-out prompts (5 per code group, the fewest a group verdict needs; the headline interval
      resamples prompts, so prompts, not rounds, narrow it) [the greedy trace 30 x 2.5 s ~1.3 min, the profile
      ~0.2 min, T=0 round 1 with 9 live methods ~3.5 min (it was 4.5 with 12: fixed, depth_only and size_only
      are replayed instead, `eval_replay_only`, ~0.6 s a generation each), round 2 (ar, ltd, grid) ~1.05 min, T=1
      one round of ar + sampled_methods 30 x 4 x 0.8 s ~1.6 min (its second round was ~1.2 min), warm-ups,
      replay and report ~0.3 min: ~8.0 min]; eval_budget_s 480 is about that floor, so later rounds run only on
      a faster machine.
    Total ~23.6 minutes quiet (estimated from unit costs): record 4.3 + grid 2.8 + train 8.4 + eval 8.0 + export
    and model load ~0.1; measured 24.3 and 25.0 min (a93cd5d, 4683c3c), then 22.3 min with the seeds on 2 worker
    processes (eda45ea: record 266 s, grid 173 s, train 447 s, eval 448 s). Measured once before these cuts
    (06ba190): 31.1 min with record 9.6 min (slowed ~10x for its first minutes by a concurrent test run; ~5.3
    quiet), grid 2.8, train 8.4, eval 10.2.
    """

    train_prompts: int = 0
    val_prompts: int = 0
    heldout_prompts: int = 30  # round-robin over the held-out suite's groups (5 per group of the code suite)
    max_new_tokens: int = 48
    width: int = 4
    max_depth: int = 8
    max_size: int = 32
    size_steps: int = 40_000
    depth_steps: int = 120_000
    coadapt_steps: int = 40_000
    rounds: int = 3
    n_steps: int = 2048
    batch_size: int = 256
    n_epochs: int = 10
    pi_arch: tuple[int, ...] = (64, 64)
    vf_arch: tuple[int, ...] = (256, 256)
    reward: str = "dinkelbach"
    live_top: int = 3
    temperatures: tuple[float, ...] = (0.0, 1.0)
    sampled_methods: tuple[str, ...] = ("hf_assisted", "grid", "ltd")
    eval_budget_s: float = 480.0
    eval_rounds: int | str = "auto"
    eval_full_rounds: int | None = 1
    eval_sampled_min_rounds: int = 1
    eval_replay_only: tuple[str, ...] = ("fixed", "depth_only", "size_only")
    check_rounds: int = 3
    profile_cycles: int = DEFAULT_PROFILE_CYCLES
    sampled_depth_steps: int = 2048
    sampled_size_steps: int = 512
    bc_iters: int = 8
    bc_epochs: int = 20
    seeds: int = 3
    seed_workers: int | None = None
    trace_workers: int | None = None

    @classmethod
    def quick(cls) -> "DemoBudget":
        return cls(train_prompts=10, val_prompts=4, heldout_prompts=12, max_new_tokens=48, size_steps=3_000,
                   depth_steps=4_000, coadapt_steps=2_000, rounds=3, n_steps=512, batch_size=128, n_epochs=5,
                   vf_arch=(256, 256), live_top=2, temperatures=(0.0, 1.0), sampled_methods=("grid", "ltd"),
                   eval_budget_s=150.0, sampled_depth_steps=1024, sampled_size_steps=256, seeds=1, profile_cycles=200)


STAGES = ("record", "grid", "train", "eval", "export")
# the budget fields each stage's result depends on; a stage's key also includes the previous stage's key, so a
# change re-runs that stage and every later one, and reuses the earlier ones
STAGE_FIELDS = {
    "record": ("train_prompts", "val_prompts", "max_new_tokens", "width", "max_depth", "max_size", "profile_cycles"),
    "grid": ("live_top", "check_rounds", "temperatures"),
    "train": ("size_steps", "depth_steps", "coadapt_steps", "rounds", "n_steps", "batch_size", "n_epochs", "pi_arch",
              "vf_arch", "reward", "temperatures", "sampled_depth_steps", "sampled_size_steps", "bc_iters", "bc_epochs",
              "seeds"),
    "eval": ("heldout_prompts", "profile_cycles", "temperatures", "sampled_methods", "eval_budget_s", "eval_rounds",
             "eval_full_rounds", "eval_sampled_min_rounds", "eval_replay_only"),
    "export": (),
}


class DemoState:
    """demo_state.json: which stages finished with which settings (a stage re-runs if its settings changed)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "demo_state.json"
        self.data = read_json(self.path, what="demo state", fix="delete it to run every stage again") \
            if self.path.exists() else {}

    def done(self, stage: str, key: str) -> dict | None:
        """The stage's finished entry when its settings are `key` (a damaged entry is not finished: the stage runs
        again, which loses nothing)."""
        entry = self.data.get(stage)
        if not (isinstance(entry, dict) and entry.get("key") == key and isinstance(entry.get("result"), dict)
                and isinstance(entry.get("seconds"), (int, float))):
            return None
        return entry

    def started_with(self, stage: str) -> str | None:
        """The settings key the stage last started with (None: never recorded)."""
        started = self.data.get(STARTED_ENTRY)
        return started.get(stage) if isinstance(started, dict) else None

    def start(self, stage: str, key: str) -> None:
        """Record that `stage` starts with settings `key`: an interrupted start resumes only with the same key."""
        started = self.data.get(STARTED_ENTRY)
        self.data[STARTED_ENTRY] = {**(started if isinstance(started, dict) else {}), stage: key}
        atomic_write_json(self.path, self.data, default=str)

    def finish(self, stage: str, key: str, result: dict, seconds: float) -> float:
        """Record the finished stage and return its seconds, those of the interrupted starts it resumed included
        (`interrupted`)."""
        seconds += self._interrupted_seconds(stage, key)
        partial = self.data.pop(PARTIAL_ENTRY, None)
        if isinstance(partial, dict):  # the other stages' interrupted starts stay recorded
            partial.pop(stage, None)
            if partial:
                self.data[PARTIAL_ENTRY] = partial
        self.data[stage] = {"key": key, "result": result, "seconds": round(seconds, 1)}
        atomic_write_json(self.path, self.data, default=str)
        return seconds

    def interrupted(self, stage: str, key: str, seconds: float) -> None:
        """Add the seconds an interrupted start of `stage` ran (Ctrl-C, an error) to what it will report when a
        resumed start finishes it (a process killed outright records nothing)."""
        partial = self.data.get(PARTIAL_ENTRY)
        seconds += self._interrupted_seconds(stage, key)
        self.data[PARTIAL_ENTRY] = {**(partial if isinstance(partial, dict) else {}),
                                    stage: {"key": key, "seconds": round(seconds, 1)}}
        try:
            atomic_write_json(self.path, self.data, default=str)
        except OSError:  # the interrupt itself is what the user must see
            pass

    def _interrupted_seconds(self, stage: str, key: str) -> float:
        """The seconds interrupted starts of `stage` under settings `key` ran (0 when none were recorded)."""
        partial = self.data.get(PARTIAL_ENTRY)
        earlier = partial.get(stage) if isinstance(partial, dict) else None
        if isinstance(earlier, dict) and earlier.get("key") == key and isinstance(earlier.get("seconds"), (int, float)):
            return float(earlier["seconds"])
        return 0.0

    def invalidate_after(self, stage: str) -> None:
        for later in STAGES[STAGES.index(stage) + 1:]:
            self.data.pop(later, None)

    def keep_dtype(self, dtype: str, reason: str | None) -> None:
        """Record the dtype the run decodes in (`_kept_dtype` reuses it when the run resumes)."""
        if self.data.get(DTYPE_ENTRY) != {"dtype": dtype, "reason": reason}:
            self.data[DTYPE_ENTRY] = {"dtype": dtype, "reason": reason}
            atomic_write_json(self.path, self.data, default=str)


DTYPE_ENTRY = "dtype"  # demo_state.json: {"dtype", "reason"} the run's stages were made in
STARTED_ENTRY = "started"  # demo_state.json: {stage: the settings key it last started with}
PARTIAL_ENTRY = "interrupted"  # demo_state.json: {stage: {"key", "seconds"}} run by interrupted starts
# what the record and grid stages write (and the demo's own state): everything else in the run folder is training's
# or a later stage's, set aside when training starts over (`set_aside_stale_training`)
BEFORE_TRAINING = ("traces", GRID_FILE, "grid.png", PROFILE_CHECK, "demo_state.json", "stale")


def set_aside_stale_training(run_dir: Path) -> Path | None:
    """Move what an earlier training (and the stages after it) left in `run_dir` to RUN/stale/train-<time>/ and
    return that folder (None when there was nothing): kept, not deleted."""
    stale = [p for p in run_dir.iterdir()
             if p.name not in BEFORE_TRAINING and not p.name.startswith(("grid.", ".grid."))
             and not p.name.endswith(LOCK_SUFFIX)]  # the run's lock (this demo holds it) stays where it is
    if not stale:
        return None
    folder = run_dir / "stale" / time.strftime("train-%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    for path in stale:
        os.replace(path, folder / path.name)
    return folder


def _kept_dtype(state: DemoState, device: str | None) -> dict | None:
    """The dtype a resumed run keeps: the recorded one when some stage finished in it and this device runs it
    natively (another machine without bf16 measures "auto" afresh, and re-runs the stages)."""
    from specpilot.drafting.pair import DTYPES, check_device, half_support

    kept = state.data.get(DTYPE_ENTRY)
    if not isinstance(kept, dict) or kept.get("dtype") not in DTYPES or not any(s in state.data for s in STAGES):
        return None
    return kept if half_support(DTYPES[kept["dtype"]], check_device(device))[0] == "native" else None


def demo_dtype(out: str | Path, *, target=None, draft=None, eagle=None, device=None) -> str:
    """The dtype `run_demo` decodes in (the one a resumed run keeps, else "auto" measured here: the measurement is
    cached per process, so run_demo's own load chooses the same), for Ray workers that must decode in it too."""
    from specpilot.drafting import ModelPair

    run_dir = Path(out)
    kept = _kept_dtype(DemoState(run_dir), device) if (run_dir / "demo_state.json").is_file() else None
    if kept:
        return kept["dtype"]
    pair = ModelPair.from_pretrained(target, draft, device=device, dtype="auto", **({"eagle": eagle} if eagle else {}))
    return str(pair.dtype).removeprefix("torch.")


def _pair_key(identity: dict) -> dict:
    """The pair as the stages' settings key sees it: its content hashes stand for the model paths (a moved checkout
    or run folder reuses its stages), and the dtype's reason is left out (it may quote timings)."""
    return {k: v for k, v in identity.items() if k != "dtype_reason"
            and not (k in ("target", "draft") and identity.get(f"{k}_hash"))}


def _key(*parts) -> str:
    return json_digest(parts)


def _limit(items: list, n: int) -> list:
    """The first n prompts, taken round-robin over (task, language) groups so a small budget still covers every
    task and language of the suite (n = 0: all)."""
    if not n or n >= len(items):
        return list(items)
    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault((getattr(item, "task", ""), getattr(item, "language", "")), []).append(item)
    picked, queues = [], list(groups.values())
    while len(picked) < n:
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    return picked


# the run folder's fixed outputs, checked before any work (`check_demo_outputs`)
DEMO_OUTPUTS = {"traces": "dir", "traces/train": "dir", "traces/validation": "dir", "traces/heldout": "dir",
                GRID_FILE: "file", "grid.png": "file", PROFILE_CHECK: "file", "demo_state.json": "file",
                "manifest.json": "file", "policies.json": "file", "seeds.json": "file", "summary.json": "file",
                "eval": "dir", "eval/report.json": "file", "eval/report.md": "file", "export": "dir",
                "export/decoder.json": "file"}


def check_demo_outputs(run_dir: Path) -> None:
    """OutputPathError, before any work, when a file the demo writes is a folder there (or a folder a file), or the
    run folder cannot be written: found at its stage, it cost every stage before (grid.json made a folder by
    mistake was found after the profile check had run and rewritten profile_check.json)."""
    from specpilot.drafting.files import check_outputs

    check_outputs({run_dir: "dir", **{run_dir / name: kind for name, kind in DEMO_OUTPUTS.items()}},
                  fix="move it away, or give another --out", what="--out")


@holds_output("out", what="--out")
def run_demo(out: str | Path = "runs/demo", *, quick: bool = False, target: str | None = None,
             draft: str | None = None, eagle: str | None = None, budget: DemoBudget | None = None, seed: int = 0,
             wandb: str | None = None, device: str | None = None, executor=None, suite: str | None = None,
             chat_template: str = "auto") -> dict:
    """Run (or resume) every stage; return the summary dict (also written to RUN/summary.json). `suite`: the
    held-out suite evaluated (default: the one that matches the target, `specpilot.eval.suites.choose_suite`);
    `chat_template`: how its prompts are sent (`specpilot.eval.suites.with_chat_template`; the code suites that
    train the policies are completions and stay raw)."""
    from specpilot.drafting import ModelPair, TreeConfig
    from specpilot.drafting.executor import LocalExecutor
    from specpilot.drafting.pair import load_tokenizer
    from specpilot.drafting.checks import check_prompt_lengths
    from specpilot.drafting.errors import one_line
    from specpilot.eval.suites import BUNDLED_SUITES, choose_suite, load_suite, with_chat_template
    from specpilot.train.rl.ppo import ResumeSettingsError
    from specpilot.train.rl.stages import BudgetPassedError

    budget = budget or (DemoBudget.quick() if quick else DemoBudget())
    run_dir = Path(out)
    check_demo_outputs(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    state = DemoState(run_dir)
    started = time.perf_counter()
    heldout_suite = choose_suite(suite, target)
    heldout = _limit(load_suite(heldout_suite["name"]), budget.heldout_prompts)
    # checked before any model loads: --chat-template on needs a template
    heldout, heldout_suite["chat_template"] = with_chat_template(heldout, load_tokenizer(target), chat_template)
    # dtype "auto": bf16 on CUDA, and on a CPU with AMX / AVX512-BF16 where it measures clearly faster (<= 0.9x
    # fp32), fp32 otherwise
    # (`specpilot.drafting.pair.resolve_dtype`); the summary says which and why. A resumed run keeps the dtype its
    # first start chose: the CPU measurement is close on some machines and would otherwise flip with the load,
    # refusing the finished stages (every stage's key holds the dtype) on a command without --dtype
    kept = _kept_dtype(state, device)
    pair = ModelPair.from_pretrained(target, draft, device=device, dtype=kept["dtype"] if kept else "auto",
                                     **({"eagle": eagle} if eagle else {}))
    if kept:
        pair.dtype_reason = f"{kept['reason']} (kept from this run's first start: its finished stages are reused)"
    trace_workers = TraceWorkers(pair, target=target, draft=draft, eagle=eagle, count=budget.trace_workers,
                                 executor=executor)
    executor = executor or LocalExecutor(pair)
    identity = {**pair.identity(), "dtype": str(pair.dtype).replace("torch.", ""),
                "dtype_reason": getattr(pair, "dtype_reason", None)}
    tree = TreeConfig(width=budget.width, max_depth=budget.max_depth, max_size=budget.max_size)
    train = _limit(load_suite("train"), budget.train_prompts)
    val = _limit(load_suite("validation"), budget.val_prompts)
    # checked now, not after the training; a bundled suite cannot be shortened (a --suite file can)
    bundled_heldout = heldout_suite["name"] if heldout_suite["name"] in BUNDLED_SUITES else None
    for prompts, bundled in ((heldout, bundled_heldout), (train, "train"), (val, "validation")):
        check_prompt_lengths(prompts, {p.prompt: len(pair.encode(p.prompt)) for p in prompts}, context=pair.max_context,
                             max_new_tokens=budget.max_new_tokens, max_depth=tree.max_depth, truncate=False,
                             options=(), bundled=bundled)
    state.keep_dtype(identity["dtype"], kept["reason"] if kept else identity["dtype_reason"])
    budget_fields = asdict(budget)
    key = _key(_pair_key(identity), seed)
    timings: dict[str, float] = {}
    results: dict[str, dict] = {}
    reused: list[str] = []

    stale_training_errors = (ResumeSettingsError, BudgetPassedError)  # a resume refused: other settings, less budget
    stages = tqdm(STAGES, desc="specpilot demo", unit="stage")
    try:  # the trace-recording processes end with the stages, however they end
        for stage in stages:
            stages.set_postfix_str(stage)
            key = _key(key, stage, {f: budget_fields[f] for f in STAGE_FIELDS[stage]},
                       *([heldout_suite["name"], chat_template] if stage == "eval" else []))  # other prompts: again
            previous = state.done(stage, key)
            damage = damaged_outputs(stage, run_dir) if previous is not None else None
            if damage:  # finished once, but a file it made is missing or corrupted now: made again, not trusted
                tqdm.write(f"[{stage}] finished before, but {damage}: running it again")
                previous = None
            if previous is not None:
                results[stage], timings[stage] = previous["result"], previous["seconds"]
                reused.append(stage)
                tqdm.write(f"[{stage}] reused from {state.path}")
                continue
            state.invalidate_after(stage)
            resumable = state.started_with(stage) == key  # an interrupted start of these very settings
            state.start(stage, key)
            t0 = time.perf_counter()
            run_stage = partial(STAGE_FUNCTIONS[stage], run_dir=run_dir, pair=pair, tree=tree, budget=budget, seed=seed,
                                train=train, val=val, heldout=heldout, wandb=wandb, executor=executor,
                                suite=heldout_suite, trace_workers=trace_workers)
            try:
                try:
                    results[stage] = run_stage()
                except BaseException as err:  # Ctrl-C or an error: the resumed start's time will include this one's
                    if not isinstance(err, stale_training_errors):  # (retried below in this start, on the same clock)
                        state.interrupted(stage, key, time.perf_counter() - t0)
                    raise
            except stale_training_errors as err:
                # training resumes its stages from checkpoints and refuses other settings (it never mixes two runs'
                # steps); the demo's own earlier training under other settings (a --quick run's folder reused by a
                # full one, a re-run grid that chose another static config) is set aside and training starts over
                moved = set_aside_stale_training(run_dir) if stage == "train" and not resumable else None
                if moved is None:
                    raise
                tqdm.write(f"[train] the earlier training used other settings ({one_line(err)}); its files moved to "
                           f"{moved}, training starts over")
                results[stage] = run_stage()
            timings[stage] = state.finish(stage, key, results[stage], time.perf_counter() - t0)
            tqdm.write(f"[{stage}] done in {timings[stage]:.0f}s")
    finally:
        trace_workers.close()
    summary = summarise(run_dir, results, timings, time.perf_counter() - started, identity, budget, reused=reused)
    atomic_write_json(run_dir / "summary.json", summary, default=str)
    _log_summary(run_dir, summary, wandb)
    print(format_summary(summary))
    return summary


def damaged_outputs(stage: str, run_dir: Path) -> str | None:
    """Why a finished stage's outputs cannot be reused (a file it wrote is missing, truncated or corrupted since),
    or None. Each is read as the later stages read it: traces and profiles, the grid result, the deployed policy
    zips, the report, the exported decoder."""
    import zipfile

    from specpilot.artifacts.trace import ARRAYS_FILE, TraceHeader
    from specpilot.envs.profile import LatencyProfile
    from specpilot.eval.inputs import load_run_policies, read_grid_best
    from specpilot.policies.exported import load_exported

    try:
        if stage == "record":
            for split in ("train", "validation"):
                folder = run_dir / "traces" / split
                TraceHeader.load(folder)
                if not zipfile.is_zipfile(folder / ARRAYS_FILE):
                    return f"{folder / ARRAYS_FILE} is missing or not a readable array file"
                LatencyProfile.load(profile_path(folder))
        elif stage == "grid":
            read_grid_best(run_dir / GRID_FILE)
        elif stage == "train":
            load_run_policies(run_dir)
        elif stage == "eval":
            read_report(run_dir / "eval")
        elif stage == "export":
            load_exported(run_dir / "export", load_pair=False)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, zipfile.BadZipFile) as err:
        return (str(err).splitlines() or [type(err).__name__])[0]
    return None


class TraceWorkers:
    """The demo's trace-recording processes (`DemoBudget.trace_workers`): started when a stage first records a
    trace (`get()`; None where there are none: with an executor, on an accelerator, one core, too little memory, or
    a count below 2) and kept until `close()`, so the record stage and the evaluation share one start-up."""

    def __init__(self, pair, *, target=None, draft=None, eagle=None, count: int | None = None, executor=None) -> None:
        from specpilot.train.scale.processes import trace_worker_count

        self.pair, self.pool = pair, None
        self.spec = dict(target=target, draft=draft, eagle=eagle)
        if executor is not None:
            self.count, self.why = 0, "the executor's workers record"
        elif count is None:
            self.count, self.why = trace_worker_count(pair)
        else:
            self.count, self.why = int(count), "DemoBudget.trace_workers"

    def get(self):
        if self.count < 2:
            return None
        if self.pool is None:
            from specpilot.train.scale.cluster import PairSpec
            from specpilot.train.scale.processes import ProcessPool

            spec = PairSpec(**self.spec, device=str(self.pair.device), threads=1,
                            dtype=str(self.pair.dtype).replace("torch.", ""))
            started = time.perf_counter()
            try:
                self.pool = ProcessPool(spec, self.count)
            except Exception as err:  # (e.g. memory): the traces are recorded in this process instead, as before
                from specpilot.drafting.errors import one_line

                self.count = 0
                tqdm.write(f"  the trace-recording processes did not start ({one_line(err)}): recording in this "
                           "process")
                return None
            tqdm.write(f"  recording traces on {self.count} processes side by side ({self.why}; one torch thread "
                       f"each, started in {time.perf_counter() - started:.0f}s); profiles, AR timing and live "
                       "measurements in this process alone")
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


# -- stages --------------------------------------------------------------------------------------------------------

def _record(*, run_dir, tree, budget, seed, train, val, executor, trace_workers=None, **_) -> dict:
    from specpilot.train.rl.pipeline import record_traces

    traces = record_traces(None, run_dir / "traces", tree=tree, train_prompts=[p.prompt for p in train],
                           val_prompts=[p.prompt for p in val], max_new_tokens=budget.max_new_tokens,
                           profile_prompts=min(8, len(train)), profile_cycles=budget.profile_cycles, seed=seed,
                           progress=True, executor=executor, shared_profile=True,
                           trace_workers=trace_workers.get() if trace_workers else None)
    return {"train": str(traces.train), "validation": str(traces.validation)}


def _grid(*, run_dir, pair, budget, val, executor, **_) -> dict:
    from specpilot.eval.costcheck import check_and_refresh
    from specpilot.train.grid.search import grid_search

    # the latency profile behind the grid search and training, checked against live first (re-measured if stale)
    traces = run_dir / "traces"
    check = check_and_refresh(pair, traces / "train", profile_path(traces / "train"),
                              also=[profile_path(traces / "validation")], prompts=2, rounds=budget.check_rounds,
                              log=lambda msg: tqdm.write(f"  {msg}"))
    atomic_write_json(run_dir / PROFILE_CHECK, check, default=str)
    result = grid_search(run_dir / "traces" / "train", executor=executor, val_prompts=[p.prompt for p in val],
                         live_top=budget.live_top, live_max_new_tokens=budget.max_new_tokens,
                         sampled_temperatures=[t for t in budget.temperatures if t > 0],
                         out=run_dir / GRID_FILE, progress=True)
    return {"best": result["best"], "oracle": result.get("oracle"), "cost_check": check}


def _train(*, run_dir, pair, budget, seed, wandb, train, **_) -> dict:
    from specpilot.train.rl.pipeline import TaskTraces, TrainOptions
    from specpilot.train.rl.ppo import PPOOverrides
    from specpilot.train.rl.sampled import train_sampled
    from specpilot.train.rl.seeds import run_seeds, seed_worker_count

    traces = TaskTraces(run_dir / "traces" / "train", run_dir / "traces" / "validation")
    ppo = PPOOverrides(n_steps=budget.n_steps, batch_size=budget.batch_size, n_epochs=budget.n_epochs,
                       pi_arch=list(budget.pi_arch), vf_arch=list(budget.vf_arch))
    options = TrainOptions(reward=budget.reward, static=run_dir / GRID_FILE, resume=True, seed=seed, ppo=ppo,
                           bc_iters=budget.bc_iters, bc_epochs=budget.bc_epochs)
    # budget.seeds whole pipelines in replay (RUN/seed<k>/, seed + k), the best on validation deployed to
    # RUN/policies.json; RUN/seeds.json has every seed's validation ratio over the grid's best
    workers = budget.seed_workers or seed_worker_count(budget.seeds, usable_cores())
    out = run_seeds(run_dir, traces, seeds=budget.seeds, options=options, workers=workers,
                    progress=lambda msg: tqdm.write(f"  {msg}"), size_steps=budget.size_steps,
                    depth_steps=budget.depth_steps, coadapt_steps=budget.coadapt_steps, rounds=budget.rounds,
                    wandb=wandb)
    # sampling is part of training: the DEPLOYED policies (only those: live steps are the expensive ones) are
    # fine-tuned live at each T > 0
    live = TrainOptions(reward=budget.reward, static=run_dir / GRID_FILE, resume=True, seed=seed,
                        ppo=PPOOverrides(**{**vars(ppo), "n_steps": 256, "batch_size": 128}), backend="live",
                        pair=pair, train_prompts=[p.prompt for p in train])
    out["sampled"] = {f"{t:g}": train_sampled(run_dir, traces, t, depth_steps=budget.sampled_depth_steps,
                                              size_steps=budget.sampled_size_steps, options=live, wandb=wandb)
                      for t in budget.temperatures if t > 0}
    return json.loads(json.dumps(out, default=str))


def _eval(*, run_dir, tree, budget, seed, heldout, executor, trace_workers=None, suite=None, **_) -> dict:
    from specpilot.artifacts.trace import is_trace
    from specpilot.eval.full import full_evaluation
    from specpilot.eval.methods import METHODS

    recorded = is_trace(run_dir / "traces" / "heldout")  # (a trace there is reused or replaced by evaluation)
    result, paths = full_evaluation(
        heldout, executor=executor, tree=tree, out_dir=run_dir / "eval", trace_dir=run_dir / "traces" / "heldout",
        check_profiles={"grid search and training": profile_path(run_dir / "traces" / "train")},
        prior_checks=({"profile behind grid search and training, checked before the grid search":
                       read_json(run_dir / PROFILE_CHECK, what="profile check", fix="run the demo's grid stage again")}
                      if (run_dir / PROFILE_CHECK).is_file() else None),
        time_budget_s=budget.eval_budget_s, rounds=budget.eval_rounds, full_rounds=budget.eval_full_rounds,
        sampled_min_rounds=budget.eval_sampled_min_rounds, replay_only=list(budget.eval_replay_only),
        methods=[m for m in METHODS if m not in budget.eval_replay_only],
        temperatures=budget.temperatures, max_new_tokens=budget.max_new_tokens, grid=run_dir / GRID_FILE,
        run_dir=run_dir, seed=seed, sampled_methods=list(budget.sampled_methods), profile_cycles=budget.profile_cycles,
        progress=lambda msg: tqdm.write(f"  {msg}"), suite=suite,
        trace_workers=None if recorded or not trace_workers else trace_workers.get())
    return {"report": {k: str(v) for k, v in paths.items()}, "skipped": result.meta.get("skipped"),
            "rounds": result.meta.get("rounds"), "seeds": _heldout_seeds(run_dir)}


def _heldout_seeds(run_dir: Path) -> dict | None:
    """Every trained seed's ltd vs the grid's best config in exact replay of the held-out trace (cheap: no
    generation), and their aggregate; None for a run without RUN/seeds.json. The grid's best is the evaluation's
    `grid` method, plain steps (depth 0) included: not the best drafting cell the seeds trained beside."""
    from specpilot.train.rl.seeds import SEEDS_FILE, evaluate_seeds

    if not (run_dir / SEEDS_FILE).is_file():
        return None
    best = GridResult.load(run_dir / GRID_FILE).best if (run_dir / GRID_FILE).is_file() else None
    static = (int(best["depth"]), int(best["size"])) if best else None
    report = run_dir / "eval" / "report.json"   # the prompts the verdicts keep (degenerate output left out)
    replay = (read_report(run_dir / "eval").get("replay") or {}) if report.is_file() else {}
    if report.is_file() and not replay:
        return None   # no replay (e.g. every prompt's output degenerate): no per-seed verdict either
    out = evaluate_seeds(run_dir, run_dir / "traces" / "heldout", static=static, prompts=replay.get("prompts_kept"))
    return json.loads(json.dumps(out, default=float))


def _export(*, run_dir, pair, **_) -> dict:
    from specpilot.train.export.writer import export_run

    meta = export_run(run_dir, run_dir / "export", pair=pair)
    return {"dir": str(run_dir / "export"), "measured": (meta or {}).get("measured")}


STAGE_FUNCTIONS = {"record": _record, "grid": _grid, "train": _train, "eval": _eval, "export": _export}


# -- summary -------------------------------------------------------------------------------------------------------

def summarise(run_dir: Path, results: dict, timings: dict, wall_s: float, identity: dict, budget: DemoBudget, *,
              reused: list[str] | tuple[str, ...] = ()) -> dict:
    """Held-out speedups with intervals, the verdicts (LTD vs grid first), replay beside live, the cost-model
    checks (before the grid search and at evaluation), the grid's best config and the training trace's oracle.
    `wall_s` is this start's time; `timings` hold each stage's own run time, also for the stages named in `reused`
    (finished by an earlier start and reused by this one)."""
    from specpilot.eval.report import measurement_label
    from specpilot.eval.summary import summarise_report

    report = read_report(run_dir / "eval")
    grid_json = GridResult.load(run_dir / GRID_FILE).data if (run_dir / GRID_FILE).exists() else {}
    summary = summarise_report(report)
    return {
        "run_dir": str(run_dir), "wall_s": round(wall_s, 1), "stage_s": {k: round(v, 1) for k, v in timings.items()},
        "reused_stages": list(reused),
        "pair": identity, "budget": asdict(budget), "label": measurement_label(report.get("meta", {})), **summary,
        "grid_best": grid_json.get("best"), "replay_oracle": grid_json.get("oracle"),
        "seeds": (results.get("eval") or {}).get("seeds"),
        "switches": _switches(run_dir, budget),
    }


def _log_summary(run_dir: Path, summary: dict, wandb: str | None) -> None:
    """The demo's results (speedups, verdicts, replay, seeds) as the summary of a wandb run "demo" in RUN/wandb
    (and TensorBoard text), beside the training stages' runs."""
    from specpilot.train.rl.logging import RunLogger

    keep = {k: v for k, v in summary.items() if k not in ("pair", "budget", "run_dir")}
    config = {"command": "demo", "pair": summary.get("pair"), "budget": summary.get("budget")}
    with RunLogger(run_dir, config, mode=wandb, name=f"{run_dir.name}-demo") as log:
        log.summarize(keep)


def _switches(run_dir: Path, budget: DemoBudget) -> dict:
    """{temperature: the sampled policies' switch verdict} (train/rl/sampled.py: plain steps, the static config or
    the policies themselves at that temperature)."""
    from specpilot.artifacts.policies import PoliciesIndex
    from specpilot.artifacts.run import sampled_dir

    out = {}
    for t in (t for t in budget.temperatures if t > 0):
        index = sampled_dir(run_dir, t) / "policies.json"
        if index.is_file():
            out[f"{t:g}"] = PoliciesIndex.load(index).off_switch
    return out


def _switch_lines(switches: dict | None) -> list[str]:
    lines = []
    for t, v in (switches or {}).items():
        if not v:
            continue
        static = v.get("vs_static") or {}
        measured = (f"policies vs plain steps {v['ratio']:.3f}x" + (
            f", vs static d{static['config'][0]} V{static['config'][1]} {static['ratio']:.3f}x" if static else "")
            + (f"; static vs plain steps {v['static_vs_plain']['ratio']:.3f}x" if v.get("static_vs_plain") else ""))
        chosen = ("plain target steps" if v.get("plain_steps") else
                  f"the static config d{v['static'][0]} V{v['static'][1]}" if v.get("static") else "the policies")
        lines.append(f"T={t} deployed: {chosen} (validation, live: {measured})")
    return lines


def format_summary(summary: dict) -> str:
    from specpilot.eval.summary import format_summary_lines

    reused = set(summary.get("reused_stages") or ())
    stage_times = ", ".join(f"{k} {v:.0f}s" + (" (earlier start, reused)" if k in reused else "")
                            for k, v in summary["stage_s"].items())
    lines = ["", f"specpilot demo — {summary['run_dir']} ({summary['wall_s']:.0f}s"
             + (" this start" if reused else "") + f": {stage_times})"]
    lines += format_summary_lines(summary)  # its first line, "measured on: LABEL", says what was measured
    best = summary.get("grid_best")
    if best:
        # the grid stage's own numbers (training trace, validation prompts): not comparable with the held-out
        # speedups printed above, so each says where it was measured
        live = (f", live {best['live_tokens_per_s']:.1f} tok/s ({best['live_speedup']:.2f}x AR, validation prompts)"
                if best.get("live_tokens_per_s") is not None else "")
        lines.append(f"grid best ({best.get('source')}): W={best.get('width')} depth={best.get('depth')} "
                     f"size={best.get('size')}, replay {best['replay_tokens_per_s']:.1f} tok/s "
                     f"({best['replay_speedup']:.2f}x AR, training trace){live}")
    for width, entry in (summary.get("replay_oracle") or {}).items():
        oracle, ar = entry.get("oracle") or {}, entry.get("ar") or {}
        if oracle.get("tokens_per_s") and ar.get("tokens_per_s"):
            lines.append(f"replay oracle (training trace, W={width}): {oracle['tokens_per_s']:.1f} tok/s, "
                         f"{oracle['tokens_per_s'] / ar['tokens_per_s']:.2f}x AR, tau "
                         f"{oracle.get('mean_accepted_length', float('nan')):.2f}")
    lines += _seed_lines(summary.get("seeds"))
    lines += _switch_lines(summary.get("switches"))
    lines.append(f"files: {summary['run_dir']}/eval/report.md, {summary['run_dir']}/export/decoder.json")
    return "\n".join(lines)


def _seed_lines(seeds: dict | None) -> list[str]:
    """Each seed's replay ratio on the held-out trace and the aggregate: the verdict does not rest on one seed."""
    if not seeds or not seeds.get("seeds"):
        return []
    rows, agg = seeds["seeds"], seeds["ltd_vs_static"]
    per_seed = ", ".join(f"seed {r['seed']} {r['ltd_vs_static']:.3f}x" + (" (deployed)" if r.get("chosen") else "")
                         for r in rows)
    line = f"ltd vs grid per seed (replay, held-out trace; deployed = best on validation): {per_seed}"
    if agg["n"] > 1:
        # distribution-free: [min, max] of n seeds covers the seeds' median with probability 1 - 2 * 0.5**n
        coverage = 1 - 2 * 0.5 ** agg["n"]
        line += (f"; median {agg['median']:.3f}x, IQM {agg['iqm']:.3f}x, [{agg['min']:.3f}, {agg['max']:.3f}] "
                 f"over {agg['n']} seeds (min-max: a {coverage:.0%} interval for the median)")
    return [line]


# -- CLI -----------------------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specpilot.drafting.cliargs import add_pair_arguments, output_dir, seed
    from specpilot.eval.suites import CHAT_TEMPLATE_MODES

    parser.add_argument("--quick", action="store_true", help="small budgets (<= ~6 minutes on 2 CPU cores)")
    parser.add_argument("--out", default="runs/demo", type=output_dir,
                        help="run directory (finished stages are reused; checked before anything runs)")
    add_pair_arguments(parser, dtype_option=False)
    parser.add_argument("--seed", type=seed, default=0, help="seed of every stage")
    parser.add_argument("--suite", default=None,
                        help="held-out suite evaluated: a bundled name or a .jsonl / .json / .txt path "
                             "(default: heldout_code for the embedded pair or a code model, heldout for a "
                             "general-purpose target)")
    parser.add_argument("--chat-template", choices=CHAT_TEMPLATE_MODES, default="auto",
                        help="send the held-out prompts through the target tokenizer's chat template: auto = "
                             "natural-language prompts when the tokenizer has one (code completions stay raw), "
                             "on = every prompt, off = none")
    parser.add_argument("--wandb", choices=["online", "offline", "disabled"], default=None,
                        help="wandb mode (default: $WANDB_MODE, else offline)")


def run(args: argparse.Namespace) -> int:
    from specpilot.drafting.cliargs import check_pair_arguments

    check_pair_arguments(args)
    run = partial(run_demo, args.out, quick=args.quick, target=args.target, draft=args.draft, eagle=args.eagle,
                  seed=args.seed, wandb=args.wandb, device=args.device, suite=args.suite,
                  chat_template=args.chat_template)
    if getattr(args, "ray", None):  # a ClusterError is reported in one line by the command's handler
        from specpilot.train.scale.cluster_cli import open_pool

        args.dtype = demo_dtype(args.out, target=args.target, draft=args.draft, eagle=args.eagle, device=args.device)
        with open_pool(args) as pool:  # the workers decode in the dtype the run is made in, as the driver does
            run(executor=pool)
    else:
        run()
    return 0
