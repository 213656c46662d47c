"""The checks an export runs on itself: the policies' choices on recorded or live states, decision latency, and
agreement between the exported actors and the SB3 ones (`train/export/writer.py` writes the results into decoder.json)."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from specpilot.drafting.control import Controller
from specpilot.drafting.cycle_math import clip_size
from specpilot.drafting.types import DraftState, TreeConfig
from specpilot.envs.spaces import observation_space
from specpilot.eval.suites import load_suite
from specpilot.policies.actor import Actor
from specpilot.policies.observation import ObservationSpec, observe


def synthetic_states(tree: TreeConfig, n: int, *, seed: int = 0, max_new_tokens: int = 128,
                     max_context: int = 4096) -> list[DraftState]:
    """Plausible DraftStates for `tree` (cumulative log-prob scores that fall with depth, random history and
    scalars, some before drafting): for latency and agreement checks when no recorded states are available."""
    rng = np.random.default_rng(seed)
    W = tree.width
    states = []
    for _ in range(n):
        depth = int(rng.integers(0, tree.max_depth + 1))
        levels = [np.sort(-rng.exponential(0.4 + 0.6 * level, size=W if level == 1 else W * W))[::-1]
                  for level in range(1, depth + 1)]
        states.append(DraftState.from_levels(
            levels, max_depth=tree.max_depth, width=W, context_len=int(rng.integers(1, int(max_context * 1.2))),
            last_top_prob=float(rng.uniform(0.01, 1.0)) if depth else 1.0,
            last_entropy=float(rng.uniform(0.0, 4.0)) if depth else 0.0,
            new_tokens=int(rng.integers(0, max_new_tokens)), max_new_tokens=max_new_tokens,
            prev_accepted=int(rng.integers(0, tree.max_depth + 1)), prev_depth=int(rng.integers(0, tree.max_depth + 1)),
            acceptance=float(rng.uniform(0.0, 1.0))))
    return states


class RecordingController(Controller):
    """Wraps a controller and records what it saw and chose: every DraftState (up to `keep` of them), per cycle the
    depth and effective verified size, per should_stop call (top-child probability, stopped)."""

    def __init__(self, inner: Controller, max_size: int, keep: int = 4000) -> None:
        self.inner, self.max_size, self.keep = inner, int(max_size), int(keep)
        self.name = inner.name
        self.states: list[DraftState] = []
        self.depths: list[int] = []
        self.sizes: list[int] = []
        self.stop_top_probs: list[float] = []
        self.stops: list[bool] = []

    def _keep(self, state: DraftState) -> None:
        if len(self.states) < self.keep:
            self.states.append(state.detached())  # every feature kept (history included), no tree kept alive

    def reset(self) -> None:
        self.inner.reset()

    def skip_drafting(self, state: DraftState) -> bool:
        self._keep(state)
        return bool(self.inner.skip_drafting(state))

    def should_stop(self, state: DraftState) -> bool:
        self._keep(state)
        stop = bool(self.inner.should_stop(state))
        self.stop_top_probs.append(float(state.last_top_prob))
        self.stops.append(stop)
        return stop

    def choose_size(self, state: DraftState) -> int:
        self._keep(state)
        size = int(self.inner.choose_size(state))
        self.depths.append(int(state.depth))
        self.sizes.append(clip_size(size, state.num_candidates, self.max_size))
        return size

    def observe(self, record) -> None:
        self.inner.observe(record)

    def choices(self) -> dict:
        return {"depths": self.depths, "sizes": self.sizes, "stop_top_probs": self.stop_top_probs,
                "stops": self.stops}


def record_choices_replay(controller: Controller, tree: TreeConfig, trace: Path) -> tuple[RecordingController, str]:
    from specpilot.envs.oracle import replay_controller

    recorder = RecordingController(controller, tree.max_size)
    replay_controller(trace, None, recorder)
    return recorder, f"replay of trace {trace}"


def record_choices_live(controller: Controller, tree: TreeConfig, pair, *, num_prompts: int = 4,
                        max_new_tokens: int = 48, seed: int = 0) -> tuple[RecordingController, str]:
    """A few greedy generations with the exported controller (validation prompts; random ids without a tokenizer)."""
    from specpilot.drafting.decoder import SpeculativeDecoder

    if pair.tokenizer is not None:
        prompts = [p.prompt for p in load_suite("validation")[:num_prompts]]
        source = f"{len(prompts)} live generations on validation prompts"
    else:
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, pair.vocab_size, (8,), generator=gen).tolist() for _ in range(num_prompts)]
        source = f"{len(prompts)} live generations on random-token prompts (the pair has no tokenizer)"
    recorder = RecordingController(controller, tree.max_size)
    decoder = SpeculativeDecoder(pair, tree)
    for prompt in prompts:
        decoder.generate(prompt, controller=recorder, max_new_tokens=max_new_tokens)
    return recorder, source


def decision_latency_us(controllers: dict[str, Controller], states: list[DraftState], *, repeats: int = 5) -> dict:
    """{name: {"depth": {...}, "size": {...}}}: microseconds per should_stop / choose_size decision (features
    included) over `states`. Passes alternate between the controllers (so background load hits them alike); each
    figure is the best pass's mean / median, after a warm-up."""
    out: dict = {name: {} for name in controllers}
    for label in ("depth", "size"):
        fns = {name: (c.should_stop if label == "depth" else c.choose_size) for name, c in controllers.items()}
        for fn in fns.values():
            for state in states[:50]:
                fn(state)  # warm-up
        best = {name: (float("inf"), float("inf")) for name in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                times = []
                for state in states:
                    t0 = time.perf_counter_ns()
                    fn(state)
                    times.append(time.perf_counter_ns() - t0)
                mean, median = sum(times) / len(times) / 1e3, statistics.median(times) / 1e3
                best[name] = (min(best[name][0], mean), min(best[name][1], median))
        for name, (mean, median) in best.items():
            out[name][label] = {"mean_us": round(mean, 2), "median_us": round(median, 2), "n": len(states)}
    return out


def sb3_actions(policy, obs: np.ndarray) -> np.ndarray:
    """SB3's deterministic actions, through the same path PPOController uses (features -> actor -> argmax)."""
    with torch.inference_mode():
        x = torch.as_tensor(obs, dtype=torch.float32)
        logits = policy.action_net(policy.mlp_extractor.forward_actor(policy.pi_features_extractor(x)))
        return logits.argmax(dim=1).numpy()


def agreement(policy, actor: Actor, spec: ObservationSpec, state_sets: dict[str, list[DraftState]], *,
              num_random: int = 10_000, seed: int = 0) -> dict:
    """{label: {"n", "same"}}: on how many observations the exported actor and the SB3 actor choose the same
    action, for each named list of DraftStates and for `num_random` uniform samples of the observation space
    ("random"). With observation normalisation, the SB3 side gets the same normalised inputs."""
    space = observation_space(spec)
    space.seed(seed)
    sets = {label: np.stack([observe(s, spec) for s in states]) for label, states in state_sets.items() if states}
    if num_random:
        sets["random"] = np.stack([space.sample() for _ in range(num_random)]).astype(np.float32)
    out = {}
    for label, obs in sets.items():
        sb3_in = torch.from_numpy(obs)
        if actor.obs_norm is not None:
            mean, std, clip = actor.obs_norm
            sb3_in = torch.clamp((sb3_in.double() - mean) / std, -clip, clip).float()
        a = actor.act_batch(obs)
        b = sb3_actions(policy, sb3_in.numpy())
        out[label] = {"n": int(len(obs)), "same": int((a == b).sum())}
    return out
