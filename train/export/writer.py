"""`specpilot export`: a trained run -> a directory a decoder loads without Stable-Baselines3, pickle or training code.

    specpilot export --run runs/ltd --out exports/ltd [--onnx]

    exports/ltd/decoder.json              format version, tree settings, observation specs, action maps, the model
                                          pair's identity (names + content hashes), library versions, policy files
                                          (+ sha256), measured decision latency / agreement / choice statistics
    exports/ltd/depth.safetensors         the depth policy's actor (Linear weights; layer list in decoder.json)
    exports/ltd/size.safetensors          the size policy's actor
    exports/ltd/{depth,size}.onnx         with --onnx, when the optional `onnx` package is installed
    exports/ltd/engines/...               static configs for transformers / vLLM / SGLang (policies.engine_configs)

Load with `SpeculativeDecoder.from_config("exports/ltd")` or `specpilot.policies.exported.load_exported`.
The self-checks (choices, latency, agreement) live in train/export/checks.py.

Only the actor is exported (the value network is a training device): SB3's `pi_features_extractor` (Flatten) ->
`mlp_extractor.policy_net` (Linear + activation layers) -> `action_net` (Linear); the deterministic action is the
argmax of its logits. The export checks itself: the exported and SB3 actors must choose the same action on every
recorded / synthetic / random observation (`measured.agreement` in decoder.json).

Where the policies' choices come from (they set the engine configs' numbers): a recorded trace (`--trace`, else the
run's validation trace: manifest "traces", or RUN/traces/validation) replayed with the exported controller; else a
few live generations on validation prompts with the run's pair; else none (engine configs then use the grid's best
or the fallback config; latency and agreement are measured on synthetic draft states).

`--run` may also be a sub-index such as RUN/stage1 (its policies.json); manifest.json, grid.json and traces/ are
then read from RUN.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch

from specpilot.artifacts.contract import RunContract, check_grid, check_pair, check_tree
from specpilot.artifacts.decoder import write_decoder_config
from specpilot.artifacts.grid import GRID_FILE, GridResult
from specpilot.artifacts.policies import POLICIES_FILE, PoliciesIndex
from specpilot.artifacts.run import (BEST_JSON, CHECKPOINTS_DIR, MANIFEST_FILE, TRACES_DIR, RunManifest,  # noqa: F401
                                     owning_run, read_progress, run_root)
from specpilot.artifacts.trace import TraceHeader, is_trace
from specpilot.drafting.control import FixedController, default_static_config
from specpilot.drafting.files import atomic_dir, atomic_path, check_writable
from specpilot.drafting.folder_lock import holds_output
from specpilot.drafting.types import TreeConfig
from specpilot.policies.actor import Actor
from specpilot.policies.engine_configs import write_engine_configs
from specpilot.policies.exported import (CONFIG_FILE, DEPTH_ACTIONS, FORMAT_NAME, FORMAT_VERSION, ExportedController,
                                         file_sha256, probe_observation)
from specpilot.policies.observation import ObservationSpec
from specpilot.train.rl.ppo import library_versions
from specpilot.train.export.checks import (agreement, decision_latency_us, record_choices_live, record_choices_replay,
                                           synthetic_states)


class ExportError(RuntimeError):
    """The run cannot be exported; the message says which file and what to do."""


def _obs_norm(stage_dir: Path, prefix: str) -> tuple[dict | None, dict[str, torch.Tensor]]:
    """Observation-normalisation statistics, if the stage trained with VecNormalize(norm_obs=True). train/rl/ppo.py
    normalises rewards only, so this is normally (None, {}). Reading SB3's VecNormalize file needs pickle: that
    happens here, at export, never at load."""
    progress = read_progress(stage_dir)
    if progress is None:
        return None, {}
    name = progress.get("vecnormalize")
    if not name or not (stage_dir / CHECKPOINTS_DIR / name).is_file():
        return None, {}
    import pickle

    with open(stage_dir / CHECKPOINTS_DIR / name, "rb") as fh:
        vec = pickle.load(fh)
    if not getattr(vec, "norm_obs", False):
        return None, {}
    rms = vec.obs_rms
    tensors = {f"{prefix}.obs_mean": torch.as_tensor(rms.mean, dtype=torch.float64),
               f"{prefix}.obs_var": torch.as_tensor(rms.var, dtype=torch.float64)}
    return ({"mean": f"{prefix}.obs_mean", "var": f"{prefix}.obs_var", "epsilon": float(vec.epsilon),
             "clip": float(vec.clip_obs)}, tensors)


_owning_run = owning_run  # the run folder (one holding manifest.json) that a path lies in, if any


def _umask_mode(path: Path) -> None:
    """safetensors creates its files 0600; give them the mode every other file gets (0666 minus the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def run_local(recorded: str | Path, *roots: Path) -> Path | None:
    """A path recorded in a run's manifest or policies.json, resolved for the run in `roots` (the run folder, and
    a sub-index folder such as RUN/stage1): relative paths under the first root; absolute ones re-rooted into a
    root that holds the same file (a copied run must not read the original's files); an absolute path into
    another run folder gives None; one outside every run is used as it is."""
    path = Path(recorded)
    if not path.is_absolute():
        return roots[0] / path
    for root in roots:
        for i in range(1, len(path.parts)):  # longest tail first: the most specific match
            candidate = root.joinpath(*path.parts[i:])
            if candidate.exists():
                return candidate
    owner = _owning_run(path) if path.exists() else None
    if owner is not None and owner not in {r.resolve() for r in roots}:
        return None
    return path


def read_manifest(root: Path) -> dict:
    """RUN/manifest.json ({} when the run has none); a garbage file is an error naming it."""
    return RunManifest.load(root).data


def find_trace(root: Path) -> Path | None:
    """The run's validation trace (else its training trace): RUN/traces/{validation,train}, then the manifest's
    "traces" (train/rl/pipeline.py) and trace paths in its config, each resolved inside the run (`run_local`)."""
    manifest = read_manifest(root)
    traces = manifest.get("traces") if isinstance(manifest.get("traces"), dict) else {}
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    named = [(k, v) for k, v in config.items() if "trace" in str(k).lower() and isinstance(v, str)]
    named.sort(key=lambda kv: 0 if "val" in kv[0].lower() else 1)  # prefer the validation trace
    recorded = [traces.get("validation"), traces.get("train"), *(v for _, v in named)]
    candidates = [root / TRACES_DIR / "validation", root / TRACES_DIR / "train",
                  *(run_local(v, root) for v in recorded if isinstance(v, str) and v)]
    for path in candidates:
        if path is not None and is_trace(path):
            return path
    return None


def _grid_best(run_dir: Path, grid: str | Path | None) -> tuple[dict | None, str | None]:
    """The grid search's best cell: `grid` when given, else the run's grid.json (grid/grid.json, grid/best.json)
    when present. A present file that is not a grid result is an error naming it, never silently skipped."""
    from specpilot.eval.inputs import read_grid_best

    if grid:
        return read_grid_best(grid), str(grid)
    for path in (run_dir / GRID_FILE, run_dir / "grid" / GRID_FILE, run_dir / "grid" / BEST_JSON):
        if path.is_file():
            return read_grid_best(path), str(path)
    return None, None


def _pair_identity(run_dir: Path, pair, trace: Path | None) -> dict:
    """The pair's identity: from `pair`, else the run's contract, else the manifest ("pair"/"models"), else the
    trace header."""
    if pair is not None:
        return pair.identity()
    manifest = read_manifest(run_dir)
    contract = manifest.get("contract") if isinstance(manifest.get("contract"), dict) else {}
    header = TraceHeader.load(trace).pair if trace is not None else None
    for entry in (contract.get("pair"), manifest.get("pair"), manifest.get("models"), header):
        if isinstance(entry, dict) and "target_hash" in entry and "draft_hash" in entry:
            return entry
    raise ExportError(f"neither {run_dir / 'manifest.json'} nor the run's trace records the model pair's identity "
                      "(target/draft content hashes): "
                      "pass the pair the run was trained on (CLI: --target/--draft, or --default-pair)")


def _run_dtype(root: Path, pair) -> str | None:
    """The dtype the run's traces and profile were measured in, i.e. the costs the policies were tuned for: the run
    contract's, else the given pair's ("bfloat16"; None for an older run without either)."""
    contract = RunContract.of_run(root)
    if contract is not None and contract.dtype:
        return str(contract.dtype).removeprefix("torch.")
    return str(pair.dtype).removeprefix("torch.") if pair is not None else None


def _run_device(pair, trace: Path | None) -> str | None:
    """The device kind ("cpu", "cuda", ...) the run's trace was recorded on, else the given pair's (None: unknown)."""
    device = TraceHeader.load(trace).device if trace is not None else None
    if device is None and pair is not None:
        device = str(pair.device)
    return str(device).split(":")[0] if device else None


def _recorded_pair(identity: dict, run_dir: Path, log, dtype: str | None = None):
    """The pair the identity names, in the run's dtype where this machine runs it natively, when it can be loaded
    here (embedded default, or existing local paths) and its hashes match; else None (the export then goes on
    without live measurements)."""
    from specpilot.policies.exported import ExportedConfigError, resolve_pair

    try:
        return resolve_pair({"pair": identity, "dtype": dtype, "_path": str(run_dir / MANIFEST_FILE)})
    except (ExportedConfigError, OSError, ValueError) as err:
        log(f"specpilot export: no live measurement of the policies' choices ({err})")
        return None


def _export_onnx(actor: Actor, path: Path) -> str | None:
    """ONNX graph of the actor's logits (input "observation" [batch, dim] -> "logits"); None without onnx."""
    try:
        import onnx  # noqa: F401  (the optional extra: pip install 'specpilot[onnx]')
    except ImportError:
        return None

    class _Module(torch.nn.Module):
        def forward(self, x):
            return actor.logits(x)

    try:
        with atomic_path(path) as tmp:
            torch.onnx.export(_Module(), (torch.zeros(1, actor.in_features),), str(tmp), input_names=["observation"],
                              output_names=["logits"],
                              dynamic_axes={"observation": {0: "batch"}, "logits": {0: "batch"}})
    except Exception as err:  # the exporter's own dependencies (e.g. onnxscript) vary across torch versions
        raise ExportError(f"ONNX export of {path.name} failed ({type(err).__name__}: {err}); install "
                          "'specpilot[onnx]' (and onnxscript for torch >= 2.9), or export without --onnx") from err
    return path.name


def _policy_zip(entry: dict, kind: str, run_dir: Path, root: Path) -> Path:
    """The policy zip policies.json names, inside this run (see `run_local`)."""
    index = run_dir / POLICIES_FILE
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or "spec" not in entry:
        raise ExportError(f"{index}: the {kind} entry lacks 'path' or 'spec'; rewrite it with "
                          "specpilot.train.rl.ppo.write_policies_index")
    path = run_local(entry["path"], run_dir, root)
    if path is None:
        owner = _owning_run(Path(entry["path"]))
        raise ExportError(f"{index}: the {kind} policy {entry['path']} belongs to another run ({owner}); copy the "
                          "zip into this run and record its path relative to it")
    return path


def _relative_to(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def _export_policy(kind: str, entry: dict, run_dir: Path, root: Path, out_dir: Path, onnx: bool, log) -> tuple:
    """One policy of policies.json -> out_dir/<kind>.safetensors; (decoder.json entry, SB3 policy, Actor, spec)."""
    from safetensors.torch import save_file

    from specpilot.policies.ppo import PolicyLoadError, load_sb3_policy

    zip_path = _policy_zip(entry, kind, run_dir, root)
    try:
        spec = ObservationSpec.from_dict(entry["spec"])
    except (KeyError, TypeError, ValueError) as err:
        raise ExportError(f"{run_dir / POLICIES_FILE}: the {kind} entry's spec is unreadable ({err})") from err
    try:
        policy = load_sb3_policy(zip_path)
    except PolicyLoadError as err:
        raise ExportError(str(err)) from err
    layers, tensors = Actor.from_sb3(policy).to_layers(kind)
    norm, norm_tensors = _obs_norm(zip_path.parent, kind)
    tensors.update(norm_tensors)
    actor = Actor.from_layers(layers, tensors, obs_norm=norm, source=f"{kind} policy")
    actions = DEPTH_ACTIONS if kind == "depth" else [int(v) for v in entry["size_actions"]]
    if actor.in_features != spec.dim or actor.n_actions != len(actions):
        raise ExportError(f"{zip_path}: the {kind} policy takes {actor.in_features} inputs and has "
                          f"{actor.n_actions} actions, but policies.json's spec gives {spec.dim} inputs and "
                          f"{len(actions)} actions; policies.json does not describe this policy")
    file = out_dir / f"{kind}.safetensors"
    with atomic_path(file) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "specpilot-policy", "kind": kind})
        _umask_mode(tmp)
    probe = probe_observation(spec)
    logits = actor.logits(torch.from_numpy(probe).unsqueeze(0))[0]
    record = {
        "file": file.name, "sha256": file_sha256(file), "spec": spec.to_dict(), "observation_dim": spec.dim,
        "layers": layers, "obs_norm": norm, "actions": actions,
        "decision": "argmax of the logits (first index on ties), float32 on the CPU",
        "probe": {"observation": probe.tolist(), "logits": logits.tolist(), "action": int(logits.argmax())},
        "source": {"zip": _relative_to(zip_path, run_dir), "zip_sha256": file_sha256(zip_path)},
    }
    if onnx and (name := _export_onnx(actor, out_dir / f"{kind}.onnx")) is not None:
        record["onnx"] = name
    return record, policy, actor, spec


