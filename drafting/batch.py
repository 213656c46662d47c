"""Batched speculative decoding: B prompts decoded together, one batched target forward verifying every tree.

`BatchSession` implements the cycle's step protocol (`specpilot.drafting.cycle`) over a batch, so
`SpeculativeDecoder.generate_batch` drives it with the same `run_generation` / `run_cycle` as `generate`: one
controller decision per cycle for the whole batch (skip / depth / size), taken on the state of the batch's *lead*
sequence (the first unfinished one); the controller observes the lead's CycleRecord. Each sequence drafts its own
tree (one batched drafter forward per level), is verified in ONE target forward over all sequences' blocks, and
accepts its own path (`drafting/verify.py`'s greedy rule).

Caches, rows and the plain step live in `specpilot.drafting.batch_ar` (shared with batched autoregressive
decoding; its docstring explains the ragged caches and their holes).

Sampling (temperature > 0): every tree takes the drafter's top-W children (`TreeConfig.sampled_children` is not
used) and each row is verified by `verify.accept_tree_sampled` (draw from the target's law at each node, descend
while the draw is a child): exact per row. seed: an int (or None): one generator serves the batch, rows drawing in
row order; a list of one int per prompt: each sequence draws from its own generator (`row_generators`), so its
draws do not depend on its batchmates' (the batched evaluation pairs methods by these per-sequence seeds).
EAGLE-3 heads. The drafter runs through `drafters.LMDrafter/EagleDrafter.forward_batch`, so a head drafts like a
draft LM (its own RaggedCache, batched tree levels) with what a single-sequence session gives it per row: every
target forward (prefill, plain step, verification) runs with output_hidden_states and each row keeps the aux states
of its committed positions (the root and its accepted path; `drafters.FeatureBuffer`, as DecodingSession keeps
them); a catch-up feed reads each fed token's preceding feature (fused once for the batch), the head's entry for
committed token m sits at position m - 1 (`offset` 1: the first token has none), and tree nodes are fed their
parent's output hidden (one [B, nodes, H] buffer: node ids are the same in every row's tree). A batch with a row
whose whole context is one token cannot draft (`can_draft` False: one plain step gives it a feature).
"""
from __future__ import annotations

import math

import torch

from specpilot.drafting.attention import decoding_mode, model_mask
from specpilot.drafting.batch_ar import (BatchRow, RaggedCache, plain_step, row_generator, row_generators,
                                          step_generators)
from specpilot.drafting.checks import check_int
from specpilot.drafting.cycle_math import clip_size, level_bounds, num_candidates, update_acceptance
from specpilot.drafting.drafters import aux_batch, fuse_aux, make_drafter
from specpilot.drafting.stopping import request_ending
from specpilot.drafting.timing import Clock
from specpilot.drafting.tree import DraftTree
from specpilot.drafting.types import CycleRecord, DraftState, GenerationOutput
from specpilot.drafting.verify import accept_greedy, accept_tree_sampled, select_block


