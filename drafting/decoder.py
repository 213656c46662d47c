"""The decoding loop: SpeculativeDecoder, its step-level DecodingSession, and the autoregressive baseline.

Everything that decodes — `generate()`, the Gymnasium environments, evaluation, exported decoders — drives the
same `DecodingSession` steps:

    session = decoder.start(prompt, max_new_tokens=..., temperature=...)   # prefill (not timed)
    while not session.done:
        state = session.draft_level()          # one draft forward -> DraftState (repeat while continuing)
        ...
        record = session.verify(size)          # one target forward over the top-`size` candidates -> CycleRecord

Invariant between cycles: the target's cache holds committed[:-1] and the last committed token is the root of the
next tree; the draft's cache holds a prefix of committed (it catches up in the next cycle's first forward).
Inference runs under `attention.decoding_mode` (torch.inference_mode(); on CUDA, SDPA without its cuDNN
backend); every clock read synchronises the device first.
"""
from __future__ import annotations

import torch

from specpilot.drafting.attention import MaskLayout, decoding_mode, model_mask
from specpilot.drafting.cache import cache_length, generation_cache, keep_positions, new_cache
from specpilot.drafting.checks import check_context, check_float, check_int, check_seed, warn_unused_sampling
from specpilot.drafting.control import FixedController, as_controller, fits_tree
from specpilot.drafting.cycle import run_generation
from specpilot.drafting.cycle_math import clip_size, level_bounds, num_candidates, update_acceptance
from specpilot.drafting.drafters import FeatureBuffer, aux_states, fuse_aux, make_drafter
from specpilot.drafting.generation_defaults import warn_generation_config
from specpilot.drafting.pair import ModelPair
from specpilot.drafting.sampling import draw, sample, sampling_probs
from specpilot.drafting.stopping import request_ending, truncate_emitted
from specpilot.drafting.timing import Clock
from specpilot.drafting.tree import TreeDrafter
from specpilot.drafting.types import CycleRecord, DraftState, GenerationOutput, TreeConfig
from specpilot.drafting.verify import (accept_greedy, accept_tree_recursive, accept_tree_sampled, block_inputs,
                                       near_tie_cut, select_block)

# most drafted nodes a tree may keep: its ancestor matrix is nodes^2 booleans (256 MiB at this size), and a tree this
# large verifies a tiny fraction of what it drafts (at most max_size)
MAX_TREE_NODES = 16_384


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed=None) -> None:
    """Sampling arguments as `generate` documents them, else TypeError / ValueError naming the argument."""
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_float("temperature", temperature, minimum=0.0)
    check_int("top_k (0 disables it)", top_k, minimum=0)
    check_float("top_p", top_p, minimum=0.0, maximum=1.0, open_low=True)
    if seed is not None:
        check_seed("seed", seed)
    warn_unused_sampling(temperature, top_k, top_p)


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


