"""The two kinds of drafter behind one small interface: a separate causal LM, or an EAGLE-3 head on the target.

The tree drafter (`drafting/tree.py`) only ever calls:

    drafter.new_cache()                           an empty KV cache
    drafter.forward(tokens, hidden, position_ids, attention_mask, cache)
        tokens [1, n] target ids; hidden [1, n, H] (EAGLE: fused target features or the head's own outputs; None
        for an LM); returns (log-probabilities [n, V_draft] float32, output hidden [n, H] or None)
    drafter.to_target(ids)                        ids in the drafter's vocabulary -> target ids
    drafter.offset                                committed token m sits at drafter position m - offset (EAGLE's
                                                  entry for c_m pairs it with the target feature of c_{m-1}, so c_0
                                                  has no entry: offset 1)
    drafter.needs_features                        the session must hand over the target's aux hidden states
    drafter.vocab_size                            V_draft
    drafter.target_probs(q)                       distributions [n, V_draft] placed on the target's ids [n, V]

`target_features(pair, hidden_states, rows)` turns a target forward's `output_hidden_states` into what an EAGLE
drafter consumes (None for an LM drafter, which needs nothing from the target); `aux_states` + `fuse_aux` are its two
halves, so a session can keep the cheap half and fuse only what the head reads. `FeatureBuffer` is that bookkeeping
for one sequence (the single-sequence session keeps one, the batch one per row); `aux_batch` is the batched
`aux_states` ([B, q, 3 * H_target]).

Batched drafting (`drafting/batch.py`) calls `drafter.forward_batch(tokens [B, q], hidden [B, q, H] | None,
position_ids [B, q], attention_mask [B, 1, q, L + q], cache)` -> (raw logits [B, q, V_draft], output hidden
[B, q, H] or None): the same models, batched, with per-row 4-D masks and positions.
"""
from __future__ import annotations

import torch

from specpilot.drafting.attention import FULL_ATTENTION, MaskLayout
from specpilot.drafting.cache import new_cache


