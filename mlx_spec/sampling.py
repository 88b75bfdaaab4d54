"""Logits -> the distribution a token is drawn from, shared by the target and every drafter.

The filters are mlx-lm's own (top-p, min-p, top-k on log-probabilities, in mlx-lm's order),
then the temperature: exactly the distribution `mlx_lm.sample_utils.make_sampler` draws from."""

from dataclasses import dataclass

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


def sample(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """One token per row of logits: argmax when greedy, else a draw from `probs`."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(log_probs(logits, params), key=key)
