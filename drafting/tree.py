"""Tree drafting (EAGLE-2/3 style dynamic tree) with the drafter's own KV cache.

The drafter is a separate LM or an EAGLE-3 head (`specpilot.drafting.drafters`); the tree logic is the same.
Level 1: one drafter forward over the committed tokens it has not seen yet (the newly emitted tokens, root last;
an EAGLE head also reads the target's features of the tokens before them); the top-W children of the root are
level-1 candidates and the first frontier.
Level d >= 2: one drafter forward over the W frontier nodes with tree attention (each node sees the committed
prefix, its ancestors and itself; position = root position + depth; an EAGLE head is fed its own output hidden at
the node's parent). Each frontier node's top-W children are candidates (W*W per level), scored by cumulative draft
log-probability; the global top-W become the next frontier. An EAGLE head drafts over its reduced vocabulary,
mapped to target ids.
W = 1 is a chain. With `sample_chain` (W = 1, temperature > 0) each level's token is drawn from the draft's sampling
distribution instead of taken by argmax, for Leviathan-style verification.

Node ids are assigned level by level, so sorting by (score desc, id asc) is ancestor-closed: a parent's score is
>= its child's and its id is smaller.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specpilot.drafting.cache import crop_to
from specpilot.drafting.sampling import sampling_probs


@dataclass
class DraftTree:
    """Flat arrays over candidate nodes (root excluded). parents[i] == -1 means the root is the parent."""

    tokens: torch.Tensor        # [cap] long
    parents: torch.Tensor       # [cap] long
    depths: torch.Tensor        # [cap] long, 1-based
    scores: torch.Tensor        # [cap] float32 cumulative draft log-probability
    ancestors: torch.Tensor     # [cap, cap] bool, ancestors[i, j]: j is i or an ancestor of i
    size: int = 0
    depth: int = 0
    frontier: torch.Tensor | None = None        # node ids of the current frontier
    draft_probs: list[torch.Tensor] | None = None  # sampled chain only: q at each level [vocab]
    _ranking: tuple | None = None                   # (sorted scores, node ids) for the tree of size _ranked_size
    _ranked_size: int = -1
    scores_view: np.ndarray | None = None           # CPU trees: a numpy view of `scores` (reading it costs no torch op)

    @classmethod
    def empty(cls, capacity: int, device: torch.device) -> "DraftTree":
        tree = cls(
            tokens=torch.zeros(capacity, dtype=torch.long, device=device),
            parents=torch.full((capacity,), -1, dtype=torch.long, device=device),
            depths=torch.zeros(capacity, dtype=torch.long, device=device),
            scores=torch.zeros(capacity, dtype=torch.float32, device=device),
            ancestors=torch.zeros(capacity, capacity, dtype=torch.bool, device=device),
        )
        if tree.scores.device.type == "cpu":
            tree.scores_view = tree.scores.numpy()  # shares memory: add_level's writes show through
        return tree

    def add_level(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Append one level of nodes; returns their ids."""
        n = int(tokens.numel())
        ids = torch.arange(self.size, self.size + n, device=tokens.device)
        self.tokens[ids] = tokens
        self.parents[ids] = parents
        self.depth += 1
        self.depths[ids] = self.depth
        self.scores[ids] = scores.float()
        if self.depth > 1:
            self.ancestors[ids] = self.ancestors[parents]
        self.ancestors[ids, ids] = True
        self.size += n
        return ids

    def ranking(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores sorted descending, node ids) of all candidates, ties by id asc: the order in which candidates are
        chosen for verification. One sort per tree size, shared by a size policy's observation and verification."""
        if self._ranked_size != self.size:
            # stable descending sort keeps smaller ids first among equal scores (ancestor closure under ties)
            values, ids = torch.sort(self.scores[: self.size], descending=True, stable=True)
            self._ranking, self._ranked_size = (values, ids), self.size
        return self._ranking

    def ranked(self) -> torch.Tensor:
        """All node ids by (score desc, id asc)."""
        return self.ranking()[1]


