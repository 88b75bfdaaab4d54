"""Draft trees through mlx-lm's own layers: mask, positions, verification, cache compaction.

Node 0 is the root (the last committed token); draft i is node i + 1 and `parents[i]` is the
node it extends. A tree forward runs the target once over all nodes: each node sees the
context and its own ancestors (the mask), and sits at position context length + depth. mlx-lm's
attention applies RoPE at `cache.offset + arange(n)`, so during a tree pass each attention's
`rope` is swapped for `DepthRope`, which calls the ORIGINAL rope once per depth group (every
rope variant stays exact). After the verdict the accepted path's K/V rows are gathered into
contiguous cache slots (`compact`)."""

import copy
from functools import partial
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import BoundedKVCache, is_recurrent


def breadth_first(
    nodes: Iterable[Hashable],
    parent_of: Callable[[Hashable], Optional[Hashable]],
    key: Optional[Callable] = None,
) -> Tuple[list, List[int]]:
    """Chosen nodes of a drafter's own tree as a draft: the nodes in breadth-first order
    (sorted by `key`, which must put a parent before its children; None: as given) and their
    parents as Draft and Tree number them (0 = the root, j + 1 = the j-th node of the order).
    parent_of(node) is None for the root's children. A node whose parent was not chosen is
    refused: silently hung off the root, it would be verified as the wrong position's draft."""
    order = sorted(nodes, key=key) if key is not None else list(nodes)
    number: Dict[Hashable, int] = {}
    parents = []
    for node in order:
        parent = parent_of(node)
        if parent is not None and parent not in number:
            raise ValueError(f"draft tree node {node!r} comes without its parent {parent!r}")
        parents.append(0 if parent is None else number[parent])
        number[node] = len(parents)
    return order, parents


