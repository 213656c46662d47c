"""The draft-and-verify cycle, written once, over any session that implements the step protocol.

A session is one prompt's generation advanced step by step. `DecodingSession` (live models, drafting/decoder.py) and
`ReplaySession` (a recorded trace and a latency profile, envs/replay.py) implement the same protocol:

    session.done                  the generation finished (EOS or max_new_tokens)
    session.finished_by           "eos" | "length" once done, else None
    session.prompt_len            tokens of the prompt
    session.tokens_emitted        new tokens emitted so far
    session.can_draft             False when nothing can be drafted this cycle (an EAGLE head before the target has
                                  produced any feature): a plain step, no questions
    session.max_depth             most draft levels in this cycle (a live session's shrinks where the context ends)
    session.clock.now()           the clock decisions are timed with
    session.cycle_state()         the DraftState before drafting (depth 0)
    session.draft_level()         one draft forward -> DraftState (depth + 1)
    session.rank_candidates()     sort the candidates for verification (timed as drafting)
    session.verify(size)          one target forward over the top-`size` candidates -> CycleRecord; size 0 with
                                  nothing drafted is a plain target step (one token, no draft forward)
    session.add_policy_time(s)    charge decision time to the current cycle (CycleRecord.policy_s; the cycle time
                                  CycleRecord.cycle_s = draft_s + verify_s excludes it)

`cycle_steps(session)` is the cycle as a generator of questions: ("skip", state) before drafting (answer True to
skip drafting: the target takes one plain step), ("stop", state) after every level below max_depth (answer True to
stop drafting), then ("size", state) (answer the number of candidates to verify, >= 1). It returns the CycleRecord.
`run_cycle` answers the questions with controllers (`generate()`, replay evaluation, profiling, export checks);
the Gymnasium environments answer the agent's questions with its actions and the rest with a partner controller.
"""
from __future__ import annotations

from typing import Any, Generator, Protocol, runtime_checkable

import numpy as np

from specpilot.drafting.types import CycleRecord, DraftState

SKIP, STOP, SIZE = "skip", "stop", "size"
Question = tuple[str, DraftState]


@runtime_checkable
class Session(Protocol):
    """The step protocol (see the module docstring); DecodingSession and ReplaySession implement all of it."""

    max_depth: int
    clock: Any

    @property
    def done(self) -> bool: ...

    @property
    def finished_by(self) -> str | None: ...

    @property
    def prompt_len(self) -> int: ...

    @property
    def tokens_emitted(self) -> int: ...

    @property
    def can_draft(self) -> bool: ...

    def cycle_state(self) -> DraftState: ...

    def draft_level(self) -> DraftState: ...

    def rank_candidates(self) -> None: ...

    def verify(self, size: int) -> CycleRecord: ...

    def add_policy_time(self, seconds: float) -> None: ...


def check_size(size: Any, who: str = "the controller") -> int:
    """A verification size as an int >= 1, or a clear error naming who returned it."""
    if isinstance(size, bool) or not hasattr(size, "__index__") or int(size) < 1:
        raise ValueError(f"{who} chose verification size {size!r}; it must be an integer >= 1 (the number of "
                         "drafted candidates to verify)")
    return int(size)


def check_answer(answer: Any, controller, method: str) -> bool:
    """A yes/no answer as a bool: True, False or a numpy bool. Anything else is a TypeError naming the method: bool()
    would take the string "no" (or a 1-element tensor, or None) for an answer and draft as it never meant."""
    if answer is True or answer is False:
        return answer
    if isinstance(answer, np.bool_):
        return bool(answer)
    who = type(getattr(controller, "inner", controller)).__name__  # a duck-typed one's own class, not its wrapper
    raise TypeError(f"{who}.{method} returned {answer!r} ({type(answer).__name__}); it must return True or False")


def cycle_steps(session: Session) -> Generator[Question, Any, CycleRecord]:
    """One cycle as questions (see the module docstring); returns the cycle's CycleRecord."""
    if not session.can_draft or (yield SKIP, session.cycle_state()):
        return session.verify(0)
    state = session.draft_level()
    while state.depth < session.max_depth:
        if (yield STOP, state):
            break
        state = session.draft_level()
    session.rank_candidates()
    size = yield SIZE, state
    return session.verify(check_size(size))


def run_cycle(session: Session, depth_controller, size_controller=None) -> CycleRecord:
    """Run one cycle with `depth_controller.skip_drafting` / `should_stop` and `size_controller.choose_size`
    (default: the depth controller) answering, their time charged to the cycle; then both `observe` the record."""
    size_controller = depth_controller if size_controller is None else size_controller
    clock = session.clock
    steps = cycle_steps(session)
    answer = None
    while True:
        try:
            question, state = steps.send(answer)  # the first send(None) starts the cycle
        except StopIteration as end:
            record = end.value
            break
        t0 = clock.now()
        if question == STOP:
            answer = check_answer(depth_controller.should_stop(state), depth_controller, "should_stop")
        elif question == SKIP:
            answer = check_answer(depth_controller.skip_drafting(state), depth_controller, "skip_drafting")
        else:
            answer = size_controller.choose_size(state)
            if isinstance(answer, bool) or not hasattr(answer, "__index__") or int(answer) < 1:
                check_size(answer, f"{type(size_controller).__name__}.choose_size")
        session.add_policy_time(clock.now() - t0)
    t0 = clock.now()
    depth_controller.observe(record)
    if size_controller is not depth_controller:
        size_controller.observe(record)
    session.add_policy_time(clock.now() - t0)  # charged to the next cycle
    return record


def run_generation(session: Session, depth_controller, size_controller=None) -> list[CycleRecord]:
    """Cycles until the session is done (controllers are reset first)."""
    depth_controller.reset()
    if size_controller is not None and size_controller is not depth_controller:
        size_controller.reset()
    records = []
    while not session.done:
        records.append(run_cycle(session, depth_controller, size_controller))
    return records
