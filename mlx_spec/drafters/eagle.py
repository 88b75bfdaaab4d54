"""EAGLE-3 chain drafting: one draft layer fed with the target's own features.

Position t of the layer's cache holds the pair (token t+1, fused target feature at t); the
layer's output there predicts token t+2. A draft step feeds the layer's own pre-norm output
back in place of the target feature it has not computed yet. After each verification the
speculative entries are dropped and the committed tokens are paired with the features the
target just computed for them: the cache holds target features only. At temperature > 0
drafts are sampled from the draft head's distribution at the target's sampling settings, and
reported as q scattered into target ids (zero outside the draft vocabulary), so that
verification stays exact. The k draft steps stay one lazy graph, evaluated together with the
verification."""

from dataclasses import replace
from typing import Dict, List

import mlx.core as mx

from ..cache import common_prefix_length, rollback_to
from ..errors import MlxSpecError
from ..sampling import SamplingParams, log_probs
from .base import Draft, Drafter


class EagleDrafter(Drafter):
    def __init__(self, model, sampling: SamplingParams, vocab_size: int, seed: int = 0):
        self.model = model
        self.taps = model.taps
        # top-k over the whole draft vocabulary keeps it all (and mlx-lm's filter wants k < size)
        keeps_all = sampling.top_k >= model.args.draft_vocab_size
        self.sampling = replace(sampling, top_k=0) if keeps_all else sampling
        self.vocab_size = vocab_size        # the target's: q spans it
        self.target_ids = model.to_target(mx.arange(model.args.draft_vocab_size))
        self.cache = model.make_cache()
        self.key = mx.random.key(seed + 1)  # independent of the engine's verification stream
        self.paired: List[int] = []         # paired[t]: the token at cache position t (context[t+1])
        self.last_hidden = None             # the layer's output at the last position: drafts from it
        self.pending = None                 # the last drafts (lazy until verification)

    def _fuse(self, taps: Dict[int, mx.array]) -> mx.array:
        return self.model.fuse(mx.concatenate([taps[i] for i in self.taps], axis=-1))

    def _extend(self, tokens: List[int], features: mx.array) -> None:
        """Append the pairs (tokens[j], features[:, j]) at the next positions."""
        out = self.model(self.model.embed(mx.array(tokens)[None]), features, self.cache)
        self.paired += tokens
        self.last_hidden = out[:, -1:]

    def prefill(self, context, taps, start):
        # Positions 0..len(context)-2 must end up paired. Pairs before `start` were built in an
        # earlier generation of this session and stay valid where their tokens still match;
        # the engine hands the target's features from `start` on (at least one position).
        keep = common_prefix_length(self.paired, context[1:])
        if keep < start:
            raise MlxSpecError("EAGLE drafter state is behind the target's cache: start a new session")
        rollback_to(self.cache, start)  # also drops drafts of an interrupted step
        self.paired = self.paired[:start]
        self._extend(context[start + 1:], self._fuse(taps))

    def propose(self, k):
        self.pending = None
        if k == 0 or self.last_hidden is None:
            return Draft()
        hidden, drafts, qs = self.last_hidden, [], []
        for i in range(k):
            if i:  # feed the previous draft and the layer's own output, still lazy
                hidden = self.model(self.model.embed(drafts[-1].reshape(1, 1)), hidden, self.cache)
            logits = self.model.logits(hidden[0, -1])
            if self.sampling.greedy:
                drafts.append(self.target_ids[mx.argmax(logits)])
                continue
            # Filtered and tempered like the target's distribution; the target ids outside the
            # draft vocabulary have probability 0 in either order, so q is scattered afterwards.
            logq = log_probs(logits, self.sampling)
            self.key, key = mx.random.split(self.key)
            drafts.append(self.target_ids[mx.random.categorical(logq, key=key)])
            q = mx.zeros((self.vocab_size,), mx.float32)
            q[self.target_ids] = mx.exp(logq)
            qs.append(q)
        self.pending = mx.stack(drafts).astype(mx.int32)
        return Draft(tokens=self.pending, q=mx.stack(qs) if qs else None)

    def commit(self, n_accepted, next_token, taps):
        drafts = self.pending.tolist() if self.pending is not None else []
        rollback_to(self.cache, len(self.paired))  # drop the speculative entries
        # taps cover [last committed token, accepted drafts]: each pairs with the token after it.
        self._extend(drafts[:n_accepted] + [next_token], self._fuse(taps))
