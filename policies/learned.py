"""LearnedController: a depth actor and/or a size actor as a Controller — PPO policies and exported ones alike.

The observation features (`specpilot.policies.observation`), the action meanings (depth: 0 CONTINUE / 1 STOP, where
STOP before drafting skips drafting; size: an index into `size_actions`) and the static fallback for a missing actor
(the depth_only / size_only ablations) live here once. Actors come from `specpilot.policies.actor.Actor`, built from
an SB3 policy (`specpilot.policies.ppo.PPOController`) or from exported safetensors
(`specpilot.policies.exported.load_exported`).
"""
from __future__ import annotations

from specpilot.drafting.control import Controller, FixedController, fits_tree
from specpilot.drafting.types import CycleRecord, DraftState
from specpilot.policies.actor import Actor
from specpilot.policies.observation import ObservationSpec

CONTINUE, STOP = 0, 1  # depth actions
DEPTH_ACTIONS = ["continue", "stop"]
PROBE_HIDDEN = (64, 64)  # the demo's actor layers (`specpilot.demo.DemoBudget.pi_arch`)


def check_actor(actor: Actor, spec: ObservationSpec | None, kind: str, n_actions: int) -> None:
    """An actor fits its observation spec and action list, or a ValueError says which does not."""
    if spec is None or spec.kind != kind:
        raise ValueError(f"{actor.source}: a {kind} policy needs a {kind} observation spec")
    if actor.in_features != spec.dim:
        raise ValueError(f"{actor.source}: the actor takes {actor.in_features} inputs but its {kind} observation "
                         f"spec produces {spec.dim} ({spec.scalar_start // spec.num_scores} x {spec.num_scores} "
                         f"scores/mask{'/depths' if spec.candidate_depths else ''} + {spec.num_scalars} scalars): "
                         "observation-spec mismatch (was the policy trained with another specpilot version?)")
    if actor.n_actions != n_actions:
        raise ValueError(f"{actor.source}: the actor has {actor.n_actions} actions but {n_actions} are expected")


