"""DFlash: one drafter forward over [last verified token, mask x (block_size - 1)] gives up to
block_size - 1 drafts, conditioned on the target's hidden states (models/dflash.py).

The drafter's context grows only by target features the engine already has: the prompt's at
prefill, the accepted positions' (taken from the verification pass, no extra target forward)
at each commit. Features committed in a step are appended at the next propose, inside the
drafting graph, so appending, drafting and verification are evaluated together with one sync.
At temperature > 0 each position is sampled from its own q; the positions do not see each
other's drafts, so q_i is exactly the probability of x_i given the prefix and verification
stays exact."""

from typing import Dict, List

import mlx.core as mx

from ..cache import rollback_to
from ..sampling import SamplingParams, log_probs
from .base import Draft, Drafter


class DFlashDrafter(Drafter):
    def __init__(self, target, model, sampling: SamplingParams, seed: int = 0):
        self.target = target
        self.model = model
        self.sampling = sampling
        self.taps = tuple(model.args.target_layer_ids)
        self.block_size = model.args.block_size
        self.mask_token_id = model.args.mask_token_id
        self.cache = model.make_cache()
        self.key = mx.random.key(seed + 1)   # independent of the engine's verification stream
        self.last_token = None               # the block's first token: the last committed one
        self.pending: List[mx.array] = []    # target features committed but not yet cached

    def _features(self, taps: Dict[int, mx.array]) -> mx.array:
        return mx.concatenate([taps[i] for i in self.taps], axis=-1)

    def _append_pending(self) -> None:
        if self.pending:
            self.model.append_context(mx.concatenate(self.pending, axis=1), self.cache)
            self.pending = []

    def prefill(self, context, taps, start):
        # Cache what the last generation committed first: the rollback needs offset >= start.
        self._append_pending()
        rollback_to(self.cache, start)
        if taps:
            self.model.append_context(self._features(taps), self.cache)
        self.last_token = context[-1]
        mx.eval([c.state for c in self.cache])

    def propose(self, k):
        n = min(k, self.block_size - 1)
        if n <= 0:
            return Draft()
        self._append_pending()
        block = mx.array([[self.last_token] + [self.mask_token_id] * (self.block_size - 1)])
        # The whole block is always run (its attention is bidirectional, so a shorter block
        # would change every prediction); only the first n positions go through the head.
        hidden = self.model(self.target.embed(block), self.cache)
        logits = self.target.lm_head(hidden[0, 1:n + 1])
        if self.sampling.greedy:
            return Draft(tokens=mx.argmax(logits, axis=-1).astype(mx.int32))
        # One log_probs for both the draws and q (over the whole vocabulary it is not cheap).
        log_q = log_probs(logits, self.sampling)
        self.key, key = mx.random.split(self.key)
        tokens = mx.random.categorical(log_q, key=key).astype(mx.int32)
        return Draft(tokens=tokens, q=mx.exp(log_q))

    def commit(self, n_accepted, next_token, taps):
        self.pending.append(self._features(taps))
        self.last_token = next_token
