"""The evaluation's methods: our decoder steered by a Controller, our AR baseline, transformers' generate(), and the
registry that builds them by name (`METHODS`, `build_methods`).

A method is a callable (token ids, **sampling) -> RunRecord; `specpilot.eval.runner.evaluate` times every call
the same way. Methods whose requirements are missing raise `MethodUnavailable` with the reason.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specpilot.artifacts.grid import GridResult
from specpilot.artifacts.run import sampled_indexes
from specpilot.drafting.control import Controller, FixedController, default_static_config
from specpilot.drafting.pair import ModelPair
from specpilot.drafting.types import TreeConfig
from specpilot.eval.metrics import RunRecord


class MethodUnavailable(RuntimeError):
    """A method's requirement is missing; the evaluation skips it and says why."""


@dataclass
class EvalContext:
    """What method factories may use. `grid` is a grid-search result JSON path, `run_dir` a trained run."""

    pair: ModelPair | None
    tree: TreeConfig
    grid: str | Path | None = None
    run_dir: str | Path | None = None
    _cache: dict = field(default_factory=dict)
    device_name: str = "cpu"  # the device without a pair (controllers built for replay only)

    @property
    def device(self) -> str:
        return str(self.pair.device) if self.pair is not None else self.device_name


Method = Callable[..., RunRecord]


class ControllerMethod:
    """Our speculative decoder steered by a Controller (fixed, grid, heuristics, trained policies).

    by_temperature: {temperature: (controller, tree)} used instead at those sampling temperatures (the grid and
    the policies a run selected or trained at T > 0)."""

    def __init__(self, name: str, pair: ModelPair, tree: TreeConfig, controller: Controller,
                 by_temperature: dict[float, tuple[Controller, TreeConfig]] | None = None) -> None:
        from specpilot.drafting.decoder import SpeculativeDecoder

        self.name = name
        self.controller = controller
        self.decoder = SpeculativeDecoder(pair, tree)
        self.by_temperature = {float(t): (c, SpeculativeDecoder(pair, tr)) for t, (c, tr) in
                               (by_temperature or {}).items()}

    def describe(self) -> dict:
        out = {**self.controller.describe(), "name": self.name, "tree": vars(self.decoder.tree)}
        if self.by_temperature:
            out["by_temperature"] = {f"{t:g}": {**c.describe(), "tree": vars(d.tree)}
                                     for t, (c, d) in self.by_temperature.items()}
        return out

    def __call__(self, ids: list[int], **sampling) -> RunRecord:
        controller, decoder = self.by_temperature.get(float(sampling.get("temperature", 0.0)),
                                                      (self.controller, self.decoder))
        out = decoder.generate(ids, controller=controller, **sampling)
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
        draft_s=out.draft_s, verify_s=out.verify_s, policy_s=out.policy_s, prefill_s=out.prefill_s,
    )


# ---- registry ------------------------------------------------------------------------------------------------
def _controller(factory: Callable[[EvalContext], tuple]):
    """A method from a factory returning (controller, tree | None[, {temperature: (controller, tree)}])."""
    def build(ctx: EvalContext, name: str) -> Method:
        controller, tree, *rest = factory(ctx)
        return ControllerMethod(name, ctx.pair, tree or ctx.tree, controller, rest[0] if rest else None)
    build.controller_factory = factory  # for `replay_controllers`: the controller without a decoder
    return build


def _fixed(ctx: EvalContext):
    return FixedController(device=ctx.device), None


def _grid(ctx: EvalContext):
    if ctx.grid is None:
        raise MethodUnavailable("no grid-search result given (--grid GRID.json from `specpilot grid`)")
    try:
        best = GridResult.load(ctx.grid).best
        depth, size, width = best["depth"], best["size"], int(best.get("width", ctx.tree.width))
    except (OSError, ValueError) as err:
        raise MethodUnavailable(f"{ctx.grid}: not a grid result with best.depth/size/width ({err})") from err
    # the best static configuration may use another width or a deeper tree than the evaluation default
    tree = TreeConfig(width=width, max_depth=max(ctx.tree.max_depth, depth), max_size=max(ctx.tree.max_size, size))
    return FixedController(depth, size), tree, _grid_by_temperature(ctx)