class DecodingSession:
    """One prompt's generation on the live models, advanced step by step: the step protocol of
    `specpilot.drafting.cycle` (see the module docstring for the cache invariant)."""

    def __init__(self, decoder: "SpeculativeDecoder", prompt: list[int], *, max_new_tokens: int,
                 temperature: float, top_k: int, top_p: float, seed: int | None, stop_strings=None,
                 stop_token_ids=None, ignore_eos: bool = False, streamer=None, drafting: bool = True) -> None:
        _check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
        pair, tree = decoder.pair, decoder.tree
        self.eos, self.stops, self.stop_ids = request_ending(pair, stop_strings, stop_token_ids, ignore_eos)
        self.streamer = streamer
        check_context(pair, len(prompt), max_new_tokens, 0)  # drafts shrink where the context ends (max_depth)
        self.pair, self.tree_config = pair, tree
        self.max_context = pair.max_context
        self.max_new_tokens = max_new_tokens
        self.sampling = (temperature, top_k, top_p) if temperature > 0 else None
        self.device = pair.device
        self.clock = Clock(self.device)
        self.generator = _generator(seed, self.device)
        self.committed: list[int] = list(prompt)
        self.prompt_len = len(prompt)
        self.new_tokens: list[int] = []
        self.cycles: list[CycleRecord] = []
        self.token_times: list[float] = []
        self.finished_by: str | None = None
        self.acceptance = 1.0
        # the greedy near-tie guard's width in rounding scales (0: off; never in sampled decoding)
        self.near_tie = tree.near_tie_units(pair.dtype) if self.sampling is None else 0.0
        self.near_ties = 0  # cycles the guard cut short
        self.drafter = TreeDrafter(make_drafter(pair), tree.width, tree.max_depth,
                                   sample=self.sampling is not None and tree.sampled_children)
        # drafting=False (a controller that never drafts, `Controller.may_draft`): a target-only session, plain steps
        # as autoregressive decoding takes them, without the drafter's prompt prefill or the EAGLE features
        # (together ~2% of a 48-token generation of the embedded pair on CPU)
        self.drafting = drafting
        self.needs_features = drafting and self.drafter.drafter.needs_features
        self.target_cache = new_cache(pair.target)
        self.target_mask_layout = MaskLayout.of(pair.target)
        # EAGLE: the target's aux hidden states, kept unfused: the fc runs once per cycle over the rows the head
        # reads, so a streak of plain steps costs no head work (~4% of a step on CPU)
        self._features = FeatureBuffer()
        self._draft_s = self._policy_s = 0.0
        self._level_s: list[float] = []
        self._fed = 0
        if streamer is not None:  # as generate() does: the prompt first (TextStreamer(skip_prompt=True) drops it)
            streamer.put(torch.tensor([prompt]))
        self.prefill_s = self._prefill(prompt)
        self.start_time = self.clock.now()

    def _prefill(self, prompt: list[int]) -> float:
        """Both caches take prompt[:-1] (the target's only in a target-only session; not timed as generation;
        returns its duration)."""
        with decoding_mode(self.device):
            t0 = self.clock.now()
            if len(prompt) > 1:
                ids = torch.tensor([prompt[:-1]], dtype=torch.long, device=self.device)
                out = self.pair.target(input_ids=ids, cache=self.target_cache, use_cache=True, logits_to_keep=1,
                                       output_hidden_states=self.needs_features)
                self._keep_features(out, None, 0)
                if self.drafting:
                    self.drafter.prefill(prompt[:-1], self._features_for(prompt[:-1]))
            return self.clock.now() - t0

    # -- target features for an EAGLE drafter ---------------------------------------------------------------------
    def _keep_features(self, out, rows, position: int) -> None:
        """Append the aux states of the target forward's `rows` (all when None), the first at `position`."""
        if not self.needs_features:
            return
        self._features.keep(aux_states(self.pair, out.hidden_states, rows), position)

    def _features_for(self, tokens: list[int]) -> torch.Tensor | None:
        """Features the drafter needs to feed these next committed tokens (each entry reads the feature of the
        token before it), then forget the ones no later token needs."""
        if not self.needs_features:
            return None
        # entry for committed token j reads the feature at position j - 1: the last of these tokens (index `end`)
        # reads end - 1, the first of the n with an entry reads end - n; the next token will read `end`
        end = self.drafter.committed + len(tokens) - 1
        return fuse_aux(self.pair, self._features.take(end, self.drafter.entries(tokens)))

    # -- state -------------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.finished_by is not None

    @property
    def tokens_emitted(self) -> int:
        return len(self.new_tokens)

    @property
    def depth(self) -> int:
        return self.drafter.tree.depth if self.drafter.tree is not None else 0

    @property
    def context_len(self) -> int:
        return len(self.committed)

    @property
    def max_depth(self) -> int:
        """Most draft levels this cycle: the tree's max_depth, fewer where the context ends sooner. A cycle verifies
        the last committed token and a draft of depth d at the d positions after it, so a prompt that fits for
        target-only decoding is decoded, its last cycles drafting shallower (as vLLM trims its speculative tokens
        at max_model_len) and, with no position left, taking plain steps."""
        return max(0, min(self.tree_config.max_depth, self.max_context - len(self.committed)))

    def add_policy_time(self, seconds: float) -> None:
        """Charge controller decision time to the current cycle (run_cycle does this for its controllers)."""
        self._policy_s += seconds

    def _state(self, tree, depth: int) -> DraftState:
        prev = self.cycles[-1] if self.cycles else None
        scores = None
        level_start = 0
        if tree is not None:
            level_start = level_bounds(self.tree_config.width, depth)[0]
            view = tree.scores_view if tree.scores_view is not None else tree.scores
            scores = view[: tree.size]
        return DraftState(
            depth=depth, max_depth=self.tree_config.max_depth, width=self.tree_config.width,
            context_len=len(self.committed),
            scores=scores, level_start=level_start,
            sorted_scores=tree.sorted_scores if tree is not None else None,
            sorted_ids=tree.sorted_ids if tree is not None else None,
            last_top_prob=self.drafter.last_top_prob if tree is not None else 1.0,
            last_entropy=self.drafter.last_entropy if tree is not None else 0.0,
            new_tokens=len(self.new_tokens), max_new_tokens=self.max_new_tokens,
            prev_accepted=prev.accepted if prev else 0, prev_depth=prev.depth if prev else 0,
            acceptance=self.acceptance)

    @property
    def can_draft(self) -> bool:
        """False for an EAGLE drafter whose whole context is one token (no target feature yet), where the
        context has no position left for a draft (max_depth 0), and in a target-only session (drafting=False)."""
        unseen = len(self.committed) - self.drafter.committed
        return self.drafting and self.max_depth > 0 and self.drafter.can_start(unseen)

    def cycle_state(self) -> DraftState:
        """The state before this cycle's first draft forward (depth 0)."""
        if self.done:
            raise RuntimeError("the generation is finished; start a new session")
        return self._state(self.drafter.tree, self.depth)

    # -- steps ---------------------------------------------------------------------------------------------------
    def draft_level(self) -> DraftState:
        """Run one draft forward (the first of a cycle also catches the draft up) and return the new state."""
        if self.done:
            raise RuntimeError("the generation is finished; start a new session")
        if not self.drafting:
            raise RuntimeError("this session was started with drafting=False (target-only): it takes plain steps")
        with decoding_mode(self.device):
            t0 = self.clock.now()
            if self.drafter.tree is None:
                unseen = self.committed[self.drafter.committed:]
                self._fed = len(unseen)
                self.drafter.start_cycle(unseen, self.sampling, self.generator, self._features_for(unseen))
            else:
                if self.drafter.tree.depth >= self.max_depth:
                    raise RuntimeError(f"cannot draft past max_depth={self.max_depth}; call verify()")
                self.drafter.extend(self.sampling, self.generator)
            tree = self.drafter.tree
            state = self._state(tree, tree.depth)
            elapsed = self.clock.now() - t0
        self._level_s.append(elapsed)
        self._draft_s += elapsed
        return state

    def rank_candidates(self) -> None:
        """Sort the drafted candidates for verification now (timed as drafting, which ends here), so a size policy
        reading `candidate_scores` and the verification share this one sort instead of each paying for one."""
        if self.drafter.tree is not None:
            with decoding_mode(self.device):
                t0 = self.clock.now()
                self.drafter.tree.ranking()
                self._draft_s += self.clock.now() - t0

    def _check_verify_size(self, size) -> int:
        if isinstance(size, bool) or not hasattr(size, "__index__"):
            raise TypeError(f"verification size must be an integer, got {size!r}")
        size = int(size)
        tree = self.drafter.tree
        if tree is None:
            if size != 0:
                raise RuntimeError("verify() needs a drafted tree: call draft_level() first (or verify(0) for a "
                                   "plain target step)")
            return 0
        if size < 1:
            raise ValueError(f"verification size must be >= 1, got {size}")
        return clip_size(size, tree.size, self.tree_config.max_size)

    def verify(self, size: int) -> CycleRecord:
        """Verify the top-`size` candidates (clipped to those drafted) in one target forward; emit 1..accepted+1
        tokens; leave both caches holding exactly the committed prefix. With nothing drafted, verify(0) is a plain
        target step: the root alone is verified and one token emitted."""
        if self.done:
            raise RuntimeError("the generation is finished; start a new session")
        size = self._check_verify_size(size)
        tree = self.drafter.tree
        if tree is None:
            return self._plain_step()
        with decoding_mode(self.device):
            t0 = self.clock.now()
            cache_len = cache_length(self.target_cache)
            block = select_block(tree, size, self.committed[-1])
            inputs = block_inputs(tree, block, cache_len, len(self.committed) - 1, self.device)
            if "attention_mask" in inputs:  # the committed prefix fills cache slots 0..cache_len-1 in order
                inputs["attention_mask"] = model_mask(self.target_mask_layout, inputs["attention_mask"],
                                                      inputs["position_ids"], cache_len)
            out = self.pair.target(**inputs, cache=self.target_cache, use_cache=True,
                                   output_hidden_states=self.needs_features)
            logits = out.logits[0]
            path, bonus = self._accept(tree, block, logits)
            cut = near_tie_cut(logits, [0] + path, self.near_tie, self.pair.dtype) if self.near_tie else None
            if cut is not None:  # the near-tie guard (verify.py): a one-token forward decides row cut's token
                path, bonus = path[:cut], None
                self.near_ties += 1
            # keep the root's and the accepted nodes' entries (compacted): all but the last committed token's
            rows = [0] + path if bonus is not None else ([0] + path)[:-1]
            if rows:
                self._keep_features(out, rows, len(self.committed) - 1)
            emitted = [block.tokens[i] for i in path] + ([bonus] if bonus is not None else [])
            kept = torch.tensor([cache_len + i for i in rows], dtype=torch.long, device=self.device)
            keep_positions(self.target_cache, cache_len, kept)
            self.drafter.end_cycle()
            emitted = self._commit(emitted)
            if bonus is None and not self.done:
                emitted += self._one_token()
            now = self.clock.now()
        return self._finish_cycle(tree, size, len(path), emitted, now - t0, now)

    def _plain_step(self) -> CycleRecord:
        """One target step on the root, as autoregressive decoding takes it (no block, mask or cache compaction)."""
        with decoding_mode(self.device):
            t0 = self.clock.now()
            emitted = self._one_token()
            now = self.clock.now()
        return self._finish_cycle(None, 0, 0, emitted, now - t0, now)

    def _one_token(self) -> list[int]:
        """One target forward on the last committed token (its entry not yet cached), committing the next token."""
        root = torch.tensor([[self.committed[-1]]], dtype=torch.long, device=self.device)
        out = self.pair.target(input_ids=root, cache=self.target_cache, use_cache=True, logits_to_keep=1,
                               output_hidden_states=self.needs_features)
        logits = out.logits[0, -1]
        if self.sampling is None:
            token = int(logits.argmax())
        else:
            token = sample(sampling_probs(logits, *self.sampling), self.generator)
        self._keep_features(out, None, len(self.committed) - 1)
        return self._commit([token])

    def _commit(self, emitted: list[int]) -> list[int]:
        emitted = self._truncate(emitted)
        self.committed.extend(emitted)
        self.new_tokens.extend(emitted)
        return emitted

    def _accept(self, tree, block, logits) -> tuple[list[int], int]:
        if self.sampling is None:
            return accept_greedy(block, logits)
        if tree is not None and tree.sampled:
            return accept_tree_recursive(block, logits, tree, self.sampling, self.generator)
        return accept_tree_sampled(block, logits, self.sampling, self.generator)

    def _finish_cycle(self, tree, size: int, accepted: int, emitted: list[int], verify_s: float,
                      now: float) -> CycleRecord:
        depth = tree.depth if tree is not None else 0
        self.token_times.extend([now - self.start_time] * len(emitted))
        record = CycleRecord(depth=depth, size=size, accepted=accepted, emitted=len(emitted),
                             draft_s=self._draft_s, verify_s=verify_s, policy_s=self._policy_s,
                             context_len=len(self.committed) - len(emitted), level_s=tuple(self._level_s),
                             fed=self._fed if depth else 0)
        self.acceptance = update_acceptance(self.acceptance, accepted, depth)
        self.cycles.append(record)
        self._draft_s = self._policy_s = 0.0
        self._level_s, self._fed = [], 0
        if self.streamer is not None:  # after the cycle's clock reads: its own time is the caller's, not the cycle's
            if emitted:
                self.streamer.put(torch.tensor([emitted]))
            if self.done:
                self.streamer.end()
        return record

    def _truncate(self, emitted: list[int]) -> list[int]:
        """Never emit past an end id, max_new_tokens or a stop string; mark the session finished when one is hit."""
        kept, finished_by = truncate_emitted(emitted, self.new_tokens, self.max_new_tokens, self.eos, self.stops,
                                             self.stop_ids)
        if finished_by is not None:
            self.finished_by = finished_by
        return kept

    def output(self) -> GenerationOutput:
        total = self.token_times[-1] if self.token_times else 0.0
        return GenerationOutput(tokens=list(self.new_tokens), prompt_len=self.prompt_len, cycles=list(self.cycles),
                                prefill_s=self.prefill_s, total_s=total, token_times=list(self.token_times),
                                finished_by=self.finished_by or "unfinished", text=self.pair.decode(self.new_tokens))


