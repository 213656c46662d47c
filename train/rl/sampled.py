"""Policies for sampled decoding: the depth and size policies fine-tuned on the LIVE decoder at a temperature > 0.

Replay models greedy decoding only (under sampling the emitted text depends on the decisions), so a run's
temperature-T policies train on live environments at T: the depth policy first, from a fresh initialisation (the
greedy policy never skips drafting and has stopped exploring it, while at T > 0 a plain step may be the better
choice), against the static size of the grid at T; then the size policy, from the greedy one, against that frozen
depth policy. No replay validation exists at T > 0, so each stage keeps its final policy. Written to
RUN/sampled/T<t>/policies.json, which evaluation uses at that temperature.

The off-switch: the fine-tuned policies are then measured live on the validation prompts at T against plain target
steps (depth 0) and against the grid's static config at T, interleaved (`off_switch_choice`). The policies are kept
when they are measurably faster than plain steps (the paired 95% interval lies above 1), the static config did
not measure faster than them and they did not choose the static config's depth and size on every cycle (at T > 0 the
fine-tuned policies often settle on the static config's own choice and then only add their decision time; else the
static config is recorded). When the policies do not pay, they give way
to what the grid deploys at T: its config there (which measured faster than plain steps when the grid chose it)
unless this measurement finds it slower than plain steps, a static config the grid did not choose at T only when it
measures faster; else the index records plain steps and loaders give controllers that never draft at that
temperature: speculation that does not pay switches itself off, as serving engines do per batch size, instead of
costing the user a few percent. Loaders give the recorded config under the policies' names. The verdict records the
rule and what it was measured for (the policy zips' digest, seed, units, static config, pair, device kind, dtype,
prompts, tree and length): a rerun whose training came out the same (an interrupted demo's train stage, run again)
keeps it instead of measuring again under another load; a verdict of an earlier rule is measured again.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

from specpilot.drafting.control import FixedController
from specpilot.artifacts.common import json_digest
from specpilot.artifacts.grid import GRID_FILE, GridResult
from specpilot.artifacts.policies import PoliciesIndex
from specpilot.artifacts.run import sampled_dir  # noqa: F401 (re-exported: RUN/sampled/T<t>)
from specpilot.drafting.types import TreeConfig
from specpilot.envs.environments import as_size_controller
from specpilot.train.rl.coadapt import write_index
from specpilot.train.rl.stages import (StageSpec, TaskTraces, TrainOptions, load_partner, run_logger, static_config,
                                    train_stage)


def _grid_choice_at(run_dir: Path, temperature: float, options: TrainOptions) -> tuple[int, int] | None:
    """The grid's drafting config at `temperature` (best_by_temperature), None when it does not draft there (or
    no grid records that temperature). The grid drafts at T > 0 only with a cell that measured faster than plain
    steps (`train.grid.search.pick_sampled`)."""
    grid = Path(options.static) if isinstance(options.static, (str, Path)) else run_dir / GRID_FILE
    cell = GridResult.load(grid).at_temperature(temperature) if grid.is_file() else None
    return (int(cell["depth"]), int(cell["size"])) if cell and int(cell["depth"]) >= 1 else None


def _static_at(run_dir: Path, temperature: float, options: TrainOptions) -> tuple[int, int]:
    """The grid's drafting config at `temperature` (`_grid_choice_at`), else the greedy one."""
    return _grid_choice_at(run_dir, temperature, options) or static_config(run_dir, options.static)


