"""Batched speculative decoding: B prompts decoded together, one batched target forward verifying every tree.

`BatchSession` implements the cycle's step protocol (`specpilot.drafting.cycle`) over a batch, so
`SpeculativeDecoder.generate_batch` drives it with the same `run_generation` / `run_cycle` as `generate`: one
controller decision per cycle for the whole batch (skip / depth / size), taken on the state of the batch's *lead*
sequence (the first unfinished one); the controller observes the lead's CycleRecord. Each sequence drafts its own
tree (one batched drafter forward per level), is verified in ONE target forward over all sequences' blocks, and
accepts its own path (`drafting/verify.py`'s greedy rule).

Caches. Each model has one batched DynamicCache [B, heads, L, dim] plus a boolean `valid` [B, L]: which slots
hold a committed entry of that row. Rows differ in length and in what each cycle accepts, so slots that hold no
entry of a row (left padding of ragged prompts, ragged catch-up feeds, the tail of a cycle that accepted less than
another row) stay in place as *holes*, masked out of every attention row (4-D boolean masks, explicit position_ids
per row: a row's positions count only its own tokens, so holes change no RoPE position). After a verification
only the cycle's tail is compacted (each row's root + accepted path moved to the front of the tail, the rest
cropped), so nothing before the tail is ever copied; the price is that holes accumulate: the cache grows by the
batch's longest emitted run per cycle instead of each row's own. Masked slots contribute exactly zero attention
weight, so every row's cache holds exactly what a fresh prefill of its committed tokens would (tests check it,
hole-stripped, after every cycle). A padded query (hole) attends to itself only, which keeps its states finite
(a fully masked row would give NaN that a later 0 * NaN would spread). Finished rows leave the batch: their rows
are dropped from both caches (index_select on the batch dimension).

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

from specpilot.drafting.cache import new_cache
from specpilot.drafting.checks import check_float, check_int
from specpilot.drafting.cycle_math import clip_size, emitted_count, level_bounds, num_candidates, update_acceptance
from specpilot.drafting.drafters import FeatureBuffer, aux_batch, fuse_aux, make_drafter
from specpilot.drafting.timing import Clock
from specpilot.drafting.tree import DraftTree
from specpilot.drafting.types import CycleRecord, DraftState, GenerationOutput
from specpilot.drafting.sampling import sampling_probs
from specpilot.drafting.verify import accept_greedy, accept_tree_sampled, select_block

PAD = 0  # token id written into holes (never attended to by a real query)


def batch_inputs(pair, prompts, max_new_tokens, *, lookahead: int) -> tuple[list[list[int]], list[int]]:
    """Prompts as token-id lists and one max_new_tokens per prompt (an int applies to all), each checked as
    `generate` checks its prompt (non-empty, fits the context with `lookahead` draft positions)."""
    from specpilot.drafting.checks import check_context

    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of prompts (strings or token-id lists)")
    ids = [pair.encode(p) for p in prompts]
    budgets = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(ids)
    if len(budgets) != len(ids):
        raise ValueError(f"max_new_tokens has {len(budgets)} entries for {len(ids)} prompts")
    for prompt, budget in zip(ids, budgets):
        check_int("max_new_tokens", budget, minimum=1)
        check_context(pair, len(prompt), budget, lookahead)
    return ids, budgets


class RaggedCache:
    """A batched DynamicCache whose rows hold different numbers of entries, with holes marked in `valid`. The
    target's is `RaggedCache(target, B, device)`; a drafter's `RaggedCache(None, B, device, drafter=...)` runs the
    drafter's `forward_batch` (`specpilot.drafting.drafters`: a draft LM or an EAGLE-3 head)."""

    def __init__(self, model, batch: int, device, drafter=None) -> None:
        self.model = model
        self.drafter = drafter
        self.cache = drafter.new_cache() if drafter is not None else new_cache(model)
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor, query_valid: torch.Tensor,
                logits_to_keep: int = 0) -> torch.Tensor:
        """One forward of `ids` [B, q] at `positions` [B, q]; each query sees the valid cached slots plus the new
        slots `new_mask` [B, q, q] allows; holes (query_valid False) see only themselves. Appends the q slots
        (valid where query_valid). Returns logits [B, q or logits_to_keep, V]."""
        return self.forward_out(ids, positions, new_mask, query_valid, logits_to_keep)[0]

    def forward_out(self, ids: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor,
                    query_valid: torch.Tensor, logits_to_keep: int = 0, *, hidden: torch.Tensor | None = None,
                    output_hidden_states: bool = False) -> tuple[torch.Tensor, object]:
        """`forward`, also returning what an EAGLE pair needs: (logits, the target's hidden_states tuple when
        output_hidden_states, a head's output hidden [B, q or logits_to_keep, H] when `hidden` [B, q, H] is fed to
        one, else None)."""
        b, q = ids.shape
        new_mask = new_mask & query_valid[:, None, :]
        new_mask |= torch.eye(q, dtype=torch.bool, device=ids.device)[None]  # every query sees itself
        old = (self.valid[:, None, :] & query_valid[:, :, None]).expand(b, q, self.length)
        mask = torch.cat([old, new_mask], dim=2)[:, None]                   # [B, 1, q, L + q]
        if self.drafter is not None:
            logits, extra = self.drafter.forward_batch(ids, hidden, positions, mask, self.cache,
                                                       logits_to_keep=logits_to_keep)
        else:
            kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
            if output_hidden_states:
                kwargs["output_hidden_states"] = True
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                             use_cache=True, **kwargs)
            logits, extra = out.logits, (out.hidden_states if output_hidden_states else None)
        self.valid = torch.cat([self.valid, query_valid], dim=1)
        return logits, extra

    def feed(self, rows: list[list[int]], starts: list[int], device, logits_to_keep: int = 0) -> torch.Tensor | None:
        """Append each row's tokens causally (left-padded to the longest, so every row's last token is the last
        column); row b's first token sits at position starts[b]. None when no row has a token."""
        out = self.feed_out(rows, starts, device, logits_to_keep)
        return None if out is None else out[0]

    def feed_out(self, rows: list[list[int]], starts: list[int], device, logits_to_keep: int = 0, *,
                 hidden: list[torch.Tensor] | None = None, output_hidden_states: bool = False) -> tuple | None:
        """`feed` returning `forward_out`'s pair; `hidden` (an EAGLE head) gives each row's [len(row), H] inputs,
        left-padded with zeros like the tokens. None when no row has a token."""
        width = max(len(r) for r in rows)
        if width == 0:
            return None
        ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        query_valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for b, (tokens, start) in enumerate(zip(rows, starts)):
            if tokens:
                ids[b, width - len(tokens):] = torch.tensor(tokens)
                positions[b, width - len(tokens):] = torch.arange(start, start + len(tokens))
                query_valid[b, width - len(tokens):] = True
        causal = torch.ones(width, width, dtype=torch.bool).tril()[None].expand(len(rows), width, width)
        padded = None
        if hidden is not None:
            like = next(h for h in hidden if h.shape[0])
            padded = like.new_zeros(len(rows), width, like.shape[-1])
            for b, h in enumerate(hidden):
                if h.shape[0]:
                    padded[b, width - h.shape[0]:] = h
        return self.forward_out(ids.to(device), positions.to(device), causal.to(device).clone(),
                                query_valid.to(device), logits_to_keep, hidden=padded,
                                output_hidden_states=output_hidden_states)

    def crop(self, length: int) -> None:
        excess = self.length - length
        if excess > 0:
            self.cache.crop(-excess)
            self.valid = self.valid[:, :length]

    def keep_tail(self, start: int, keep: list[list[int]]) -> None:
        """Of the slots from `start` on, keep row b's slots start + keep[b][i] (ascending), moved to the tail's front;
        drop the rest (holes where a row keeps fewer than the longest)."""
        width = max(len(k) for k in keep)
        device = self.valid.device
        index = torch.zeros(len(keep), width, dtype=torch.long)
        valid = torch.zeros(len(keep), width, dtype=torch.bool)
        for b, rows in enumerate(keep):
            index[b, :len(rows)] = torch.tensor(rows, dtype=torch.long)
            valid[b, :len(rows)] = True
        index, valid = index.to(device), valid.to(device)
        identity = bool((index == torch.arange(width, device=device)[None]).all())
        for layer in self.cache.layers:
            if layer.keys is None or layer.keys.numel() == 0 or identity:
                continue
            _, heads, _, dim = layer.keys.shape
            gather = index[:, None, :, None].expand(-1, heads, -1, dim)
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                moved = tensor[:, :, start:].gather(2, gather)              # a copy: safe to write back in place
                tensor[:, :, start:start + width] = moved
        self.crop(start + width)
        self.valid = torch.cat([self.valid[:, :start], valid], dim=1)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished sequences leave the batch)."""
        for layer in self.cache.layers:
            if layer.keys is None or layer.keys.dim() != 4:
                continue
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
        self.valid = self.valid.index_select(0, rows)

    def compact(self, min_holes: float = 0.5) -> bool:
        """When at least `min_holes` of the slots are holes (rows left, others were refilled, acceptance was
        ragged), move every row's entries to the front in order and crop the rest: one copy that shortens every
        later attention. Positions are explicit and holes are masked, so no row's attention changes. Call only
        between cycles (no tree nodes cached). Returns whether it compacted."""
        counts = self.valid.sum(dim=1)
        width = int(counts.max()) if counts.numel() else 0
        if self.length == 0 or self.length - width < min_holes * self.length:
            return False
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :width]  # valid slots first
        for layer in self.cache.layers:
            if layer.keys is None or layer.keys.dim() != 4:
                continue
            gather = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.valid = torch.arange(width, device=self.valid.device)[None] < counts[:, None]
        return True

    def append_rows(self, other: "RaggedCache") -> None:
        """Add `other`'s rows after this cache's rows (continuous batching: newly admitted sequences). The shorter
        cache is padded at its end with holes, so no row's entries move; a layer one side never wrote is zeros."""
        width = max(self.length, other.length)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            sides = [(layer, n, len(v)) for layer, n, v in ((mine, self.length, self.valid),
                                                             (theirs, other.length, other.valid))]
            known = [layer for layer, _, _ in sides if layer.keys is not None and layer.keys.dim() == 4]
            if not known:
                continue
            _, heads, _, dim = known[0].keys.shape
            like = known[0].keys
            for name in ("keys", "values"):
                parts = []
                for layer, n, rows in sides:
                    tensor = getattr(layer, name)
                    if tensor is None or tensor.dim() != 4:
                        tensor = like.new_zeros(rows, heads, n, dim)
                    if n < width:
                        tensor = torch.cat([tensor, tensor.new_zeros(rows, heads, width - n, dim)], dim=2)
                    parts.append(tensor)
                setattr(mine, name, torch.cat(parts, dim=0))
            if not mine.is_initialized:
                mine.is_initialized, mine.device = True, like.device
        pad = [torch.zeros(len(v), width - v.shape[1], dtype=torch.bool, device=v.device)
               for v in (self.valid, other.valid)]
        self.valid = torch.cat([torch.cat([self.valid, pad[0]], dim=1), torch.cat([other.valid, pad[1]], dim=1)])

    def row_entries(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row `row`'s cached entries with the holes stripped: per layer (keys, values) [heads, n, dim]."""
        keep = self.valid[row].nonzero().flatten()
        return [(layer.keys[row][:, keep], layer.values[row][:, keep]) for layer in self.cache.layers
                if layer.keys is not None]


def prefill_rows(model, rows: list, device) -> RaggedCache:
    """A fresh RaggedCache of `model` holding every row's committed[:-1] (one ragged forward; its last token is
    the next step's root)."""
    cache = RaggedCache(model, len(rows), device)
    cache.feed([r.committed[:-1] for r in rows], [0] * len(rows), device, logits_to_keep=1)
    return cache


def plain_step(cache: RaggedCache, rows: list, device, sampling: tuple | None = None,
               generator: torch.Generator | list[torch.Generator] | None = None, on_hidden=None) -> list[int]:
    """One batched target step: every row's last committed token through `cache` (one forward, one query per row),
    the next token per row (greedy, or drawn at `sampling` = (temperature, top_k, top_p); `generator`: one for the
    batch, or one per row). Batched AR and the speculative batch's depth-0 cycle both step with this, so "don't
    speculate" costs what batched AR costs.
    on_hidden (an EAGLE pair's session): called with the forward's hidden_states (output_hidden_states on)."""
    b = len(rows)
    roots = torch.tensor([[r.committed[-1]] for r in rows], dtype=torch.long, device=device)
    positions = torch.tensor([[len(r.committed) - 1] for r in rows], dtype=torch.long, device=device)
    ones = torch.ones(b, 1, dtype=torch.bool, device=device)
    logits, hidden_states = cache.forward_out(roots, positions, ones[:, :, None].clone(), ones, logits_to_keep=1,
                                              output_hidden_states=on_hidden is not None)
    logits = logits[:, -1]
    if on_hidden is not None:
        on_hidden(hidden_states)
    if sampling is None:
        return logits.argmax(dim=-1).tolist()
    probs = sampling_probs(logits, *sampling)
    if isinstance(generator, list):  # per-sequence seeds: each row draws from its own generator
        return [int(torch.multinomial(probs[i], 1, generator=g)) for i, g in enumerate(generator)]
    return torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()


def row_generators(seed, n: int, device) -> torch.Generator | list[torch.Generator]:
    """The batch's random generators: seed an int or None -> one shared generator (None: a random seed); a list
    of n ints -> one generator per prompt (per-sequence seeds). Bad seeds raise TypeError / ValueError."""
    seeds = seed if isinstance(seed, (list, tuple)) else [seed]
    if isinstance(seed, (list, tuple)) and len(seeds) != n:
        raise ValueError(f"seed: {len(seeds)} per-sequence seeds for {n} prompts")
    gens = []
    for s in seeds:
        if s is not None:
            check_int("seed", s)
        gen = torch.Generator(device=device)
        gen.manual_seed(int(s) if s is not None else int(torch.randint(0, 2**62, ()).item()))
        gens.append(gen)
    return gens if isinstance(seed, (list, tuple)) else gens[0]


def _row_generator(generator, row):
    """The generator `row` draws from (its own under per-sequence seeds)."""
    return generator[row.index] if isinstance(generator, list) else generator


def _step_generators(generator, rows: list):
    return [generator[r.index] for r in rows] if isinstance(generator, list) else generator


class _Row:
    """One sequence of the batch: its committed tokens, output and per-cycle records."""

    def __init__(self, index: int, prompt: list[int], max_new_tokens: int) -> None:
        self.index = index
        self.committed = list(prompt)
        self.prompt_len = len(prompt)
        self.max_new_tokens = max_new_tokens
        self.new_tokens: list[int] = []
        self.cycles: list[CycleRecord] = []
        self.token_times: list[float] = []
        self.finished_by: str | None = None
        self.acceptance = 1.0
        self.draft_committed = 0        # committed tokens the drafter has accounted for (entries: minus its offset)
        self.features = FeatureBuffer()  # EAGLE: the target's aux states of committed positions the head will read
        self.tree: DraftTree | None = None
        self.fed = 0
        self.start = 0.0                # clock reading when its decoding started (after its prefill)
        self.prefill_s = 0.0

    def truncate(self, emitted: list[int], eos: int | None) -> list[int]:
        """Never emit past EOS or max_new_tokens (as DecodingSession._truncate)."""
        left = self.max_new_tokens - len(self.new_tokens)
        if eos is not None and eos in emitted[:left]:
            self.finished_by = "eos"
            left = emitted.index(eos) + 1
        elif len(emitted) >= left:
            self.finished_by = "length"
        return emitted[: emitted_count(len(emitted) - 1, left)]


class BatchSession:
    """B prompts advanced together through the cycle's step protocol (see the module docstring). States and the
    returned CycleRecords are the lead row's (the first unfinished one); `outputs()` gives every row's."""

    def __init__(self, decoder, prompts: list[list[int]], *, max_new_tokens, sampling: tuple | None = None,
                 seed: int | None = None, max_batch: int | None = None) -> None:
        pair, tree = decoder.pair, decoder.tree
        self.pair, self.tree_config = pair, tree
        self.max_depth = tree.max_depth
        self.width = tree.width
        self.device = pair.device
        self.clock = Clock(self.device)
        self.eos = pair.eos_token_id
        self.sampling = sampling  # (temperature, top_k, top_p), None for greedy
        self.generator = row_generators(seed, len(prompts), self.device)
        self.capacity = num_candidates(tree.width, tree.max_depth)
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(prompts)
        self.rows = [_Row(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_new_tokens))]
        self.max_batch = len(self.rows) if max_batch is None else check_int("max_batch", max_batch, minimum=1)
        self.active: list[_Row] = self.rows[: self.max_batch]
        self.queue: list[_Row] = self.rows[self.max_batch:]    # continuous batching: admitted as rows finish
        self.drafter = make_drafter(pair)
        self.needs_features = self.drafter.needs_features
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
        with torch.inference_mode():
            t0 = self.clock.now()
            self.target = self._prefill_target(self.active)
            return self.clock.now() - t0

    def _prefill_target(self, rows: list[_Row]) -> RaggedCache:
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

    def _feed_draft(self, cache: RaggedCache, rows: list[_Row], *, to_root: bool) -> tuple | None:
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
        with torch.inference_mode():
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
    def lead(self) -> _Row:
        return self.active[0]

    @property
    def done(self) -> bool:
        return not self.active

    @property
    def finished_by(self) -> str | None:
        return None if self.active else (self.rows[0].finished_by or "length")

    @property
    def prompt_len(self) -> int:
        return self.lead.prompt_len if self.active else self.rows[0].prompt_len

    @property
    def tokens_emitted(self) -> int:
        return len((self.lead if self.active else self.rows[0]).new_tokens)

    @property
    def can_draft(self) -> bool:
        """A draft LM always can; an EAGLE head needs a target feature before every row's root (False while some
        row's whole context is one token: the cycle is a plain step)."""
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
            depth=self._depth, max_depth=self.max_depth, width=self.width, context_len=len(row.committed),
            scores=scores, level_start=level_start,
            sorted_scores=tree.sorted_scores if tree is not None else None,
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
        with torch.inference_mode():
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
        with torch.inference_mode():
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
        with torch.inference_mode():
            t0 = self.clock.now()
            results = self._verify_plain() if self._depth == 0 else self._verify_trees(size)
            emitted_rows = []
            for row, (accepted, emitted) in zip(self.active, results):
                emitted = row.truncate(emitted, self.eos)
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
        with torch.inference_mode():
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
                            _step_generators(self.generator, self.active), on_hidden=keep)
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
                path, bonus = accept_tree_sampled(blk, logits[b], self.sampling, _row_generator(self.generator, r))
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


