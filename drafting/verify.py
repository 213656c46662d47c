"""Verification: pick the top-V candidates, run ONE target forward over them with tree attention, accept.

The verified block is [root] + the V selected candidates in id order (parents before children). Each token sees
the committed prefix in the target cache, its ancestors and itself; its position is root position + depth.
Acceptance returns the accepted candidates (a root-to-node path) and the emitted token after it (the target's
argmax in greedy mode, a draw from the target's law otherwise), so a cycle emits accepted + 1 tokens. Three rules:
greedy; deterministic (top-W) children at temperature > 0; sampled children (recursive rejection sampling).

The near-tie guard (greedy only, `TreeConfig.near_tie`): in half precision a tree forward and a one-token forward
round differently, so where the target's top-1 and top-2 logits are within rounding of each other the verify
forward's argmax may not be the one autoregressive decoding computes. `near_tie_cut` finds the first row along
[root] + accepted path whose top-1/top-2 margin is below `near_tie` rounding scales, eps(dtype) * max(1, |top-1|)
(eps = 2^-7 for bf16, 2^-10 for fp16, 2^-23 for fp32); the decoder then commits only the tokens decided before that
row, drops that row's cache entry, and decides the next token with a one-token forward: the computation AR does.
Every committed token is still the target's argmax at its prefix, so the fp32 greedy law (output == the target's
greedy output) holds with the guard on or off; it only changes which forward decides a near tie.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.drafting.sampling import residual_distribution, sample, sampling_probs, uniform
from specpilot.drafting.tree import DraftTree


@dataclass
class Block:
    """The verified block. Index 0 is the root; index i >= 1 is candidate node_ids[i-1]."""

    node_ids: torch.Tensor      # [V] tree node ids, ascending
    tokens: list[int]           # [1+V] root token then candidates
    parents: list[int]          # [1+V] block index of each entry's parent (-1 for the root)


def select_block(tree: DraftTree | None, size: int, root_token: int) -> Block:
    """Top-`size` candidates by (score desc, id asc), returned in id order with block-local parent indices.
    No tree (or size 0): the root alone, a plain target step."""
    if tree is None or size == 0:
        return Block(node_ids=torch.zeros(0, dtype=torch.long), tokens=[root_token], parents=[-1])
    chosen = tree.ranked()[:size]
    node_ids = torch.sort(chosen).values
    tokens = tree.tokens[node_ids].tolist()
    parent_nodes = tree.parents[node_ids].tolist()
    local = {node: i + 1 for i, node in enumerate(node_ids.tolist())}
    parents = [-1] + [local.get(p, 0) if p >= 0 else 0 for p in parent_nodes]
    return Block(node_ids=node_ids, tokens=[root_token] + tokens, parents=parents)


def block_inputs(tree: DraftTree | None, block: Block, cache_len: int, root_position: int, device) -> dict:
    """input_ids, 4-D boolean tree mask and position ids for the target forward over the block (a lone root needs
    no mask: it sees the whole cache, as in plain decoding)."""
    v = int(block.node_ids.numel())
    ids = torch.tensor([block.tokens], dtype=torch.long, device=device)
    if v == 0:
        return {"input_ids": ids, "position_ids": torch.tensor([[root_position]], dtype=torch.long, device=device)}
    tree_mask = torch.zeros(1 + v, 1 + v, dtype=torch.bool, device=device)
    tree_mask[:, 0] = True                                        # everyone sees the root
    tree_mask[1:, 1:] = tree.ancestors[block.node_ids][:, block.node_ids]
    mask = torch.cat([torch.ones(1 + v, cache_len, dtype=torch.bool, device=device), tree_mask], dim=1)
    depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depths[block.node_ids]])
    positions = (root_position + depths)[None]
    return {"input_ids": ids, "attention_mask": mask[None, None], "position_ids": positions}


def _children(block: Block) -> dict[int, dict[int, int]]:
    """parent block index -> {token: child block index}; first (best-ranked) child wins on duplicate tokens."""
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(block.tokens)):
        children.setdefault(block.parents[i], {}).setdefault(block.tokens[i], i)
    return children


def accept_greedy(block: Block, logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest path whose every token is the target's argmax at its parent; plus the target's next token.

    Returns (accepted block indices along the path, emitted token)."""
    argmax = logits.argmax(dim=-1).tolist()                       # [1+V]
    children = _children(block)
    path, node = [], 0
    while True:
        nxt = children.get(node, {}).get(argmax[node])
        if nxt is None:
            return path, argmax[node]
        path.append(nxt)
        node = nxt