class SpeculativeDecoder:
    """Exact tree speculative decoding of `pair.target` with the pair's drafter (its EAGLE-3 head, else its draft LM),
    steered by a Controller.

    Greedy output equals the target's greedy output token for token; sampled output follows the target's law
    (temperature, top-k, top-p applied identically to both models).
    """

    default_controller = None  # what generate() uses when given none: an exported decoder's policies (from_config)
    dtype_note: str | None = None  # from_config: why the pair decodes in another dtype than its policies were tuned in

    def __init__(self, pair: ModelPair, tree: TreeConfig | None = None) -> None:
        if not isinstance(pair, ModelPair):
            raise TypeError(f"pair must be a specpilot ModelPair, got {type(pair).__name__}")
        tree = TreeConfig() if tree is None else tree
        if not isinstance(tree, TreeConfig):
            raise TypeError(f"tree must be a TreeConfig, got {type(tree).__name__}")
        vocab = pair.drafter_vocab_size
        if tree.width > vocab:  # a level cannot have more distinct children than the drafter has tokens
            raise ValueError(f"TreeConfig.width={tree.width} exceeds the drafter's vocabulary of {vocab} tokens; "
                             f"use a width in 1..{vocab}")
        nodes = num_candidates(tree.width, tree.max_depth)
        if nodes > MAX_TREE_NODES:  # refused before anything is allocated: a wide tree fails on memory mid-run
            raise ValueError(f"TreeConfig(width={tree.width}, max_depth={tree.max_depth}) keeps up to {nodes:,} drafted "
                             f"nodes per cycle (W + (max_depth - 1) W^2; its ancestor matrix alone needs "
                             f"{nodes * nodes / 2 ** 30:.1f} GiB); at most {MAX_TREE_NODES:,}: lower the width or "
                             "max_depth")
        self.pair = pair
        self.tree = tree

    def start(self, prompt, *, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
              top_p: float = 1.0, seed: int | None = None, stop_strings=None, stop_token_ids=None,
              ignore_eos: bool = False, streamer=None, drafting: bool = True) -> DecodingSession:
        """A session on `prompt`, prefilled. drafting=False: target-only (every cycle a plain step; the drafter is
        never fed), what `generate` starts for a controller that never drafts (`Controller.may_draft`)."""
        return DecodingSession(self, self.pair.encode(prompt), max_new_tokens=max_new_tokens,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                               stop_strings=stop_strings, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                               streamer=streamer, drafting=drafting)

    def generate(self, prompt, *, controller=None, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_strings=None,
                 stop_token_ids=None, ignore_eos: bool = False, streamer=None) -> GenerationOutput:
        """Generate up to `max_new_tokens` new tokens, one `run_cycle` after another. `controller` (a Controller, or
        anything with should_stop / choose_size: skip_drafting / observe / reset default as Controller's) defaults
        to `default_controller` (an exported decoder's policies), else FixedController() for the device. A
        FixedController deeper or larger than the tree is refused (it would be capped without a word). `prompt`:
        text, token ids, or a tokenizer's output (its attention_mask's padding dropped).
        stop_strings: a string or list of strings; the generation ends with the token that completes one in the
        generated text (`finished_by` "stop"; `specpilot.drafting.stopping`). stop_token_ids: ids that end it as the
        end ids do (kept; `finished_by` "stop"), vLLM's option. ignore_eos: decode past the end ids, to the budget
        (vLLM's option, for benchmarks). streamer: a transformers streamer
        (`TextStreamer`, `TextIteratorStreamer`, any `put(ids)` / `end()`): given the prompt's ids, then each
        cycle's emitted tokens as one [1, n] tensor, then `end()`, as generate() feeds it."""
        controller = self._controller(controller)
        warn_generation_config(self.pair)
        session = self.start(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, stop_strings=stop_strings, stop_token_ids=stop_token_ids,
                             ignore_eos=ignore_eos, streamer=streamer, drafting=controller.may_draft())
        run_generation(session, controller)
        return session.output()

    def _controller(self, controller):
        """`controller`, else `default_controller` (an exported decoder's policies), else FixedController() for the
        device; a controller that does not fit the tree is refused (`Controller.check_tree`: a FixedController
        deeper or larger than it would be capped without a word, trained policies observe their own tree)."""
        if controller is None:
            controller = self.default_controller or FixedController(device=str(self.pair.device))
        controller = as_controller(controller)  # a duck-typed one gets the optional methods it lacks
        fits_tree(controller, self.tree)
        return controller

    def generate_batch(self, prompts, *, controller=None, max_new_tokens=128, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, seed: int | list[int] | None = None,
                       max_batch: int | None = None, stop_strings=None, stop_token_ids=None,
                       ignore_eos: bool = False) -> list[GenerationOutput]:
        """Decode several prompts together (`specpilot.drafting.batch`): one batched draft forward per level, one
        target forward verifying every sequence's tree, one controller decision per cycle for the batch.
        prompts: a list of prompts (text or ids), a 2-D id tensor / array without padding, or a tokenizer's output
        (`tokenizer(texts, padding=True, return_tensors="pt")`: each row without its attention_mask's padding).
        controller: as for `generate` (default: an exported decoder's policies, else FixedController()).
        max_new_tokens: one int, or one per prompt (a list, array or tensor). max_batch: decode at most this many at once, refilling a
        finished row's place from the remaining prompts in order (continuous batching of a prompt queue; None:
        all at once). Returns one GenerationOutput per prompt, in prompt order (an admitted prompt's prefill_s
        and token_times count from its own admission). Either drafter: a draft LM or an EAGLE-3 head (per-row target
        features); at temperature > 0 the trees take top-W children (exact per row). seed: an int for the batch, or
        a list of one per prompt (each sequence draws from its own generator). stop_strings, stop_token_ids,
        ignore_eos: as `generate` takes them; each row ends on its own, where it would alone."""
        from specpilot.drafting.batch import BatchSession
        from specpilot.drafting.batch_ar import batch_inputs

        controller = self._controller(controller)
        _check_sampling(1, temperature, top_k, top_p, None if isinstance(seed, (list, tuple)) else seed)
        warn_generation_config(self.pair)
        ids, budgets = batch_inputs(self.pair, prompts, max_new_tokens, lookahead=0)  # BatchSession.max_depth
        sampling = (temperature, top_k, top_p) if temperature > 0 else None
        session = BatchSession(self, ids, max_new_tokens=budgets, sampling=sampling, seed=seed, max_batch=max_batch,
                               stop_strings=stop_strings, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                               drafting=controller.may_draft())
        run_generation(session, controller)
        return session.outputs()

    @classmethod
    def from_config(cls, config_dir, pair: ModelPair | None = None, *, allow_pair_mismatch: bool = False,
                    device: str | None = None, dtype=None) -> "SpeculativeDecoder":
        """A decoder from an exported directory (`specpilot export`) whose generate() decides with its exported
        policies (`decoder.default_controller`) unless given another controller. pair=None loads the pair decoder.json
        names, in the dtype the run was measured in when this device runs it natively (`decoder.dtype_note` says
        why not otherwise); allow_pair_mismatch, device and dtype as `specpilot.policies.exported.load_exported`
        takes them."""
        from specpilot.policies.exported import load_exported

        controller, tree, meta = load_exported(config_dir, pair=pair, allow_pair_mismatch=allow_pair_mismatch,
                                               device=device, dtype=dtype)
        decoder = cls(meta["model_pair"], tree)
        decoder.default_controller = controller
        # the pair loads in the dtype the policies were tuned in where it can; when it cannot, why (else None)
        decoder.dtype_note = meta.get("dtype_note")
        return decoder


