"""Logits -> the distribution a token is drawn from, shared by the target and every drafter.

The filters are mlx-lm's own (top-p, min-p, top-k on log-probabilities, in mlx-lm's order),
then the temperature: exactly the distribution `mlx_lm.sample_utils.make_sampler` draws from."""

from dataclasses import dataclass, replace
from typing import Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def check(self, vocab_size: int) -> "SamplingParams":
        from .errors import MlxSpecError

        if self.temp < 0:
            raise MlxSpecError(f"--temp must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise MlxSpecError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise MlxSpecError(f"--min-p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.top_k < vocab_size:
            raise MlxSpecError(f"--top-k must be in [0, {vocab_size}), got {self.top_k}")
        return self


def log_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Normalized log-probabilities [..., V] of the sampling distribution (-inf where filtered)."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    logprobs = logprobs * (1.0 / params.temp)
    return logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)


def probs(logits: mx.array, params: SamplingParams) -> mx.array:
    return mx.exp(log_probs(logits, params))


class Sampler:
    """The sampling settings and the randomness of one generation, shared by the target's
    verification and the drafter's draws.

    Default rule (reproducible): the token at absolute position i is argmax(log p_i + g_i), with
    g_i Gumbel noise keyed by (seed, i) over the target's vocabulary. Whatever the draft source,
    draft length or timing, position i meets the same g_i, so the output depends only on the
    target, the settings, the prompt and the seed; a draft is accepted when it equals that
    token, and a sampling drafter draws argmax(log q_i + g_i) with the same noise, which makes
    it agree with the target as often as their distributions allow.

    residual=True: the classic rule (accept x with min(1, p/q), else draw from norm(max(0, p -
    q))), which needs q and its own random stream: exact, but the tokens for a seed depend on the
    draft source and on the lengths drafted."""

    def __init__(self, params: SamplingParams = SamplingParams(), seed: int = 0, residual: bool = False):
        self.params, self.residual = params, residual
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        self.seed, self._keys = seed, {}

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def needs_q(self) -> bool:
        """Whether verification needs the drafts' distributions."""
        return self.residual and not self.greedy

    def next_key(self, stream: str) -> mx.array:
        """The residual rule's draws: one stream for verification, one for the drafter."""
        if stream not in self._keys:
            self._keys[stream] = mx.random.split(mx.random.key(self.seed))[int(stream == "draft")]
        self._keys[stream], key = mx.random.split(self._keys[stream])
        return key

    def noise(self, positions: Sequence[int], vocab_size: int) -> mx.array:
        """[len(positions), vocab_size] Gumbel noise, one row per absolute position."""
        seed = (self.seed & 0xFFFFFFFF) << 32
        distinct = sorted(set(positions))
        rows = mx.stack(
            [
                mx.random.gumbel(shape=(vocab_size,), key=mx.random.key(seed | (p & 0xFFFFFFFF)))
                for p in distinct
            ]
        )
        if distinct == list(positions):
            return rows
        return rows[mx.array([distinct.index(p) for p in positions])]

    def choose(self, logits: mx.array, positions: Sequence[int]) -> mx.array:
        """The target's tokens [n] from its logits [n, V] for the given positions."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        noise = self.noise(positions, logits.shape[-1])
        return mx.argmax(log_probs(logits, self.params) + noise, axis=-1)

    def _draft_log_probs(self, logits: mx.array) -> mx.array:
        """A drafter's distribution: the softmax when greedy, else at the target's sampling
        settings."""
        if self.greedy:
            return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        params = self.params
        if params.top_k >= logits.shape[-1]:  # a narrow draft head: top-k keeps it all
            params = replace(params, top_k=0)
        return log_probs(logits, params)

    def _draft_noise(self, positions: Sequence[int], vocab_size: int, ids, width: int) -> mx.array:
        """The target's noise at the positions, in a drafter's columns (ids as in draw)."""
        noise = self.noise(positions, vocab_size)
        return noise[:, ids] if ids is not None else noise[:, :width]

    def tree_log_probs(
        self, logits: mx.array, positions: Sequence[int], vocab_size: int, ids: mx.array = None
    ) -> mx.array:
        """The normalized log-probabilities [n, w] a draft tree takes its top tokens from, for a
        drafter's logits [n, w] at the given positions (ids as in draw). The default rule: the
        target's token is the argmax of its log-probabilities plus the position's noise, so the
        tree is the greedy tree of the drafter's log-probabilities plus the same noise (its top
        child is the chain's draw). Greedy: the softmax; the residual rule (whose verifier does
        not see the noise): the tempered, filtered distribution."""
        log_q = self._draft_log_probs(logits)
        if self.greedy or self.residual:
            return log_q
        log_q = log_q + self._draft_noise(positions, vocab_size, ids, logits.shape[-1])
        return log_q - mx.logsumexp(log_q, axis=-1, keepdims=True)

    def draw(self, logits: mx.array, positions: Sequence[int], vocab_size: int, ids: mx.array = None):
        """A drafter's tokens [n] (target ids) from its logits [n, w] for the given
        positions; ids[j] is the target id of column j (None: column j is id j). Returns
        (tokens, q, confidence): q [n, vocab_size] the distributions drawn from, only where
        verification needs them (the residual rule), else None; confidence [n] the drafter's
        probability of each token (at the sampling settings), for the draft-length policy."""
        log_q = self._draft_log_probs(logits)
        if self.greedy:
            tokens, q = mx.argmax(logits, axis=-1), None
        elif self.residual:
            tokens = mx.random.categorical(log_q, key=self.next_key("draft"))
            q = mx.exp(log_q)
            if ids is not None:
                q = mx.zeros((q.shape[0], vocab_size), q.dtype).at[:, ids].add(q)
            elif q.shape[-1] < vocab_size:  # a draft head narrower than the target's
                q = mx.pad(q, [(0, 0), (0, vocab_size - q.shape[-1])])
        else:
            noise = self._draft_noise(positions, vocab_size, ids, logits.shape[-1])
            tokens, q = mx.argmax(log_q + noise, axis=-1), None
        confidence = mx.exp(mx.take_along_axis(log_q, tokens[:, None], axis=-1)[:, 0])
        if ids is not None:
            tokens = ids[tokens]
        return tokens.astype(mx.int32), q, confidence
