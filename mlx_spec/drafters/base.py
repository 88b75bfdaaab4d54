"""The Drafter protocol: every source of drafts implements these four members."""

import copy
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import mlx.core as mx

from ..sampling import Sampler
from ..tree import breadth_first


@dataclass
class Draft:
    # ints, or a lazy mx.array that the engine evaluates together with the verification
    tokens: Union[List[int], mx.array] = field(default_factory=list)
    # Tree drafts: parents[i] is the node draft i extends (0 = the last committed token,
    # j + 1 = draft j), in breadth-first order. None: a chain.
    parents: Optional[List[int]] = None
    # [k, V] probabilities the drafts were sampled from, where verification needs them (the
    # residual rule, Sampler.needs_q); None = deterministic (one-hot) drafts or not needed.
    q: Optional[mx.array] = None
    # [k] the drafter's own probability of each draft given its parent (its confidence), from
    # which the engine's policy decides what is worth verifying; None: no estimate.
    confidence: Optional[Union[List[float], mx.array]] = None
    # Draft positions the drafter computed (what drafting's cost is measured in): a tree sets its
    # number of levels; None: one per draft (a chain).
    levels: Optional[int] = None

    def __len__(self):
        return len(self.tokens)

    @property
    def positions(self) -> int:
        return len(self) if self.levels is None else self.levels

    @property
    def confidences(self) -> List[Optional[float]]:
        """confidence as floats (None for each draft where there is no estimate)."""
        if self.confidence is None:
            return [None] * len(self)
        return self.confidence.tolist() if isinstance(self.confidence, mx.array) else list(self.confidence)

    @classmethod
    def chain(cls, draws) -> "Draft":
        """A chain from one Sampler.draw (tokens, q, confidence) per drafted position."""
        tokens, qs, confidence = zip(*draws)
        return cls(
            tokens=mx.concatenate(tokens),
            q=mx.concatenate(qs) if qs[0] is not None else None,
            confidence=mx.concatenate(confidence),
        )

    def as_chain(self) -> "Draft":
        """A tree whose nodes form one chain (what the policy left of it) as that chain, which
        verifies cheaper; any other draft as it is."""
        if self.parents is not None and self.parents == list(range(len(self))):
            return Draft(tokens=self.tokens, q=self.q, confidence=self.confidence)
        return self

    @property
    def parent_nodes(self) -> List[int]:
        """parents, also for a chain (draft i extends node i)."""
        return list(self.parents) if self.parents is not None else list(range(len(self)))

    @classmethod
    def of_tree(
        cls, nodes: Sequence["TreeNode"], chain: bool = False, levels: Optional[int] = None
    ) -> "Draft":
        """The chosen nodes of a drafter's tree (every node's parent among them) in breadth-first
        order, best first within a level; chain: they form one chain, drafted as such."""
        order, parents = breadth_first(
            nodes, lambda node: node.parent, key=lambda node: (node.depth, -node.score)
        )
        return cls(
            tokens=[node.token for node in order],
            parents=None if chain else parents,
            confidence=[node.confidence for node in order],
            levels=levels,
        )

    def subset(self, kept: Sequence[int]) -> "Draft":
        """The drafts at indices `kept` (ancestors included, in order), as a Draft of their own."""
        if list(kept) == list(range(len(self))):
            return self
        tokens = self.tokens.tolist() if isinstance(self.tokens, mx.array) else self.tokens
        parents = None
        if self.parents is not None:
            _, parents = breadth_first(kept, lambda i: self.parents[i] - 1 if self.parents[i] else None)
        confidence = self.confidences
        return Draft(
            tokens=[tokens[i] for i in kept],
            parents=parents,
            q=self.q[mx.array(kept)] if self.q is not None and kept else None,
            confidence=[confidence[i] for i in kept] if self.confidence is not None else None,
        )


@dataclass(eq=False)  # hashed by identity: Draft.of_tree numbers the nodes
class TreeNode:
    """One candidate of a drafter's tree."""

    token: int  # a target id
    depth: int  # 1: the position after the last committed token
    score: float  # the path's value (a probability, or its log): never above its parent's
    confidence: float  # its probability given its parent
    parent: Optional["TreeNode"] = None  # None: a child of the root
    below: Any = None  # what its drafter needs to offer its children (a trie, a cache slot)


