"""Batched autoregressive decoding, and the ragged-batch parts batched speculative decoding shares with it.

`autoregressive_generate_batch` is the batched baseline; `specpilot.drafting.batch.BatchSession` (speculative) steps
with the same `plain_step` when a cycle does not draft, over the same `RaggedCache`, `BatchRow`s and per-row
generators, so "don't speculate" costs exactly what batched AR costs.

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
"""
from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

import numpy as np
import torch

from specpilot.drafting.attention import MaskLayout, decoding_mode, model_mask
from specpilot.drafting.cache import new_cache
from specpilot.drafting.checks import check_float, check_int, check_seed, warn_unused_sampling
from specpilot.drafting.drafters import FeatureBuffer
from specpilot.drafting.generation_defaults import warn_generation_config
from specpilot.drafting.timing import Clock
from specpilot.drafting.tree import DraftTree
from specpilot.drafting.types import CycleRecord, GenerationOutput
from specpilot.drafting.sampling import draw, sampling_probs
from specpilot.drafting.stopping import StopStrings, request_ending, truncate_emitted

PAD = 0  # token id written into holes (never attended to by a real query)


def batch_inputs(pair, prompts, max_new_tokens, *, lookahead: int) -> tuple[list[list[int]], list[int]]:
    """Prompts as token-id lists and one max_new_tokens per prompt (an int applies to all), each checked as
    `generate` checks its prompt (non-empty, fits the context with `lookahead` draft positions)."""
    from specpilot.drafting.checks import check_context
    from specpilot.drafting.pair import padded_rows, tokenizer_rows

    if isinstance(prompts, Mapping) and "input_ids" in prompts:  # a tokenizer's output: rows without the padding
        prompts = tokenizer_rows(prompts)
    elif isinstance(prompts, torch.Tensor) or (isinstance(prompts, np.ndarray)
                                               and np.issubdtype(prompts.dtype, np.integer)):  # ids, one row each
        if prompts.ndim != 2:
            raise ValueError(f"prompts as a tensor or array must be 2-D (one row of ids per prompt), got shape "
                             f"{list(prompts.shape)}: for one prompt pass [ids] or call generate")
        prompts = prompts.tolist()
        pads = (getattr(getattr(pair, "tokenizer", None), "pad_token_id", None), *pair.eos_token_ids)
        padded = padded_rows(prompts, pads)
        if padded:
            raise ValueError(f"rows {padded[:5]} of the prompt tensor start or end with a pad or end id where "
                             "others do not: a padded batch would decode its padding as prompt text. Pass the "
                             "tokenizer's output with its attention_mask (generate_batch(tokenizer(texts, "
                             "padding=True, return_tensors='pt'))) or a list of unpadded prompts")
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list of prompts, got one string: pass [text] for a batch of one, or call "
                        "generate(text)")
    if not hasattr(prompts, "__len__"):
        raise TypeError(f"prompts must be a non-empty list of prompts (strings or token-id lists), got "
                        f"{type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of prompts (strings or token-id lists)")
    if isinstance(prompts, (AbstractSet, Mapping)):  # outputs come back in the prompts' order: it must have one
        raise TypeError(f"prompts must be a list or tuple (outputs come back in its order), got a "
                        f"{type(prompts).__name__}")
    if hasattr(max_new_tokens, "ndim") and hasattr(max_new_tokens, "tolist"):  # a numpy array / tensor of budgets
        max_new_tokens = max_new_tokens.tolist()
    budgets = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
    if len(budgets) != len(prompts):
        raise ValueError(f"max_new_tokens has {len(budgets)} entries for {len(prompts)} prompts")
    ids = []
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        try:
            ids.append(pair.encode(prompt))
            check_int("max_new_tokens", budget, minimum=1)
            check_context(pair, len(ids[-1]), budget, lookahead)
        except (TypeError, ValueError) as err:
            if type(err) not in (TypeError, ValueError) or len(prompts) == 1:
                raise
            raise type(err)(f"prompt {i} of {len(prompts)}: {err}") from None  # which one, in a batch
    return ids, budgets


class RaggedCache:
    """A batched DynamicCache whose rows hold different numbers of entries, with holes marked in `valid`. The
    target's is `RaggedCache(target, B, device)`; a drafter's `RaggedCache(None, B, device, drafter=...)` runs the
    drafter's `forward_batch` (`specpilot.drafting.drafters`: a draft LM or an EAGLE-3 head)."""

    def __init__(self, model, batch: int, device, drafter=None) -> None:
        self.model = model
        self.drafter = drafter
        self.cache = drafter.new_cache() if drafter is not None else new_cache(model)
        self.mask_layout = drafter.mask_layout if drafter is not None else MaskLayout.of(model)
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
        # the cached valid slots are committed tokens; the new slots are the queries (a feed can be long)
        mask = model_mask(self.mask_layout, mask, positions, self.valid, positions)
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
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                # each tensor's own heads and head dim: under MLA (DeepSeek-V2/V3) keys and values differ in both
                _, heads, _, dim = tensor.shape
                gather = index[:, None, :, None].expand(-1, heads, -1, dim)
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
            for name in ("keys", "values"):  # each with its own heads and head dim (they differ under MLA)
                tensor = getattr(layer, name)
                setattr(layer, name, tensor.gather(2, order[:, None, :, None].expand(-1, tensor.shape[1], -1,
                                                                                     tensor.shape[3])))
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
            like = known[0].keys
            for name in ("keys", "values"):
                parts = []
                _, heads, _, dim = getattr(known[0], name).shape  # keys' and values' own (they differ under MLA)
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
        return [int(draw(probs[i], g)) for i, g in enumerate(generator)]
    return draw(probs, generator)[:, 0].tolist()


