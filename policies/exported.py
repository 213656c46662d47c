"""Loading an exported decoder (`specpilot export`): decoder.json + safetensors actors -> ExportedController.

This module is the inference side of an export and deliberately depends on nothing from training: it imports
neither stable_baselines3, gymnasium nor pickle, reads weights only through `safetensors` (no code execution, no
unpickling) and rebuilds each actor as `specpilot.policies.actor.Actor`, the class PPO inference uses too.
Observations come from `specpilot.policies.observation`, the same feature functions the policies were trained on.

    controller, tree, meta = load_exported("exports/ltd")                 # policies only (no models loaded)
    controller, tree, meta = load_exported("exports/ltd", pair=my_pair)   # + check the pair's content hashes
    decoder = SpeculativeDecoder.from_config("exports/ltd")               # decoder + decoder.default_controller

decoder.json (format "specpilot-decoder", FORMAT_VERSION below), the fields this loader relies on:

    tree        {"width", "max_depth", "max_size", "size_actions"}
    pair        ModelPair.identity() of the pair the policies were trained for (names + content hashes)
    dtype       the dtype the run's traces and latency profile were measured in ("float32", "bfloat16", ...; absent
                in older exports): the recorded pair loads in it unless a dtype is asked for (`export_dtype`)
    device      the device kind they were measured on ("cpu", "cuda"; absent in older exports)
    policies    {"depth": POLICY | null, "size": POLICY | null, "fallback": {"depth": int|null, "size": int|null},
                 "batch_guard": null | {"table": {batch size: [depth, size]}, "fallback": [batch sizes]}}
    POLICY      {"file": "depth.safetensors", "sha256": <hex of the file>, "spec": ObservationSpec.to_dict(),
                 "layers": [{"kind": "linear", "in": int, "out": int, "weight": key, "bias": key} |
                            {"kind": "activation", "name": "tanh" | "relu" | ..., ...}],
                 "obs_norm": null | {"mean": key, "var": key, "epsilon": float, "clip": float},
                 "actions": ["continue", "stop"] (depth) | [verification sizes] (size),
                 "probe": {"observation": [...], "logits": [...], "action": int}}

Loading refuses (ExportedConfigError naming decoder.json, the field, the value and the limit) a policy entry without
its file, sha256 or layers (every export records them; without the sha256 the weights' integrity would go unchecked),
and sizes or depths outside the tree section (the decoder would cap them without a word): policies.size.actions and
tree.size_actions (the same list) in 1..max_size, policies.fallback depth in 0..max_depth and size in 1..max_size.

With a batch_guard (a run trained over batch sizes, `specpilot train all --batch-sizes`, whose validation guard
hands some batch sizes to the per-batch-size table) the controller is the policies behind that guard
(`BatchGuardController`, the run's `ltd_guarded`), so the exported decoder decides as the run was deployed; exports
without one (and older ones) load as the policies alone.

Decisions are deterministic: the action is the argmax of the actor's logits (the first index on exact ties, as
torch.argmax and SB3's deterministic predict both do), computed in float32 on the CPU.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from specpilot.artifacts.decoder import (DECODER_FILE, DECODER_VERSION, FORMAT_NAME, ExportedConfigError,  # noqa: F401
                                         read_decoder_config)
from specpilot.drafting.checks import check_int
from specpilot.drafting.control import Controller, FixedController
from specpilot.drafting.types import DraftState, TreeConfig
from specpilot.policies.actor import Actor, ActorError
from specpilot.policies.learned import DEPTH_ACTIONS, LearnedController  # noqa: F401 (DEPTH_ACTIONS re-exported)
from specpilot.policies.observation import ObservationSpec, depth_observation, size_observation

CONFIG_FILE, FORMAT_VERSION = DECODER_FILE, DECODER_VERSION  # the names export and older callers use


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (decoder.json records one per policy file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


class ExportedController(LearnedController):
    """Exported depth/size actors as a Controller (the same decisions as PPOController on the SB3 policies)."""

    name = "exported"
    label = "exported"


# ---------------------------------------------------------------------------------------------------------------
# loading and validation


def probe_state(spec: ObservationSpec) -> DraftState:
    """A fixed, deterministic DraftState exercising every feature (scores, padding, scalars) of `spec`; export
    records the observation and logits it produces, load recomputes them: if the feature code changed since the
    export, loading fails instead of silently feeding the policy different inputs."""
    n = spec.num_scores
    k = max(1, n // 2 + 1) if n > 1 else 1  # fewer real scores than slots: padding is exercised
    scores = -np.linspace(0.05, -1.5 * spec.score_floor, k, dtype=np.float32)  # past the floor: clipping exercised
    depth = max(1, spec.max_depth // 2)
    return DraftState(depth=depth, max_depth=spec.max_depth, width=spec.width, context_len=spec.max_context // 3,
                      scores=scores, last_top_prob=0.5, last_entropy=1.0, new_tokens=7, max_new_tokens=64,
                      prev_accepted=1, prev_depth=2, acceptance=0.6,
                      # read only by the optional batch features: older specs' probe observations are unchanged
                      batch_size=4, context_max=spec.max_context // 2)


def probe_observation(spec: ObservationSpec) -> np.ndarray:
    state = probe_state(spec)
    return depth_observation(state, spec) if spec.kind == "depth" else size_observation(state, spec)


def read_config(config_dir: str | Path) -> dict:
    """decoder.json of an export directory (or the file itself), with its format checked."""
    if not isinstance(config_dir, (str, Path)) or not str(config_dir).strip():
        raise TypeError(f"config must be the path of an export folder (or its decoder.json), got {config_dir!r}")
    return read_decoder_config(config_dir)


POLICY_KEYS = ("file", "sha256", "layers")  # what loading a policy entry cannot do without


def _load_tensors(path: Path, expected_sha256: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise ExportedConfigError(f"policy file {path} named in decoder.json is missing: restore it or re-export "
                                  "the run into this directory")
    if file_sha256(path) != expected_sha256:
        raise ExportedConfigError(f"policy file {path} does not match the sha256 recorded in decoder.json (the file "
                                  "is corrupted or was replaced): restore it or re-export the run")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ExportedConfigError(f"policy file {path} is not a readable safetensors file ({err}); it is corrupted: "
                                  "re-export the run") from err


def _load_policy(root: Path, entry: dict, kind: str) -> tuple[Actor, ObservationSpec]:
    where = f"{root / CONFIG_FILE} ({kind} policy)"
    try:
        spec = ObservationSpec.from_dict(entry["spec"])
    except (KeyError, TypeError, ValueError) as err:
        raise ExportedConfigError(f"{where}: observation spec mismatch or unreadable spec ({err})") from err
    if spec.kind != kind:
        raise ExportedConfigError(f"{where}: the spec is for a {spec.kind!r} policy; decoder.json is corrupted")
    missing = [key for key in POLICY_KEYS if not entry.get(key)]
    if missing:
        # every export records all of them (sha256 since format 1): an entry without one was edited, and loading it
        # would skip a check (the sha256: the weights' integrity) instead of failing
        raise ExportedConfigError(f"{where}: the entry lacks {', '.join(repr(k) for k in missing)}: decoder.json is "
                                  "incomplete (edited or damaged); restore it or re-export the run")
    path = root / entry["file"]
    tensors = _load_tensors(path, entry["sha256"])
    try:
        actor = Actor.from_layers(entry["layers"], tensors, obs_norm=entry.get("obs_norm"), source=str(path))
    except (ActorError, KeyError, TypeError) as err:
        raise ExportedConfigError(f"{err}; the weights file does not belong to this decoder.json: re-export the "
                                  "run") from err
    probe = entry.get("probe")
    if probe:
        obs = probe_observation(spec)
        recorded = np.asarray(probe.get("observation", []), dtype=np.float32)
        if recorded.shape != obs.shape or not np.allclose(recorded, obs, atol=1e-6):
            raise ExportedConfigError(
                f"{where}: observation-spec mismatch: this specpilot computes different {kind} features for the "
                "recorded probe state than the exporting version did (the feature layout changed). Re-export the "
                "run with this version, or use the specpilot version that exported it")
        logits = actor.logits(torch.from_numpy(obs).unsqueeze(0))[0]
        ref = torch.tensor(probe.get("logits", []), dtype=torch.float32)
        if ref.shape != logits.shape or not torch.allclose(logits, ref, atol=1e-4, rtol=1e-4):
            raise ExportedConfigError(f"{path}: the actor's logits on the probe observation differ from those "
                                      "recorded at export; the weights are corrupted or mismatched: re-export")
    return actor, spec


def _pair_mismatch(recorded: dict, actual: dict) -> list[str]:
    return [f"{key}: exported for {recorded.get(key)!r}, got {actual.get(key)!r}"
            for key in ("target_hash", "draft_hash") if recorded.get(key) != actual.get(key)]


def _load_recorded_pair(recorded: dict, config: str, device: str | None, dtype, dtype_source: str | None = None):
    """The pair decoder.json's `pair` section names: the embedded target with the recorded drafter kind, or the
    recorded target and drafter (draft LM or EAGLE-3 head) paths when they exist here."""
    from specpilot.drafting.pair import ModelPair

    kind = recorded.get("drafter") or "draft_lm"
    if kind not in ("draft_lm", "eagle3"):
        raise ExportedConfigError(f"{config}: unknown drafter kind {kind!r} in the pair section (expected draft_lm "
                                  "or eagle3); re-export the run")
    option = "eagle" if kind == "eagle3" else "draft"
    target, source = recorded.get("target"), recorded.get("draft")
    local = str(source) if source and Path(str(source)).exists() else None
    if str(recorded.get("name", "")).startswith("specpilot-default"):
        return ModelPair.from_pretrained(device=device, dtype=dtype, dtype_source=dtype_source,
                                         **{option: local or "embedded"})
    if target and local and Path(str(target)).exists():
        return ModelPair.from_pretrained(target, device=device, dtype=dtype, dtype_source=dtype_source,
                                         **{option: local})
    raise ExportedConfigError(
        f"{config} names the pair {recorded.get('name')!r} (target {target!r}, {option} {source!r}), which cannot "
        f"be loaded from here (paths are local to the exporting machine): pass pair=ModelPair.from_pretrained("
        f"target=..., {option}=...) (CLI: --target/--{option})")


EXPORT_DTYPE_SOURCE = "recorded in decoder.json (the policies were tuned in it)"


def export_dtype_source(asked, dtype) -> str | None:
    """The pair's dtype_source: the export's when its recorded dtype was taken (none was asked for), else None."""
    return EXPORT_DTYPE_SOURCE if asked is None and dtype is not None else None


def export_dtype(meta: dict, device: str | None = None, dtype=None) -> tuple[object, str | None]:
    """(dtype to load the recorded pair in, note or None). The policies chose depths and sizes for the costs of the
    dtype (and device kind) the run was measured in (decoder.json "dtype", "device"): a bf16 run loaded in fp32
    decodes correctly but slower, with choices made for other costs. So: `dtype` when asked for; else the recorded
    dtype when this device is of the recorded kind and runs it natively (`half_support`); else the device's default,
    with a note saying what was recorded and why it is not used (another device kind, a bf16 export on a CPU without
    AVX512-BF16/AMX). An export that records no dtype loads in the device's default, without a note."""
    from specpilot.drafting.pair import DTYPES, check_device, half_support

    recorded = str(meta.get("dtype") or "").removeprefix("torch.")
    if dtype is not None or not recorded:
        return dtype, None
    if recorded not in DTYPES:
        return None, f"decoder.json records dtype {recorded!r}, which this specpilot does not know: loaded in the " \
                     "device's default dtype"
    device = check_device(device)
    kind, tuned_on = device.split(":")[0], str(meta.get("device") or "").split(":")[0]
    if tuned_on and tuned_on != kind:
        return None, (f"the policies were tuned on {tuned_on} in {recorded}: on {kind} the pair loads in the device's "
                      "default dtype (decoding stays exact; the choices were made for another device's costs)")
    support, why = half_support(DTYPES[recorded], device)
    if support == "native":
        return recorded, None
    return None, (f"the policies were tuned in {recorded}, which this machine does not run natively ({why}): loaded "
                  "in the device's default dtype; decoding stays exact, but the choices were made for other costs "
                  "(ask for --dtype to override, or re-train on this machine)")


