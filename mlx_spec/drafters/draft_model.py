"""A separate small model with the target's tokenizer drafts k tokens autoregressively.

It keeps its own KV cache; after each verification it rolls back to the longest prefix that is
still valid (no re-prefill). At temperature > 0 it draws its drafts from its own q at the
target's sampling settings, with the generation's noise (sampling.Sampler). The k draft forwards
stay one lazy graph: drafting and verification are evaluated together, with one sync."""

from typing import List

import mlx.core as mx

from ..cache import Snapshots, check_speculation, common_prefix_length, is_recurrent, make_cache, rollback_to
from ..errors import MlxSpecError
from .base import Draft, Drafter


def check_same_vocabulary(target, draft) -> None:
    """Refuse a draft model whose tokens are not the target's (size, first ids, specials)."""
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is None or dt is None:
        if target.vocab_size != draft.vocab_size:
            raise MlxSpecError(
                f"draft model vocabulary ({draft.vocab_size}) does not match the "
                f"target's ({target.vocab_size})"
            )
        return
    tv, dv = tt.get_vocab(), dt.get_vocab()
    if len(tv) != len(dv):
        raise MlxSpecError(f"draft model tokenizer has {len(dv)} tokens, the target's has {len(tv)}")
    first = range(min(1000, len(tv)))
    if tt.convert_ids_to_tokens(list(first)) != dt.convert_ids_to_tokens(list(first)):
        raise MlxSpecError("draft model tokenizer assigns different ids than the target's")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tt, name, None) != getattr(dt, name, None):
            raise MlxSpecError(f"draft model {name} differs from the target's")


class DraftModelDrafter(Drafter):
    shared = ("draft",)

    def __init__(self, draft, vocab_size: int):
        self.draft = draft
        self.vocab_size = vocab_size  # the target's: q is padded to it
        self.cache = make_cache(draft.model)
        check_speculation(self.cache, draft.model_type, "a draft model")
        # Recurrent layers (a hybrid or Mamba draft model) roll back to a snapshot of their
        # state, taken before each draft position: the drafts are fed one at a time.
        self.recurrent = any(is_recurrent(c) for c in self.cache)
        self.snapshots = Snapshots()
        self.context: List[int] = []  # committed tokens
        self.cached: List[int] = []  # tokens whose K/V are in self.cache
        self.pending = None  # the last drafts (lazy until verification)

    def _feed(self, tokens: List[int]):
        logits, _ = self.draft.forward(mx.array(tokens)[None], self.cache)
        self.cached += tokens
        self._snapshot(len(self.cached))
        return logits

    def _snapshot(self, length: int) -> None:
        if self.recurrent:
            self.snapshots.take(self.cache, length)

    def _roll_back(self, length: int) -> None:
        """As the engine's: a cache that cannot roll back exactly (a sliding window that has
        rotated past the drafts) starts again empty and is refilled at the next propose."""
        # Also where nothing committed is dropped: an interrupted step leaves drafts past it.
        # A recurrent state does not know its length: there only a real drop goes through it.
        dropped = length < len(self.cached) or not self.recurrent
        if dropped and not rollback_to(self.cache, length, self.snapshots):
            self.cache, length = make_cache(self.draft.model), 0
        self.cached = self.cached[:length]

    def prefill(self, context, taps, start):
        # The prompt is fed at the first propose: nothing is paid while the policy drafts nothing.
        self._roll_back(common_prefix_length(self.cached, context[:-1]))
        self.context = list(context)

    def propose(self, k):
        self.pending = None
        if k == 0:
            return Draft()
        position = len(self.context)  # of the next draft
        self.snapshots = Snapshots()
        fed = len(self.context)  # positions in the cache once the context is fed

        def draw(logits):
            nonlocal position
            position += 1
            return self.sampler.draw(logits[0, -1:, : self.vocab_size], [position - 1], self.vocab_size)

        def next_draw(previous):  # feeds the previous draft, lazily: no sync unless stopping early
            nonlocal fed
            logits = self.draft.forward(previous[0][None], self.cache)[0]
            fed += 1
            self._snapshot(fed)
            return draw(logits)

        draft = self.chain_draws(k, lambda: draw(self._feed(self.context[len(self.cached) :])), next_draw)
        self.pending = draft.tokens
        return draft

    def commit(self, accepted, next_token, taps):
        drafts = self.pending.tolist() if self.pending is not None else []
        self.pending = None
        # The cache saw the context and drafts 1..k-1; what stays valid is the part of them
        # that was committed.
        fed = drafts[:-1]
        valid = len(self.cached) + common_prefix_length(fed, accepted)
        self.cached += fed
        self._roll_back(valid)
        self.context += list(accepted) + [next_token]