def accept_tree_sampled(block: Block, logits: torch.Tensor, sampling: tuple, generator) -> tuple[list[int], int]:
    """Deterministic (top-W) children: draw y ~ p at the node, descend iff y is a child, else emit y. Exact."""
    children = _children(block)
    path, node = [], 0
    while True:
        p = sampling_probs(logits[node], *sampling)
        y = sample(p, generator)
        nxt = children.get(node, {}).get(y)
        if nxt is None:
            return path, y
        path.append(nxt)
        node = nxt


def accept_tree_recursive(block: Block, logits: torch.Tensor, tree, sampling: tuple, generator
                          ) -> tuple[list[int], int]:
    """Sampled children (drawn from q without replacement): multi-draft recursive rejection sampling. At each node,
    with p the target's sampling distribution, the node's verified children are tried in sampling order: child x_i
    is accepted with probability min(1, p(x_i) / q_i(x_i)); on rejection p <- norm(max(p - q_i, 0)) and
    q_{i+1} = q_i without x_i, renormalised. If every child is rejected the emitted token is drawn from the final p.
    Exact (the target's law) because the verified children of a node are a prefix of its sampling order whose
    length never depends on their values (see drafting/tree.py). W = 1 is Leviathan et al.'s chain rule."""
    children: dict[int, list[tuple[int, int]]] = {}
    for i in range(1, len(block.tokens)):
        children.setdefault(block.parents[i], []).append((i, block.tokens[i]))  # ascending ids: sampling order
    path, node = [], 0
    while True:
        p = sampling_probs(logits[node], *sampling)
        nxt = None
        if node in children:
            q = tree.q_of_children(-1 if node == 0 else int(block.node_ids[node - 1])).clone()
            for index, token in children[node]:
                q_x, p_x = float(q[token]), float(p[token])
                if q_x <= 0.0:  # not a draw (fewer tokens than W had mass): as if absent
                    continue
                if p_x >= q_x or uniform(generator, p.device) * q_x < p_x:
                    nxt = index
                    break
                p = residual_distribution(p, q) if residual_distribution(p, q) is not None else p
                q[token] = 0.0
                mass = float(q.sum())
                if mass <= 0.0:
                    break
                q /= mass
        if nxt is None:
            return path, sample(p, generator)
        path.append(nxt)
        node = nxt


def rounding_scale(dtype: torch.dtype) -> float:
    """Machine epsilon of the dtype the target computes in: one rounding step of a logit near 1."""
    return float(torch.finfo(dtype).eps)


def near_tie_cut(logits: torch.Tensor, rows: list[int], units: float, dtype: torch.dtype | None = None) -> int | None:
    """Index k into `rows` (block rows [root] + accepted path) of the first row whose top-1/top-2 logit margin is
    below `units` * eps(dtype) * max(1, |top-1|), or None (no near tie, or units <= 0: the guard is off). The tokens
    decided at rows[:k] stand; the one rows[k] would decide is left to a one-token forward."""
    if units <= 0 or logits.shape[-1] < 2:
        return None
    eps = rounding_scale(dtype or logits.dtype)
    top = torch.topk(logits[rows].float(), 2, dim=-1).values               # [len(rows), 2]
    margin = top[:, 0] - top[:, 1]
    tied = margin < units * eps * top[:, 0].abs().clamp(min=1.0)
    hits = torch.nonzero(tied)
    return int(hits[0]) if hits.numel() else None