def train_sampled(run_dir: str | Path, traces: TaskTraces | str | Path, temperature: float, *, depth_steps: int,
                  size_steps: int, options: TrainOptions, wandb: str | None = None, guard_repeats: int = 2) -> Path:
    """Fine-tune the run's final policies live at `temperature`, then decide the off-switch (`check_off_switch`,
    `guard_repeats` interleaved rounds over the validation prompts; 0 skips it); returns the written policies.json."""
    if temperature <= 0:
        raise ValueError(f"train_sampled is for temperatures > 0 (greedy policies train on replay), got {temperature}")
    run_dir, traces = Path(run_dir), TaskTraces.resolve(traces)
    options = replace(options, backend="live", temperature=float(temperature))
    final = PoliciesIndex.load(run_dir)
    static = _static_at(run_dir, temperature, options)
    grid_drafts = _grid_choice_at(run_dir, temperature, options) is not None
    tag = f"T{temperature:g}"
    with run_logger(run_dir, None, wandb, {"stage": f"sampled_{tag}", "temperature": temperature}) as log:
        size_partner = as_size_controller(static[1])
        depth = train_stage(StageSpec("depth", f"{tag}_depth", depth_steps, partner=size_partner,
                                      val_partner=size_partner), run_dir, traces, options, log)
        frozen = load_partner("depth", depth.best, depth.spec, fallback=FixedController(*static))
        size = train_stage(StageSpec("size", f"{tag}_size", size_steps, partner=frozen, val_partner=frozen,
                                     size_actions=final.size.size_actions,
                                     init_from=final.resolve("size", run_dir), seed_offset=1),
                           run_dir, traces, options, log)
    folder = sampled_dir(run_dir, temperature)
    earlier = _earlier_verdict(folder)
    index = write_index(folder, depth, size, static, copy=True)
    if guard_repeats > 0 and options.pair is not None:
        from specpilot.envs.replay import load_trace

        val = load_trace(traces.validation)  # its prompts, tree and length: the setting the policies were made for
        prompts = [val.prompt(i) for i in range(val.num_prompts)]
        tree = TreeConfig(width=val.width, max_depth=val.max_depth, max_size=val.max_size)
        basis = verdict_basis(folder, options.pair, prompts, tree=tree, temperature=temperature,
                              repeats=guard_repeats, seed=options.seed, max_new_tokens=val.max_new_tokens,
                              static=static, static_is_grid_choice=grid_drafts)
        if verdict_stands(earlier, basis):
            # a rerun (an interrupted demo's train stage) whose policies came out the same: the verdict measured for
            # them stands; measuring again would let the machine's load flip the deployed choice
            _save_verdict(index, earlier)
            return index
        check_off_switch(index, options.pair, prompts, tree=tree, temperature=temperature, repeats=guard_repeats,
                         seed=options.seed, max_new_tokens=val.max_new_tokens, static=static,
                         static_is_grid_choice=grid_drafts)
    return index


def verdict_basis(folder: Path, pair, prompts, *, tree: TreeConfig, temperature: float, repeats: int, seed: int,
                  max_new_tokens: int, static: tuple[int, int] | None, static_is_grid_choice: bool = False) -> dict:
    """What an off-switch verdict was measured for, recorded in it: the rule that decides it, the policies (their
    zips' digest), the temperature, units, seed and static config (and whether the grid chose it at that
    temperature), the pair (content hashes) with its device kind
    and dtype, the prompts, the tree and the length. A rerun with the same basis keeps the verdict (`train_sampled`)."""
    identity = pair.identity()
    return {"rule": OFF_SWITCH_RULE, "temperature": temperature, "units": repeats * len(prompts), "seed": seed,
            "policies": policies_digest(folder),
            "static_measured": [int(v) for v in static] if static is not None else None,
            "static_is_grid_choice": bool(static_is_grid_choice),
            "measured_for": {"pair": [identity["target_hash"], identity["draft_hash"]], "device": pair.device.type,
                             "dtype": str(pair.dtype).removeprefix("torch."),
                             "tree": [tree.width, tree.max_depth, tree.max_size],
                             "max_new_tokens": int(max_new_tokens), "prompts": json_digest(prompts)}}


def verdict_stands(earlier: dict | None, basis: dict) -> bool:
    """Whether an earlier verdict was decided by today's rule for exactly `basis` (`verdict_basis`): then it is kept."""
    return earlier is not None and all(earlier.get(k) == v for k, v in basis.items())


def _save_verdict(index: Path, verdict: dict) -> None:
    updated = PoliciesIndex.load(index)
    updated.off_switch = verdict
    updated.save(index)


def policies_digest(folder: Path) -> str:
    """sha256 over the policy zips of an index folder (depth.zip, size.zip): which policies a verdict was made for."""
    import hashlib

    digest = hashlib.sha256()
    for name in ("depth.zip", "size.zip"):
        path = Path(folder) / name
        digest.update(name.encode() + (path.read_bytes() if path.is_file() else b"-"))
    return digest.hexdigest()


def _earlier_verdict(folder: Path) -> dict | None:
    """The off-switch verdict of an index already in `folder` (None: none, or unreadable)."""
    try:
        return PoliciesIndex.load(folder / "policies.json").off_switch or None
    except (OSError, ValueError, KeyError, TypeError):
        return None


