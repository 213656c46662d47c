"""Run logging: TensorBoard always, wandb optionally (offline by default, so it never needs the network).

    logger = RunLogger(run_dir, config)                # wandb mode: argument > $WANDB_MODE > "offline"
    logger.log({"stage/val/tokens_per_s": 51.2}, step=4096)
    model.set_logger(logger.sb3_logger("depth_s1"))    # SB3's own train/* metrics go to both sinks
    callback = CycleMetricsCallback(logger, "depth_s1")

Metric namespaces (fixed, per training stage):
    <stage>/rollout/reward_mean      mean raw (un-normalised) env reward per step over the rollout
    <stage>/cycle/mean_accepted_length  tau: tokens emitted per finished cycle (bonus token included)
    <stage>/cycle/tokens_per_s       sum(emitted) / sum(draft_s + verify_s) over the rollout's finished cycles
    <stage>/cycle/depth, /size       histograms (TensorBoard) and means of the chosen depth / verification size
    <stage>/val/*                    validation results;  <stage>/train/*, <stage>/time/* from SB3
"""
from __future__ import annotations

import json
import os
import re
import secrets
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.logger import KVWriter, Logger, TensorBoardOutputFormat

from specpilot.drafting.errors import one_line
from specpilot.drafting.files import atomic_write_json, check_writable, nearest_existing

WANDB_MODES = ("online", "offline", "disabled")
CYCLE_INFO_KEYS = ("accepted", "emitted", "depth", "size", "draft_s", "verify_s")


def resolve_wandb_mode(mode: str | None = None) -> str:
    """The argument if given, else $WANDB_MODE, else "offline"."""
    source = "" if mode else " (from $WANDB_MODE)" if os.environ.get("WANDB_MODE") else ""
    mode = mode or os.environ.get("WANDB_MODE") or "offline"
    if mode == "dryrun":  # wandb's old name for offline
        mode = "offline"
    if mode not in WANDB_MODES:
        raise ValueError(f"wandb mode must be one of {WANDB_MODES}, got {mode!r}{source}"
                         + ("; set WANDB_MODE to one of them, or unset it" if source else ""))
    return mode


ONLINE_INIT_TIMEOUT_S = 30.0  # wandb's default waits 90 s for an unreachable server before giving up
RUN_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"  # wandb's own ids: 8 characters of these


def new_run_id() -> str:
    """A fresh wandb run id, made here so it can be kept before wandb starts."""
    return "".join(secrets.choice(RUN_ID_ALPHABET) for _ in range(8))


@contextmanager
def _usable_cache(fallback: Path):
    """wandb's service process keeps its logs in the user's cache folder ($XDG_CACHE_HOME, else ~/.cache) and, when
    it cannot (HOME unset, a read-only home), prints its own log lines on stderr instead, about 20 per run. Where
    that folder cannot be written, the service is started with `fallback` as its cache, only while wandb starts
    (other libraries keep reading the user's)."""
    base = os.environ.get("XDG_CACHE_HOME") or (os.path.join(os.environ["HOME"], ".cache")
                                                if os.environ.get("HOME") else None)
    if base and os.access(nearest_existing(Path(base)), os.W_OK):
        yield
        return
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(fallback)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = previous


RUN_IDS_FILE = "run_ids.json"  # RUN/wandb/run_ids.json: {command or stage: wandb run id}, so a resume continues it
_USER_ID_TAKEN: set[str] = set()  # the user's $WANDB_RUN_ID once a command's run in this process has taken it


def derived_run_id(user_id: str, run_dir: Path, key: str, *, command: bool) -> str | None:
    """The wandb id of a run when the user set $WANDB_RUN_ID: None (the user's id itself) for the first command's
    run of this process, else `<user id>-<run folder name>-<command or stage>` (wandb's reserved characters
    replaced). A command starts several runs (`train all --seeds 3`: one per seed, in worker processes; the demo:
    seeds, sampled stages and its summary): each gets its own id, derived from the user's so they are found
    together, instead of all of them writing into one run."""
    if command and user_id not in _USER_ID_TAKEN:
        _USER_ID_TAKEN.add(user_id)
        return None
    return f"{user_id}-" + re.sub(r"[^A-Za-z0-9_.+=-]+", "_", f"{run_dir.name}-{key}")