def _measure(exported, sb3_controller, sb3: dict, actors: dict, specs: dict, tree: TreeConfig, *, trace, pair,
             identity: dict, root: Path, measure_live: bool, num_prompts: int, max_new_tokens: int, num_random: int,
             seed: int, log, dtype: str | None = None) -> tuple:
    """(recorder or None, measured section of decoder.json): the policies' choices (replayed trace > live
    generations > none), their agreement with SB3 and their decision latency."""
    recorder, source = None, "none (synthetic states only)"
    if trace is None and measure_live and pair is None:
        pair = _recorded_pair(identity, root, log, dtype)
    if trace is not None:
        recorder, source = record_choices_replay(exported, tree, trace)
    elif measure_live and pair is not None:
        recorder, source = record_choices_live(exported, tree, pair, num_prompts=num_prompts,
                                               max_new_tokens=max_new_tokens, seed=seed)
    states = list(recorder.states) if recorder else []
    synth = synthetic_states(tree, max(0, 1000 - len(states)), seed=seed)
    agree = {kind: agreement(sb3[kind], actors[kind], specs[kind], {"recorded": states, "synthetic": synth},
                             num_random=num_random, seed=seed) for kind in actors}
    mismatches = sum(v["n"] - v["same"] for a in agree.values() for v in a.values())
    if mismatches:
        log(f"specpilot export: WARNING: the exported and SB3 actors disagree on {mismatches} observation(s) "
            "(float round-off at near-ties?); see measured.agreement in decoder.json")
    latency = {**decision_latency_us({"exported": exported, "sb3": sb3_controller}, (states + synth)[:500]),
               "device": "cpu", "threads": torch.get_num_threads(),
               "note": "per decision, observation features included; best of 5 alternating passes"}
    return recorder, {"choices_source": source, "latency_us": latency, "agreement": agree}