def _grid_by_temperature(ctx: EvalContext) -> dict:
    """The grid's best per sampling temperature (`best_by_temperature`: measured live at that temperature)."""
    out = {}
    for t, cell in GridResult.load(ctx.grid).best_by_temperature.items():
        depth, size, width = int(cell["depth"]), int(cell["size"]), int(cell.get("width", ctx.tree.width))
        tree = TreeConfig(width=width, max_depth=max(ctx.tree.max_depth, depth, 1),
                          max_size=max(ctx.tree.max_size, size, 1))
        out[float(t)] = (FixedController(depth, size), tree)
    return out


def grid_batch_table(grid: str | Path) -> dict[int, dict]:
    """{batch_size: cell} of a grid.json's `per_batch_size` entries ([{batch_size, depth, size[, width]}, ...]:
    the best static config measured per batch size); MethodUnavailable when the file has none."""
    try:
        result = GridResult.load(grid)
    except (OSError, ValueError) as err:
        raise MethodUnavailable(f"{grid}: not a readable grid result ({err})") from err
    if not result.per_batch_size:  # rows are checked by GridResult.load
        raise MethodUnavailable(f"{grid} has no per_batch_size table (`specpilot grid --batch-sizes` writes one)")
    return {int(e["batch_size"]): dict(e) for e in result.per_batch_size}


def _batch_table(ctx: EvalContext):
    """The grid's per-batch-size static configs as one controller (`BatchTableController`); at batch size 1
    (single-sequence evaluation) it is the batch-1 entry."""
    from specpilot.policies.heuristics import BatchTableController

    if ctx.grid is None:
        raise MethodUnavailable("no grid-search result given (--grid GRID.json with a per_batch_size table)")
    cells = grid_batch_table(ctx.grid)
    widths = {int(c.get("width", ctx.tree.width)) for c in cells.values() if c["depth"] > 0}
    if len(widths) > 1:
        raise MethodUnavailable(f"{ctx.grid}: per_batch_size mixes tree widths {sorted(widths)}; one decoder tree "
                                "serves every batch size")
    width = widths.pop() if widths else ctx.tree.width
    tree = TreeConfig(width=width, max_depth=max([ctx.tree.max_depth] + [c["depth"] for c in cells.values()]),
                      max_size=max([ctx.tree.max_size] + [c["size"] for c in cells.values()]))
    return BatchTableController({b: (c["depth"], c["size"]) for b, c in cells.items()}), tree


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
        return copy.deepcopy(loaded[key]), None, _trained_by_temperature(ctx, key)
    return factory


def _trained_by_temperature(ctx: EvalContext, key: str) -> dict:
    """Policies the run trained at a sampling temperature: RUN/sampled/T<t>/policies.json (specpilot.train)."""
    from specpilot.policies.ppo import load_run_controllers

    out = {}
    for temperature, folder in sampled_indexes(ctx.run_dir):
        controllers = load_run_controllers(folder, device="cpu")
        if key in controllers:
            out[temperature] = (copy.deepcopy(controllers[key]), ctx.tree)
    return out


def _hf(assisted: bool):
    def build(ctx: EvalContext, name: str) -> Method:
        from specpilot.eval.hf_baselines import HFGenerate, configure_assistant

        if assisted and "hf_assistant" not in ctx._cache:
            assistant = _assistant(ctx)
            # same draft length as our `fixed` default, HF's default constant schedule and confidence threshold
            configure_assistant(assistant, num_assistant_tokens=default_static_config(ctx.device)[0])
            ctx._cache["hf_assistant"] = assistant
        return HFGenerate(ctx.pair, assisted=assisted, name=name, assistant=ctx._cache.get("hf_assistant"))
    return build


