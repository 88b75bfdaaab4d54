"""The Drafter protocol: every source of drafts implements these four members."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import mlx.core as mx


@dataclass
class Draft:
    # ints, or a lazy mx.array that the engine evaluates together with the verification
    tokens: Union[List[int], mx.array] = field(default_factory=list)
    # Tree drafts: parents[i] is the node draft i extends (0 = the last committed token,
    # j + 1 = draft j), in breadth-first order. None: a chain.
    parents: Optional[List[int]] = None
    # [k, V] probabilities the drafts were sampled from; None = deterministic (one-hot) drafts.
    q: Optional[mx.array] = None

    def __len__(self):
        return len(self.tokens)


class Drafter:
    """A drafter owns its state. The engine calls, in order:
    prefill(context, taps, start) once per generation, then per step propose(k) and
    commit(n_accepted, next_token, taps)."""

    # Target layers whose hidden states the drafter needs (DESIGN.md tap convention).
    taps: Sequence[int] = ()
    # True when propose may return a tree (verified through tree.py, which needs a plain KV cache).
    tree: bool = False

    def prefill(self, context: List[int], taps: Dict[int, mx.array], start: int) -> None:
        """context: every token so far, the last one not yet seen by the target; the target has
        just processed context[start:-1] (taps hold its hidden states for those positions);
        context[:start] was already processed in an earlier generation of this session."""

    def propose(self, k: int) -> Draft:
        """Up to k draft tokens (a tree: up to k deep) that follow the last committed token."""
        raise NotImplementedError

    def commit(self, n_accepted: int, next_token: int, taps: Dict[int, mx.array], path=None) -> None:
        """n_accepted drafts and then next_token were committed: the first n_accepted of a
        chain, or for a tree the drafts at indices `path` (passed only for tree drafts). taps
        hold the target's hidden states at [last committed token, accepted drafts]."""


class NoDrafter(Drafter):
    """Plain decoding through the same loop: one target token per step."""

    def propose(self, k: int) -> Draft:
        return Draft()