def autoregressive_generate_batch(pair, prompts, *, max_new_tokens=128, max_batch: int | None = None,
                                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                                  seed=None) -> list[GenerationOutput]:
    """Target-only decoding of several prompts together (the batched baseline): greedy, or at temperature > 0
    drawn from the target's (top-k / top-p filtered) law with `seed` as `generate_batch` takes it (an int for the
    batch, or one per prompt: per-sequence seeds). One ragged prefill of every
    prompt[:-1], then one target forward per step over every unfinished row's last token (`plain_step`, the step
    BatchSession's depth-0 cycle takes); rows leave the batch at EOS or their max_new_tokens (one int, or one per
    prompt). max_batch: at most this many rows at once, finished rows refilled from the remaining prompts in order
    (continuous batching, as `generate_batch(max_batch=)`). Same caches, masks and timing as BatchSession's plain
    steps; the draft is never touched."""
    ids, budgets = batch_inputs(pair, prompts, max_new_tokens, lookahead=0)
    device, clock, eos = pair.device, Clock(pair.device), pair.eos_token_id
    check_float("temperature", temperature, minimum=0.0)
    check_int("top_k (0 disables it)", top_k, minimum=0)
    check_float("top_p", top_p, minimum=0.0, maximum=1.0, open_low=True)
    sampling = (temperature, top_k, top_p) if temperature > 0 else None
    generator = row_generators(seed, len(ids), device) if sampling is not None else None
    rows = [_Row(i, p, m) for i, (p, m) in enumerate(zip(ids, budgets))]
    limit = len(rows) if max_batch is None else check_int("max_batch", max_batch, minimum=1)
    active, queue = rows[:limit], rows[limit:]
    with torch.inference_mode():
        t0 = clock.now()
        cache = prefill_rows(pair.target, active, device)
        start = clock.now()
        for r in active:
            r.start, r.prefill_s = start, start - t0
        while active:
            tokens = plain_step(cache, active, device, sampling, _step_generators(generator, active))
            now = clock.now()
            for row, token in zip(active, tokens):
                emitted = row.truncate([token], eos)
                row.committed.extend(emitted)
                row.new_tokens.extend(emitted)
                row.token_times.append(now - row.start)
            alive = [i for i, r in enumerate(active) if r.finished_by is None]
            if len(alive) < len(active):
                active = [active[i] for i in alive]
                if active or queue:
                    cache.select_rows(torch.tensor(alive, dtype=torch.long, device=device))
            take, queue = queue[: limit - len(active)], queue[limit - len(active):]
            if take:
                t1 = clock.now()
                cache.compact()
                cache.append_rows(prefill_rows(pair.target, take, device))
                now = clock.now()
                for r in take:
                    r.start, r.prefill_s = now, now - t1
                active.extend(take)
    return [GenerationOutput(tokens=list(r.new_tokens), prompt_len=r.prompt_len, prefill_s=r.prefill_s,
                             total_s=r.token_times[-1] if r.token_times else 0.0, token_times=list(r.token_times),
                             finished_by=r.finished_by or "length", text=pair.decode(r.new_tokens)) for r in rows]