def resolve_pair(meta: dict, pair=None, *, allow_pair_mismatch: bool = False, device: str | None = None,
                 dtype=None, dtype_source: str | None = None):
    """The ModelPair to decode with: `pair` when given, else the pair decoder.json names (the embedded target with
    the recorded drafter, or local target / draft-or-EAGLE-head paths that exist). Its content hashes must equal the
    recorded ones unless `allow_pair_mismatch=True` (policies then steer a pair they were not trained for: still
    lossless, maybe slow)."""
    recorded = meta.get("pair") or {}
    config = meta.get("_path", CONFIG_FILE)
    if pair is not None and not callable(getattr(pair, "identity", None)):
        raise TypeError(f"pair must be a ModelPair (specpilot.drafting.ModelPair.from_pretrained(...)) or None (the "
                        f"pair decoder.json records), got {type(pair).__name__} {pair!r:.60}")
    if pair is None:
        asked = dtype
        dtype, _ = export_dtype(meta, device, dtype)
        pair = _load_recorded_pair(recorded, config, device, dtype, dtype_source or export_dtype_source(asked, dtype))
    if recorded and not allow_pair_mismatch:
        diffs = _pair_mismatch(recorded, pair.identity())
        if diffs:
            recorded_dtype = str(meta.get("dtype") or "").removeprefix("torch.")
            loaded_dtype = str(pair.dtype).removeprefix("torch.")
            hint = (f" The hashes were taken in {recorded_dtype} and the pair is loaded in {loaded_dtype}: weights that "
                    f"{recorded_dtype} rounds hash differently." if recorded_dtype and recorded_dtype != loaded_dtype
                    else "")
            raise ExportedConfigError(
                f"{config}: the model pair does not match the one the policies were exported for ({'; '.join(diffs)})."
                f"{hint} Load the recorded pair (same weights and dtype), or pass allow_pair_mismatch=True "
                "(`specpilot generate`: --allow-pair-mismatch) to use the policies anyway (decoding stays lossless; "
                "speed may suffer)")
    return pair


