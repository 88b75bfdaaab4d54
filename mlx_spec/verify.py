"""Acceptance rules for a chain of drafts. Everything is computed on the device; the caller
syncs once per step.

Greedy, and sampling by the default (seeded) rule: the target's token at each position is
`Sampler.choose` (argmax, or argmax of log-probabilities plus that position's Gumbel noise);
drafts are accepted while they equal it, and the target's token follows.

The residual rule (Leviathan et al.): accept draft x_i with probability min(1, p_i(x_i) /
q_i(x_i)); at the first rejection sample from norm(max(0, p_i - q_i)); if all k drafts pass,
sample the bonus token from p_k. Deterministic drafts have one-hot q: x is accepted with
probability p(x) and the replacement comes from p without x.
"""

from typing import Optional

import mlx.core as mx

from .sampling import Sampler, probs


def verify_chain(
    logits: mx.array, drafts: mx.array, q: Optional[mx.array], sampler: Sampler, first_position: int
) -> mx.array:
    """logits [k+1, V] of the target at [last token, x_1..x_k], which predict the tokens at
    first_position..; drafts [k] (int); q [k, V] draft probabilities (the residual rule only;
    None for deterministic drafts). Returns int32 [2]: (accepted drafts n, the target's token
    after them)."""
    k = drafts.shape[0]
    if not sampler.residual or sampler.greedy:
        target = sampler.choose(logits, range(first_position, first_position + k + 1))
        n = mx.cumprod((drafts == target[:k]).astype(mx.int32)).sum() if k else mx.array(0)
        return mx.stack([n, target[n]]).astype(mx.int32)

    accept_key, sample_key = mx.random.split(sampler.next_key("verify"))
    p = probs(logits, sampler.params)  # [k+1, V]
    rows = mx.arange(k)
    p_x = p[rows, drafts]  # [k]
    if q is None:
        q = (mx.arange(p.shape[-1])[None] == drafts[:, None]).astype(p.dtype)
    q_x = q[rows, drafts]
    u = mx.random.uniform(shape=(k,), key=accept_key)
    accepted = (u * q_x < p_x).astype(mx.int32)  # u < p/q without dividing
    n = mx.cumprod(accepted).sum() if k else mx.array(0)
    # Row i < k: residual after rejecting x_i; row k: the bonus distribution p_k.
    residual = mx.concatenate([mx.maximum(p[:k] - q, 0.0), p[k:]], axis=0)[n]
    # p == q up to rounding can leave no residual mass: then p itself is the exact answer.
    residual = mx.where(residual.sum() > 0, residual, p[n])
    token = mx.random.categorical(mx.log(residual), key=sample_key)
    return mx.stack([n, token]).astype(mx.int32)
