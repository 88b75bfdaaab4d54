"""EAGLE-3 chain drafting: one draft layer fed with the target's own features. An MTP module
(models/mtp.py) has the same interface and drafts through the same code (chains only).

Position t of the layer's cache holds the pair (token t+1, fused target feature at t); the
layer's output there predicts token t+2. A draft step feeds the layer's own pre-norm output
back in place of the target feature it has not computed yet. After each verification the
speculative entries are dropped and the committed tokens are paired with the features the
target just computed for them: the cache holds target features only. At temperature > 0
drafts are drawn from the draft head's distribution at the target's sampling settings, with
the generation's noise (sampling.Sampler). The k draft steps stay one lazy graph, evaluated together with the
verification."""

from typing import Dict, List, Optional, Protocol, Sequence

import mlx.core as mx
import numpy as np

from ..cache import common_prefix_length, rollback_to
from ..errors import MlxSpecError
from .base import Draft, Drafter, TreeNode, best_first


class FeatureDraftModel(Protocol):
    """What EagleDrafter drafts with: an EAGLE-3 layer (models/eagle3.py) or an MTP module
    (models/mtp.py). Position t of its cache pairs token t+1 with the target's feature at t;
    its output at t, fed back as the next position's hidden state, predicts token t+2."""

    taps: Sequence[int]  # target layers whose features it reads (DESIGN.md convention)
    draft_vocab_size: int  # columns of its head
    draft_ids: Optional[mx.array]  # the target id of each column (None: the target's vocabulary)
    supports_tree: bool  # whether __call__ takes positions and a mask (EAGLE-2 trees)

    def make_cache(self) -> list: ...

    def embed(self, tokens: mx.array) -> mx.array: ...

    def fuse(self, features: mx.array) -> mx.array:
        """The concatenated taps [1, n, len(taps) * target H] -> its hidden input."""

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list, **tree) -> mx.array:
        """[1, n, H] embeddings and hidden states -> its output [1, n, H]; a tree passes
        positions and mask (where supports_tree)."""

    def logits(self, hidden: mx.array) -> mx.array: ...