@holds_output("out_dir", what="export folder", kind="swapped")
def export_run(run_dir: str | Path, out_dir: str | Path, *, pair=None, onnx: bool = False,
               trace: str | Path | None = None, grid: str | Path | None = None, measure_live: bool = True,
               num_prompts: int = 4, max_new_tokens: int = 48, num_random: int = 10_000, seed: int = 0,
               log=print) -> dict:
    """Export run_dir (policies.json + SB3 zips) to out_dir; return decoder.json's content.

    pair: the ModelPair the run was trained on (its identity goes into decoder.json; it also drives the live
    measurement when there is no trace). Without it the identity comes from the run's manifest ("pair"/"models").
    """
    run_dir, out_dir = Path(run_dir), check_writable(out_dir, kind="dir", what="export folder")
    # the export is staged beside out_dir and renamed in: its parent must take files too, not only out_dir
    check_writable(out_dir.parent, kind="dir", what="the export folder's parent")
    index_path = run_dir / POLICIES_FILE
    typed = PoliciesIndex.load(index_path, fix="train the run first (it is written by "
                               "specpilot.train.rl.ppo.write_policies_index)")
    index = {kind: e.to_dict() for kind, e in typed.entries().items()}
    index["fallback"] = typed.fallback
    if not index.get("depth") and not index.get("size"):
        raise ExportError(f"{index_path} names neither a depth nor a size policy: nothing to export")
    root = run_root(run_dir)
    given_trace = bool(trace)
    trace = Path(trace) if trace else find_trace(root)
    if trace is not None:
        from specpilot.envs.replay import load_trace

        load_trace(trace)  # readable before any work (FileNotFoundError / InputFileError name the file)
    identity = _pair_identity(root, pair, trace)
    grid_best, grid_path = _grid_best(root, grid)  # read before any work: a bad grid result fails here
    _check_contract(root, typed, pair, trace, given_trace, grid=grid_path)
    _check_replaceable(out_dir)
    # all or nothing: everything is written into a temporary sibling folder, swapped in only when complete; a
    # failure (or Ctrl-C) leaves an earlier export byte-identical and a new folder absent
    with atomic_dir(out_dir) as staging:
        meta = _export_into(staging, out_dir, run_dir, root, index, index_path, pair=pair, onnx=onnx, trace=trace,
                            identity=identity, grid_best=grid_best, grid_path=grid_path, measure_live=measure_live,
                            num_prompts=num_prompts, max_new_tokens=max_new_tokens, num_random=num_random,
                            seed=seed, log=log)
    return meta


