"""DDTree: a draft tree from one DFlash forward. The block gives a distribution for each of the
next positions; the tree holds the token paths with the highest product of those probabilities
(the expected accepted length of a tree is the sum over its nodes of that product, if the
target agreed with the drafter's marginals), up to a node budget, then it is verified in one
target pass like any tree. The drafts are the top tokens of each position (deterministic;
when sampling by the seeded rule, of the drafter's distribution plus the position's noise, as
the target picks: Sampler.tree_log_probs): the seeded rule's greedy walk and the residual
rule's sibling rule with one-hot q (sampling without replacement) are both exact for them."""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .base import Draft, TreeNode, best_first
from .dflash import DFlashDrafter


def best_tree(log_probs: Sequence[Sequence[Tuple[int, float]]], budget: int) -> Draft:
    """The `budget` paths of largest probability product. log_probs[d]: (token,
    log-probability) candidates at depth d + 1; every node of a depth has them as children."""

    def at_depth(depth: int, parent: Optional[TreeNode]) -> List[TreeNode]:
        base = parent.score if parent is not None else 0.0
        return [
            TreeNode(token, depth, base + value, float(np.exp(value)), parent)
            for token, value in (log_probs[depth - 1] if depth <= len(log_probs) else ())
        ]

    nodes = best_first(at_depth(1, None), lambda node: at_depth(node.depth + 1, node), budget)
    return Draft.of_tree(nodes, levels=len(log_probs))


def tree_from_logits(
    logits: mx.array,
    positions: Sequence[int],
    sampler,
    vocab_size: int,
    topk: int,
    budget: int,
    ids: mx.array = None,
) -> Draft:
    """A budgeted tree from independent logits [n, w] for the given positions (a DFlash block,
    Medusa heads), built from Sampler.tree_log_probs; ids[j] is the target id of column j
    (None: column j is id j)."""
    log_q = sampler.tree_log_probs(logits, positions, vocab_size, ids=ids)
    topk = min(topk, log_q.shape[-1])
    columns = mx.argpartition(-log_q, kth=topk - 1, axis=-1)[:, :topk]
    values = mx.take_along_axis(log_q, columns, axis=-1)
    tokens = columns if ids is None else ids[columns]
    candidates = [
        [(t, v) for t, v in zip(row_ids, row_values) if v > -np.inf]
        for row_ids, row_values in zip(tokens.tolist(), values.tolist())
    ]
    return best_tree(candidates, budget)


class DDTreeDrafter(DFlashDrafter):
    tree = True

    def __init__(self, target, model, budget: int = 16, topk: int = 4):
        super().__init__(target, model)
        self.budget, self.topk = budget, topk

    def chains(self):
        return DFlashDrafter(self.target, self.model)  # DFlash: the block's draws

    def propose(self, k):
        n = min(k, self.block_size - 1)
        if n <= 0:
            return Draft()
        return tree_from_logits(
            self.block_logits(n),
            range(self.position, self.position + n),
            self.sampler,
            self.target.vocab_size,
            self.topk,
            self.budget,
            ids=self.model.draft_ids,
        )
