"""Ray workers that hold a model pair each, and a pool that runs work units on them with retries: the Ray executor.

    with WorkerPool(PairSpec(target="t", draft="d"), workers=8) as pool:        # after connect("auto")
        record_task(None, tree, prompts, "out/", executor=pool)                  # any orchestrator, any job

- `PairSpec`: what a worker needs to load its own pair (paths or the embedded pair, an optional EAGLE head,
  device, dtype, threads). Small and picklable: it travels to the workers, the models do not.
- `connect(address)`: "local" starts Ray on this machine, "auto" joins the running cluster, anything else is a
  cluster address. Ray is imported here, inside functions: `import specpilot...` never imports it.
- `PairWorker`: the body of one Ray actor. It loads the pair on its device (`num_gpus=1` on GPU clusters, which
  Ray maps to a GPU of its own; CPU workers take `threads` cores) and runs work units `fn(worker, **payload)`
  (`specpilot.drafting.executor`); it can also host one live environment (`specpilot.train.scale.ray_vecenv`).
- `WorkerPool`: N actors in a placement group of N bundles, so N workers land on N GPUs (or N x threads cores).
  `map` hands each idle worker the next task; a task that raises, or whose worker dies (Ray restarts the
  actor, which reloads its pair), is retried once and reported in `ShardOutcome.retried`.

The orchestrators (`specpilot.envs.record.record_task`, `specpilot.train.grid.search.grid_search`,
`specpilot.eval.runner.evaluate`) plan the tasks and merge what they return, the same way as in one process.
"""
from __future__ import annotations

import os
import sys
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from specpilot.drafting.executor import ShardOutcome, ShardTask, describe_worker

LOCAL, AUTO = "local", "auto"
MAX_RESTARTS = 2  # Ray restarts a dead worker (which reloads its pair) this many times
FAULT_MODES = ("exit", "raise")


class ClusterError(RuntimeError):
    """The cluster cannot do what was asked (no Ray, too few resources, a shard failed twice); says what to do."""


