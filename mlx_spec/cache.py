"""The target's KV cache: mlx-lm's own caches, which grow in chunks as tokens arrive and roll
back by moving an offset (stale rows are overwritten later, never copied).

Not every cache can roll back. A sliding-window cache (`RotatingKVCache`) overwrites its oldest
entries once it wraps; a recurrent one (`ArraysCache`: Mamba, Gated DeltaNet) holds one state,
not one entry per position; a `ChunkedKVCache` drops the previous chunk. `rollback_to` rolls
back exactly where the entries it needs are still there and otherwise says so, and the caller
rebuilds the cache from the tokens: never a cache that silently differs from a plain run."""

from typing import Any, List, Sequence

from mlx_lm.models.cache import (ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache,
                                 make_prompt_cache)

from .errors import MlxSpecError


def make_cache(model) -> List[Any]:
    return make_prompt_cache(model)


def _layers(cache):
    """The leaf caches (CacheList holds several per layer)."""
    for c in cache:
        if isinstance(c, CacheList):
            yield from _layers(c.caches)
        else:
            yield c


def check_speculation(cache: Sequence[Any], model_type: str, what: str = "speculative decoding") -> None:
    """Refuse, in one line and before any token, a cache that verification could not roll
    back: a recurrent state would need every drafted position replayed."""
    kinds = sorted({type(c).__name__ for c in _layers(cache)
                    if isinstance(c, ArraysCache) or not hasattr(c, "offset")})
    if kinds:
        raise MlxSpecError(f"{what} cannot roll back the {', '.join(kinds)} of this {model_type} model "
                           "(recurrent layers); use --draft none")


def check_tree(cache: Sequence[Any], model_type: str) -> None:
    """Tree verification writes every node's K/V, then moves the accepted path's rows into
    place (tree.compact): that needs one row per position, as in a plain KVCache."""
    kinds = sorted({type(c).__name__ for c in _layers(cache) if type(c) is not KVCache})
    if kinds:
        raise MlxSpecError(f"tree drafts need a plain KV cache; this {model_type} model uses "
                           f"{', '.join(kinds)}: draft a chain (no --tree-budget)")


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _rollback_rotating(c: RotatingKVCache, length: int) -> bool:
    """mlx-lm's sliding-window cache. A multi-token update leaves its entries in temporal order
    (the last max_size - 1 before it, then the new ones): dropping the newest n is a slice, and
    exact while the window before `length` is still held. After a one-token update the buffer
    has rotated over the entries a rollback would need."""
    n = c.offset - length
    held = c.keys.shape[2] if c.keys is not None else 0
    if c.offset < c.max_size and c._idx == c.offset:   # not wrapped yet: index = position
        c.trim(n)
        return True
    if c.keep or c._idx != held:
        return False
    kept = held - n
    # Every position of the window before `length` must be there, and a full window at least
    # (mlx-lm's one-token update assumes a full buffer once the cache has wrapped).
    if kept < min(length, c.max_size) or (length < c.max_size and kept != length):
        return False
    c.keys, c.values = c.keys[..., :kept, :], c.values[..., :kept, :]
    c.offset, c._idx = length, kept
    return True


def _rollback_layer(c, length: int) -> bool:
    n = c.offset - length
    if n == 0:
        return True
    if n < 0:
        return False
    if isinstance(c, RotatingKVCache):
        return _rollback_rotating(c, length)
    if isinstance(c, ChunkedKVCache) and n > c.offset - c.start_position:
        return False   # the previous chunk's entries are gone
    if not c.is_trimmable():
        return False
    c.trim(n)
    return True


def rollback_to(cache: List[Any], length: int) -> bool:
    """Keep the first `length` positions of every layer's cache (per layer, so that a step
    interrupted half-way through its layers is repaired too). False when some layer cannot
    roll back exactly (recurrent state, a window or chunk moved past them): the caller then
    starts from a new cache. A recurrent layer does not know its length: call this only when
    something is to be dropped."""
    ok = True
    for c in _layers(cache):
        if isinstance(c, ArraysCache):
            ok = False
        elif not _rollback_layer(c, length):
            ok = False
    return ok