def load_exported(config_dir: str | Path, pair=None, *, load_pair: bool = True, allow_pair_mismatch: bool = False,
                  device: str | None = None, dtype=None) -> tuple[Controller, TreeConfig, dict]:
    """(controller, tree_config, meta) from an export directory, every file validated. The controller is an
    ExportedController, behind a `BatchGuardController` when decoder.json carries the run's batch guard.

    pair: the ModelPair to check against the recorded identity (hash mismatch -> ExportedConfigError, unless
    allow_pair_mismatch=True). With pair=None and load_pair=True the recorded pair is loaded when possible (see
    `resolve_pair`); load_pair=False loads the policies only. meta is decoder.json's content plus
    meta["model_pair"]: the ModelPair (or None when none was loaded).
    """
    meta = read_config(config_dir)
    root = Path(meta["_path"]).parent
    config = meta["_path"]
    try:
        t = meta["tree"]
        tree = TreeConfig(width=t["width"], max_depth=t["max_depth"], max_size=t["max_size"])
        policies = meta["policies"]
        if not isinstance(policies, dict):
            raise TypeError(f"'policies' is a {type(policies).__name__}, not a mapping")
        wrong = [k for k in ("depth", "size", "fallback", "batch_guard")
                 if policies.get(k) is not None and not isinstance(policies[k], dict)]
        if wrong:
            raise TypeError(f"policies.{wrong[0]} is a {type(policies[wrong[0]]).__name__}, not a mapping")
    except (KeyError, TypeError, ValueError) as err:
        raise ExportedConfigError(f"{config}: missing or invalid 'tree'/'policies' section ({err}); re-export") from err

    depth_actor = size_actor = depth_spec = size_spec = size_actions = None
    if policies.get("depth"):
        depth_actor, depth_spec = _load_policy(root, policies["depth"], "depth")
    if policies.get("size"):
        size_actor, size_spec = _load_policy(root, policies["size"], "size")
        size_actions = _tree_ints(config, "policies.size.actions", policies["size"].get("actions"), tree)
    if depth_actor is None and size_actor is None:
        raise ExportedConfigError(f"{config} names neither a depth nor a size policy; re-export a trained run")
    _check_tree_values(config, meta["tree"], policies, tree, size_actions)
    for spec in (depth_spec, size_spec):
        if spec is not None and (spec.width != tree.width or spec.max_depth != tree.max_depth):
            raise ExportedConfigError(
                f"{config}: observation-spec mismatch: the {spec.kind} policy was trained for width {spec.width}, "
                f"max_depth {spec.max_depth} but the tree section says width {tree.width}, max_depth "
                f"{tree.max_depth}; re-export the run")

    model_pair = None
    if pair is not None or load_pair:
        asked = dtype
        dtype, why = export_dtype(meta, device, dtype) if pair is None else (dtype, None)
        model_pair = resolve_pair(meta, pair, allow_pair_mismatch=allow_pair_mismatch, device=device, dtype=dtype,
                                  dtype_source=export_dtype_source(asked, dtype))
        meta["dtype_note"] = _dtype_note(meta, model_pair, why)
    fb = policies.get("fallback") or {}
    fb_device = str(model_pair.device) if model_pair is not None else None
    fallback = FixedController(fb.get("depth"), fb.get("size"), device=fb_device)
    name = meta.get("name") or "exported"
    try:
        controller = ExportedController(depth_actor, size_actor, depth_spec, size_spec, size_actions, fallback,
                                        name=name)
    except ValueError as err:
        raise ExportedConfigError(f"{config}: {err}; re-export the run") from err
    if policies.get("batch_guard"):
        controller = _guarded(controller, policies["batch_guard"], tree, config)
    meta["model_pair"] = model_pair
    return controller, tree, meta