def export_file_names() -> set[str]:
    """Every path (relative, POSIX) an export may write: what an earlier export may hold and a new one replaces."""
    from specpilot.policies.engine_configs import ENGINE_FILES

    policies = {f"{kind}.{ext}" for kind in ("depth", "size") for ext in ("safetensors", "onnx")}
    return {CONFIG_FILE, "engines/README.md", *policies, *(f"engines/{rel}" for rel in ENGINE_FILES.values())}


def _check_replaceable(out_dir: Path) -> None:
    """The export replaces out_dir as a whole: it must be new, empty, or an earlier export (holds decoder.json)
    holding nothing but files an export writes, so replacing it never deletes anything of the user's."""
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not (out_dir / CONFIG_FILE).is_file():
        raise ExportError(f"{out_dir} holds files but no {CONFIG_FILE}: an export replaces its folder as a whole, so "
                          "give a new or empty folder (or an earlier export's)")
    known = export_file_names()
    foreign = sorted(rel for f in out_dir.rglob("*") if not f.is_dir()
                     if (rel := f.relative_to(out_dir).as_posix()) not in known)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ExportError(f"{out_dir} is an earlier export that also holds files an export does not write "
                          f"({shown}); an export replaces its folder as a whole, so move them out or give a new "
                          "folder")


