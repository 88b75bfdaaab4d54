"""The target's KV cache: mlx-lm's own caches, which grow in chunks as tokens arrive and roll
back by moving an offset (stale rows are overwritten later, never copied)."""

from typing import Any, List, Sequence

from mlx_lm.models.cache import make_prompt_cache

from .errors import MlxSpecError


def make_cache(model) -> List[Any]:
    return make_prompt_cache(model)


def check_rollback(cache: List[Any], what: str) -> None:
    if not all(c.is_trimmable() for c in cache):
        kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        raise MlxSpecError(f"{what} needs a cache that can roll back; this model uses {', '.join(kinds)}")


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def rollback_to(cache: List[Any], length: int) -> None:
    """Keep the first `length` positions of every layer's cache (per layer, so that a step
    interrupted half-way through its layers is repaired too)."""
    for c in cache:
        c.trim(c.offset - length)