OFF_SWITCH_RULE = ("the policies when their paired 95% interval over plain steps lies above 1, unless the static "
                   "config measured faster (ratio below 1) or the policies chose its depth and size on every cycle "
                   "(they would only add their decision time), then the static config; else the grid's own config at "
                   "the temperature unless its interval over plain steps lies below 1, or another static config "
                   "only when its interval lies above 1; else plain steps")


def off_switch_choice(policies_low: float, policies_vs_static: float | None, static_ci: Sequence[float] | None,
                      static_is_grid_choice: bool = False, same_as_static: bool = False) -> str:
    """What a temperature's controllers become (`OFF_SWITCH_RULE`): "policies", "static" or "plain".

    policies_low: the lower end of the policies' paired 95% interval over plain steps; policies_vs_static: their
    ratio over the static config; static_ci: the static config's paired 95% interval over plain steps (None: no
    drafting static config was measured). Policies that do not pay fall back to what the grid deploys at that
    temperature: its config there already measured faster than plain steps when the grid chose it
    (static_is_grid_choice), so it stays unless this measurement finds it slower (interval below 1); a static config
    the grid did not choose at T (its greedy one) replaces plain steps only when it measures faster here.
    same_as_static: the policies chose the static config's (depth, size) on every cycle of the measurement; then
    their ratio over it is decision time plus timing noise (at T=1 a 1.002x [0.984, 1.020] kept policies that decided
    exactly like d1 V3 and then read 0.989x "slower" in the evaluation), so the static config is deployed."""
    if policies_low > 1.0:
        if policies_vs_static is not None and (same_as_static or policies_vs_static < 1.0):
            return "static"
        return "policies"
    if static_ci is None:
        return "plain"
    if static_is_grid_choice:
        return "plain" if static_ci[1] < 1.0 else "static"
    return "static" if static_ci[0] > 1.0 else "plain"


def check_off_switch(index: str | Path, pair, prompts, *, tree: TreeConfig, temperature: float, repeats: int = 2,
                     seed: int = 0, max_new_tokens: int = 64, static: tuple[int, int] | None = None,
                     static_is_grid_choice: bool = False) -> dict:
    """Measure the index's "ltd" controller against plain target steps (and the static (depth, size) config, when
    given and drafting; `static_is_grid_choice`: the grid deploys it at this temperature) live at `temperature`,
    choose with `off_switch_choice` and write the verdict into the index
    (`off_switch`: {"plain_steps": bool, "static": [depth, size] | None, "ratio", "ci", "vs_static",
    "static_vs_plain", "rule", ...}); returns it."""
    from specpilot.eval.runner import measure_controllers
    from specpilot.policies.ppo import load_run_controllers

    index = Path(index)
    ltd = load_run_controllers(index.parent, off_switch=False)["ltd"]  # the policies, not a previous verdict
    controllers = {"ltd": ltd, "plain": FixedController(0)}
    if static is not None and int(static[0]) >= 1:
        controllers["static"] = FixedController(int(static[0]), int(static[1]))
    res = measure_controllers(pair, controllers, prompts, tree=tree, max_new_tokens=max_new_tokens, repeats=repeats,
                              temperature=temperature, seed=seed, baseline="plain",
                              also_vs=["static"] if "static" in controllers else [])
    vs_static = res["ltd"]["vs"].get("static")
    static_vs_plain = res["static"]["vs_baseline"] if "static" in controllers else None
    same_as_static = bool(vs_static and vs_static.get("same_decisions"))
    choice = off_switch_choice(res["ltd"]["vs_baseline"]["ci"][0], vs_static and vs_static["ratio"],
                               static_vs_plain and static_vs_plain["ci"], static_is_grid_choice, same_as_static)
    config = [int(static[0]), int(static[1])] if static is not None else None
    verdict = {"plain_steps": choice == "plain", "ratio": res["ltd"]["vs_baseline"]["ratio"],
               "ci": res["ltd"]["vs_baseline"]["ci"],
               "static": config if choice == "static" else None,
               "vs_static": vs_static and {"config": config, "ratio": vs_static["ratio"], "ci": vs_static["ci"],
                                           "same_decisions": same_as_static},
               "static_vs_plain": static_vs_plain and {"config": config, "ratio": static_vs_plain["ratio"],
                                                       "ci": static_vs_plain["ci"]},
               **verdict_basis(index.parent, pair, prompts, tree=tree, temperature=temperature, repeats=repeats,
                               seed=seed, max_new_tokens=max_new_tokens, static=static,
                               static_is_grid_choice=static_is_grid_choice)}
    _save_verdict(index, verdict)
    return verdict