class LMDrafter:
    """A separate causal LM sharing the target's vocabulary. Its output rows may be padded differently from the
    target's (Qwen2.5-0.5B 151,936 vs 7B 152,064 for one tokenizer): it then drafts over the first `vocab_size`
    ids both models have (`ModelPair` checks the tokenizer's ids lie below it), and its distributions are placed
    on the target's ids with zeros above."""

    offset = 0
    needs_features = False
    kind = "draft_lm"

    def __init__(self, model, target_vocab_size: int | None = None) -> None:
        self.model = model
        self.mask_layout = MaskLayout.of(model)  # mask format and sliding windows (drafting/attention.py)
        rows = int(model.get_output_embeddings().weight.shape[0])
        self.target_vocab_size = rows if target_vocab_size is None else int(target_vocab_size)
        self.vocab_size = min(rows, self.target_vocab_size)
        self._rows = rows

    def new_cache(self):
        return new_cache(self.model)

    def forward(self, tokens, hidden, position_ids, attention_mask, cache, *, last_only: bool = False):
        kwargs = {"logits_to_keep": 1} if last_only else {}
        if attention_mask is not None:
            kwargs.update(attention_mask=attention_mask, position_ids=position_ids)
        logits = self.model(input_ids=self._embeddable(tokens), cache=cache, use_cache=True, **kwargs).logits[0]
        return torch.log_softmax(self._shared(logits).float(), dim=-1), None

    def forward_batch(self, tokens, hidden, position_ids, attention_mask, cache, *, logits_to_keep: int = 0):
        kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
        out = self.model(input_ids=self._embeddable(tokens), attention_mask=attention_mask,
                         position_ids=position_ids, cache=cache, use_cache=True, **kwargs)
        return self._shared(out.logits), None

    def _embeddable(self, tokens: torch.Tensor) -> torch.Tensor:
        """Committed ids the draft has rows for: a target with more (padding) rows can, in principle, emit an id
        past the draft's; the draft reads its last row instead (only its guesses change, never the output)."""
        return tokens.clamp(max=self._rows - 1) if self._rows < self.target_vocab_size else tokens

    def _shared(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the ids the target has too (padding rows past them are never drafted)."""
        return logits[..., : self.vocab_size] if self._rows > self.vocab_size else logits

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def target_probs(self, q: torch.Tensor) -> torch.Tensor:
        if q.shape[-1] == self.target_vocab_size:
            return q
        return torch.nn.functional.pad(q, (0, self.target_vocab_size - q.shape[-1]))


class EagleDrafter:
    """An EAGLE-3 head (`specpilot.drafting.eagle.Eagle3Head`) reading the target's features."""

    offset = 1
    needs_features = True
    kind = "eagle3"

    mask_layout = FULL_ATTENTION  # one full-attention layer taking boolean masks, over its own cache

    def __init__(self, head) -> None:
        self.head = head
        self.vocab_size = int(head.config.draft_vocab_size)

    def new_cache(self):
        return self.head.new_cache()

    def forward(self, tokens, hidden, position_ids, attention_mask, cache, *, last_only: bool = False):
        logits, out = self.head(tokens, hidden, position_ids=position_ids, attention_mask=attention_mask,
                                cache=cache, logits_to_keep=1 if last_only else 0)
        logits, out = logits[0], out[0]
        if last_only:
            out = out[-1:]
        return torch.log_softmax(logits, dim=-1), out

    def forward_batch(self, tokens, hidden, position_ids, attention_mask, cache, *, logits_to_keep: int = 0):
        logits, out = self.head(tokens, hidden, position_ids=position_ids, attention_mask=attention_mask, cache=cache,
                                logits_to_keep=logits_to_keep)
        return logits, (out[:, -logits_to_keep:] if logits_to_keep else out)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(ids)

    def target_probs(self, q: torch.Tensor) -> torch.Tensor:
        ids = self.to_target(torch.arange(q.shape[-1], device=q.device))
        out = torch.zeros(q.shape[0], self.head.config.vocab_size, device=q.device, dtype=q.dtype)
        return out.index_copy_(1, ids, q)


def make_drafter(pair):
    """The pair's drafter: its EAGLE-3 head when it has one, else its draft LM."""
    if getattr(pair, "eagle", None) is not None:
        return EagleDrafter(pair.eagle)
    return LMDrafter(pair.draft, target_vocab_size=pair.vocab_size)


def aux_states(pair, hidden_states, rows: torch.Tensor | list[int] | None = None) -> torch.Tensor | None:
    """The target forward's aux-layer hidden states of rows `rows` (all when None), concatenated: [k, 3 * H_target].
    None without a head. No matmul: the decoder keeps these and fuses them only when the head reads them, so a plain
    target step (depth 0) pays nothing for the head."""
    head = getattr(pair, "eagle", None)
    if head is None:
        return None
    if rows is None:
        return torch.cat([hidden_states[i][0] for i in head.aux_layer_ids], dim=-1)
    return torch.cat([hidden_states[i][0, rows] for i in head.aux_layer_ids], dim=-1)


def aux_batch(pair, hidden_states) -> torch.Tensor | None:
    """Every row's and query's aux-layer states of a batched target forward, concatenated: [B, q, 3 * H_target]
    (None without a head). Rows then keep their own slices (`FeatureBuffer.keep`)."""
    head = getattr(pair, "eagle", None)
    if head is None:
        return None
    return torch.cat([hidden_states[i] for i in head.aux_layer_ids], dim=-1)


class FeatureBuffer:
    """One sequence's target aux states of the contiguous positions at.., kept unfused until the head reads them
    (the fc runs once per cycle over the rows the head reads, so a streak of plain steps costs no head work)."""

    __slots__ = ("parts", "length", "at")

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.length = self.at = 0

    def keep(self, new: torch.Tensor, position: int) -> None:
        """Append aux states [k, 3 * H_target] of positions position..position + k - 1."""
        if not self.parts:
            self.at = position
        assert position == self.at + self.length, "features must stay contiguous"
        self.parts.append(new)  # joined when the drafter reads them: no copy per plain step
        self.length += new.shape[0]

    def take(self, end: int, count: int) -> torch.Tensor:
        """The aux states of positions end - count .. end - 1 (unfused), forgetting every position before `end`
        (the head's entry for committed token j reads the feature at j - 1: the next token fed reads `end`)."""
        at = self.at
        kept = torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0]
        rows = kept[end - count - at: end - at]
        rest = kept[end - at:]
        self.parts, self.length, self.at = [rest], rest.shape[0], end
        return rows


def fuse_aux(pair, aux: torch.Tensor) -> torch.Tensor:
    """[k, 3 * H_target] aux states -> the head's fused features fc(aux) [k, H]."""
    fc = pair.eagle.fc
    return fc(aux.to(fc.weight.dtype))


def target_features(pair, hidden_states, rows: torch.Tensor | list[int] | None = None) -> torch.Tensor | None:
    """Fused EAGLE features [k, H] of the target forward's rows `rows` (all when None), or None without a head."""
    aux = aux_states(pair, hidden_states, rows)
    return None if aux is None else fuse_aux(pair, aux)