def _export_into(out_dir: Path, final_dir: Path, run_dir: Path, root: Path, index: dict, index_path: Path, *, pair,
                 onnx: bool, trace: Path | None, identity: dict, grid_best, grid_path, measure_live: bool,
                 num_prompts: int, max_new_tokens: int, num_random: int, seed: int, log) -> dict:
    """Write the whole export into out_dir (a staging folder that becomes `final_dir`); return decoder.json."""
    from specpilot.policies.ppo import PPOController

    policies: dict = {"depth": None, "size": None}
    sb3, actors, specs = {}, {}, {}
    if onnx and importlib.util.find_spec("onnx") is None:  # said once, not once per policy
        log("specpilot export: --onnx skipped: the optional `onnx` package is not installed "
            "(pip install 'specpilot[onnx]'); the safetensors export is complete without it")
        onnx = False
    for kind in ("depth", "size"):
        if index.get(kind):
            policies[kind], sb3[kind], actors[kind], specs[kind] = _export_policy(kind, index[kind], run_dir, root,
                                                                                  out_dir, onnx, log)
    size_actions = policies["size"]["actions"] if policies["size"] else None
    fb = index.get("fallback") or {}
    policies["fallback"] = {"depth": fb.get("depth"), "size": fb.get("size")}
    fb_depth, fb_size = (fb.get("depth") if fb.get("depth") is not None else default_static_config(None)[0],
                         fb.get("size") or default_static_config(None)[1])
    spec0 = specs.get("depth") or specs["size"]
    tree = TreeConfig(width=spec0.width, max_depth=spec0.max_depth,
                      max_size=max(size_actions) if size_actions else max(fb_size, 1))
    fallback = FixedController(fb.get("depth"), fb.get("size"))
    exported = ExportedController(actors.get("depth"), actors.get("size"), specs.get("depth"), specs.get("size"),
                                  size_actions, fallback)
    sb3_controller = PPOController(sb3.get("depth"), sb3.get("size"), specs.get("depth"), specs.get("size"),
                                   size_actions, fallback)
    # a run with a validation guard deploys the guarded controller: decoder.json carries the guard (so the exported
    # decoder decides as `ltd_guarded` does) and its table is the one the engines get; checked before measuring
    guarded = _run_guard(run_dir, root, exported, log)
    if guarded is not None:
        try:
            guarded.table.check_tree(tree)
        except ValueError as err:
            raise ExportError(f"the run's validation guard cannot run on the exported tree: {err}") from err
    policies["batch_guard"] = guarded.to_dict() if guarded is not None else None
    dtype = _run_dtype(root, pair)  # the costs the policies were tuned for: the recorded pair loads in it
    recorder, measured = _measure(exported, sb3_controller, sb3, actors, specs, tree, trace=trace, pair=pair,
                                  identity=identity, root=root, measure_live=measure_live, num_prompts=num_prompts,
                                  max_new_tokens=max_new_tokens, num_random=num_random, seed=seed, log=log,
                                  dtype=dtype)
    draft_gen = (pair.draft.generation_config.to_diff_dict()
                 if pair is not None and getattr(pair, "draft", None) is not None else None)
    # the grid's measured best cell per batch size (`specpilot grid --batch-sizes`): the engines' per-batch tables
    per_batch = GridResult.load(grid_path).per_batch_size if grid_path else []
    learned = _learned_batch_table(guarded or exported, specs, run_dir, root, trace, per_batch, log)
    engines = write_engine_configs(out_dir, pair=identity, width=tree.width, grid_best=grid_best,
                                   choices=recorder.choices() if recorder else {}, fallback=(fb_depth, fb_size),
                                   draft_generation_config=draft_gen, tokenizer=_tokenizer_folder(pair, identity),
                                   final_dir=final_dir, per_batch_size=per_batch or None,
                                   learned_per_batch_size=learned)
    engines["grid"] = grid_path
    meta = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "name": "exported",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "source_run": str(run_dir.resolve()),
        "tree": {"width": tree.width, "max_depth": tree.max_depth, "max_size": tree.max_size,
                 "size_actions": size_actions},
        "observation": {"module": "specpilot.policies.observation", "depth": "last level's scores, drafting order",
                        "size": "top candidate scores, sorted", "spec_version": spec0.version},
        "pair": identity, "dtype": dtype, "device": _run_device(pair, trace), "policies": policies,
        "engine_configs": engines, "versions": library_versions(),
        "measured": measured,
    }
    write_decoder_config(out_dir, meta)
    return meta


