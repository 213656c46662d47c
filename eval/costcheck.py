"""Is the latency profile still right? Replay's predicted tokens/s of static configs against a live measurement.

The latency profile (`specpilot.envs.profile`) is measured once, when traces are recorded; replay, the grid
search and PPO training all rest on it. If the machine's load changed since, every replay-trained decision rests
on a stale cost model. The check:

1. predicted: tokens/s of each static (depth, size) config on some trace prompts under replay with the profile
   (`replay_static`: draft + verify time, exact accepted lengths);
2. measured: the same configs live on the same prompts, `rounds` interleaved rounds with the evaluation's loop
   (`evaluate(controllers=...)`), time = wall time minus prefill (what replay models); per round one pooled
   tokens/s, so the live measurement's own spread is known: spread = (max - min) / 2 of the rounds' tokens/s,
   over the pooled tokens/s the error is relative to (a round timed under load can make it exceed 100%);
3. error = predicted / measured - 1 per config; a config is off when |error| > spread + tolerance (default 25%:
   beyond the noise by more than the tolerance), and the profile is `stale` when any config is off.

The plain step is checked too: depth 0 (`PLAIN`, "d0_s0") under replay is replay's autoregressive decoding, so its
prediction is measured against the live `ar` runs of the same loop (the row's `method` is "ar").

`check_and_refresh` re-measures a stale profile (`measure_profile`), saves it (the old one kept as
profile.stale.json), and re-checks the new profile against the same live numbers. The profile's age comes from
its meta["created"] (else the file's modification time).
"""
from __future__ import annotations

import datetime
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specpilot.eval.metrics import RunRecord

DEFAULT_TOLERANCE = 0.25
PLAIN = (0, 0)   # depth 0: plain target steps only; measured against live `ar`
AR = "ar"


def profile_age_s(profile, path: str | Path | None = None) -> tuple[float | None, str | None]:
    """(age in seconds, creation time as ISO text) of a LatencyProfile; (None, None) when unknown."""
    created = (getattr(profile, "meta", None) or {}).get("created")
    when = None
    if created:
        try:
            when = datetime.datetime.fromisoformat(str(created))
            if when.tzinfo is None:  # naive: local time
                when = when.astimezone()
        except ValueError:
            when = None
    if when is None and path is not None and Path(path).is_file():
        when = datetime.datetime.fromtimestamp(Path(path).stat().st_mtime, tz=datetime.timezone.utc)
    if when is None:
        return None, None
    now = datetime.datetime.now(datetime.timezone.utc)
    return (now - when).total_seconds(), when.isoformat(timespec="seconds")