class LearnedController(Controller):
    """Depth from `depth_actor` (CONTINUE / STOP, also asked before drafting: STOP there skips drafting), size from
    `size_actor` (an index into `size_actions`); whichever actor is None is decided by `fallback`."""

    name = "learned"
    label = "learned"  # what describe() reports for a part decided by an actor

    def __init__(self, depth_actor: Actor | None = None, size_actor: Actor | None = None,
                 depth_spec: ObservationSpec | None = None, size_spec: ObservationSpec | None = None,
                 size_actions: list[int] | None = None, fallback: Controller | None = None, *,
                 name: str | None = None) -> None:
        if depth_actor is None and size_actor is None:
            raise ValueError(f"{type(self).__name__} needs a depth actor, a size actor or both")
        self.depth_actor, self.size_actor = depth_actor, size_actor
        self.depth_spec = depth_spec if depth_actor is not None else None
        self.size_spec = size_spec if size_actor is not None else None
        self.size_actions = [int(v) for v in size_actions] if size_actor is not None and size_actions else None
        self.fallback = fallback if fallback is not None else FixedController()
        if name is not None:
            self.name = name
        if depth_actor is not None:
            check_actor(depth_actor, depth_spec, "depth", len(DEPTH_ACTIONS))
            depth_actor.prepare(depth_spec)
        if size_actor is not None:
            if not self.size_actions:
                raise ValueError("a size actor needs size_actions")
            check_actor(size_actor, size_spec, "size", len(self.size_actions))
            bad = [v for v in self.size_actions if not 1 <= v <= size_spec.num_scores]
            if bad:  # a size the policy cannot have observed: 0 verifies nothing, past num_scores it saw no scores
                raise ValueError(f"size_actions {self.size_actions}: {bad} outside 1..{size_spec.num_scores}, the "
                                 "candidates the size policy observes")
            size_actor.prepare(size_spec)

    @property
    def has_depth(self) -> bool:
        return self.depth_actor is not None

    @property
    def has_size(self) -> bool:
        return self.size_actor is not None

    def reset(self) -> None:
        self.fallback.reset()

    def skip_drafting(self, state: DraftState) -> bool:
        if self.depth_actor is None:
            return self.fallback.skip_drafting(state)
        return self.depth_actor.decide(state, self.depth_spec) == STOP

    def should_stop(self, state: DraftState) -> bool:
        if self.depth_actor is None:
            return self.fallback.should_stop(state)
        return self.depth_actor.decide(state, self.depth_spec) == STOP

    def choose_size(self, state: DraftState) -> int:
        if self.size_actor is None:
            return self.fallback.choose_size(state)
        return self.size_actions[self.size_actor.decide(state, self.size_spec)]

    def observe(self, record: CycleRecord) -> None:
        self.fallback.observe(record)

    def check_tree(self, tree) -> None:
        """The actors read scores laid out for the tree they were trained on, and a size action past the tree's
        max_size would be clipped: another tree is refused, naming the one the policies need."""
        for spec in (self.depth_spec, self.size_spec):
            if spec is not None and (spec.width, spec.max_depth) != (tree.width, tree.max_depth):
                raise ValueError(f"{self.name}: its {spec.kind} policy observes trees of width {spec.width} and "
                                 f"max_depth {spec.max_depth}, but the decoder's tree has width {tree.width} and "
                                 f"max_depth {tree.max_depth}: decode with the tree it was trained for (a run's "
                                 "manifest or an export's decoder.json names it), or train a policy for this tree")
        if self.size_actions and max(self.size_actions) > tree.max_size:
            raise ValueError(f"{self.name}: its size policy verifies up to {max(self.size_actions)} candidates, more "
                             f"than the tree's max_size {tree.max_size}: use a TreeConfig with max_size >= "
                             f"{max(self.size_actions)}")
        parts = tuple(part for part, learned in (("depth", self.has_depth), ("size", self.has_size)) if not learned)
        if isinstance(self.fallback, FixedController):
            self.fallback.check_tree(tree, parts=parts)
        elif parts:
            fits_tree(self.fallback, tree)

    def actor_questions(self) -> frozenset[str]:
        return frozenset(({"skip", "stop"} if self.has_depth else set()) | ({"size"} if self.has_size else set()))

    def describe(self) -> dict:
        return {
            "name": self.name,
            "depth": self.label if self.has_depth else self.fallback.describe(),
            "size": self.label if self.has_size else self.fallback.describe(),
            "depth_spec": self.depth_spec.to_dict() if self.depth_spec else None,
            "size_spec": self.size_spec.to_dict() if self.size_spec else None,
            "size_actions": self.size_actions,
        }


def probe_controller(width: int, max_depth: int, size_actions: list[int], *, hidden: tuple[int, ...] = PROBE_HIDDEN,
                     seed: int = 0) -> LearnedController:
    """A LearnedController with random tanh actors of `hidden` layers for both questions, whose answers nobody
    uses: the latency profile times its decisions right after the decoder's own steps (`envs.profile`), where a
    trained policy of that size decides, so replay can charge what deciding costs on this machine."""
    import torch

    gen = torch.Generator().manual_seed(int(seed))

    def actor(n_in: int, n_out: int) -> Actor:
        layers, sizes = [], [n_in, *hidden, n_out]
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(("linear", torch.randn(b, a, generator=gen) / a ** 0.5, torch.zeros(b)))
            if i < len(sizes) - 2:
                layers.append(("activation", "tanh", {}))
        return Actor(layers, source="decision-time probe")

    depth_spec = ObservationSpec.for_depth(width, max_depth)
    size_spec = ObservationSpec.for_size(width, max_depth, size_actions)
    return LearnedController(actor(depth_spec.dim, len(DEPTH_ACTIONS)), actor(size_spec.dim, len(size_actions)),
                             depth_spec, size_spec, list(size_actions), name="probe")
