"""DFlash: one drafter forward over [last verified token, mask x (block_size - 1)] gives up to
block_size - 1 drafts, conditioned on the target's hidden states (models/dflash.py).

The drafter's context grows only by target features the engine already has: the prompt's at
prefill, the accepted positions' (taken from the verification pass, no extra target forward)
at each commit. Features are appended to its cache at the next propose, inside the drafting
graph, so appending, drafting and verification are evaluated together with one sync, and
steps that do not draft (the policy's plain steps) pay nothing for the drafter.
At temperature > 0 each position is drawn from its own q with the generation's noise
(sampling.Sampler); the positions do not see each other's drafts, so under the residual rule
q_i is exactly the probability of x_i given the prefix."""

from typing import Dict, List

import mlx.core as mx

from ..cache import rollback_to
from .base import Draft, Drafter


class DFlashDrafter(Drafter):
    shared = ("target", "model")

    def __init__(self, target, model):
        self.target = target
        self.model = model
        self.taps = tuple(model.args.target_layer_ids)
        self.block_size = model.args.block_size
        self.mask_token_id = model.args.mask_token_id
        self.cache = model.make_cache()
        self.last_token = None  # the block's first token: the last committed one
        self.position = 0  # of the first draft: the committed tokens so far
        self.pending: List[mx.array] = []  # target features committed but not yet cached

    def _features(self, taps: Dict[int, mx.array]) -> mx.array:
        return mx.concatenate([taps[i] for i in self.taps], axis=-1)

    def _append_pending(self) -> None:
        if self.pending:
            self.model.append_context(mx.concatenate(self.pending, axis=1), self.cache)
            self.pending = []

    def _keep_context(self, length: int) -> None:
        """Keep the first `length` context positions, cached or pending."""
        cached = self.cache[0].offset
        if length <= cached:
            rollback_to(self.cache, length)
            self.pending = []
            return
        kept, left = [], length - cached
        for features in self.pending:
            if left <= 0:
                break
            kept.append(features[:, :left])
            left -= features.shape[1]
        self.pending = kept

    def prefill(self, context, taps, start):
        # The prompt's context K/V is computed lazily, at the next proposal (inside its drafting
        # graph): a generation in which the policy never drafts never pays for it.
        self._keep_context(start)
        if taps:
            self.pending.append(self._features(taps))
        self.last_token = context[-1]
        self.position = len(context)

    def block_logits(self, n: int) -> mx.array:
        """The drafter's logits [n, draft vocabulary] for the next n positions (lazy)."""
        self._append_pending()
        block = mx.array([[self.last_token] + [self.mask_token_id] * (self.block_size - 1)])
        # The whole block is always run (its attention is bidirectional, so a shorter block
        # would change every prediction); only the first n positions go through the head.
        hidden = self.model(self.target.embed(block), self.cache)[0, 1 : n + 1]
        return self.target.lm_head(hidden) if self.model.rows is None else self.model.rows(hidden)

    def propose(self, k):
        n = min(k, self.block_size - 1)
        if n <= 0:
            return Draft()
        logits = self.block_logits(n)
        tokens, q, confidence = self.sampler.draw(
            logits, range(self.position, self.position + n), self.target.vocab_size, ids=self.model.draft_ids
        )
        return Draft(tokens=tokens, q=q, confidence=confidence)

    def commit(self, accepted, next_token, taps):
        self.pending.append(self._features(taps))
        self.last_token = next_token
        self.position += len(accepted) + 1