class Tree:
    def __init__(self, parents: Sequence[int]):
        """parents[i]: the node (0 = root, j + 1 = draft j) that draft i extends; parents come
        before children and depths never decrease (breadth-first order)."""
        self.parents = [-1] + [int(p) for p in parents]
        self.depths = [0]
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}: parent {p} must be an earlier node")
            self.depths.append(self.depths[p] + 1)
        if any(b < a for a, b in zip(self.depths, self.depths[1:])):
            raise ValueError("tree nodes must be in breadth-first order")
        self.children = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            self.children[p].append(i)

    def __len__(self):
        return len(self.parents)

    def ancestors_mask(self) -> np.ndarray:
        """[n, n] bool: node i sees node j iff j is i or one of its ancestors."""
        n = len(self)
        mask = np.zeros((n, n), dtype=bool)
        for i in range(n):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = self.parents[j]
        return mask

    def attention_mask(self, context_length: int) -> mx.array:
        """[n, context + n] bool: the whole context, then each node's ancestors."""
        seen = np.ones((len(self), context_length), dtype=bool)
        return mx.array(np.concatenate([seen, self.ancestors_mask()], axis=1))

    def positions(self, context_length: int) -> List[int]:
        return [context_length + d for d in self.depths]

    def depth_groups(self):
        """(depth, first node, end) for each depth: contiguous in breadth-first order."""
        groups, start = [], 0
        for i in range(1, len(self) + 1):
            if i == len(self) or self.depths[i] != self.depths[start]:
                groups.append((self.depths[start], start, i))
                start = i
        return groups

    def path_to(self, node: int) -> List[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


class DepthRope(nn.Module):
    """Applies the original rope at offset + depth to each depth group of a tree pass."""

    def __init__(self, rope, groups):
        super().__init__()
        self.original = rope
        self.groups = groups

    def __call__(self, x, offset=0):
        # Each node becomes a length-1 sequence, so the whole group sits at one position.
        return mx.concatenate(
            [
                self.original(x[..., start:end, None, :], offset=offset + depth)[..., 0, :]
                for depth, start, end in self.groups
            ],
            axis=-2,
        )


def tree_forward(target, tokens: mx.array, tree: Tree, cache, taps=(), replay=None):
    """One target pass over the tree nodes (tokens [n]): (logits [1, n, V], taps). Attention
    layers see the tree through the mask; recurrent layers run one depth at a time
    (`recurrent_by_depth`); `replay` (cache.Replay) records them for `compact`."""
    context_length = next((c.offset for c in cache if not is_recurrent(c)), 0)  # 0: no attention
    bounded = next((c for c in cache if isinstance(c, BoundedKVCache)), None)  # --max-kv-size
    mask = (
        bounded.tree_mask(tree.depths, tree.ancestors_mask())
        if bounded is not None
        else tree.attention_mask(context_length)
    )
    groups = tree.depth_groups()
    # Each attention's rope (any rope variant) runs once per depth group; recurrent layers have none.
    attentions = [
        m
        for layer, c in zip(target.layers, cache)
        if not is_recurrent(c)
        for _, m in layer.named_modules()
        if isinstance(getattr(m, "rope", None), nn.Module)
    ]
    originals = [attention.rope for attention in attentions]
    try:
        for attention, rope in zip(attentions, originals):
            attention.rope = DepthRope(rope, groups)
        return target.forward(
            tokens[None], cache, taps, mask=mask, replay=replay, recurrent=partial(recurrent_by_depth, tree)
        )
    finally:
        for attention, rope in zip(attentions, originals):
            attention.rope = rope


def recurrent_by_depth(tree: Tree, call, x: mx.array, cache) -> mx.array:
    """A recurrent layer over the tree's nodes (x [1, n, H]): a node's state is its parent's
    advanced by the node's input, so the layer runs once per depth, over that depth's nodes
    as a batch of one-position sequences, each from its parent's state (gathered from the
    depth before). call(inputs, cache) runs the layer. The cache keeps its state (the
    accepted path's is set by `compact`)."""
    outputs, states, previous = [], list(cache.cache), 0
    for depth, start, end in tree.depth_groups():
        if depth:  # each node's parent, among the nodes of the depth before
            index = mx.array([tree.parents[i] - previous for i in range(start, end)])
            states = [None if s is None else s[index] for s in states]
        nodes = copy.copy(cache)
        nodes.cache = list(states)
        outputs.append(call(x[0, start:end, None], nodes)[:, 0])
        states, previous = nodes.cache, start
    return mx.concatenate(outputs)[None]


def compact(cache, start: int, path: Sequence[int], nodes: int, replay=None) -> None:
    """Move the K/V rows of the accepted path's nodes (tree node indices of a pass over
    `nodes` nodes, written at start + node) to start, start + 1, ...; the cache then ends after
    the path. Recurrent layers take the path's state from the pass's replay (Replay.follow)."""
    end = start + len(path)
    for c in cache:
        if is_recurrent(c):
            continue
        # A KVCache holds position q at row q; a BoundedKVCache holds the pass's nodes after
        # the `first` rows it kept (in temporal order), and ends with the path.
        first = c.keys.shape[2] - nodes if isinstance(c, BoundedKVCache) else start
        rows = mx.array([first + node for node in path])
        c.keys[..., first : first + len(path), :] = c.keys[..., rows, :]
        c.values[..., first : first + len(path), :] = c.values[..., rows, :]
        if isinstance(c, BoundedKVCache):
            c.keys, c.values = c.keys[..., : first + len(path), :], c.values[..., : first + len(path), :]
            c._idx = first + len(path)
        c.offset = end
    if replay is not None:
        replay.follow(path)
        if not replay.roll_back(end):
            raise RuntimeError("a tree's replay could not follow its path")  # a bug, never input


def verify_tree(
    logits: mx.array, tokens: Sequence[int], tree: Tree, sampler, q: Optional[mx.array], first_position: int
) -> (List[int], int):
    """Walk the tree from the root: (accepted path of node indices, the target's next token).

    Greedy and the default sampling rule: the target's token at each node is `Sampler.choose`
    for the position it predicts (first_position + its depth: siblings share the noise); follow
    the child that drafted it. The residual rule: at each node try the children in order with
    the chain rule (accept x with min(1, r(x)/q(x)), else r <- norm(max(0, r - q))); if none is
    accepted, sample from what is left of r. q[i] is the distribution draft i was drawn from
    (None: deterministic drafts, one-hot)."""
    from .sampling import probs

    node_tokens = [None] + list(tokens)
    if sampler.greedy or not sampler.residual:
        best = sampler.choose(logits, [first_position + d for d in tree.depths]).tolist()
        path = [0]
        while True:
            follow = [c for c in tree.children[path[-1]] if node_tokens[c] == best[path[-1]]]
            if not follow:
                return path, best[path[-1]]
            path.append(follow[0])

    p = np.array(probs(logits, sampler.params), dtype=np.float64)
    q = None if q is None else np.array(q, dtype=np.float64)
    rng = np.random.default_rng(int(mx.random.randint(0, 2**31 - 1, key=sampler.next_key("verify")).item()))
    path = [0]
    while True:
        residual = p[path[-1]].copy()
        for child in tree.children[path[-1]]:
            x = node_tokens[child]
            q_child = np.eye(1, len(residual), x)[0] if q is None else q[child - 1]
            if rng.random() * q_child[x] < residual[x]:
                path.append(child)
                break
            residual = np.maximum(residual - q_child, 0.0)
            total = residual.sum()
            residual = residual / total if total > 0 else p[path[-1]]
        else:
            return path, int(rng.choice(len(residual), p=residual / residual.sum()))
