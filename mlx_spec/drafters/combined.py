"""suffix+X: suffix decoding and a learned drafter in one step (as ArcticInference pairs them).

Each step drafts from the suffix trees first; where that draft is expected to commit at least
STRONG tokens the learned drafter is not run, else it drafts too and the draft expected to
commit more (the sum of its nodes' path confidences) is verified. Both drafters commit every
step's outcome, whichever drafted it (Drafter.commit takes the accepted tokens), so each stays
in step with the context."""

import copy
from typing import List

import mlx.core as mx

from .base import Draft, Drafter

STRONG = 2.0   # expected tokens from the suffix draft above which the learned drafter rests


def expected_tokens(draft: Draft) -> float:
    """The sum over a draft's nodes of the product of the confidences from the root to it."""
    reach = [1.0]
    for parent, confidence in zip(draft.parent_nodes, draft.confidences):
        reach.append(reach[parent] * (1.0 if confidence is None else confidence))
    return sum(reach[1:])


class SuffixPlus(Drafter):
    def __init__(self, suffix: Drafter, learned: Drafter, learned_length: int):
        """learned_length: the most drafts the learned drafter makes per step (its source's default)."""
        self.suffix, self.learned, self.learned_length = suffix, learned, learned_length
        self.taps = learned.taps
        self.tree = suffix.tree or learned.tree

    def bind(self, sampler, target_cache, keep_drafting=None):
        super().bind(sampler, target_cache, keep_drafting)
        for member in (self.suffix, self.learned):
            member.bind(sampler, target_cache, keep_drafting)

    def spawn(self):
        twin = copy.copy(self)
        twin.suffix, twin.learned = self.suffix.spawn(), self.learned.spawn()
        return twin

    def chains(self):
        suffix, learned = self.suffix.chains(), self.learned.chains()
        if suffix is None or learned is None:
            return None
        twin = copy.copy(self)
        twin.suffix, twin.learned, twin.tree = suffix, learned, False
        return twin

    def prefill(self, context, taps, start):
        self.suffix.prefill(context, taps, start)
        self.learned.prefill(context, taps, start)

    def propose(self, k):
        draft = self.suffix.propose(k)
        expected = expected_tokens(draft) if len(draft) else 0.0
        if expected >= STRONG:
            return draft
        learned = self.learned.propose(min(k, self.learned_length))
        if len(learned):
            mx.eval(learned.tokens, learned.confidence)
            if expected_tokens(learned) > expected:
                return learned
        return draft

    def commit(self, accepted: List[int], next_token, taps):
        self.suffix.commit(accepted, next_token, taps)
        self.learned.commit(accepted, next_token, taps)

    def finish(self, output):
        self.suffix.finish(output)
        self.learned.finish(output)
