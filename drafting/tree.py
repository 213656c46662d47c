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
W = 1 is a chain.

Sampled children (`sample=True`, used at temperature > 0): each expanded node's W children are drawn from the
drafter's sampling distribution q (temperature, top-k, top-p applied as to the target) WITHOUT replacement
(Gumbel-top-k: the keys' order is the sampling order), for multi-draft recursive rejection sampling at verification
(`specpilot.drafting.verify.accept_tree_recursive`). That rule is exact only if how many of a node's children are
verified never depends on those children's sampled values, so sampled children are ranked for verification by a
priority that does not read them: min(parent's priority, parent's path score + log of the i-th largest probability
of q) for the i-th child in sampling order; the true path scores (cumulative log q) still pick the frontier.
Deterministic children (`sample=False`) are the top-W by q; their priority is their path score.

Node ids are assigned level by level and, within a parent, in child order, so sorting by (priority desc, id asc) is
closed under ancestors (a child's priority never exceeds its parent's; the parent's id is smaller) and, for sampled
children, under earlier siblings (priorities fall along the sampling order).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specpilot.drafting.attention import model_mask
from specpilot.drafting.cache import crop_to
from specpilot.drafting.cycle_math import num_candidates
from specpilot.drafting.sampling import sampling_probs


@dataclass
class DraftTree:
    """Flat arrays over candidate nodes (root excluded). parents[i] == -1 means the root is the parent."""

    tokens: torch.Tensor        # [cap] long
    parents: torch.Tensor       # [cap] long
    depths: torch.Tensor        # [cap] long, 1-based
    scores: torch.Tensor        # [cap] float32 verification priority (= path score for deterministic children)
    path_scores: torch.Tensor   # [cap] float32 cumulative draft log-probability of the path to the node
    ancestors: torch.Tensor     # [cap, cap] bool, ancestors[i, j]: j is i or an ancestor of i
    size: int = 0
    depth: int = 0
    frontier: torch.Tensor | None = None        # node ids of the current frontier
    q_rows: list[torch.Tensor] | None = None    # sampled children: the q [k, target vocab] each level was drawn from
    q_index: torch.Tensor | None = None         # sampled children: [cap] row of q (over all levels) a node came from
    _ranking: tuple | None = None                   # (sorted scores, node ids) for the tree of size _ranked_size
    _ranked_size: int = -1
    scores_view: np.ndarray | None = None           # CPU trees: a numpy view of `scores` (reading it costs no torch op)
    _sorted_view: np.ndarray | None = None          # CPU trees: a numpy view of the ranking's sorted scores
    _ids_view: np.ndarray | None = None             # CPU trees: a numpy view of the ranking's node ids

    @classmethod
    def empty(cls, capacity: int, device: torch.device, sampled: bool = False) -> "DraftTree":
        scores = torch.zeros(capacity, dtype=torch.float32, device=device)
        tree = cls(
            tokens=torch.zeros(capacity, dtype=torch.long, device=device),
            parents=torch.full((capacity,), -1, dtype=torch.long, device=device),
            depths=torch.zeros(capacity, dtype=torch.long, device=device),
            scores=scores,
            path_scores=torch.zeros(capacity, dtype=torch.float32, device=device) if sampled else scores,
            ancestors=torch.zeros(capacity, capacity, dtype=torch.bool, device=device),
            q_rows=[] if sampled else None,
            q_index=torch.full((capacity,), -1, dtype=torch.long, device=device) if sampled else None,
        )
        if tree.scores.device.type == "cpu":
            tree.scores_view = tree.scores.numpy()  # shares memory: add_level's writes show through
        return tree

    @property
    def sampled(self) -> bool:
        return self.q_rows is not None

    def add_level(self, tokens: torch.Tensor, parents: torch.Tensor, path_scores: torch.Tensor,
                  priority: torch.Tensor | None = None, q: torch.Tensor | None = None) -> torch.Tensor:
        """Append one level of nodes (parent-major, each parent's children in child order); returns their ids.
        Sampled children also give their priority and the q [parents, vocab] they were drawn from."""
        n = int(tokens.numel())
        ids = torch.arange(self.size, self.size + n, device=tokens.device)
        self.tokens[ids] = tokens
        self.parents[ids] = parents
        self.depth += 1
        self.depths[ids] = self.depth
        self.path_scores[ids] = path_scores.float()
        if self.sampled:
            self.scores[ids] = priority.float()
            first = sum(int(r.shape[0]) for r in self.q_rows)
            per_parent = n // q.shape[0]
            self.q_index[ids] = first + torch.arange(q.shape[0], device=ids.device).repeat_interleave(per_parent)
            self.q_rows.append(q)
        if self.depth > 1:
            self.ancestors[ids] = self.ancestors[parents]
        self.ancestors[ids, ids] = True
        self.size += n
        return ids

    def q_of_children(self, node: int) -> torch.Tensor:
        """The q a sampled node's children were drawn from (node -1: the root)."""
        child = int(torch.nonzero(self.parents[: self.size] == node)[0])
        row = int(self.q_index[child])
        for rows in self.q_rows:
            if row < rows.shape[0]:
                return rows[row]
            row -= rows.shape[0]
        raise IndexError("q row out of range")

    def ranking(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(priorities sorted descending, node ids) of all candidates, ties by id asc: the order in which candidates
        are chosen for verification. One sort per tree size, shared by a size policy's observation and
        verification."""
        if self._ranked_size != self.size:
            # stable descending sort keeps smaller ids first among equal scores (closure under ties)
            values, ids = torch.sort(self.scores[: self.size], descending=True, stable=True)
            self._ranking, self._ranked_size = (values, ids), self.size
            # taken here, beside the sort (drafting time): a size policy then reads numpy without a conversion
            # (measured: the PPO size decision 86 -> 57 us of CPU time, median, at 1 thread on the demo's policies)
            self._sorted_view = values.numpy() if self.scores_view is not None else None
            self._ids_view = ids.numpy() if self.scores_view is not None else None
        return self._ranking

    def sorted_scores(self) -> np.ndarray | torch.Tensor:
        """The candidates' priorities sorted descending (`ranking()[0]`): a numpy view on CPU trees."""
        values = self.ranking()[0]
        return values if self._sorted_view is None else self._sorted_view

    def sorted_ids(self) -> np.ndarray | torch.Tensor:
        """The candidates' node ids in verification order (`ranking()[1]`): a numpy view on CPU trees (a size
        policy that observes the candidates' depths reads them from the ids)."""
        ids = self.ranking()[1]
        return ids if self._ids_view is None else self._ids_view

    def ranked(self) -> torch.Tensor:
        """All node ids by (priority desc, id asc)."""
        return self.ranking()[1]


class TreeDrafter:
    """Owns the drafter's cache and grows one draft tree per cycle, from either kind of drafter
    (`specpilot.drafting.drafters`: a separate LM or an EAGLE-3 head) through the same steps.

    committed: committed tokens the drafter has accounted for (its cache holds their entries: committed - offset
    positions; it is cropped back to them after a cycle).
    """

    def __init__(self, drafter, width: int, max_depth: int, sample: bool = False) -> None:
        if not hasattr(drafter, "forward") or not hasattr(drafter, "offset"):
            from specpilot.drafting.drafters import LMDrafter

            drafter = LMDrafter(drafter)  # a bare causal LM
        self.drafter = drafter
        self.width = width
        self.max_depth = max_depth
        self.sample = sample
        self.cache = drafter.new_cache()
        self.device = None
        self.committed = 0
        self.capacity = num_candidates(width, max_depth)
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
        """log-probs [n, V_draft] -> (child target ids [n, k], child log-probs [n, k], log of the i-th largest
        probability [n, k] (sampled) or None, q over the target vocabulary [n, V] (sampled) or None)."""
        if not (self.sample and sampling is not None):
            values, local = torch.topk(logq, self.width, dim=-1)
            return self.drafter.to_target(local), values, None, None
        q_draft = sampling_probs(logq, *sampling)                                # [n, V_draft]
        log_q = torch.log(q_draft)
        # Gumbel-top-k: k draws without replacement, in sampling order (keys descending)
        uniform = torch.rand(q_draft.shape, generator=generator, device=q_draft.device).clamp_(1e-20, 1.0)
        local = torch.topk(log_q - torch.log(-torch.log(uniform)), self.width, dim=-1).indices  # [n, k]
        ranked_log_q = torch.topk(log_q, self.width, dim=-1).values             # value-free child priorities
        return (self.drafter.to_target(local), log_q.gather(-1, local), ranked_log_q,
                self._target_probs(q_draft))

    def _target_probs(self, q_draft: torch.Tensor) -> torch.Tensor:
        """Distributions [n, V_draft] over the drafter's vocabulary, placed on the target's ids (zero elsewhere)."""
        return self.drafter.target_probs(q_draft)

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
        tokens, logprobs, ranked, q = self._children(logq, sampling, generator)
        tree = DraftTree.empty(self.capacity, self._device(), sampled=q is not None)
        ids_level = tree.add_level(tokens[0], torch.full_like(tokens[0], -1), logprobs[0],
                                   ranked[0] if ranked is not None else None, q)
        tree.frontier = ids_level
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
        mask = model_mask(self.drafter.mask_layout, mask, positions, self.prefix_len)
        hidden = self._node_hidden[frontier][None] if self._node_hidden is not None else None
        logq, out = self.drafter.forward(tree.tokens[frontier][None], hidden, positions, mask, self.cache)  # [n, V]
        child_tokens, child_logprobs, ranked, q = self._children(logq, sampling, generator)  # [n, k]
        k = child_tokens.shape[1]
        cumulative = tree.path_scores[frontier][:, None] + child_logprobs  # [n, k]
        priority = None
        if ranked is not None:  # never reads the children's own sampled values (see the module docstring)
            priority = torch.minimum(tree.scores[frontier][:, None],
                                     tree.path_scores[frontier][:, None] + ranked).reshape(-1)
        parents = frontier[:, None].expand(n, k)
        ids = tree.add_level(child_tokens.reshape(-1), parents.reshape(-1), cumulative.reshape(-1), priority, q)
        if out is not None:
            self._node_hidden[ids] = out.repeat_interleave(k, dim=0)  # each child is fed with its parent's output
        best = int(torch.argmax(cumulative.reshape(-1)))
        tree.frontier = ids[torch.topk(cumulative.reshape(-1), min(self.width, ids.numel())).indices]
        self._record_features(logq[best // k], float(child_logprobs.reshape(-1)[best]))
        return tree

    def end_cycle(self) -> None:
        """Drop the tree nodes from the drafter's cache: it again holds exactly the committed entries."""
        crop_to(self.cache, self.prefix_len)
        self.tree = None