class EagleDrafter(Drafter):
    shared = ("model", "target_ids")

    def __init__(self, model: FeatureDraftModel, vocab_size: int, tree_budget: int = 0, tree_topk: int = 8):
        if tree_budget and not model.supports_tree:
            raise MlxSpecError("this drafter drafts chains only: drop --tree-budget")
        self.model = model
        self.tree_budget, self.tree_topk = tree_budget, tree_topk  # tree mode when budget > 0
        self.tree = tree_budget > 0
        self.taps = model.taps
        self.vocab_size = vocab_size  # the target's: q spans it
        self.target_ids = model.draft_ids  # column j's target id (None: the target's vocabulary)
        self.cache = model.make_cache()
        self.paired: List[int] = []  # paired[t]: the token at cache position t (context[t+1])
        self.last_hidden = None  # the layer's output at the last position: drafts from it
        # Committed (tokens, features) not yet run through the layer: while the policy runs plain
        # steps nothing is paid per step; the next proposal runs them all in one batch.
        self.waiting: List[tuple] = []

    def _fuse(self, taps: Dict[int, mx.array]) -> mx.array:
        return self.model.fuse(mx.concatenate([taps[i] for i in self.taps], axis=-1))

    def _extend(self, tokens: List[int], features: mx.array) -> None:
        """Append the pairs (tokens[j], features[:, j]) at the next positions."""
        out = self.model(self.model.embed(mx.array(tokens)[None]), features, self.cache)
        self.paired += tokens
        self.last_hidden = out[:, -1:]

    def _catch_up(self) -> None:
        if self.waiting:
            tokens = [t for pair_tokens, _ in self.waiting for t in pair_tokens]
            self._extend(tokens, mx.concatenate([features for _, features in self.waiting], axis=1))
            self.waiting = []

    def prefill(self, context, taps, start):
        # Positions 0..len(context)-2 must end up paired. Pairs before `start` were built in an
        # earlier generation of this session and stay valid where their tokens still match;
        # the engine hands the target's features from `start` on (at least one position).
        self._catch_up()
        keep = common_prefix_length(self.paired, context[1:])
        if keep < start:
            raise MlxSpecError("EAGLE drafter state is behind the target's cache: start a new session")
        rollback_to(self.cache, start)  # also drops drafts of an interrupted step
        self.paired = self.paired[:start]
        self.last_hidden = None
        if taps:  # a one-token prompt has no feature yet: the first step is plain
            self._extend(context[start + 1 :], self._fuse(taps))

    def propose(self, k):
        if k == 0:
            return Draft()
        self._catch_up()
        if self.last_hidden is None:  # nothing paired yet (a one-token prompt's first step)
            return Draft()
        if self.tree_budget:
            return self._propose_tree(depth=k)
        hidden, position = self.last_hidden, len(self.paired) + 1  # of the first draft

        def draw():
            # Filtered and tempered like the target's distribution over the draft vocabulary;
            # the target ids outside it have probability 0 either way.
            nonlocal position
            position += 1
            return self.sampler.draw(
                self.model.logits(hidden[0, -1:]), [position - 1], self.vocab_size, ids=self.target_ids
            )

        def next_draw(previous):  # feeds the previous draft and the layer's own output, lazily
            nonlocal hidden
            hidden = self.model(self.model.embed(previous[0][None]), hidden, self.cache)
            return draw()

        return self.chain_draws(k, draw, next_draw)

    def chains(self):
        return self.spawn_without_trees()

    def commit(self, accepted, next_token, taps):
        rollback_to(self.cache, len(self.paired))  # drop the speculative entries
        # taps cover [last committed token, accepted drafts]: each pairs with the token after it.
        self.waiting.append((accepted + [next_token], self._fuse(taps)))

    def _propose_tree(self, depth: int) -> Draft:
        """EAGLE-2's dynamic tree: grow `depth` levels, each time expanding the top-k frontier
        nodes (by cumulative log-probability) into their top-k children; keep the best
        `tree_budget` nodes. Drafts are the top-k of Sampler.tree_log_probs (deterministic: q is
        one-hot), so the tree verifier's chain rule keeps sampling exact. One small sync per level."""
        topk, offset = min(self.tree_topk, self.model.draft_vocab_size), len(self.paired)
        children: Dict[Optional[TreeNode], List[TreeNode]] = {}  # None: the root
        slots: List[TreeNode] = []  # the nodes run through the layer; node.below: its cache slot
        hidden = self.last_hidden[0]  # the hidden each frontier row continues
        rows: List[Optional[TreeNode]] = [None]  # the node of each row of `hidden`
        for level in range(1, depth + 1):
            # Every node of a level drafts the token at the same position.
            logp = self.sampler.tree_log_probs(
                self.model.logits(hidden), [offset + level] * len(rows), self.vocab_size, ids=self.target_ids
            )
            columns = mx.argpartition(-logp, kth=topk - 1, axis=-1)[:, :topk]
            values = mx.take_along_axis(logp, columns, axis=-1)
            tokens = columns if self.target_ids is None else self.target_ids[columns]
            for parent, row_tokens, row_values in zip(rows, tokens.tolist(), values.tolist()):
                base = parent.score if parent is not None else 0.0
                children[parent] = [
                    TreeNode(token, level, base + value, float(np.exp(value)), parent)
                    for token, value in zip(row_tokens, row_values)
                ]
            if level == depth:
                break
            frontier = sorted((c for row in rows for c in children[row]), key=lambda node: -node.score)[:topk]
            # Run the layer on the frontier: each node sees the context and its ancestors.
            mask = np.zeros((len(frontier), offset + len(slots) + len(frontier)), dtype=bool)
            mask[:, :offset] = True
            for r, node in enumerate(frontier):
                ancestor = node.parent
                while ancestor is not None:
                    mask[r, offset + ancestor.below] = True
                    ancestor = ancestor.parent
                mask[r, offset + len(slots) + r] = True
            parent_rows = [rows.index(node.parent) for node in frontier]
            for node in frontier:
                node.below = len(slots)
                slots.append(node)
            hidden = self.model(
                self.model.embed(mx.array([node.token for node in frontier])[None]),
                hidden[mx.array(parent_rows)][None],
                self.cache,
                positions=mx.array([offset + level - 1] * len(frontier)),
                mask=mx.array(mask),
            )[0]
            rows = frontier
        nodes = best_first(children[None], lambda node: children.get(node, []), self.tree_budget)
        return Draft.of_tree(nodes, levels=depth)
