"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): draft what followed the earlier
occurrences of the context's last tokens, in this generation's prompt and output and in a
memory of earlier outputs that persists across runs (suffix_memory.py), as a tree.

Each step finds the longest recent suffix (of MATCH_LENGTHS) that occurred before, in each of
the two places; the continuations of its most recent occurrences, counted in a trie, give each
next token an empirical probability, count / (occurrences + 1/m) for a node whose path agrees
with the context over m tokens: many occurrences that agree are near certain, and one is worth
m / (m + 1), as prompt lookup rates a match (a long match is likely copied text). The draft is
the tree of the continuations with the largest products of those probabilities, each token at
least MIN_PROBABILITY, at most FACTOR x the match length nodes (a short match is weak
evidence) and --tree-budget, up to the step's depth; of the two places' trees the one expected to commit more is drafted. Where trees
are not verified (--tree-budget 0, a recurrent target) the tree's most probable path is drafted
as a chain. Drafts are deterministic, so every sampling rule stays exact; each node's
probability is its confidence, which the policy calibrates like any source's."""

from typing import Dict, List, Optional, Sequence, Tuple

from ..suffix_memory import MATCH_LENGTHS, MAX_OCCURRENCES
from .base import Draft, Drafter, TreeNode, best_first

FACTOR = 4  # the most nodes per matched token
MIN_PROBABILITY = 0.1  # a token's probability given its parent, below which it is not drafted


class ContextIndex:
    """The end positions of every n-gram (n in MATCH_LENGTHS) of one generation's tokens,
    updated in O(len(MATCH_LENGTHS)) per token."""

    def __init__(self):
        self.tokens: List[int] = []
        self.ends: Dict[Tuple[int, ...], List[int]] = {}

    def append(self, token: int) -> None:
        self.tokens.append(token)
        end = len(self.tokens) - 1
        for n in MATCH_LENGTHS:
            if n > end + 1:
                break
            self.ends.setdefault(tuple(self.tokens[end + 1 - n :]), []).append(end)

    def continuations(self, depth: int) -> Tuple[int, List[List[int]]]:
        """As SuffixMemory.continuations, for the tokens' own last n-gram (its last
        occurrence, the current one, has nothing after it yet)."""
        for n in reversed(MATCH_LENGTHS):
            if n <= len(self.tokens):
                ends = self.ends[tuple(self.tokens[-n:])]
                if len(ends) > 1:
                    return n, [
                        self.tokens[e + 1 : e + 1 + depth] for e in reversed(ends[-1 - MAX_OCCURRENCES : -1])
                    ]
        return 0, []


def best_tree(
    continuations: Sequence[Sequence[int]], match_length: int, depth: int, budget: int, chain: bool
) -> Tuple[Draft, float]:
    """The draft tree of the continuations (see the module's docstring) and its expected
    accepted length (the sum of its nodes' path probabilities, if they were true)."""
    root: dict = {}  # token -> [count, children]
    for continuation in continuations:
        node = root
        for token in continuation[:depth]:
            entry = node.setdefault(token, [0, {}])
            entry[0] += 1
            node = entry[1]

    def offered(children: dict, parent: Optional[TreeNode]) -> List[TreeNode]:
        """The children worth drafting, scored by their path's probability."""
        level, path = (1, 1.0) if parent is None else (parent.depth + 1, parent.score)
        total = sum(count for count, _ in children.values()) + 1 / (match_length + level - 1)
        return [
            TreeNode(token, level, path * count / total, count / total, parent, below=grandchildren)
            for token, (count, grandchildren) in children.items()
            if count / total >= MIN_PROBABILITY
        ]

    nodes = best_first(
        offered(root, None), lambda node: offered(node.below, node), min(budget, FACTOR * match_length), chain
    )
    if not nodes:
        return Draft(), 0.0
    return Draft.of_tree(nodes, chain=chain), sum(node.score for node in nodes)


class SuffixDrafter(Drafter):
    shared = ("memory",)
    reads_cached_context = False

    def __init__(self, tree_budget: int = 16, memory=None, tree: bool = True):
        """memory: a SuffixMemory (None: this generation's tokens only); tree False: chains."""
        self.budget, self.memory = tree_budget, memory
        self.tree = tree and tree_budget > 0
        self.index = ContextIndex()

    def chains(self):
        twin = self.spawn()
        twin.tree = False  # the tree's most probable path
        return twin

    def prefill(self, context, taps, start):
        self.index = ContextIndex()
        for token in context:
            self.index.append(token)

    def propose(self, k):
        if k <= 0:
            return Draft()
        candidates = [self.index.continuations(k)]
        if self.memory is not None:
            candidates.append(self.memory.continuations(self.index.tokens, k))
        best, expected = Draft(), 0.0
        for match_length, continuations in candidates:
            if match_length:
                draft, value = best_tree(
                    continuations, match_length, k, self.budget if self.tree else k, chain=not self.tree
                )
                if value > expected:
                    best, expected = draft, value
        return best

    def commit(self, accepted, next_token, taps):
        for token in list(accepted) + [next_token]:
            self.index.append(token)

    def finish(self, output):
        if self.memory is not None:
            self.memory.add(output)
            self.memory.save()