def _run_guard(run_dir: Path, root: Path, exported, log):
    """`exported` behind the run's validation guard (RUN/batch_guard.json, `train/rl/validation.write_batch_guard`:
    the per-batch-size table decides at the batch sizes where the policy lost to it on validation), or None."""
    from specpilot.policies.ppo import load_batch_guard

    guarded = next((g for d in (run_dir, root) if (g := load_batch_guard(d, exported)) is not None), None)
    if guarded is not None:
        log(f"specpilot export: the decoder runs the policies behind the run's validation guard (the table decides "
            f"at batch sizes {guarded.fallback})")
    return guarded


def _learned_batch_table(controller, specs: dict, run_dir: Path, root: Path, trace: Path | None,
                         per_batch: list[dict], log) -> list[dict] | None:
    """The batch-aware controller's own per-batch-size table (`envs.batch_replay.learned_batch_table`) on the
    export's trace, or None for policies that do not observe the batch (or without a trace / a profile with batch
    curves, said in the log). controller: the exported policies, behind the run's validation guard when it has one
    (`_run_guard`). Batch sizes: those the run trained over (manifest stage_setup), else the grid's table's.
    Profile: the one training used, else RUN/grid.profile_w<W>.json, else the trace's."""
    if not any("batch" in spec.features for spec in specs.values()):
        return None
    from specpilot.envs.batch_replay import learned_batch_table
    from specpilot.envs.replay import ReplayModel

    setups = [s for d in (run_dir, root) for s in RunManifest.load(d).section("stage_setup").values()
              if isinstance(s, dict) and s.get("batch_sizes")]
    sizes = [int(b) for b in setups[0]["batch_sizes"]] if setups else sorted(int(r["batch_size"]) for r in per_batch)
    width = next(iter(specs.values())).width
    profiles = [Path(s["batch_profile"]) for s in setups if s.get("batch_profile")] + \
        [d / f"{Path(GRID_FILE).stem}.profile_w{width}.json" for d in (run_dir, root)]
    profile = next((p for p in profiles if p.is_file()), None)
    if trace is None or not sizes:
        log("specpilot export: no learned per-batch-size table (needs a trace and the batch sizes the run trained "
            "over)")
        return None
    try:
        return learned_batch_table(ReplayModel(trace, profile), controller, sizes)
    except (ValueError, FileNotFoundError) as err:
        log(f"specpilot export: no learned per-batch-size table ({err})")
        return None


