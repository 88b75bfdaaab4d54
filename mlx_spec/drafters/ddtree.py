"""DDTree: a draft tree from one DFlash forward. The block gives a distribution for each of the
next positions; the tree holds the token paths with the highest product of those probabilities
(the expected accepted length of a tree is the sum over its nodes of that product, if the
target agreed with the drafter's marginals), up to a node budget, then it is verified in one
target pass like any tree. The drafts are the top tokens of each position (deterministic;
when sampling by the seeded rule, of the drafter's distribution plus the position's noise, as
the target picks: Sampler.tree_log_probs): the seeded rule's greedy walk and the residual
rule's sibling rule with one-hot q (sampling without replacement) are both exact for them."""

import heapq
from typing import List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..tree import breadth_first
from .base import Draft
from .dflash import DFlashDrafter


def best_tree(log_probs: Sequence[Sequence[Tuple[int, float]]], budget: int):
    """The `budget` paths of largest probability product, as a breadth-first tree.
    log_probs[d]: (token, log-probability) candidates at depth d + 1, best first. Returns
    (tokens, parents, conditional probabilities), parents as in Draft (0 = root)."""
    # Best-first: a node's children are the candidates of the next depth; a product never
    # grows along a path, so the best `budget` nodes come out ancestors first.
    heap = [(-lp, 0, j, -1) for j, (_, lp) in enumerate(log_probs[0][:1])] if log_probs else []
    chosen = []  # (score, depth, candidate index, parent index in chosen)
    while heap and len(chosen) < budget:
        neg, depth, j, parent = heapq.heappop(heap)
        chosen.append((-neg, depth, j, parent))
        me = len(chosen) - 1
        if j + 1 < len(log_probs[depth]):  # the next sibling
            heapq.heappush(
                heap, (neg + log_probs[depth][j][1] - log_probs[depth][j + 1][1], depth, j + 1, parent)
            )
        if depth + 1 < len(log_probs) and log_probs[depth + 1]:  # the first child
            heapq.heappush(heap, (neg - log_probs[depth + 1][0][1], depth + 1, 0, me))
    order, parents = breadth_first(
        range(len(chosen)),
        lambda i: chosen[i][3] if chosen[i][3] >= 0 else None,
        key=lambda i: (chosen[i][1], -chosen[i][0], i),
    )
    tokens = [log_probs[chosen[i][1]][chosen[i][2]][0] for i in order]
    confidence = [float(np.exp(log_probs[chosen[i][1]][chosen[i][2]][1])) for i in order]
    return tokens, parents, confidence


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
    candidates: List[List[Tuple[int, float]]] = [
        sorted(((t, v) for t, v in zip(row_ids, row_values) if v > -np.inf), key=lambda c: -c[1])
        for row_ids, row_values in zip(tokens.tolist(), values.tolist())
    ]
    tokens, parents, confidence = best_tree(candidates, budget)
    return Draft(tokens=tokens, parents=parents, confidence=confidence, levels=len(candidates))


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