def _in_tree(config: str, name: str, value, low: int, high: int, what: str) -> int:
    """`value` as an int in low..high, else ExportedConfigError naming decoder.json, the field, the value and the
    tree's limit (the decoder would cap a larger one without a word)."""
    try:
        return check_int(name, value, minimum=low, maximum=high)
    except (TypeError, ValueError) as err:
        raise ExportedConfigError(f"{config}: {err} (the tree section's {what} is {high}); restore decoder.json or "
                                  "re-export the run") from None


def _tree_ints(config: str, name: str, values, tree: TreeConfig) -> list[int]:
    """A list of verification sizes (`name` in decoder.json), each in 1..tree.max_size."""
    if not isinstance(values, list) or not values:
        raise ExportedConfigError(f"{config}: {name} must be a non-empty list of sizes, got {values!r}; restore "
                                  "decoder.json or re-export the run")
    return [_in_tree(config, f"each of {name}", v, 1, tree.max_size, "max_size") for v in values]


def _check_tree_values(config: str, tree_section: dict, policies: dict, tree: TreeConfig,
                       size_actions: list[int] | None) -> None:
    """Every size and depth decoder.json holds besides the policies' actions fits its tree section: the copy of the
    size actions there (equal to the size policy's), the static fallback (depth 0..max_depth, size 1..max_size)."""
    recorded = tree_section.get("size_actions")
    if recorded is not None:
        recorded = _tree_ints(config, "tree.size_actions", recorded, tree)
        if size_actions is not None and recorded != size_actions:
            raise ExportedConfigError(f"{config}: tree.size_actions {recorded} differs from policies.size.actions "
                                      f"{size_actions} (export writes one list twice); restore decoder.json or "
                                      "re-export the run")
    fb = policies.get("fallback") or {}
    if not isinstance(fb, dict):
        raise ExportedConfigError(f"{config}: policies.fallback must be an object {{depth, size}} or null, "
                                  f"got {fb!r}; restore decoder.json or re-export the run")
    depth = fb.get("depth")
    if depth is not None:
        depth = _in_tree(config, "policies.fallback.depth", depth, 0, tree.max_depth, "max_depth")
    if fb.get("size") is not None:  # a config that never drafts (depth 0) verifies nothing: size 0 is its own
        _in_tree(config, "policies.fallback.size", fb["size"], 0 if depth == 0 else 1, tree.max_size, "max_size")


def _dtype_note(meta: dict, model_pair, why: str | None) -> str | None:
    """Why the pair decodes in another dtype than the one the policies were tuned in (None when it does not): `why`
    (`export_dtype`'s note) when there is one, else that the dtype was asked for or came with the given pair."""
    recorded = str(meta.get("dtype") or "").removeprefix("torch.")
    actual = str(model_pair.dtype).removeprefix("torch.")
    if not recorded or actual == recorded:
        return None
    return why or (f"decoding in {actual}, but the policies were tuned in {recorded}: still exact, but the choices "
                   "were made for other costs")


def _guarded(controller: ExportedController, guard, tree: TreeConfig, config: str) -> Controller:
    """The exported policies behind the run's validation guard (decoder.json policies.batch_guard), checked."""
    from specpilot.policies.heuristics import BatchGuardController

    try:
        guarded = BatchGuardController.from_dict(controller, guard)
        guarded.table.check_tree(tree)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ExportedConfigError(f"{config}: invalid policies.batch_guard ({err}); re-export the run") from err
    return guarded