def autoregressive_generate(pair: ModelPair, prompt, *, max_new_tokens: int = 128, temperature: float = 0.0,
                            top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_strings=None,
                            stop_token_ids=None, ignore_eos: bool = False, streamer=None) -> GenerationOutput:
    """Target-only decoding on the same caches and timing as the speculative decoder (the speedup baseline).

    Like the speculative session, the prefill covers prompt[:-1] (not timed) and the timed loop starts by feeding
    the last prompt token, one target forward per new token. stop_strings, stop_token_ids, ignore_eos and streamer
    as `generate` takes them.
    """
    _check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    eos, stops, stop_ids = request_ending(pair, stop_strings, stop_token_ids, ignore_eos)
    warn_generation_config(pair)
    ids = pair.encode(prompt)
    check_context(pair, len(ids), max_new_tokens, 0)
    device, clock = pair.device, Clock(pair.device)
    generator = _generator(seed, device) if temperature > 0 else None
    cache = generation_cache(pair.target)
    tokens: list[int] = []
    times: list[float] = []
    finished_by = "length"
    if streamer is not None:  # as generate() does: the prompt first (TextStreamer(skip_prompt=True) drops it)
        streamer.put(torch.tensor([ids]))
    with decoding_mode(device):
        t0 = clock.now()
        if len(ids) > 1:
            pair.target(input_ids=torch.tensor([ids[:-1]], device=device), cache=cache, use_cache=True,
                        logits_to_keep=1)
        start = clock.now()
        current = torch.tensor([[ids[-1]]], device=device)
        for _ in range(max_new_tokens):
            logits = pair.target(input_ids=current, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            if temperature > 0:
                current = draw(sampling_probs(logits, temperature, top_k, top_p), generator)  # [1, 1]
            else:
                current = logits.argmax(dim=-1, keepdim=True)                       # [1, 1], stays on device
            token = int(current)
            _, ended = truncate_emitted([token], tokens, max_new_tokens, eos, stops, stop_ids)  # the sessions' rule
            tokens.append(token)
            times.append(clock.now() - start)
            if streamer is not None:
                streamer.put(current.cpu())
            if ended is not None:
                finished_by = ended
                break
    if streamer is not None:
        streamer.end()
    return GenerationOutput(tokens=tokens, prompt_len=len(ids), prefill_s=start - t0,
                            total_s=times[-1] if times else 0.0, token_times=times, finished_by=finished_by,
                            text=pair.decode(tokens))