def default_configs(trace, sizes: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The plain step (depth 0, against live ar) and three static configs spanning the trace's tree: shallow and
    narrow, middle, deepest and widest. `sizes`: the verification sizes the profile measured (its meta["sizes"]);
    the middle config takes the largest of them up to half the tree's size, so the check tests measured prices
    (an unmeasured size is interpolated between its neighbours: on a CPU whose row plan leaves 17 rows to the
    default kernel, V=16 ran 20% slower than priced from V=15 and V=20, a config no policy or grid cell uses)."""
    d, s, w = trace.max_depth, trace.max_size, trace.width
    middle = max(1, s // 2)
    measured = [int(v) for v in sizes or () if 1 <= int(v) <= middle]
    return sorted({PLAIN, (1, min(w, s)), (max(1, d // 2), max(measured, default=middle)), (d, s)})


def config_name(depth: int, size: int) -> str:
    return f"d{depth}_s{size}"


PLAIN_NAME = config_name(*PLAIN)


def predicted(trace, profile, configs: Sequence[tuple[int, int]], prompts: Sequence[int]) -> dict[str, float]:
    """Replay tokens/s of each config over trace prompts `prompts` (name -> tokens/s)."""
    from specpilot.envs.oracle import replay_static

    return {config_name(d, s): replay_static(trace, profile, d, s, prompts=list(prompts))["tokens_per_s"]
            for d, s in configs}


def measure_live(pair, trace, configs: Sequence[tuple[int, int]], prompts: Sequence[int], *, rounds: int = 3,
                 warmup: int = 1, seed: int = 0, progress: Callable[[str], None] | None = None) -> list[RunRecord]:
    """Live greedy runs of each config (FixedController) on trace prompts `prompts`, `rounds` interleaved rounds
    of the evaluation loop with the trace's tree; returns the records (`ar` included, as in every evaluation: it
    is what depth-0 configs are measured against, so they are not run themselves)."""
    from specpilot.drafting.types import TreeConfig
    from specpilot.eval.runner import evaluate
    from specpilot.eval.suites import Prompt
    from specpilot.policies import FixedController

    controllers = {config_name(d, s): FixedController(d, s) for d, s in configs if d > 0}
    items = [Prompt(id=str(i), task="trace", language="-", split="trace", prompt=str(i)) for i in prompts]
    tree = TreeConfig(width=trace.width, max_depth=trace.max_depth, max_size=trace.max_size)
    result = evaluate(items, pair=pair, controllers=controllers, temperatures=(0.0,), rounds=rounds, warmup=warmup,
                      max_new_tokens=trace.max_new_tokens, tree=tree, seed=seed,
                      encode=lambda text: trace.prompt(int(text)), progress=progress)
    return result.records


def compare_rates(predicted_tps: dict[str, float], records: Sequence[RunRecord], *,
                  tolerance: float = DEFAULT_TOLERANCE, measured_as: dict[str, str] | None = None) -> dict:
    """Predicted vs measured per config (module docstring, step 3). `records`: live runs whose `method` is the
    config name and `repeat` the round; `measured_as` maps a config to the live method it is measured against
    (default: the plain step "d0_s0" against `ar`; such a row carries that `method`)."""
    measured_as = {PLAIN_NAME: AR} if measured_as is None else measured_as
    rows = []
    for name, pred in predicted_tps.items():
        live = measured_as.get(name, name)
        recs = [r for r in records if r.method == live]
        if not recs:
            continue
        decode = lambda rs: sum(r.wall_s - r.prefill_s for r in rs)  # noqa: E731 - what replay models
        measured = sum(r.n_tokens for r in recs) / decode(recs)
        per_round = [sum(r.n_tokens for r in rs) / decode(rs)
                     for k in sorted({r.repeat for r in recs}) if (rs := [r for r in recs if r.repeat == k])]
        spread = (max(per_round) - min(per_round)) / 2.0 / measured if len(per_round) > 1 else 0.0
        error = pred / measured - 1.0
        rows.append({"config": name, "predicted_tokens_per_s": pred, "measured_tokens_per_s": measured,
                     "measured_by_round": per_round, "spread": spread, "error": error,
                     "off": bool(abs(error) > spread + tolerance), **({"method": live} if live != name else {})})
    return _verdict(rows, tolerance)


def _verdict(rows: list[dict], tolerance: float) -> dict:
    """The check's result over its config rows; `worst_spread` is the live spread of the config with the largest
    error (a large error "within tolerance" says why: the live rounds themselves moved that much)."""
    worst = max(rows, key=lambda r: abs(r["error"]), default=None)
    return {"configs": rows, "tolerance": tolerance, "stale": any(r["off"] for r in rows),
            "max_abs_error": abs(worst["error"]) if worst else None,
            "worst_spread": worst["spread"] if worst else None}


def check_profile(pair, trace, profile, prompts: int | Sequence[int] = 3, *,
                  configs: Sequence[tuple[int, int]] | None = None, rounds: int = 3,
                  tolerance: float = DEFAULT_TOLERANCE, profile_path: str | Path | None = None, seed: int = 0,
                  progress: Callable[[str], None] | None = None) -> dict:
    """Check `profile` against a live measurement on `trace` (a Trace or its directory); `prompts`: how many of
    the trace's prompts (the first ones) or which indices. Returns compare_rates' dict plus the profile's age,
    the configs, prompts and rounds used, the seconds spent, and `live` (the records, for re-checks)."""
    from specpilot.envs.replay import load_profile, load_trace

    started = time.perf_counter()
    trace = load_trace(trace)
    profile = load_profile(profile, trace)
    indices = list(range(min(prompts, trace.num_prompts))) if isinstance(prompts, int) else list(prompts)
    if not indices:
        raise ValueError("check_profile needs at least one trace prompt")
    configs = [(min(int(d), trace.max_depth), int(s))
               for d, s in (configs or default_configs(trace, (profile.meta or {}).get("sizes")))]
    records = measure_live(pair, trace, configs, indices, rounds=rounds, seed=seed, progress=progress)
    out = compare_rates(predicted(trace, profile, configs, indices), records, tolerance=tolerance)
    age, created = profile_age_s(profile, profile_path)
    out.update({"age_s": age, "created": created, "prompts": indices, "rounds": rounds,
                "seconds": round(time.perf_counter() - started, 1), "live": records})
    return out


def refresh_profile(pair, trace, path: str | Path, *, prompts: int = 4, seed: int = 0, reason: str = "",
                    progress: bool = False):
    """Re-measure the latency profile on the first `prompts` trace prompts (at least DEFAULT_PROFILE_CYCLES cycles,
    the AR reference of replay speedups timed between them) with the trace's tree and budget; save it to `path`
    (an existing file is kept as profile.stale.json beside it). Returns the new LatencyProfile."""
    from specpilot.drafting.types import TreeConfig
    from specpilot.envs.profile import DEFAULT_PROFILE_CYCLES, measure_profile
    from specpilot.envs.replay import load_trace

    trace = load_trace(trace)
    path = Path(path)
    tree = TreeConfig(width=trace.width, max_depth=trace.max_depth, max_size=trace.max_size)
    ids = [trace.prompt(i) for i in range(min(prompts, trace.num_prompts))]
    # AR timed between the prompts: replay speedups over the refreshed profile divide by an AR of the same moment
    profile = measure_profile(pair, tree, ids, max_new_tokens=trace.max_new_tokens, seed=seed,
                              min_cycles=DEFAULT_PROFILE_CYCLES, progress=progress, ar=True)
    profile.meta.setdefault("created", _now())
    profile.meta.update({"pair": trace.header.get("pair"), "refreshed": reason or "re-measured"})
    if path.is_file():
        shutil.copyfile(path, path.with_name("profile.stale.json"))
    profile.save(path)
    return profile


def check_and_refresh(pair, trace, profile_path: str | Path, *, also: Sequence[str | Path] = (),
                      prompts: int = 3, profile_prompts: int = 4, configs: Sequence[tuple[int, int]] | None = None,
                      rounds: int = 3, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0,
                      log: Callable[[str], None] = print) -> dict:
    """check_profile; when stale, refresh_profile (also copying the new profile to the paths in `also`, e.g. the
    validation trace's) and re-check it against the same live numbers. Says what happened through `log`.
    Returns {"before": check, "refreshed": bool, "after": re-check or None} (JSON-able: no records)."""
    from specpilot.envs.replay import load_trace

    trace = load_trace(trace)
    before = check_profile(pair, trace, profile_path, prompts, configs=configs, rounds=rounds, tolerance=tolerance,
                           profile_path=profile_path, seed=seed)
    live = before.pop("live")
    log(f"cost model check ({profile_path}): {summary_line(before)}")
    if not before["stale"]:
        return {"before": before, "refreshed": False, "after": None}
    reason = (f"stale: replay predicted {before['max_abs_error']:.0%} off the live tokens/s "
              f"(tolerance {tolerance:.0%} beyond the live spread)")
    log(f"cost model is {reason}; re-measuring the latency profile")
    profile = refresh_profile(pair, trace, profile_path, prompts=profile_prompts, seed=seed, reason=reason)
    for other in also:
        if Path(other).is_file():
            shutil.copyfile(other, Path(other).with_name("profile.stale.json"))
        profile.save(other)
    configs_used = [tuple(int(x) for x in c["config"][1:].split("_s")) for c in before["configs"]]
    after = compare_rates(predicted(trace, profile, configs_used, before["prompts"]), live, tolerance=tolerance)
    after["age_s"], after["created"] = profile_age_s(profile)
    log(f"re-measured profile: {summary_line(after)}")
    return {"before": before, "refreshed": True, "after": after}


def summary_line(check: dict) -> str:
    """'predicted/measured tokens/s d1_s4 120/118 (+2%), ...; age 3.2 min; ok' (or 'STALE')."""
    parts = [f"{c['config']}{' (vs ' + c['method'] + ')' if c.get('method') else ''} "
             f"{c['predicted_tokens_per_s']:.1f}/{c['measured_tokens_per_s']:.1f} "
             f"({100 * c['error']:+.0f}%, live spread +-{100 * c['spread']:.0f}%)" for c in check["configs"]]
    age = check.get("age_s")
    age_text = f"; profile age {age / 60:.1f} min" if age is not None else "; profile age unknown"
    return ("predicted/measured tokens/s " + ", ".join(parts) + age_text
            + ("; STALE" if check["stale"] else f"; within tolerance (stale past the spread + "
                                                f"{100 * check['tolerance']:.0f}%)"))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def check_records(trace, profile, records: Sequence[RunRecord], configs: dict[str, tuple[int, int]],
                  prompt_index: dict[str, int], *, tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """The check without extra generations: an evaluation's own live greedy runs of fixed-config methods
    (`configs`: method name -> (depth, size)) against replay of the same configs on the trace of the same prompts
    (`prompt_index`: prompt id -> trace index). Per method, predicted over the prompts the method ran; first the
    plain step (replay at depth 0) against the live `ar` runs."""
    rows = []
    ar = [r for r in records if r.method == AR and r.temperature == 0.0 and r.concurrency == 1]
    ar_idx = sorted({prompt_index[r.prompt_id] for r in ar if r.prompt_id in prompt_index})
    if ar_idx:
        ar = [r for r in ar if r.prompt_id in prompt_index]
        rows += compare_rates(predicted(trace, profile, [PLAIN], ar_idx), ar, tolerance=tolerance)["configs"]
    for name, (depth, size) in configs.items():
        recs = [r for r in records if r.method == name and r.temperature == 0.0 and r.concurrency == 1]
        idx = sorted({prompt_index[r.prompt_id] for r in recs if r.prompt_id in prompt_index})
        if not idx:
            continue
        pred = predicted(trace, profile, [(min(depth, trace.max_depth), size)], idx)
        renamed = [RunRecord(**{**r.__dict__, "method": next(iter(pred))}) for r in recs]
        row = compare_rates(pred, renamed, tolerance=tolerance, measured_as={})["configs"][0]
        rows.append({**row, "method": name})
    return _verdict(rows, tolerance)