def assisted_refusal(pair) -> str | None:
    """Why transformers' assisted generation cannot draft with this pair's draft LM, or None: with output sizes
    that differ (a draft padded differently, which specpilot drafts with) it takes the two models for different
    tokenizers and asks for both (universal assisted generation)."""
    if pair.draft is None:
        return None
    rows = int(pair.draft.get_output_embeddings().weight.shape[0])
    if rows != pair.vocab_size:
        return (f"transformers' assisted generation needs equal output sizes; this draft has {rows} logits and the "
                f"target {pair.vocab_size} (padded differently for one tokenizer), which it reads as different "
                "tokenizers: leave hf_assisted out")
    return None


def _assisted_refusal_unit(worker) -> dict:
    """Work unit of `assisted_refusal_on`: the refusal for the worker's pair."""
    return {"refusal": assisted_refusal(worker.pair)}


def assisted_refusal_on(executor) -> str | None:
    """`assisted_refusal` asked of a worker of `executor` (on Ray the driver has no pair), so hf_assisted with a draft
    transformers cannot assist with is refused before any work, locally and on Ray alike."""
    from specpilot.drafting.executor import ShardTask

    [outcome] = executor.map(_assisted_refusal_unit, [ShardTask(0, {})])
    return outcome.result["refusal"]


def _assistant(ctx: EvalContext):
    """transformers' assisted generation needs a separate draft LM: the pair's, or for the embedded target drafted
    by its EAGLE-3 head, the embedded draft LM (loaded once, on the pair's device and dtype)."""
    if ctx.pair.draft is not None:
        refusal = assisted_refusal(ctx.pair)
        if refusal is not None:
            raise MethodUnavailable(refusal)
        return ctx.pair.draft
    if not ctx.pair.name.startswith("specpilot-default"):
        raise MethodUnavailable("transformers' assisted generation needs a separate draft LM; this pair drafts with "
                                "an EAGLE-3 head")
    from transformers import AutoModelForCausalLM

    from specpilot.drafting.pair import DEFAULT_PAIR_DIR

    model = AutoModelForCausalLM.from_pretrained(str(DEFAULT_PAIR_DIR / "draft"), dtype=ctx.pair.dtype)
    return model.to(ctx.pair.device).eval()


METHODS: dict[str, Callable[[EvalContext, str], Method]] = {
    "ar": lambda ctx, name: ARMethod(ctx.pair),
    "hf_generate": _hf(assisted=False),
    "hf_assisted": _hf(assisted=True),
    "fixed": _controller(_fixed),
    "grid": _controller(_grid),
    "batch_table": _controller(_batch_table),
    "ddd": _controller(_heuristic("ddd")),
    "svip": _controller(_heuristic("svip")),
    "confidence": _controller(_heuristic("confidence")),
    "hf_heuristic": _controller(_heuristic("hf_heuristic")),
    "ltd": _controller(_trained("ltd")),
    "depth_only": _controller(_trained("depth_only")),
    "size_only": _controller(_trained("size_only")),
    # the run's deployed batch-aware controller: its policy behind the validation guard (RUN/batch_guard.json)
    "ltd_guarded": _controller(_trained("ltd_guarded")),
}


def replay_controllers(names: list[str], ctx: EvalContext) -> tuple[dict[str, tuple], dict[str, str]]:
    """({name: (controller, tree)}, {skipped name: reason}) of controller methods evaluated in replay only (no
    live runs, no pair needed: `ctx.pair` may be None)."""
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    out: dict[str, tuple] = {}
    skipped: dict[str, str] = {}
    for name in names:
        factory = getattr(METHODS[name], "controller_factory", None)
        if factory is None:
            skipped[name] = "not a controller of our decoder: replay cannot run it"
            continue
        try:
            controller, tree, *_ = factory(ctx)
        except MethodUnavailable as err:
            skipped[name] = str(err)
            continue
        out[name] = (controller, tree or ctx.tree)
    return out, skipped


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