def import_ray():
    """The `ray` module, or a ClusterError saying how to install it. Unless the environment says otherwise, workers'
    lines reach the driver each as printed (Ray would fold the workers' progress lines into "[repeated 2x across
    cluster]", read at import) and without colour codes when the output is not a terminal (a log file)."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    use_found_token()  # read by Ray's core when it loads
    try:
        import ray
    except ImportError as err:
        raise ClusterError("Ray is not installed: `pip install 'specpilot[ray]'` (on every node of the cluster), "
                           "or run without --ray") from err
    return ray


def connect(address: str = LOCAL, *, num_cpus: int | None = None, num_gpus: int | None = None) -> dict:
    """Join or start Ray and return its resources. `address`: "local" (start Ray here with `num_cpus`/`num_gpus`),
    "auto" (the cluster `ray start` set up on this node) or "host:port" / "ray://host:port". A Ray already
    initialised in this process is reused as it is."""
    ray = import_ray()
    if not ray.is_initialized():
        if address not in (LOCAL, "auto"):
            _check_reachable(address)  # before ray.init, which retries for minutes printing client errors
        quiet = dict(include_dashboard=False, logging_level="WARNING", log_to_driver=True)
        try:
            with interrupts_held("Ray has started", then=shutdown):  # a half-started Ray orphans its agents
                if address == LOCAL:
                    ray.init(num_cpus=num_cpus, num_gpus=num_gpus, **quiet)
                else:
                    ray.init(address=address, **quiet)
        except ConnectionError as err:
            if address not in (LOCAL, "auto"):  # something answered gRPC there (_check_reachable), and refused us
                raise ClusterError(f"a Ray cluster answers at {address!r} but this process could not join it ({err}):"
                                   " with token authentication (the default of `ray start` in recent Ray) give its "
                                   "token (RAY_AUTH_TOKEN, or ~/.ray/auth_token as on the head node), or run with "
                                   "--ray auto on a node of the cluster; else check the Ray version and the port"
                                   ) from err
            raise ClusterError(f"cannot reach a Ray cluster at {address!r} ({err}): start one with `ray start "
                               "--head` (and `ray start --address HEAD:6379` on the other nodes), or use "
                               "--ray local") from err
    return dict(ray.cluster_resources())


@contextmanager
def interrupts_held(until: str, *, then: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold Ctrl-C (SIGINT), and SIGTERM where a Python handler takes it (the CLI's), while the block runs, then run
    `then` and interrupt as the held signal's handler does: Ray interrupted while it starts leaves its agents
    running, or crashes at exit. A second signal interrupts at once. The handlers are put back after the block, so
    one the block replaced is undone (ray.init installs its own SIGTERM handler, which would exit with code 15,
    skipping train's checkpoint). Outside the main thread (where Python delivers no signals) the block just runs;
    an ignored SIGINT stays ignored."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # no signal reaches this thread
        return
    # a process that ignores Ctrl-C (started in the background by a script) keeps ignoring it; SIGTERM is then the
    # signal that reaches it, and its handler is held and put back all the same
    signals = ([signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else []) + \
        ([signal.SIGTERM] if callable(signal.getsignal(signal.SIGTERM)) else [])
    previous = {signum: signal.getsignal(signum) for signum in signals}
    held: list[int] = []

    def hold(signum, frame) -> None:
        if held:
            for number, handler in previous.items():
                signal.signal(number, handler)
            raise KeyboardInterrupt
        held.append(signum)
        print(f"interrupted: stopping once {until} (Ctrl-C again to stop now)", file=sys.stderr, flush=True)

    for signum in signals:
        signal.signal(signum, hold)
    failed = None
    try:
        yield
    except Exception as err:  # the block failed too: a held Ctrl-C is still what the user asked for
        if not held:
            raise
        failed = err
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if held:
        if then is not None:
            try:
                then()
            except Exception:  # noqa: BLE001 - after a failed block the interrupt is the news, not the clean-up
                if failed is None:
                    raise
        handler = previous.get(held[0])
        if callable(handler) and handler is not signal.default_int_handler:
            handler(held[0], None)  # the CLI's SIGTERM handler: it raises KeyboardInterrupt and notes the signal
        raise KeyboardInterrupt from failed


def use_found_token() -> None:
    """Join a cluster by address with the token Ray would use to join it as `auto` (set before Ray is imported): a
    cluster from `ray start` asks for one (token authentication, on by default in recent Ray), and Ray sends it only
    when RAY_AUTH_MODE=token, which it sets by itself for `auto` and `local` alone. Nothing changes when
    RAY_AUTH_MODE is set or no token is found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)."""
    if "RAY_AUTH_MODE" in os.environ or "ray" in sys.modules:  # a loaded Ray keeps the mode it read: changing the
        return                                                # variable now would start servers it cannot join
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or \
            (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def _check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """ClusterError in one line when nothing listens at "host:port" / "ray://host:port", or when what listens there
    does not speak gRPC (Ray's GCS and its client server do): ray.init would retry such an address for ~15 minutes.
    With RAY_USE_TLS set only the connection is checked (the gRPC probe is plain text)."""
    import socket

    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"--ray {address!r} is not an address: give local, auto, HOST:PORT or ray://HOST:PORT")
    how = ("start one with `ray start --head` (and `ray start --address HEAD:6379` on the other nodes), or use "
           "--ray local")
    tls = os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true", "yes")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
            answer = tls or _http2_handshake(conn)  # a TLS cluster answers only a TLS handshake: Ray's own to make
    except OSError as err:
        raise ClusterError(f"cannot reach a Ray cluster at {address!r} ({err.strerror or err}): {how}") from None
    if not answer:
        raise ClusterError(f"something listens at {address!r} but it is not a Ray cluster (it does not answer "
                           f"gRPC): check the port (`ray start --head` prints the address, 6379 by default), or "
                           f"{how}")


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HTTP2_SETTINGS = 0x4  # frame type a gRPC server sends first after the client's preface (RFC 9113, 3.4)


def _http2_handshake(conn) -> bool:
    """True when the server on `conn` answers the HTTP/2 client preface and an empty SETTINGS frame with a SETTINGS
    frame, as every gRPC server does; False for anything else (an HTTP/1 server, a closed or silent socket)."""
    header = b""
    try:
        conn.sendall(HTTP2_PREFACE + bytes([0, 0, 0, HTTP2_SETTINGS, 0, 0, 0, 0, 0]))
        while len(header) < 9:  # a frame header: 3 bytes length, 1 byte type, 1 flags, 4 stream id
            chunk = conn.recv(9 - len(header))
            if not chunk:
                break
            header += chunk
    except OSError:  # a timeout (a silent server), or one that resets the connection
        return False
    return len(header) == 9 and header[3] == HTTP2_SETTINGS


def shutdown() -> None:
    """Stop this process's connection to Ray (and the local Ray that `connect("local")` started)."""
    ray = import_ray()
    if ray.is_initialized():
        ray.shutdown()


@dataclass(frozen=True)
class PairSpec:
    """How a worker loads its pair. target/draft: paths or hub ids, both None for the embedded pair; eagle: an
    EAGLE-3 head path (passed to `ModelPair.from_pretrained` only when given); device: None = "cuda" on a GPU
    worker, else "cpu"; dtype: None = the device's default; threads: torch intra-op threads of the worker."""

    target: str | None = None
    draft: str | None = None
    eagle: str | None = None
    device: str | None = None
    dtype: str | None = None
    threads: int = 1
    dtype_source: str | None = None  # where an explicit dtype came from (ModelPair.from_pretrained's dtype_source)

    def __post_init__(self) -> None:
        if self.target is not None and self.draft is None and self.eagle is None:
            raise ValueError("PairSpec with a target needs its drafter: draft (a draft LM) or eagle (an EAGLE-3 head)")
        if self.draft is not None and self.eagle is not None:
            raise ValueError("PairSpec takes draft or eagle, not both")
        if int(self.threads) < 1:
            raise ValueError(f"PairSpec.threads must be >= 1, got {self.threads}")
        for name in ("target", "draft", "eagle"):  # a worker may start in another directory: local paths absolute
            value = getattr(self, name)
            if value is not None and value != "embedded" and Path(str(value)).expanduser().exists():
                object.__setattr__(self, name, str(Path(str(value)).expanduser().absolute()))

    def load(self):
        """The ModelPair on this process's device (called on the worker)."""
        import torch

        from specpilot.drafting.pair import ModelPair

        torch.set_num_threads(int(self.threads))
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        extra = {"eagle": self.eagle} if self.eagle is not None else {}
        return ModelPair.from_pretrained(self.target, self.draft, device=device, dtype=self.dtype,
                                         dtype_source=self.dtype_source, **extra)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------------------
# the worker (a Ray actor: `ray.remote(PairWorker)` in WorkerPool)


class PairWorker:
    """Holds one pair on one device and runs shards on it. Methods are called remotely by WorkerPool."""

    def __init__(self, spec: PairSpec, index: int) -> None:
        self.spec, self.index = spec, index
        self.pair = spec.load()
        self.env = None
        self._warm: set[str] = set()

    def describe(self) -> dict:
        """Where this worker runs (`describe_worker`, with its Ray GPU ids and node)."""
        import ray

        return describe_worker(self.pair, self.index, gpu_ids=[str(g) for g in ray.get_gpu_ids()],
                               node_ip=ray.util.get_node_ip_address())

    def run(self, fn: Callable[..., Any], payload: dict, fault: str | None = None) -> Any:
        """The work unit `fn(self, **payload)` (see `specpilot.drafting.executor`). `fault` is a test hook: "exit"
        kills this worker's process, "raise" fails the task (WorkerPool passes it only on a task's first attempt,
        when asked to)."""
        if fault == "exit":
            os._exit(1)
        if fault == "raise":
            raise RuntimeError("fault injected by WorkerPool(inject_fault=...)")
        return fn(self, **payload)

    def first(self, what: str) -> bool:
        """True the first time this worker process does `what` (its warm-up is then run, and not kept)."""
        first = what not in self._warm
        self._warm.add(what)
        return first

    def say(self, msg: str) -> None:
        print(f"[worker {self.index}]", msg, flush=True)  # Ray forwards a worker's stdout to the driver

    # -- one live environment (specpilot.train.scale.ray_vecenv.RayVecEnv) -----------------------------------------------
    def env_make(self, env_fn: Callable[[Any], Any]) -> tuple:
        """Build this worker's environment as env_fn(pair) on its own pair (Monitor-wrapped, as SB3's DummyVecEnv
        wraps it); return its spaces and metadata."""
        from stable_baselines3.common.monitor import Monitor

        if self.env is not None:
            self.env.close()
        self.env = Monitor(env_fn(self.pair))
        return self.env.observation_space, self.env.action_space, self.env.metadata

    def env_reset(self, seed: int | None, options: dict | None) -> tuple:
        return self.env.reset(seed=seed, **({"options": options} if options else {}))

    def env_step(self, action) -> tuple:
        """One step in SB3's VecEnv convention: (obs, reward, done, info, reset_info), resetting at episode end."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        done = terminated or truncated
        info["TimeLimit.truncated"] = truncated and not terminated
        reset_info: dict = {}
        if done:
            info["terminal_observation"] = obs
            obs, reset_info = self.env.reset()
        return obs, reward, done, info, reset_info

    def env_call(self, op: str, name: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        """get / set / method / is_wrapped / has on the environment (SB3's VecEnv attribute API)."""
        from stable_baselines3.common.env_util import is_wrapped

        if op == "get":
            return self.env.get_wrapper_attr(name)
        if op == "has":
            return self.env.has_wrapper_attr(name)
        if op == "set":
            return setattr(self.env, name, args[0])
        if op == "method":
            return self.env.get_wrapper_attr(name)(*args, **(kwargs or {}))
        if op == "is_wrapped":
            return is_wrapped(self.env, args[0])
        raise ValueError(f"unknown env_call op {op!r}")

    def env_close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


# ---------------------------------------------------------------------------------------------------------------------
# the pool


class WorkerPool:
    """N PairWorker actors in one placement group (one bundle each: 1 GPU + `threads` CPUs on GPU clusters,
    `threads` CPUs otherwise, reserved by the bundle: the actors themselves request no CPU): the Ray executor of
    `specpilot.drafting.executor` (`map`, `workers`, `device`). Call `connect()` first. Use as a context manager,
    or call close().

    gpus: True / False, or None = use GPUs when the cluster has at least `workers` of them.
    inject_fault: test hook {"shard": i, "mode": "exit" | "raise"}: shard i's first attempt kills its worker
    process (Ray restarts it) or raises; either way the shard is retried.
    """

    def __init__(self, spec: PairSpec, *, workers: int, gpus: bool | None = None, strategy: str = "PACK",
                 ready_timeout_s: float = 600.0, inject_fault: dict | None = None) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            raise ClusterError("Ray is not connected: call specpilot.train.scale.cluster.connect(address) first")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if inject_fault is not None and inject_fault.get("mode") not in FAULT_MODES:
            raise ValueError(f"inject_fault mode must be one of {FAULT_MODES}, got {inject_fault}")
        resources = ray.cluster_resources()
        self.gpus = bool(resources.get("GPU", 0) >= workers) if gpus is None else bool(gpus)
        self.spec = spec if spec.device or not self.gpus else PairSpec(**{**spec.to_dict(), "device": "cuda"})
        bundle = {"CPU": float(spec.threads), **({"GPU": 1.0} if self.gpus else {})}
        self.bundle, self.inject_fault = bundle, inject_fault
        short = {k: v * workers for k, v in bundle.items() if v * workers > resources.get(k, 0)}
        if short:  # fail now rather than wait for resources the cluster does not have at all
            raise ClusterError(f"{workers} workers of {bundle} need {short} but the cluster has {dict(resources)}: "
                               "lower --workers or --threads, or add nodes")
        self.placement = placement_group([dict(bundle) for _ in range(workers)], strategy=strategy)
        try:
            self._start(workers, bundle, resources, ready_timeout_s)
        except BaseException:  # a refusal, a worker that cannot load its pair, Ctrl-C: leave nothing placed
            self.close()
            raise
        self.deaths = [0] * workers
        self._recovering: dict[Any, tuple[int, int]] = {}  # probe ref -> (worker, tries): restarting actors

    def _start(self, workers: int, bundle: dict, resources: dict, ready_timeout_s: float) -> None:
        """Wait for the placement group, then start the actors and wait until each has loaded its pair."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        try:
            ray.get(self.placement.ready(), timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"the cluster cannot place {workers} workers of {bundle} within {ready_timeout_s:.0f}s"
                               f" (it has {dict(resources)}): lower --workers or --threads, or add nodes") from None
        actor = ray.remote(PairWorker)
        self.actors = [actor.options(num_cpus=0, num_gpus=1 if self.gpus else 0, max_restarts=MAX_RESTARTS,
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, i))
                       .remote(self.spec, i) for i in range(workers)]
        try:
            self.workers = ray.get([a.describe.remote() for a in self.actors])
        except ray.exceptions.RayError as err:
            raise ClusterError(f"a worker could not load its pair {self.spec}: {err}") from err

    def __len__(self) -> int:
        return len(self.actors)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill the actors and free their placement group."""
        import ray

        for a in getattr(self, "actors", []):
            ray.kill(a, no_restart=True)
        self.actors = []
        if getattr(self, "placement", None) is not None:
            ray.util.remove_placement_group(self.placement)
            self.placement = None

    @property
    def device(self) -> str:
        return self.workers[0]["device"]

    def _fault(self, task: ShardTask, attempt: int) -> str | None:
        f = self.inject_fault
        return f["mode"] if f is not None and attempt == 0 and int(f["shard"]) == task.shard else None

    def map(self, fn: Callable[..., Any], tasks: list[ShardTask], *, retries: int = 1,
            on_done: Callable[[ShardTask, ShardOutcome], None] | None = None,
            progress: Callable[[str], None] | None = None) -> list[ShardOutcome]:
        """Run `fn(worker, **task.payload)` for every task on the next idle worker; return outcomes in task order. A failed shard (an exception,
        or its worker died) is retried up to `retries` times; `on_done` is called as each shard finishes (write
        it to disk there, so an interrupted run can resume). Raises ClusterError when a shard fails for good."""
        import ray

        say = progress or (lambda msg: None)
        queue = deque((t, 0, None) for t in tasks)
        busy = {w for w, _ in self._recovering.values()}
        idle = deque(w for w in range(len(self.actors)) if w not in busy)
        running: dict[Any, tuple[ShardTask, int, int, str | None]] = {}
        outcomes: dict[int, ShardOutcome] = {}
        started = time.perf_counter()
        while queue or running:
            while queue and idle:
                task, attempt, reason = queue.popleft()
                w = idle.popleft()
                ref = self.actors[w].run.remote(fn, task.payload, self._fault(task, attempt))
                running[ref] = (task, attempt, w, reason)
            if not running and not self._recovering:
                raise ClusterError("every worker died more often than Ray restarts it; check the workers' logs "
                                   "(`ray logs`) and rerun: finished shards are kept")
            (ref,), _ = ray.wait(list(running) + list(self._recovering), num_returns=1)
            if ref in self._recovering:
                self._probe(ref, idle)
                continue
            task, attempt, w, reason = running.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayError as err:
                died = isinstance(err, ray.exceptions.RayActorError)
                self.deaths[w] += died
                if not died:
                    idle.append(w)
                elif self.deaths[w] <= MAX_RESTARTS:  # Ray restarts it: wait until it answers before reusing it
                    self._recovering[self.actors[w].describe.remote()] = (w, 0)
                why = f"worker {w} {'died' if died else 'raised'}: {_first_line(err)}"
                if attempt >= retries:
                    raise ClusterError(f"shard {task.shard} (prompts {task.prompts}) failed {attempt + 1} times; "
                                       f"last: {why}. Finished shards are kept: rerun the same command to resume"
                                       ) from err
                say(f"shard {task.shard}: {why}; retrying prompts {task.prompts}")
                queue.append((task, attempt + 1, why))
                continue
            idle.append(w)
            outcome = ShardOutcome(task.shard, result, self.workers[w], attempt + 1, reason)
            outcomes[task.shard] = outcome
            if on_done is not None:
                on_done(task, outcome)
            say(f"shard {task.shard} done on worker {w} ({len(outcomes)}/{len(tasks)}, "
                f"{time.perf_counter() - started:.1f}s)")
        return [outcomes[t.shard] for t in tasks]

    def _probe(self, ref, idle: deque) -> None:
        """A restarting worker's `describe` probe returned: idle again when it answered, else probe again (a
        restart reloads the pair: up to ~10 minutes), else give the worker up."""
        import ray

        w, tries = self._recovering.pop(ref)
        try:
            self.workers[w] = ray.get(ref)
            idle.append(w)
        except ray.exceptions.RayActorError:
            if tries < 1200:
                time.sleep(0.5)
                self._recovering[self.actors[w].describe.remote()] = (w, tries + 1)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    tail = [line for line in text if line.strip()]
    return (tail[-1] if tail else type(err).__name__)[:300]