class RunLogger:
    """Writes scalars/histograms to run_dir/tb (TensorBoard) and, unless disabled, a wandb run in run_dir/wandb.

    Both start with the first record, so a command refused before it logs anything leaves neither (nor a wandb run).
    The wandb run's id is kept per command (or stage) in RUN/wandb/run_ids.json: the same command on the same run
    folder (a `--resume`) continues that run (`resume="allow"`) instead of starting another. $WANDB_PROJECT,
    $WANDB_NAME and $WANDB_RUN_ID are honoured: the user's id names the command's run, and the other runs the
    command starts (seeds, stages) get ids derived from it (`derived_run_id`). Online, a server that cannot be
    reached within ONLINE_INIT_TIMEOUT_S falls back to offline logging in the run folder (`wandb sync` uploads it
    later): nothing logged is lost. resume=False starts a new wandb run each time (`specpilot eval` into a folder it
    wrote before)."""

    def __init__(self, run_dir: str | Path, config: dict | None = None, mode: str | None = None, *,
                 project: str | None = None, name: str | None = None, resume: bool = True,
                 folder_option: str = "--run") -> None:
        self.mode = resolve_wandb_mode(mode)  # a bad mode is refused before anything is written
        self.run_dir = Path(run_dir)
        self.config = dict(config or {})
        self.project = project or os.environ.get("WANDB_PROJECT") or "specpilot"
        self.name = os.environ.get("WANDB_NAME") or name or self.run_dir.name
        self._tb = None
        self.wandb_run = None
        self._wandb_tried = False
        self.resume = resume  # False: a new wandb run even where the command's id is saved (an evaluation redone)
        self.folder_option = folder_option  # the command's option that names run_dir (said when it is unusable)

    @property
    def tb(self):
        """The TensorBoard writer (run_dir/tb), made at the first record."""
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self.check_folders()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        return self._tb

    def check_folders(self) -> None:
        """NotADirectoryError when a file sits where the TensorBoard logs go, OutputPathError when their folder
        cannot be written (said before a stage or an evaluation does any work, not when the first record lands)."""
        folder = self.run_dir / "tb"
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file, where the run's TensorBoard logs go: move it away, or "
                                     f"write into another {self.folder_option} folder")
        check_writable(folder, kind="dir", what="the TensorBoard logs' folder")

    def _wandb(self):
        """The wandb run, started at the first record (None when disabled or when it could not start)."""
        if not self._wandb_tried and self.mode != "disabled":
            self._wandb_tried = True
            self.wandb_run = self._init_wandb()
        return self.wandb_run

    def _ids_path(self) -> Path:
        return self.run_dir / "wandb" / RUN_IDS_FILE

    def _saved_ids(self) -> dict:
        try:
            ids = json.loads(self._ids_path().read_text())
        except (OSError, ValueError):  # none yet, or damaged: a new run (the ids are a convenience, not a contract)
            return {}
        return ids if isinstance(ids, dict) else {}

    def _init_wandb(self):
        try:
            import wandb
        except Exception as err:  # logging must never kill a training run
            warnings.warn(f"wandb could not be imported ({err}); logging to TensorBoard only", stacklevel=4)
            return None
        key = str(self.config.get("command") or self.config.get("stage") or "run")
        ids = self._saved_ids()
        user_id, name = os.environ.get("WANDB_RUN_ID"), self.name
        derived = user_id and derived_run_id(user_id, self.run_dir, key, command="command" in self.config)
        if derived and os.environ.get("WANDB_NAME"):
            name = f"{name}{derived.removeprefix(user_id)}"  # the user's name, told apart like the ids
        # the user's id is passed explicitly: wandb reads $WANDB_RUN_ID once per process, not at every init
        saved = derived or user_id or (ids.get(key) if self.resume else None)
        resume = (os.environ.get("WANDB_RESUME") or "allow") if user_id and not derived else "allow"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if saved is None:
            # the id is chosen and kept before wandb starts: a run interrupted while wandb starts (its folder made,
            # its id not yet returned) is continued by the rerun, not left as an orphan beside a new one
            saved = new_run_id()
            self._keep_id(ids, key, saved)

        def start(mode: str):
            settings = wandb.Settings(silent=True, console="off", init_timeout=ONLINE_INIT_TIMEOUT_S)
            return wandb.init(project=self.project, name=name, dir=str(self.run_dir), mode=mode,
                              config=self.config, id=saved, resume=resume,
                              allow_val_change=True, reinit="create_new", settings=settings)

        try:
            with _usable_cache((self.run_dir / "wandb" / ".cache").absolute()):  # wandb refuses a relative one
                run = start(self.mode)
        except Exception as err:  # logging must never kill a training run
            if self.mode != "online":
                warnings.warn(f"wandb could not start in {self.mode} mode ({err}); logging to TensorBoard only",
                              stacklevel=4)
                return None
            try:
                run = start("offline")
            except Exception as again:
                warnings.warn(f"wandb could not start online ({err}) nor offline ({again}); logging to TensorBoard "
                              "only", stacklevel=4)
                return None
            warnings.warn(f"wandb could not start online ({one_line(err)}); logging offline to "
                          f"{self.run_dir / 'wandb'} instead: `wandb sync` uploads it later", stacklevel=4)
        # charts against each stage's own environment steps (the `timesteps` every record carries), not wandb's
        # count of log calls
        try:
            run.define_metric("*", step_metric="timesteps")
        except Exception:  # noqa: BLE001 - a convenience of the charts, never worth failing a run
            pass
        if ids.get(key) != run.id:
            self._keep_id(ids, key, run.id)
        return run

    def _keep_id(self, ids: dict, key: str, run_id: str) -> None:
        ids[key] = run_id
        try:
            self._ids_path().parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self._ids_path(), ids)
        except OSError as err:
            warnings.warn(f"could not keep the wandb run id ({err}): a resume will start a new run", stacklevel=5)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Scalars become scalars, sequences become histograms (TensorBoard) / wandb.Histogram."""
        payload: dict[str, Any] = {}
        for key, value in metrics.items():
            if value is None:
                continue
            if isinstance(value, (list, tuple, np.ndarray)):
                arr = np.asarray(value, dtype=np.float64)
                if arr.size == 0:
                    continue
                self.tb.add_histogram(key, arr, global_step=step)
                payload[key] = arr
            elif isinstance(value, (int, float, np.integer, np.floating)):
                if np.isfinite(value):
                    self.tb.add_scalar(key, float(value), global_step=step)
                    payload[key] = float(value)
        if payload and self._wandb() is not None:
            import wandb

            data = {k: wandb.Histogram(v) if isinstance(v, np.ndarray) else v for k, v in payload.items()}
            # a per-stage step key instead of wandb's global `step=`: stages restart at 0 and wandb's step must
            # only grow
            data["timesteps"] = step
            self.wandb_run.log(data)

    def summarize(self, values: dict[str, Any]) -> None:
        """A run's results (e.g. the demo's held-out speedups and verdicts) as the wandb run's summary: nested keys
        joined with "/", numbers and short strings kept (None, lists and non-finite numbers left out)."""
        flat: dict[str, Any] = {}

        def walk(prefix: str, value) -> None:
            if isinstance(value, dict):
                for key, inner in value.items():
                    walk(f"{prefix}/{key}" if prefix else str(key), inner)
            elif isinstance(value, bool) or (isinstance(value, str) and len(value) <= 200):
                flat[prefix] = value
            elif isinstance(value, (int, float, np.integer, np.floating)) and np.isfinite(value):
                flat[prefix] = float(value) if isinstance(value, (float, np.floating)) else int(value)

        walk("", values)
        if not flat:
            return
        self.tb.add_text("summary", json.dumps(flat, indent=1, default=str))
        if self._wandb() is not None:
            self.wandb_run.summary.update(flat)

    def note(self, text: str) -> None:
        """A one-line event of the run (e.g. "size_s1: resuming size seed 0 from ... at step 2048"), kept in
        TensorBoard as text (the CLI's logger also prints it)."""
        self.tb.add_text("events", text)

    def sb3_logger(self, stage: str) -> Logger:
        """An SB3 Logger whose records go to TensorBoard (run_dir/tb/<stage>) and to wandb under <stage>/."""
        self.check_folders()
        tb_dir = str(self.run_dir / "tb" / stage)
        formats: list[KVWriter] = [TensorBoardOutputFormat(tb_dir), _ForwardWriter(self, stage)]
        return Logger(folder=str(self.run_dir / "tb" / stage), output_formats=formats)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as err:  # pragma: no cover - best effort at shutdown
                warnings.warn(f"wandb finish failed: {err}", stacklevel=2)
            self.wandb_run = None

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ForwardWriter(KVWriter):
    """Forwards SB3's dumped records to wandb (TensorBoard gets them from SB3's own writer)."""

    def __init__(self, run_logger: RunLogger, stage: str) -> None:
        self.run_logger = run_logger
        self.stage = stage

    def write(self, key_values: dict[str, Any], key_excluded: dict[str, tuple[str, ...]], step: int = 0) -> None:
        run = self.run_logger.wandb_run
        if run is None:
            return
        data = {f"{self.stage}/{k}": float(v) for k, v in key_values.items()
                if isinstance(v, (int, float, np.integer, np.floating)) and "wandb" not in key_excluded.get(k, ())}
        if data:
            data["timesteps"] = step
            run.log(data)

    def close(self) -> None:
        pass


class CycleMetricsCallback(BaseCallback):
    """Logs per-rollout cycle metrics from env infos.

    Environments report a finished draft-and-verify cycle by putting the keys `accepted`, `emitted`, `depth`,
    `size`, `draft_s`, `verify_s` in that step's info (steps without them, e.g. a depth policy's CONTINUE, are
    skipped). Rewards are logged un-normalised (VecNormalize's original reward when present).
    """

    def __init__(self, run_logger: RunLogger | None, stage: str, verbose: int = 0) -> None:
        super().__init__(verbose)
        self.run_logger = run_logger
        self.stage = stage
        self._cycles: dict[str, list[float]] = defaultdict(list)
        self._rewards: list[float] = []

    def _on_rollout_start(self) -> None:
        self._cycles.clear()
        self._rewards.clear()

    def _on_step(self) -> bool:
        vec_norm = self.model.get_vec_normalize_env()
        rewards = vec_norm.get_original_reward() if vec_norm is not None else self.locals.get("rewards")
        if rewards is not None:
            self._rewards.extend(np.asarray(rewards, dtype=np.float64).ravel().tolist())
        for info in self.locals.get("infos", ()):
            if all(k in info for k in CYCLE_INFO_KEYS):
                for k in CYCLE_INFO_KEYS:
                    self._cycles[k].append(float(info[k]))
        return True

    def rollout_metrics(self) -> dict[str, Any]:
        p = f"{self.stage}/"
        out: dict[str, Any] = {}
        if self._rewards:
            out[p + "rollout/reward_mean"] = float(np.mean(self._rewards))
        if self._cycles.get("emitted"):
            emitted = np.asarray(self._cycles["emitted"])
            time_s = np.asarray(self._cycles["draft_s"]) + np.asarray(self._cycles["verify_s"])
            out[p + "cycle/mean_accepted_length"] = float(emitted.mean())
            out[p + "cycle/tokens_per_s"] = float(emitted.sum() / time_s.sum()) if time_s.sum() > 0 else None
            out[p + "cycle/count"] = int(emitted.size)
            for k in ("depth", "size"):
                out[p + f"cycle/{k}"] = np.asarray(self._cycles[k])
                out[p + f"cycle/{k}_mean"] = float(np.mean(self._cycles[k]))
        return out

    def _on_rollout_end(self) -> None:
        metrics = self.rollout_metrics()
        if self.run_logger is not None and metrics:
            self.run_logger.log(metrics, step=self.num_timesteps)