def row_generators(seed, n: int, device) -> torch.Generator | list[torch.Generator]:
    """The batch's random generators: seed an int or None -> one shared generator (None: a random seed); a list
    of n ints -> one generator per prompt (per-sequence seeds). Bad seeds raise TypeError / ValueError."""
    seeds = seed if isinstance(seed, (list, tuple)) else [seed]
    if isinstance(seed, (list, tuple)) and len(seeds) != n:
        raise ValueError(f"seed: {len(seeds)} per-sequence seeds for {n} prompts")
    gens = []
    for s in seeds:
        if s is not None:
            check_seed("seed", s)
        gen = torch.Generator(device=device)
        gen.manual_seed(int(s) if s is not None else int(torch.randint(0, 2**62, ()).item()))
        gens.append(gen)
    return gens if isinstance(seed, (list, tuple)) else gens[0]


def row_generator(generator, row):
    """The generator `row` draws from (its own under per-sequence seeds)."""
    return generator[row.index] if isinstance(generator, list) else generator


def step_generators(generator, rows: list):
    return [generator[r.index] for r in rows] if isinstance(generator, list) else generator


class BatchRow:
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

    def truncate(self, emitted: list[int], eos: tuple[int, ...], stops: StopStrings | None = None,
                 stop_ids: tuple[int, ...] = ()) -> list[int]:
        """Never emit past an end id (`eos`: the pair's `eos_token_ids`, or none), max_new_tokens, a stop token id
        or a stop string (the single-sequence session's rule, `stopping.truncate_emitted`)."""
        kept, finished_by = truncate_emitted(emitted, self.new_tokens, self.max_new_tokens, eos, stops, stop_ids)
        if finished_by is not None:
            self.finished_by = finished_by
        return kept


def autoregressive_generate_batch(pair, prompts, *, max_new_tokens=128, max_batch: int | None = None,
                                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                                  seed=None, stop_strings=None, stop_token_ids=None,
                                  ignore_eos: bool = False) -> list[GenerationOutput]:
    """Target-only decoding of several prompts together (the batched baseline): greedy, or at temperature > 0
    drawn from the target's (top-k / top-p filtered) law with `seed` as `generate_batch` takes it (an int for the
    batch, or one per prompt: per-sequence seeds). One ragged prefill of every
    prompt[:-1], then one target forward per step over every unfinished row's last token (`plain_step`, the step
    BatchSession's depth-0 cycle takes); rows leave the batch at EOS or their max_new_tokens (one int, or one per
    prompt). max_batch: at most this many rows at once, finished rows refilled from the remaining prompts in order
    (continuous batching, as `generate_batch(max_batch=)`). Same caches, masks and timing as BatchSession's plain
    steps; the draft is never touched. stop_strings, stop_token_ids, ignore_eos: as `generate_batch` takes them (each
    row ends on its own)."""
    ids, budgets = batch_inputs(pair, prompts, max_new_tokens, lookahead=0)
    eos, stops, stop_ids = request_ending(pair, stop_strings, stop_token_ids, ignore_eos)
    device, clock = pair.device, Clock(pair.device)
    check_float("temperature", temperature, minimum=0.0)
    check_int("top_k (0 disables it)", top_k, minimum=0)
    check_float("top_p", top_p, minimum=0.0, maximum=1.0, open_low=True)
    warn_unused_sampling(temperature, top_k, top_p)
    warn_generation_config(pair)
    sampling = (temperature, top_k, top_p) if temperature > 0 else None
    generator = row_generators(seed, len(ids), device)  # checked greedy too, as generate_batch checks it
    generator = generator if sampling is not None else None
    rows = [BatchRow(i, p, m) for i, (p, m) in enumerate(zip(ids, budgets))]
    limit = len(rows) if max_batch is None else check_int("max_batch", max_batch, minimum=1)
    active, queue = rows[:limit], rows[limit:]
    with decoding_mode(device):
        t0 = clock.now()
        cache = prefill_rows(pair.target, active, device)
        start = clock.now()
        for r in active:
            r.start, r.prefill_s = start, start - t0
        while active:
            tokens = plain_step(cache, active, device, sampling, step_generators(generator, active))
            now = clock.now()
            for row, token in zip(active, tokens):
                emitted = row.truncate([token], eos, stops, stop_ids)
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