def best_first(
    first: Iterable[TreeNode],
    children: Callable[[TreeNode], Iterable[TreeNode]],
    budget: int,
    chain: bool = False,
) -> List[TreeNode]:
    """The `budget` best nodes of a tree grown best first: take the best candidate so far, then
    offer its children. A child never scores above its parent and ties go to the shallower
    node, so every node comes after its parent and the nodes taken are the best ancestor-closed
    set (EAGLE-2's and DDTree's tree, SuffixDecoding's). chain: only the best child of a node
    taken competes next (the most probable path)."""
    heap: list = []
    arrival = itertools.count()  # ties at equal score and depth: first offered first

    def offer(nodes: Iterable[TreeNode]) -> None:
        for node in nodes:
            heapq.heappush(heap, (-node.score, node.depth, next(arrival), node))

    offer(first)
    taken: List[TreeNode] = []
    while heap and len(taken) < budget:
        node = heapq.heappop(heap)[-1]
        if chain:
            heap.clear()
        taken.append(node)
        offer(children(node))
    return taken


class Drafter:
    """A drafter owns its state. The engine calls bind(...) once, then prefill(context, taps,
    start) once per generation, per step propose(k) and commit(accepted, next_token, taps), and
    finish(output) when the generation ends."""

    # Target layers whose hidden states the drafter needs (DESIGN.md tap convention).
    taps: Sequence[int] = ()
    # True when propose may return a tree (verified through tree.py, which needs a plain KV cache).
    tree: bool = False
    # Drafters that run the target's own layers (LayerSkip) verify a chain with verify_forward
    # (the target's forward's signature) instead of the target's forward, so that work done
    # while drafting is not done twice.
    verify_forward: Optional[Callable] = None
    # False where drafts come from the context's token ids alone and ids never seen do no harm:
    # the engine may then continue a prompt cache whose tokens are not known (Engine.resume).
    reads_cached_context: bool = True
    # Attributes that hold weights (models, the target): copies made by spawn share them.
    shared: Sequence[str] = ()
    # What bind hands over; until then, greedy drafting that never stops early.
    sampler: Sampler = Sampler()
    keep_drafting: Optional[Callable[[List[float]], bool]] = None

    def bind(
        self,
        sampler: Sampler,
        target_cache: Callable[[], list],
        keep_drafting: Optional[Callable[[List[float]], bool]] = None,
    ) -> None:
        """What the engine shares, handed over once: the generation's sampling settings and
        noise (the drafter draws with them); the target's cache as it is now (a callable: a
        new conversation brings a new cache); and, where drafts should stop as soon as they no
        longer pay, keep_drafting, which a drafter that drafts one position at a time may call
        with its drafts' confidences so far (floats, a sync per draft) to stop when False."""
        self.sampler, self.keep_drafting = sampler, keep_drafting

    def spawn(self) -> "Drafter":
        """A drafter of the same source and weights with a state of its own (another sequence
        of a batch); bind it before use."""
        memo = {id(getattr(self, name)): getattr(self, name) for name in self.shared}
        return copy.deepcopy(self, memo)

    def chains(self) -> Optional["Drafter"]:
        """A drafter of the same source and weights that drafts chains (a batch verifies chains
        only), with a state of its own; None where the source drafts trees only. Tree drafters
        that can draft chains override it."""
        return None if self.tree else self.spawn()

    def spawn_without_trees(self) -> "Drafter":
        """chains() of a source whose chains are its --tree-budget 0 mode."""
        twin = self.spawn()
        twin.tree, twin.tree_budget = False, 0
        return twin

    def chain_draws(self, k: int, first_draw, next_draw) -> "Draft":
        """A chain of up to k draws: first_draw(), then next_draw(previous draw) each time,
        stopping early when keep_drafting says the next draft would not pay."""
        draws = [first_draw()]
        while len(draws) < k:
            if self.keep_drafting is not None:
                mx.eval(draws[-1][2])
                if not self.keep_drafting([d[2].item() for d in draws]):
                    break
            draws.append(next_draw(draws[-1]))
        return Draft.chain(draws)

    def prefill(self, context: List[int], taps: Dict[int, mx.array], start: int) -> None:
        """context: every token so far, the last one not yet seen by the target; the target has
        just processed context[start:-1] (taps hold its hidden states for those positions);
        context[:start] was already processed in an earlier generation of this session."""

    def propose(self, k: int) -> Draft:
        """Up to k draft tokens (a tree: up to k deep) that follow the last committed token."""
        raise NotImplementedError

    def commit(self, accepted: List[int], next_token: int, taps: Dict[int, mx.array]) -> None:
        """The draft tokens `accepted` (root to leaf) and then next_token were committed. They
        are the accepted path of the last proposal, or of another drafter's where drafters are
        combined (suffix+eagle): a drafter keeps step with what was committed, whoever drafted
        it. taps hold the target's hidden states at [last committed token, accepted drafts]."""

    def finish(self, output: List[int]) -> None:
        """The generation ended after committing `output` (the tokens after the prompt)."""


class NoDrafter(Drafter):
    """Plain decoding through the same loop: one target token per step."""

    reads_cached_context = False

    def propose(self, k: int) -> Draft:
        return Draft()