class BatchSession:
    """B prompts advanced together through the cycle's step protocol (see the module docstring). States and the
    returned CycleRecords are the lead row's (the first unfinished one); `outputs()` gives every row's."""

    def __init__(self, decoder, prompts: list[list[int]], *, max_new_tokens, sampling: tuple | None = None,
                 seed: int | None = None, max_batch: int | None = None, stop_strings=None, stop_token_ids=None,
                 ignore_eos: bool = False, drafting: bool = True) -> None:
        pair, tree = decoder.pair, decoder.tree
        self.eos, self.stops, self.stop_ids = request_ending(pair, stop_strings, stop_token_ids, ignore_eos)
        self.pair, self.tree_config = pair, tree
        self.max_context = pair.max_context
        self.width = tree.width
        self.device = pair.device
        self.clock = Clock(self.device)
        self.sampling = sampling  # (temperature, top_k, top_p), None for greedy
        self.generator = row_generators(seed, len(prompts), self.device)
        self.capacity = num_candidates(tree.width, tree.max_depth)
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(prompts)
        self.rows = [BatchRow(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_new_tokens))]
        self.max_batch = len(self.rows) if max_batch is None else check_int("max_batch", max_batch, minimum=1)
        self.active: list[BatchRow] = self.rows[: self.max_batch]
        self.queue: list[BatchRow] = self.rows[self.max_batch:]    # continuous batching: admitted as rows finish
        self.drafter = make_drafter(pair)
        # drafting=False (a controller that never drafts, `Controller.may_draft`): target-only, as DecodingSession
        self.drafting = drafting
        self.needs_features = drafting and self.drafter.needs_features
        self.offset = self.drafter.offset
        self.target = RaggedCache(pair.target, len(self.active), self.device)
        self.draft = RaggedCache(None, len(self.active), self.device, drafter=self.drafter)
        self._node_hidden: torch.Tensor | None = None  # EAGLE: [B, capacity, H] the hidden each node is fed with
        self._depth = 0
        self._draft_start = 0           # draft cache length before this cycle's tree nodes
        self._drafted = False           # the draft has been fed (a cycle drafted, or prefill_draft)
        self._draft_s = self._policy_s = 0.0
        self._level_s: list[float] = []
        self._last_top_prob, self._last_entropy = 1.0, 0.0
        self.prefill_s = self._prefill()
        self.start_time = self.clock.now()
        for r in self.active:
            r.start, r.prefill_s = self.start_time, self.prefill_s

    def _prefill(self) -> float:
        """The target's prefill only: the draft stays empty until the first cycle that drafts, whose catch-up feed
        (`_start_trees`) prefills it then, so a batch that never drafts costs exactly batched AR."""
        with decoding_mode(self.device):
            t0 = self.clock.now()
            self.target = self._prefill_target(self.active)
            return self.clock.now() - t0

    def _prefill_target(self, rows: list[BatchRow]) -> RaggedCache:
        """A target RaggedCache holding these rows' committed[:-1] (one ragged forward); with an EAGLE head each row
        keeps the forward's aux states of its tokens (features from position 0)."""
        cache = RaggedCache(self.pair.target, len(rows), self.device)
        feeds = [r.committed[:-1] for r in rows]
        out = cache.feed_out(feeds, [0] * len(rows), self.device, logits_to_keep=1,
                             output_hidden_states=self.needs_features)
        if self.needs_features and out is not None:
            aux = aux_batch(self.pair, out[1])
            width = aux.shape[1]
            for b, (row, tokens) in enumerate(zip(rows, feeds)):
                if tokens:
                    row.features.keep(aux[b, width - len(tokens):], 0)
        return cache

    def _feed_draft(self, cache: RaggedCache, rows: list[BatchRow], *, to_root: bool) -> tuple | None:
        """Catch each row's drafter up on committed[draft_committed:] (to_root) or up to committed[:-1] (one ragged
        forward, logits of the last column). An EAGLE head's entries are the tokens that have a preceding target
        feature, fed with it (fused once for the batch), at position token index - 1. Returns (logits [B, 1, V],
        output hidden [B, 1, H] or None), or None when no row had an entry."""
        tokens, starts, feats = [], [], []
        for row in rows:
            new = row.committed[row.draft_committed: None if to_root else len(row.committed) - 1]
            entries = new[max(0, self.offset - row.draft_committed):]
            tokens.append(entries)
            starts.append(max(0, row.draft_committed - self.offset))
            if self.needs_features and new:  # as DecodingSession._features_for: the next fed token reads `end`
                feats.append(row.features.take(row.draft_committed + len(new) - 1, len(entries)))
            elif self.needs_features:
                feats.append(None)
            row.draft_committed += len(new)
        hidden = None
        if self.needs_features and any(t for t in tokens):
            parts = [f for f in feats if f is not None]
            fused = fuse_aux(self.pair, torch.cat(parts) if len(parts) > 1 else parts[0])
            split = iter(torch.split(fused, [f.shape[0] for f in parts]))
            hidden = [next(split) if f is not None else fused[:0] for f in feats]
        return cache.feed_out(tokens, starts, self.device, logits_to_keep=1, hidden=hidden)

    def prefill_draft(self) -> float:
        """Catch every live row's draft up to committed[:-1] now (one ragged forward; returns its seconds): what the
        first drafting cycle would otherwise feed. For measurements whose cycles must see steady-state catch-ups
        only (envs/profile.py's batch profile), as a single-sequence session's prefill gives them."""
        with decoding_mode(self.device):
            t0 = self.clock.now()
            self._feed_draft(self.draft, self.active, to_root=False)
            self._drafted = True
            return self.clock.now() - t0

    def _admit(self) -> None:
        """Refill the batch from the queue up to max_batch: the new rows' target prefill (one ragged forward over
        them only) appended after the live rows; their draft rows start empty (caught up when a cycle drafts)."""
        take = self.queue[: self.max_batch - len(self.active)]
        if not take:
            return
        self.queue = self.queue[len(take):]
        t0 = self.clock.now()
        self.target.compact()
        self.target.append_rows(self._prefill_target(take))
        # a batch that has drafted prefills the newcomers' draft now, over them only (else the next drafting
        # cycle's catch-up would pad every row to a whole prompt); one that never drafted never pays for it
        self.draft.compact()
        newcomers = RaggedCache(None, len(take), self.device, drafter=self.drafter)
        if self._drafted:
            self._feed_draft(newcomers, take, to_root=False)
        self.draft.append_rows(newcomers)
        now = self.clock.now()
        for r in take:
            r.start, r.prefill_s = now, now - t0
        self.active.extend(take)

    # -- protocol state --------------------------------------------------------------------------------------------
    @property
    def lead(self) -> BatchRow:
        return self.active[0]

    @property
    def done(self) -> bool:
        return not self.active

    @property
    def finished_by(self) -> str | None:
        """Once done, "eos" when every row ended with its end token, "stop" when every row ended with an end token
        or a stop string and one with a stop string, else "length"."""
        if self.active:
            return None
        ends = {r.finished_by for r in self.rows}
        return "eos" if ends == {"eos"} else "stop" if ends <= {"eos", "stop"} else "length"

    @property
    def prompt_len(self) -> int:
        return self.lead.prompt_len if self.active else self.rows[0].prompt_len

    @property
    def tokens_emitted(self) -> int:
        return len((self.lead if self.active else self.rows[0]).new_tokens)

    @property
    def max_depth(self) -> int:
        """Most draft levels this cycle: the tree's max_depth, fewer where the longest row's context ends sooner
        (`DecodingSession.max_depth`: every row drafts the batch's depth)."""
        room = self.max_context - max(len(r.committed) for r in self.active) if self.active else 0
        return max(0, min(self.tree_config.max_depth, room))

    @property
    def can_draft(self) -> bool:
        """A draft LM can while the context has room (max_depth > 0); an EAGLE head also needs a target feature
        before every row's root (False while some row's whole context is one token: the cycle is a plain step).
        Never in a target-only session (drafting=False)."""
        if not self.drafting or self.max_depth == 0:
            return False
        return self.offset == 0 or all(len(r.committed) > self.offset for r in self.active)

    def add_policy_time(self, seconds: float) -> None:
        self._policy_s += seconds

    def _state(self) -> DraftState:
        row = self.lead
        tree = row.tree
        lengths = [len(r.committed) for r in self.active]   # the load the batch-aware controllers see
        prev = row.cycles[-1] if row.cycles else None
        scores, level_start = None, 0
        if tree is not None:
            level_start = level_bounds(self.width, tree.depth)[0]
            view = tree.scores_view if tree.scores_view is not None else tree.scores
            scores = view[: tree.size]
        return DraftState(
            depth=self._depth, max_depth=self.tree_config.max_depth, width=self.width, context_len=len(row.committed),
            scores=scores, level_start=level_start,
            sorted_scores=tree.sorted_scores if tree is not None else None,
            sorted_ids=tree.sorted_ids if tree is not None else None,
            last_top_prob=self._last_top_prob if tree is not None else 1.0,
            last_entropy=self._last_entropy if tree is not None else 0.0,
            new_tokens=len(row.new_tokens), max_new_tokens=row.max_new_tokens,
            prev_accepted=prev.accepted if prev else 0, prev_depth=prev.depth if prev else 0,
            acceptance=row.acceptance, batch_size=len(self.active), context_max=max(lengths),
            context_mean=sum(lengths) / len(lengths))

    def cycle_state(self) -> DraftState:
        if self.done:
            raise RuntimeError("the generation is finished; start a new session")
        return self._state()

    # -- drafting --------------------------------------------------------------------------------------------------
    def _record_features(self, logq_row: torch.Tensor, child_logprob: float) -> None:
        p = logq_row.exp()
        self._last_entropy = float(-(p * logq_row).sum())
        self._last_top_prob = math.exp(child_logprob)

    def draft_level(self) -> DraftState:
        """One batched drafter forward: level 1 catches every row's draft cache up (ragged feeds) and takes the
        roots' top-W children; level d >= 2 feeds every row's W frontier nodes with its own tree mask."""
        if self.done:
            raise RuntimeError("the generation is finished; start a new session")
        if not self.drafting:
            raise RuntimeError("this session was started with drafting=False (target-only): it takes plain steps")
        with decoding_mode(self.device):
            t0 = self.clock.now()
            if self._depth == 0:
                self._start_trees()
            else:
                if self._depth >= self.max_depth:
                    raise RuntimeError(f"cannot draft past max_depth={self.max_depth}; call verify()")
                self._extend_trees()
            self._depth += 1
            state = self._state()
            elapsed = self.clock.now() - t0
        self._level_s.append(elapsed)
        self._draft_s += elapsed
        return state

    def _start_trees(self) -> None:
        fed = [len(r.committed) - r.draft_committed for r in self.active]
        logits, hidden = self._feed_draft(self.draft, self.active, to_root=True)
        self._draft_start = self.draft.length
        self._drafted = True
        logq = torch.log_softmax(logits[:, -1].float(), dim=-1)                          # [B, V_draft]
        values, local = torch.topk(logq, self.width, dim=-1)                              # [B, W]
        tokens = self.drafter.to_target(local)
        if hidden is not None:  # level 1's nodes are fed the root's output hidden
            self._node_hidden = hidden.new_empty(len(self.active), self.capacity, hidden.shape[-1])
            self._node_hidden[:, : self.width] = hidden[:, -1:]
        for b, row in enumerate(self.active):
            row.fed = fed[b]
            tree = DraftTree.empty(self.capacity, self.device)
            tree.frontier = tree.add_level(tokens[b], torch.full_like(tokens[b], -1), values[b])
            row.tree = tree
            row.fed_nodes = tree.frontier[:0]
        self._record_features(logq[0], float(values[0, 0]))

    def _extend_trees(self) -> None:
        trees = [r.tree for r in self.active]
        frontiers = [t.frontier for t in trees]
        n = int(frontiers[0].numel())
        ids = torch.stack([t.tokens[f] for t, f in zip(trees, frontiers)])               # [B, n]
        positions = torch.stack([torch.full((n,), len(r.committed) - 1 - self.offset + r.tree.depth,
                                            dtype=torch.long, device=self.device) for r in self.active])
        # each node sees the committed slots, its fed ancestors and itself (tree-node slots start at _draft_start)
        fed_masks, new_masks = [], []
        for r, f in zip(self.active, frontiers):
            fed_masks.append(r.tree.ancestors[f][:, r.fed_nodes])
            new_masks.append(r.tree.ancestors[f][:, f])
        fed_mask = torch.stack(fed_masks)                                                  # [B, n, fed]
        b = len(self.active)
        query_valid = torch.ones(b, n, dtype=torch.bool, device=self.device)
        committed = self.draft.valid[:, : self._draft_start]                                # holes stay masked
        mask_old = torch.cat([committed[:, None, :].expand(b, n, self._draft_start), fed_mask], dim=2)
        hidden = None
        if self._node_hidden is not None:  # each node is fed its parent's output hidden
            index = torch.stack(frontiers)                                                 # [B, n]
            hidden = self._node_hidden.gather(1, index[:, :, None].expand(-1, -1, self._node_hidden.shape[-1]))
        mask = torch.cat([mask_old, torch.stack(new_masks)], dim=2)[:, None]
        mask = model_mask(self.drafter.mask_layout, mask, positions, committed)
        logits, out = self.drafter.forward_batch(ids, hidden, positions, mask, self.draft.cache)
        self.draft.valid = torch.cat([self.draft.valid, query_valid], dim=1)
        logq = torch.log_softmax(logits.float(), dim=-1)                                   # [B, n, V_draft]
        values, local = torch.topk(logq, self.width, dim=-1)                              # [B, n, W]
        tokens = self.drafter.to_target(local)
        k = self.width
        for bi, (row, tree, frontier) in enumerate(zip(self.active, trees, frontiers)):
            row.fed_nodes = torch.cat([row.fed_nodes, frontier])
            cumulative = tree.path_scores[frontier][:, None] + values[bi]                 # [n, W]
            parents = frontier[:, None].expand(n, k)
            new_ids = tree.add_level(tokens[bi].reshape(-1), parents.reshape(-1), cumulative.reshape(-1))
            tree.frontier = new_ids[torch.topk(cumulative.reshape(-1), min(self.width, new_ids.numel())).indices]
            if bi == 0:
                best = int(torch.argmax(cumulative.reshape(-1)))
                self._record_features(logq[0, best // k], float(values[0].reshape(-1)[best]))
                level_ids = new_ids  # the same ids in every row's tree (every level has n * W nodes)
        if out is not None:
            self._node_hidden[:, level_ids] = out.repeat_interleave(k, dim=1)

    def rank_candidates(self) -> None:
        with decoding_mode(self.device):
            t0 = self.clock.now()
            for r in self.active:
                if r.tree is not None:
                    r.tree.ranking()
            self._draft_s += self.clock.now() - t0

    # -- verification ----------------------------------------------------------------------------------------------
    def verify(self, size: int) -> CycleRecord:
        """Verify every row's top-`size` candidates (one batched target forward), accept per row, compact the
        caches' tails, retire finished rows. Returns the lead row's record."""
        if self.done:
            raise RuntimeError("the generation is finished; start a new session")
        if isinstance(size, bool) or not hasattr(size, "__index__"):
            raise TypeError(f"verification size must be an integer, got {size!r}")
        size = int(size)
        if self._depth == 0:
            if size != 0:
                raise RuntimeError("verify() needs drafted trees: call draft_level() first (or verify(0))")
        elif size < 1:
            raise ValueError(f"verification size must be >= 1, got {size}")
        else:
            size = clip_size(size, self.lead.tree.size, self.tree_config.max_size)
        lead = self.lead
        with decoding_mode(self.device):
            t0 = self.clock.now()
            results = self._verify_plain() if self._depth == 0 else self._verify_trees(size)
            emitted_rows = []
            for row, (accepted, emitted) in zip(self.active, results):
                emitted = row.truncate(emitted, self.eos, self.stops, self.stop_ids)
                row.committed.extend(emitted)
                row.new_tokens.extend(emitted)
                emitted_rows.append((accepted, emitted))
            now = self.clock.now()
        verify_s = now - t0
        depth = self._depth
        lead_record = None
        for row, (accepted, emitted) in zip(self.active, emitted_rows):
            row.token_times.extend([now - row.start] * len(emitted))
            record = CycleRecord(depth=depth, size=size if depth else 0, accepted=accepted, emitted=len(emitted),
                                 draft_s=self._draft_s, verify_s=verify_s, policy_s=self._policy_s,
                                 context_len=len(row.committed) - len(emitted), level_s=tuple(self._level_s),
                                 fed=row.fed if depth else 0)
            row.acceptance = update_acceptance(row.acceptance, accepted, depth)
            row.cycles.append(record)
            row.tree, row.fed = None, 0
            if row is lead:
                lead_record = record
        self._depth, self._draft_s, self._policy_s, self._level_s = 0, 0.0, 0.0, []
        with decoding_mode(self.device):
            self._retire()
            self._admit()
        return lead_record

    def _verify_plain(self) -> list[tuple[int, list[int]]]:
        """Every row's root through the target (one token each): batched autoregressive decoding, the very step
        `autoregressive_generate_batch` takes (`plain_step`)."""
        keep = None
        if self.needs_features:
            def keep(hidden_states):
                aux = aux_batch(self.pair, hidden_states)                                   # [B, 1, 3 * H]
                for b, row in enumerate(self.active):
                    row.features.keep(aux[b], len(row.committed) - 1)
        tokens = plain_step(self.target, self.active, self.device, self.sampling,
                            step_generators(self.generator, self.active), on_hidden=keep)
        return [(0, [t]) for t in tokens]

    def _verify_trees(self, size: int) -> list[tuple[int, list[int]]]:
        if self._draft_start < self.draft.length:       # drop the tree nodes: the draft holds committed entries
            self.draft.crop(self._draft_start)
        blocks = [select_block(r.tree, size, r.committed[-1]) for r in self.active]
        q = 1 + size
        ids = torch.tensor([blk.tokens for blk in blocks], dtype=torch.long, device=self.device)
        masks, positions = [], []
        for r, blk in zip(self.active, blocks):
            tree_mask = torch.zeros(q, q, dtype=torch.bool, device=self.device)
            tree_mask[:, 0] = True
            tree_mask[1:, 1:] = r.tree.ancestors[blk.node_ids][:, blk.node_ids]
            masks.append(tree_mask)
            depths = torch.cat([torch.zeros(1, dtype=torch.long, device=self.device), r.tree.depths[blk.node_ids]])
            positions.append(len(r.committed) - 1 + depths)
        start = self.target.length
        query_valid = torch.ones(len(blocks), q, dtype=torch.bool, device=self.device)
        logits, hidden_states = self.target.forward_out(ids, torch.stack(positions), torch.stack(masks), query_valid,
                                                        output_hidden_states=self.needs_features)
        aux = aux_batch(self.pair, hidden_states) if self.needs_features else None          # [B, q, 3 * H]
        results, keep = [], []
        for b, (r, blk) in enumerate(zip(self.active, blocks)):
            if self.sampling is None:
                path, bonus = accept_greedy(blk, logits[b])
            else:
                path, bonus = accept_tree_sampled(blk, logits[b], self.sampling, row_generator(self.generator, r))
            keep.append([0] + path)
            results.append((len(path), [blk.tokens[i] for i in path] + [bonus]))
        if aux is not None:  # each row's root's and accepted nodes' features (the bonus token has none yet): one gather
            rows = torch.tensor([b for b, k in enumerate(keep) for _ in k], dtype=torch.long, device=aux.device)
            cols = torch.tensor([c for k in keep for c in k], dtype=torch.long, device=aux.device)
            for row, part in zip(self.active, torch.split(aux[rows, cols], [len(k) for k in keep])):
                row.features.keep(part, len(row.committed) - 1)
        self.target.keep_tail(start, keep)
        return results

    def _retire(self) -> None:
        alive = [i for i, r in enumerate(self.active) if r.finished_by is None]
        if len(alive) == len(self.active):
            return
        self.active = [self.active[i] for i in alive]
        if alive or self.queue:
            index = torch.tensor(alive, dtype=torch.long, device=self.device)
            self.target.select_rows(index)
            self.draft.select_rows(index)

    # -- results ---------------------------------------------------------------------------------------------------
    def outputs(self) -> list[GenerationOutput]:
        return [GenerationOutput(tokens=list(r.new_tokens), prompt_len=r.prompt_len, cycles=list(r.cycles),
                                 prefill_s=r.prefill_s, total_s=r.token_times[-1] if r.token_times else 0.0,
                                 token_times=list(r.token_times), finished_by=r.finished_by or "length",
                                 text=self.pair.decode(r.new_tokens)) for r in self.rows]
