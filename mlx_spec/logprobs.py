"""The committed tokens' log-probabilities and most likely alternatives, where a generation asks
for them (logprobs / top_logprobs): from the logits the verification pass computed anyway, at the
rows the verdict committed only, for every generation of a batch at once.

They are worked out with numpy on the host: MLX's CPU backend takes ~3 ms for the log-sum-exp and
~2 ms for a top-5 partition of 4 rows of 49,152 logits (exp and partition are not vectorised
there), numpy ~0.3 ms for both (a block-wise top-k below); on Metal the copy of a few committed
rows is small. Values are float32, as mlx-lm's (logits - logsumexp(logits))."""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .events import TokenLogprobs

BLOCK = 256  # top_indices' block: ~200 blocks per vocabulary of 50k, each a short scan


@dataclass
class LogprobRows:
    """A pass's rows as logprobs need them: the (processed) logits [n, V] and the token each row
    commits [n]; `committed`, once committed_logprobs has run, the committed rows' figures."""

    logits: mx.array
    tokens: mx.array
    top: int  # alternatives per token
    distribution: bool  # the whole distribution too (the Python API's mlx-lm field)
    committed: Optional[List[TokenLogprobs]] = None


def committed_logprobs(asked: Sequence[Tuple[LogprobRows, int]]) -> None:
    """Each (rows, n)'s first n rows (the committed tokens) as TokenLogprobs, into rows.committed:
    every generation's rows together (one evaluation, not one sync per generation)."""
    if not asked:
        return
    logits = mx.concatenate([rows.logits[:n] for rows, n in asked])
    logits = logits if logits.dtype == mx.float32 else logits.astype(mx.float32)
    tokens = mx.concatenate([rows.tokens[:n] for rows, n in asked])
    mx.eval(logits, tokens)
    values, tokens = np.asarray(logits), np.asarray(tokens)
    peak = values.max(axis=-1, keepdims=True)
    total = peak + np.log(np.exp(values - peak).sum(axis=-1, keepdims=True))
    chosen = (np.take_along_axis(values, tokens[:, None].astype(np.int64), axis=-1) - total)[:, 0].tolist()
    top = max(rows.top for rows, _ in asked)
    best = top_indices(values, top) if top else np.zeros((len(values), 0), np.int64)
    best_values = (np.take_along_axis(values, best, axis=-1) - total).tolist()
    best, start = best.tolist(), 0
    for rows, n in asked:
        distribution = (
            logits[start : start + n] - mx.array(total[start : start + n]) if rows.distribution else None
        )
        rows.committed = [
            TokenLogprobs(
                chosen[i],
                tuple(zip(best[i][: rows.top], best_values[i][: rows.top])),
                None if distribution is None else distribution[i - start],
            )
            for i in range(start, start + n)
        ]
        start += n


def token_logprobs(rows: Optional[LogprobRows], n: int) -> Optional[List[TokenLogprobs]]:
    """The first n rows (the committed tokens) as TokenLogprobs (None: not asked)."""
    if rows is None:
        return None
    if rows.committed is None:
        committed_logprobs([(rows, n)])
    return rows.committed


def top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Each row's k largest entries' indices [n, k], largest first. They lie in the k blocks with
    the largest maxima (an entry outside them has k larger block maxima above it), so only those
    blocks are partitioned, not the whole row (~0.5 ms a row of 49,152 for numpy and MLX alike)."""
    n, width = values.shape
    k = min(k, width)
    if width <= BLOCK * k:
        candidates, index = values, np.broadcast_to(np.arange(width), values.shape)
    else:
        padding = -width % BLOCK
        if padding:
            values = np.pad(values, ((0, 0), (0, padding)), constant_values=-np.inf)
        blocks = values.reshape(n, -1, BLOCK)
        kept = np.argpartition(-blocks.max(axis=-1), k - 1, axis=-1)[:, :k]  # [n, k]
        candidates = np.take_along_axis(blocks, kept[:, :, None], axis=1).reshape(n, k * BLOCK)
        index = (kept[:, :, None] * BLOCK + np.arange(BLOCK)).reshape(n, k * BLOCK)
    part = np.argpartition(-candidates, k - 1, axis=-1)[:, :k]
    order = np.argsort(-np.take_along_axis(candidates, part, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(np.take_along_axis(index, part, axis=-1), order, axis=-1)