class TreeDrafter:
    """Owns the drafter's cache and grows one draft tree per cycle, from either kind of drafter
    (`specpilot.drafting.drafters`: a separate LM or an EAGLE-3 head) through the same steps.

    committed: committed tokens the drafter has accounted for (its cache holds their entries: committed - offset
    positions; it is cropped back to them after a cycle).
    """

    def __init__(self, drafter, width: int, max_depth: int, sample_chain: bool = False) -> None:
        if not hasattr(drafter, "forward") or not hasattr(drafter, "offset"):
            from specpilot.drafting.drafters import LMDrafter

            drafter = LMDrafter(drafter)  # a bare causal LM
        self.drafter = drafter
        self.width = width
        self.max_depth = max_depth
        self.sample_chain = sample_chain
        self.cache = drafter.new_cache()
        self.device = None
        self.committed = 0
        self.capacity = width + (max_depth - 1) * width * width
        self.tree: DraftTree | None = None
        self.root_position = 0
        self._fed: torch.Tensor | None = None  # node ids fed to the drafter this cycle, in cache order
        self._node_hidden: torch.Tensor | None = None  # EAGLE: the hidden each node is fed with (its parent's output)
        self.last_top_prob = 1.0
        self.last_entropy = 0.0

    @property
    def prefix_len(self) -> int:
        """Cache positions holding committed entries (tree nodes come after them)."""
        return max(0, self.committed - self.drafter.offset)

    def can_start(self, unseen: int) -> bool:
        """Whether a cycle can draft after feeding `unseen` more committed tokens (an EAGLE head needs the target's
        feature of the token before the root: none exists while the whole context is one token)."""
        return self.committed + unseen > self.drafter.offset

    def entries(self, tokens: list[int]) -> int:
        """How many of these next committed tokens get a cache entry (an EAGLE head has none for the context's
        first token: no target feature precedes it)."""
        return max(0, len(tokens) - max(0, self.drafter.offset - self.committed))

    def feed(self, tokens: list[int], features: torch.Tensor | None = None, *, last_only: bool = True):
        """Feed committed tokens. features (EAGLE): one row per token that gets an entry (`entries`), the target's
        feature of the token before it. Returns the drafter's (log-probs, hidden) of the fed rows (last only)."""
        skip = max(0, self.drafter.offset - self.committed)
        start = self.prefix_len
        self.committed += len(tokens)
        tokens = tokens[skip:]
        if not tokens:
            return None
        if features is not None:
            assert features.shape[0] == len(tokens), "one target feature per fed token"
        device = self._device()
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        positions = torch.arange(start, start + len(tokens), device=device)[None]
        hidden = features[None] if features is not None else None
        return self.drafter.forward(ids, hidden, positions, None, self.cache, last_only=last_only)

    def _device(self) -> torch.device:
        if self.device is None:
            model = getattr(self.drafter, "model", None) or self.drafter.head
            self.device = next(model.parameters()).device
        return self.device

    def prefill(self, tokens: list[int], features: torch.Tensor | None = None) -> None:
        """Feed committed tokens without drafting (prompt prefill; not timed by callers)."""
        if tokens:
            self.feed(tokens, features)

    def _children(self, logq: torch.Tensor, sampling: tuple | None, generator) -> tuple:
        """log-probs [n, V_draft] -> (child target ids [n, k], child log-probs [n, k], q over the target vocabulary
        or None)."""
        if self.sample_chain and sampling is not None:
            q_draft = sampling_probs(logq, *sampling)                          # [1, V_draft]
            local = torch.multinomial(q_draft, 1, generator=generator)         # [1, 1]
            q = self._target_probs(q_draft[0])
            return self.drafter.to_target(local), logq.gather(-1, local), q
        values, local = torch.topk(logq, self.width, dim=-1)
        return self.drafter.to_target(local), values, None

    def _target_probs(self, q_draft: torch.Tensor) -> torch.Tensor:
        """A distribution over the drafter's vocabulary, placed on the target's ids (zero elsewhere)."""
        if self.drafter.offset == 0:
            return q_draft
        ids = self.drafter.to_target(torch.arange(q_draft.numel(), device=q_draft.device))
        return torch.zeros(self.drafter.head.config.vocab_size, device=q_draft.device).scatter(0, ids, q_draft)

    def _record_features(self, logq_row: torch.Tensor, child_logprob: float) -> None:
        p = logq_row.exp()
        self.last_entropy = float(-(p * logq_row).sum())
        self.last_top_prob = math.exp(child_logprob)

    def start_cycle(self, new_tokens: list[int], sampling: tuple | None = None, generator=None,
                    features: torch.Tensor | None = None) -> DraftTree:
        """Level 1: feed the committed tokens the drafter has not seen (root last) and take the root's children."""
        assert new_tokens, "a cycle needs at least the root token"
        logq, hidden = self.feed(new_tokens, features, last_only=True)      # [1, V], [1, H] | None
        self.root_position = self.prefix_len - 1
        tokens, logprobs, q = self._children(logq, sampling, generator)
        tree = DraftTree.empty(self.capacity, self._device())
        ids_level = tree.add_level(tokens[0], torch.full_like(tokens[0], -1), logprobs[0])
        tree.frontier = ids_level
        tree.draft_probs = [q] if q is not None else None
        if hidden is not None:
            self._node_hidden = hidden.new_empty(self.capacity, hidden.shape[-1])
            self._node_hidden[ids_level] = hidden[0]
        self._fed = ids_level[:0]
        self.tree = tree
        self._record_features(logq[0], float(logprobs[0, 0]))
        return tree

    def extend(self, sampling: tuple | None = None, generator=None) -> DraftTree:
        """Level d >= 2: one drafter forward over the frontier with tree attention; W*W new candidates."""
        tree = self.tree
        assert tree is not None and tree.depth >= 1, "call start_cycle first"
        if tree.depth >= self.max_depth:
            raise RuntimeError(f"the tree already has max_depth={self.max_depth} levels")
        frontier = tree.frontier                                   # [n]
        n = int(frontier.numel())
        self._fed = torch.cat([self._fed, frontier])               # cache order of fed tree nodes
        # mask [1, 1, n, prefix + fed]: prefix visible to all; among fed nodes only ancestors (incl. self)
        tree_part = tree.ancestors[frontier][:, self._fed]         # [n, fed]
        prefix_part = torch.ones(n, self.prefix_len, dtype=torch.bool, device=tree_part.device)
        mask = torch.cat([prefix_part, tree_part], dim=1)[None, None]
        positions = torch.full((1, n), self.root_position + tree.depth, dtype=torch.long, device=mask.device)
        hidden = self._node_hidden[frontier][None] if self._node_hidden is not None else None
        logq, out = self.drafter.forward(tree.tokens[frontier][None], hidden, positions, mask, self.cache)  # [n, V]
        child_tokens, child_logprobs, q = self._children(logq, sampling, generator)  # [n, k]
        k = child_tokens.shape[1]
        cumulative = tree.scores[frontier][:, None] + child_logprobs  # [n, k]
        parents = frontier[:, None].expand(n, k)
        ids = tree.add_level(child_tokens.reshape(-1), parents.reshape(-1), cumulative.reshape(-1))
        if out is not None:
            self._node_hidden[ids] = out.repeat_interleave(k, dim=0)  # each child is fed with its parent's output
        best = int(torch.argmax(cumulative.reshape(-1)))
        tree.frontier = ids[torch.topk(cumulative.reshape(-1), min(self.width, ids.numel())).indices]
        if q is not None:
            tree.draft_probs.append(q)
        self._record_features(logq[best // k], float(child_logprobs.reshape(-1)[best]))
        return tree

    def end_cycle(self) -> None:
        """Drop the tree nodes from the drafter's cache: it again holds exactly the committed entries."""
        crop_to(self.cache, self.prefix_len)
        self.tree = None