def _check_contract(root: Path, index: PoliciesIndex, pair, trace: Path | None, given_trace: bool, *,
                    grid: str | None = None) -> None:
    """Refuse (ContractError naming both sides) a pair, a trace or a grid result that is not the run's:
    decoder.json would name the wrong pair, or the choices / engine configs would come from another tree."""
    contract = RunContract.of_run(root)
    run = f"run {root} (its manifest)"
    if grid is not None and contract is not None:
        check_grid(GridResult.load(grid), contract, grid_from=f"grid result {grid}", run=run,
                   fix="export with the run's own grid result (drop --grid) or one searched for this run")
    if pair is not None and contract is not None:
        check_pair(contract.pair, pair.identity(), expected_from=run, got_from="the pair given (--target/--draft)",
                   fix="export with the pair the run was trained on (or without --target: the run records it)")
    if trace is None:
        return
    header = TraceHeader.load(trace)
    what = f"trace {trace}" + ("" if given_trace else " (found in the run)")
    fix = "drop --trace (the run's own validation trace is used) or give a trace recorded for this run"
    if contract is not None:
        check_pair(contract.pair, header.pair, expected_from=run, got_from=what, fix=fix)
    policies = index.tree()
    check_tree(policies, header.tree, expected_from=f"the run's policies ({index.path})", got_from=what, fix=fix)


def _tokenizer_folder(pair, identity: dict) -> str | None:
    """Where the target's tokenizer lives when the target folder has none (engines need it: vLLM --tokenizer)."""
    from specpilot.drafting.pair import DEFAULT_PAIR_DIR, TOKENIZER_FILES

    target = Path(str(identity.get("target", "")))
    beside = target.parent / "tokenizer"  # the embedded pair's layout: the same installation as the recorded target
    folder = str(beside) if (target.name and beside.is_dir()) else None
    folder = folder or getattr(getattr(pair, "tokenizer", None), "name_or_path", None)
    if folder is None and str(identity.get("name", "")).startswith("specpilot-default"):
        folder = str(DEFAULT_PAIR_DIR / "tokenizer")
    if folder and not any((target / name).exists() for name in TOKENIZER_FILES):
        return str(Path(folder).resolve()) if Path(folder).exists() else str(folder)
    return None


def _summary_lines(meta: dict, out_dir: Path) -> list[str]:
    m = meta["measured"]
    lines = [f"exported to {out_dir / CONFIG_FILE} (choices from: {m['choices_source']})"]
    for kind in ("depth", "size"):
        if meta["policies"].get(kind):
            e, s = m["latency_us"]["exported"][kind], m["latency_us"]["sb3"][kind]
            a = m["agreement"][kind]
            same = sum(v["same"] for v in a.values())
            total = sum(v["n"] for v in a.values())
            lines.append(f"  {kind} decision latency: exported {e['mean_us']:.1f} us (median {e['median_us']:.1f}) "
                         f"vs SB3 actor {s['mean_us']:.1f} us (median {s['median_us']:.1f}); same action on "
                         f"{same}/{total} observations")
    eng = meta["engine_configs"]
    lines.append(f"  engine configs: chain depth {eng['chain_depth']['value']} ({eng['chain_depth']['source']}), "
                 f"tree D/W/V {eng['tree_shape']['depth']}/{eng['tree_shape']['width']}/{eng['tree_shape']['size']} "
                 f"({eng['tree_shape']['source']}); files under {out_dir / 'engines'}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specpilot.train.cli_args import export_arguments

    export_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from specpilot.drafting.cliargs import load_pair, pair_given, say
    from specpilot.drafting.folder_lock import being_written, output_lock

    if args.default_pair and args.target is not None:
        raise ValueError("--default-pair and --target name two different pairs: give one")
    with output_lock(args.out, what="--out", kind="swapped"):  # held from before the pair loads
        if (writer := being_written(args.run)) is not None:
            say(f"note: --run {args.run} is being written by another specpilot run ({writer}): its policies are "
                "exported as they are now")
        pair = load_pair(args) if pair_given(args) or args.default_pair else None
        meta = export_run(args.run, args.out, pair=pair, onnx=args.onnx, trace=args.trace, grid=args.grid,
                          num_prompts=args.prompts, max_new_tokens=args.max_new_tokens)
    for line in _summary_lines(meta, Path(args.out)):
        print(line)
    return 0
