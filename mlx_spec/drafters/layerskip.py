"""LayerSkip self-speculation: the target's first `exit_layer` layers, then its final norm and
output layer, draft; the full model verifies, sharing one cache.

Drafting runs the early layers over [last committed token, d_1 .. d_{k-1}] in the target's own
cache. Verification (`verify_forward`, which the engine calls instead of the target's forward)
runs the early layers only over what they have not seen (d_k), then the remaining layers over
all k + 1 positions, starting from the exit layer's states computed while drafting: the early
layers do each position's work once, as in the LayerSkip paper. When the policy verifies fewer
drafts than were drafted, the early layers' surplus entries are dropped first; after the
verdict the engine rolls every layer back to the accepted prefix as usual.

Targets: mlx-lm models whose layers are called as `layer(h, mask, cache)` over plain KV caches
(the Llama family and most others without windows or recurrent state)."""

from typing import List

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from ..cache import rollback_to
from ..errors import MlxSpecError
from .base import Draft, Drafter


class LayerSkipDrafter(Drafter):
    shared = ("target",)

    def __init__(self, target, exit_layer: int):
        n = target.num_layers
        if not 1 <= exit_layer < n:
            raise MlxSpecError(
                f"--exit-layer must lie in 1..{n - 1} for this {n}-layer model, got {exit_layer}"
            )
        self.target, self.exit_layer = target, exit_layer
        self.target_cache = None  # bind: the engine's cache, as it is now
        self.last_token = None
        self.position = 0  # of the first draft
        self.exits: List[mx.array] = []  # exit-layer states of the positions drafted this step

    def bind(self, sampler, target_cache, keep_drafting=None) -> None:
        """It drafts in the engine's cache: plain KV caches only."""
        kinds = {type(c).__name__ for c in target_cache()}
        if kinds != {"KVCache"}:
            raise MlxSpecError(
                f"--draft layerskip needs plain KV caches; this {self.target.model_type} model "
                f"has {', '.join(sorted(kinds))}"
            )
        super().bind(sampler, target_cache, keep_drafting)
        self.target_cache = target_cache

    def _layers(self, h: mx.array, start: int, stop: int) -> mx.array:
        cache = self.target_cache()
        mask = create_attention_mask(h, cache[start]) if h.shape[1] > 1 else None
        for i in range(start, stop):
            h = self.target.layers[i](h, mask, cache=cache[i])
        return h

    def prefill(self, context, taps, start):
        self.last_token, self.position, self.exits = context[-1], len(context), []

    def propose(self, k):
        self.exits = []
        if k <= 0:
            return Draft()
        token, draws = mx.array([self.last_token]), []
        for i in range(k):
            h = self._layers(self.target.embed(token[None]), 0, self.exit_layer)
            self.exits.append(h)
            tokens, q, confidence = self.sampler.draw(
                self.target.head(h[0]), [self.position + i], self.target.vocab_size
            )
            draws.append((tokens, q, confidence))
            token = tokens
        return Draft.chain(draws)

    def verify_forward(self, inputs: mx.array, cache, taps, replay=None):
        """The target's logits over inputs [1, m + 1] = [last token, d_1 .. d_m], reusing the
        early layers' work of propose."""
        m1, early = inputs.shape[1], len(self.exits)
        if early == 0:
            return self.target.forward(inputs, cache, taps)
        if m1 <= early:  # fewer verified than drafted: drop the surplus
            offset = cache[0].offset - (early - m1)
            rollback_to(cache[: self.exit_layer], offset)
            exits = self.exits[:m1]
        else:  # d_k has not been through the early layers yet
            exits = self.exits + [self._layers(self.target.embed(inputs[:, early:]), 0, self.exit_layer)]
        h = self._layers(mx.concatenate(exits, axis=1), self.exit_layer, self.target.num_layers)
        return self.target.lm_head(self.target.final_norm(h)), {}

    def commit(self, accepted, next_token, taps):
        self.last_token, self.exits = next_token, []
        self.position += len(accepted) + 1
