"""Tree drafting (EAGLE-2/3 style dynamic tree) with the draft model's own KV cache.

Level 1: one draft forward over the tokens the draft has not seen yet (the newly emitted tokens, root last); the
top-W children of the root are level-1 candidates and the first frontier.
Level d >= 2: one draft forward over the W frontier nodes with tree attention (each node sees the committed prefix,
its ancestors and itself; position = root position + depth). Each frontier node's top-W children are candidates
(W*W per level), scored by cumulative draft log-probability; the global top-W become the next frontier.
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

from specpilot.drafting.cache import crop_to, new_cache
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
    """Owns the draft model's cache and grows one draft tree per cycle.

    committed: number of committed tokens the draft's cache holds (its cache is cropped back to it after a cycle).
    """

    def __init__(self, draft, width: int, max_depth: int, sample_chain: bool = False) -> None:
        self.model = draft
        self.width = width
        self.max_depth = max_depth
        self.sample_chain = sample_chain
        self.device = next(draft.parameters()).device
        self.cache = new_cache(draft)
        self.committed = 0
        self.capacity = width + (max_depth - 1) * width * width
        self.tree: DraftTree | None = None
        self.root_position = 0
        self._fed: torch.Tensor | None = None  # node ids fed to the draft this cycle, in cache order
        self.last_top_prob = 1.0
        self.last_entropy = 0.0

    def prefill(self, tokens: list[int]) -> None:
        """Feed committed tokens without drafting (prompt prefill; not timed by callers)."""
        if tokens:
            ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
            self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1)
            self.committed += len(tokens)

    def _logprobs_to_children(self, logits: torch.Tensor, sampling: tuple | None, generator) -> tuple:
        """logits [n, vocab] -> (child tokens [n, k], child log-probs [n, k], q or None)."""
        logq = torch.log_softmax(logits.float(), dim=-1)
        if self.sample_chain and sampling is not None:
            q = sampling_probs(logits, *sampling)  # [1, vocab]
            token = torch.multinomial(q, 1, generator=generator)  # [1, 1]
            return token, logq.gather(-1, token), q[0]
        values, tokens = torch.topk(logq, self.width, dim=-1)
        return tokens, values, None

    def _record_features(self, logq_row: torch.Tensor, child_logprob: float) -> None:
        p = logq_row.exp()
        self.last_entropy = float(-(p * logq_row).sum())
        self.last_top_prob = math.exp(child_logprob)

    def start_cycle(self, new_tokens: list[int], sampling: tuple | None = None, generator=None) -> DraftTree:
        """Level 1: feed the committed tokens the draft has not seen (root last) and take the root's children."""
        assert new_tokens, "a cycle needs at least the root token"
        ids = torch.tensor([new_tokens], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.committed += len(new_tokens)
        self.root_position = self.committed - 1
        logits = out.logits[0, -1:]  # [1, vocab]
        tokens, logprobs, q = self._logprobs_to_children(logits, sampling, generator)
        tree = DraftTree.empty(self.capacity, self.device)
        ids_level = tree.add_level(tokens[0], torch.full_like(tokens[0], -1), logprobs[0])
        tree.frontier = ids_level
        tree.draft_probs = [q] if q is not None else None
        self._fed = ids_level[:0]
        self.tree = tree
        logq_root = torch.log_softmax(logits[0].float(), dim=-1)
        self._record_features(logq_root, float(logprobs[0, 0]))
        return tree

    def extend(self, sampling: tuple | None = None, generator=None) -> DraftTree:
        """Level d >= 2: one draft forward over the frontier with tree attention; W*W new candidates."""
        tree = self.tree
        assert tree is not None and tree.depth >= 1, "call start_cycle first"
        if tree.depth >= self.max_depth:
            raise RuntimeError(f"the tree already has max_depth={self.max_depth} levels")
        frontier = tree.frontier                                   # [n]
        n = int(frontier.numel())
        self._fed = torch.cat([self._fed, frontier])               # cache order of fed tree nodes
        # mask [1, 1, n, committed + fed]: prefix visible to all; among fed nodes only ancestors (incl. self)
        tree_part = tree.ancestors[frontier][:, self._fed]         # [n, fed]
        prefix_part = torch.ones(n, self.committed, dtype=torch.bool, device=self.device)
        mask = torch.cat([prefix_part, tree_part], dim=1)[None, None]
        position = self.root_position + tree.depth
        positions = torch.full((1, n), position, dtype=torch.long, device=self.device)
        out = self.model(input_ids=tree.tokens[frontier][None], attention_mask=mask, position_ids=positions,
                         cache=self.cache, use_cache=True)
        logits = out.logits[0]                                     # [n, vocab]
        child_tokens, child_logprobs, q = self._logprobs_to_children(logits, sampling, generator)  # [n, k]
        k = child_tokens.shape[1]
        cumulative = tree.scores[frontier][:, None] + child_logprobs  # [n, k]
        parents = frontier[:, None].expand(n, k)
        ids = tree.add_level(child_tokens.reshape(-1), parents.reshape(-1), cumulative.reshape(-1))
        best = int(torch.argmax(cumulative.reshape(-1)))
        tree.frontier = ids[torch.topk(cumulative.reshape(-1), min(self.width, ids.numel())).indices]
        if q is not None:
            tree.draft_probs.append(q)
        logq_parent = torch.log_softmax(logits[best // k].float(), dim=-1)
        self._record_features(logq_parent, float(child_logprobs.reshape(-1)[best]))
        return tree

    def end_cycle(self) -> None:
        """Drop the tree nodes from the draft cache: it again holds exactly the committed tokens it has seen."""
        crop_to(self.cache, self.committed)
        self.tree = None
