"""The Drafter protocol: every source of drafts implements these four members."""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import mlx.core as mx

from ..sampling import Sampler


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

    def __len__(self):
        return len(self.tokens)

    @classmethod
    def chain(cls, draws) -> "Draft":
        """A chain from one Sampler.draw (tokens, q, confidence) per drafted position."""
        tokens, qs, confidence = zip(*draws)
        return cls(tokens=mx.concatenate(tokens), q=mx.concatenate(qs) if qs[0] is not None else None,
                   confidence=mx.concatenate(confidence))

    @property
    def parent_nodes(self) -> List[int]:
        """parents, also for a chain (draft i extends node i)."""
        return list(self.parents) if self.parents is not None else list(range(len(self)))

    def subset(self, kept: Sequence[int]) -> "Draft":
        """The drafts at indices `kept` (ancestors included, in order), as a Draft of their own."""
        tokens = self.tokens.tolist() if isinstance(self.tokens, mx.array) else self.tokens
        confidence = self.confidence.tolist() if isinstance(self.confidence, mx.array) else self.confidence
        parents = None
        if self.parents is not None:
            new = {old: i + 1 for i, old in enumerate(kept)}
            parents = [new.get(self.parents[i] - 1, 0) for i in kept]
        return Draft(tokens=[tokens[i] for i in kept], parents=parents,
                     q=self.q[mx.array(kept)] if self.q is not None and kept else None,
                     confidence=[confidence[i] for i in kept] if confidence is not None else None)


class Drafter:
    """A drafter owns its state. The engine calls, in order:
    prefill(context, taps, start) once per generation, then per step propose(k) and
    commit(n_accepted, next_token, taps)."""

    # Target layers whose hidden states the drafter needs (DESIGN.md tap convention).
    taps: Sequence[int] = ()
    # True when propose may return a tree (verified through tree.py, which needs a plain KV cache).
    tree: bool = False
    # The generation's sampling settings and noise; the engine sets it (greedy until then).
    sampler: Sampler = Sampler()
    # Set by the engine when drafts should stop as soon as they no longer pay: a drafter that
    # drafts one position at a time may call it with its drafts' confidences so far (floats,
    # which costs a sync per draft) and stop when it returns False.
    keep_drafting: Optional[Callable[[List[float]], bool]] = None
    # Drafters that run the target's own layers (LayerSkip): the engine sets target_cache to its
    # KV cache, and verifies a chain with verify_forward (the target's forward's signature)
    # instead of the target's forward, so that work done while drafting is not done twice.
    target_cache = None
    verify_forward: Optional[Callable] = None

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

    def commit(self, n_accepted: int, next_token: int, taps: Dict[int, mx.array], path=None) -> None:
        """n_accepted drafts and then next_token were committed: the first n_accepted of a
        chain, or for a tree the drafts at indices `path` (passed only for tree drafts). taps
        hold the target's hidden states at [last committed token, accepted drafts]."""


class NoDrafter(Drafter):
    """Plain decoding through the same loop: one target token per step."""

    def propose(self, k: int) -> Draft:
        return Draft()
