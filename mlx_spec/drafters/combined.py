"""Two sources in one step: a drafter that copies text (suffix decoding; a request's predicted
output) first, a second one (a learned drafter; the engine's own source) where the copy is weak.
suffix+X pairs suffix decoding and a learned drafter as ArcticInference does; Engine pairs a
request's prediction with its source the same way.

Each step drafts from the first source; where that draft is expected to commit at least STRONG
tokens the second is not run, else it drafts too and the draft expected to commit more (the sum
of its nodes' path confidences) is verified. Both drafters commit every step's outcome,
whichever drafted it (Drafter.commit takes the accepted tokens), so each stays in step with the
context."""

import copy
from typing import List

import mlx.core as mx

from .base import Draft, Drafter

STRONG = 2.0  # expected tokens from the first draft above which the second source rests


def expected_tokens(draft: Draft) -> float:
    """The sum over a draft's nodes of the product of the confidences from the root to it."""
    reach = [1.0]
    for parent, confidence in zip(draft.parent_nodes, draft.confidences):
        reach.append(reach[parent] * (1.0 if confidence is None else confidence))
    return sum(reach[1:])


class Combined(Drafter):
    def __init__(self, first: Drafter, second: Drafter, second_length: int):
        """second_length: the most drafts the second source makes per step (its own default)."""
        self.first, self.second, self.second_length = first, second, second_length
        self.taps = second.taps
        self.tree = first.tree or second.tree
        self.reads_cached_context = first.reads_cached_context or second.reads_cached_context

    def bind(self, sampler, target_cache, keep_drafting=None):
        super().bind(sampler, target_cache, keep_drafting)
        for member in (self.first, self.second):
            member.bind(sampler, target_cache, keep_drafting)

    def spawn(self):
        twin = copy.copy(self)
        twin.first, twin.second = self.first.spawn(), self.second.spawn()
        return twin

    def chains(self):
        first, second = self.first.chains(), self.second.chains()
        if first is None or second is None:
            return None
        twin = copy.copy(self)
        twin.first, twin.second, twin.tree = first, second, False
        return twin

    def prefill(self, context, taps, start):
        self.first.prefill(context, taps, start)
        self.second.prefill(context, taps, start)

    def propose(self, k):
        draft = self.first.propose(k)
        expected = expected_tokens(draft) if len(draft) else 0.0
        if expected >= STRONG:
            return draft
        second = self.second.propose(min(k, self.second_length))
        if len(second):
            mx.eval(second.tokens, second.confidence)
            if expected_tokens(second) > expected:
                return second
        return draft

    def commit(self, accepted: List[int], next_token, taps):
        self.first.commit(accepted, next_token, taps)
        self.second.commit(accepted, next_token, taps)

    def finish(self, output):
        self.first.finish(output)
        self.second.finish(output)
