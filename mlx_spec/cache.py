"""The target's KV cache: mlx-lm's own caches, which grow in chunks as tokens arrive and roll
back by moving an offset (stale rows are overwritten later, never copied).

Not every cache can roll back by moving an offset. A sliding-window cache (`RotatingKVCache`)
overwrites its oldest entries once it wraps; a recurrent one (`ArraysCache`: Mamba, Gated
DeltaNet) holds one state, not one entry per position, and is rolled back by a `Replay` of the
last pass; a `ChunkedKVCache` drops the previous chunk. `rollback_to` rolls back exactly where
what it needs is still there and otherwise says so, and the caller rebuilds the cache from the
tokens: never a cache that silently differs from a plain run."""

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    _BaseCache,
    make_prompt_cache,
)

from .errors import MlxSpecError


def make_cache(model, max_kv_size: Optional[int] = None) -> List[Any]:
    """mlx-lm's cache for the model; max_kv_size (--max-kv-size): where mlx-lm makes its
    RotatingKVCache(max_kv_size, keep=4), a BoundedKVCache, which verifies exactly."""
    cache = make_prompt_cache(model, max_kv_size)
    return [
        BoundedKVCache(c.max_size, c.keep) if type(c) is RotatingKVCache and max_kv_size else c for c in cache
    ]


class BoundedKVCache(RotatingKVCache):
    """mlx-lm's cache of --max-kv-size: the first `keep` positions and a window of the latest.
    Decoding one token at a time, position q attends to positions < keep and to the last
    max_size - keep up to itself; mlx-lm's mask for a pass over several positions is a plain
    sliding window of max_size, which hides the kept positions from every row but the first.
    While `verifying` (a verification pass, cache.verification), the mask is one-token
    decoding's instead, so the pass computes what plain decoding computes; a pass over a prompt
    keeps mlx-lm's mask, as its prefill has it."""

    verifying = False

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        if N == 1 or not self.verifying or window_size is not None:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        rows = mx.arange(self.offset, self.offset + N)
        columns = mx.concatenate([self._held_positions(), rows])
        return (columns <= rows[:, None]) & self._in_window(columns, rows)

    def tree_mask(self, depths: Sequence[int], ancestors) -> mx.array:
        """The mask of a tree pass over nodes at these depths (ancestors [n, n] bool: node i
        sees node j): as one-token decoding of each node's path would see the cache, the node
        at position offset + depth."""
        rows = self.offset + mx.array(list(depths))
        held = self._held_positions()
        visible = mx.concatenate([mx.ones((len(depths), held.size), mx.bool_), mx.array(ancestors)], axis=1)
        return visible & self._in_window(mx.concatenate([held, rows]), rows)

    def _held_positions(self) -> mx.array:
        """The positions of the columns a multi-token update will hand over before the new ones
        (update_and_fetch keeps the old entries in temporal order: all of them, or the first
        `keep` and the latest)."""
        p, keep = self.offset, self.keep
        if self.keys is None:
            held = 0
        else:  # what _temporal_order hands _update_concat, then cut to size - 1
            whole = self._idx == self.keys.shape[2] or self._idx < self.offset
            held = min(self.keys.shape[2] if whole else self._idx, self.max_size - 1)
        return (
            mx.arange(p) if held == p else mx.concatenate([mx.arange(keep), mx.arange(p - (held - keep), p)])
        )

    def _in_window(self, columns: mx.array, rows: mx.array) -> mx.array:
        """[rows, columns]: the column is one a query at that row's position sees in one-token
        decoding (the first `keep`, or within the latest max_size - keep)."""
        rows = rows[:, None]
        return (columns < self.keep) | (columns >= rows - (self.max_size - self.keep - 1))


def is_quantized(cache: Sequence[Any]) -> bool:
    return any(isinstance(c, QuantizedKVCache) for c in _layers(cache))


def is_bounded(cache: Sequence[Any]) -> bool:
    return any(isinstance(c, BoundedKVCache) for c in _layers(cache))


@contextmanager
def verification(cache: Sequence[Any]):
    """Within: the cache's bounded layers mask a pass as one-token decoding would (BoundedKVCache)."""
    bounded = [c for c in _layers(cache) if isinstance(c, BoundedKVCache)]
    for c in bounded:
        c.verifying = True
    try:
        yield
    finally:
        for c in bounded:
            c.verifying = False


QUANTIZED_SPECULATION = (
    "a verification pass computes keys and values equal to one-token decoding's only up to "
    "float32's last bits, which the quantized cache rounds apart, so speculation would not "
    "print mlx-lm's tokens"
)


@dataclass(frozen=True)
class KVQuantization:
    """mlx-lm's --kv-bits, --kv-group-size and --quantized-kv-start: once the cache holds `start`
    positions its plain KV layers become QuantizedKVCache (mlx-lm's maybe_quantize_kv_cache,
    after each pass, as its generate_step does). Plain decoding only: a verification pass
    computes each position's K/V equal to one-token decoding's only up to float32's last bits
    (other matmul shapes), and a quantization step rounds some of them apart, a difference that
    grows through the layers (benchmarks/kv_quantization_rounding.py): speculation over it
    would not print mlx-lm's tokens."""

    bits: int
    group_size: int = 64
    start: int = 5000  # mlx-lm's default quantized_kv_start

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 5, 6, 8) or self.group_size not in (32, 64, 128) or self.start < 0:
            raise MlxSpecError(
                f"--kv-bits must be 2, 3, 4, 5, 6 or 8 and --kv-group-size 32, 64 or 128 "
                f"(got {self.bits}, {self.group_size}); --quantized-kv-start >= 0"
            )

    def check(self, cache: List[Any], model_type: str, speculative: bool) -> None:
        """Refuse in one line, before any token: speculation (see above), and what mlx-lm cannot
        quantize, a sliding window (its own generate raises at the switch)."""
        if speculative:
            raise MlxSpecError(f"--kv-bits: {QUANTIZED_SPECULATION}: use --draft none or drop --kv-bits")
        windows = sorted({type(c).__name__ for c in cache if isinstance(c, RotatingKVCache)})
        if windows:
            raise MlxSpecError(
                f"--kv-bits: mlx-lm cannot quantize the {', '.join(windows)} of this {model_type} "
                "model (sliding-window attention): drop --kv-bits"
            )

    def apply(self, cache: List[Any]) -> None:
        from mlx_lm.generate import maybe_quantize_kv_cache

        maybe_quantize_kv_cache(cache, self.start, self.group_size, self.bits)


# The layers of a prompt cache file (mlx_lm.cache_prompt) that mlx-spec reads, and the kinds
# of the model's own cache each may stand for.
PROMPT_CACHE_LAYERS = {"KVCache": KVCache, "QuantizedKVCache": KVCache, "ArraysCache": ArraysCache}


def prompt_cache_metadata(path) -> Tuple[dict, List[str]]:
    """(metadata, layer classes) of a prompt cache file written by mlx_lm.cache_prompt (a
    safetensors file, never unpickled; mlx-lm stores [metadata, classes, scalars] flattened)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise MlxSpecError(f"no prompt cache file {path}")
    try:
        _, stored = mx.load(str(path), return_metadata=True)
        part = lambda i: {k[2:]: v for k, v in stored.items() if k.startswith(f"{i}.")}  # noqa: E731
        classes = [c for _, c in sorted(part(1).items(), key=lambda item: int(item[0]))]
    except Exception as e:
        raise MlxSpecError(
            f"cannot read the prompt cache file {path}: {str(e).splitlines()[0] if str(e) else e!r} "
            "(mlx_lm.cache_prompt writes safetensors)"
        ) from None
    return part(0), classes


def read_prompt_cache(path, model, model_type: str) -> List[Any]:
    """The cache of a prompt cache file written by mlx_lm.cache_prompt, checked against
    the model: one line for a file that is missing, unreadable, of layer kinds mlx-spec cannot
    roll back, or of another model's shape."""
    from mlx_lm.models.cache import load_prompt_cache

    path = Path(path).expanduser()
    _, classes = prompt_cache_metadata(path)
    unknown = sorted(set(classes) - set(PROMPT_CACHE_LAYERS))
    if not classes or unknown:
        raise MlxSpecError(
            f"the prompt cache file {path} holds {', '.join(unknown) or 'no layers'}: mlx-spec reads "
            f"caches of {', '.join(PROMPT_CACHE_LAYERS)} layers"
        )
    try:
        cache = load_prompt_cache(str(path))
    except Exception as e:
        raise MlxSpecError(f"cannot read the prompt cache file {path}: {e}") from None
    # The model's own cache after one token: the kinds and shapes a cache of this model has.
    fresh = make_cache(model)
    model(mx.array([[0]]), cache=fresh)
    shape = lambda c: [a.shape[1:] for a in c.cache if a is not None]  # noqa: E731  (recurrent states)
    if len(cache) != len(fresh) or any(
        PROMPT_CACHE_LAYERS[type(c).__name__] is not type(f)
        or (type(c) is KVCache and (c.keys is None or c.keys.shape[1] != f.keys.shape[1]))
        or (isinstance(c, QuantizedKVCache) and c.keys[0].shape[1] != f.keys.shape[1])
        or (isinstance(c, ArraysCache) and shape(c) != shape(f))
        for c, f in zip(cache, fresh)
    ):
        raise MlxSpecError(
            f"the prompt cache file {path} was made by another model (its layers differ from this "
            f"{model_type} model's)"
        )
    if not any(hasattr(c, "offset") for c in cache):
        raise MlxSpecError(
            f"the prompt cache file {path} does not say how many tokens it holds (a model without "
            "attention layers): mlx-spec cannot continue it"
        )
    return cache


def _layers(cache):
    """The leaf caches (CacheList holds several per layer)."""
    for c in cache:
        if isinstance(c, CacheList):
            yield from _layers(c.caches)
        else:
            yield c


def is_cache(value) -> bool:
    return isinstance(value, (_BaseCache, CacheList))


def is_recurrent(cache) -> bool:
    """Whether a layer's cache holds recurrent state (also inside a CacheList)."""
    return any(isinstance(c, ArraysCache) for c in _layers([cache]))


def check_speculation(
    cache: Sequence[Any], model_type: str, what: str = "speculative decoding", replayed: bool = True
) -> None:
    """Refuse, in one line and before any token, a cache that verification could not roll
    back: one of an unknown kind, or a recurrent state where no Replay is kept (`replayed`:
    the target's are, a draft model's are not)."""
    kinds = sorted(
        {
            type(c).__name__
            for c in _layers(cache)
            if (isinstance(c, ArraysCache) and not replayed)
            or not (isinstance(c, ArraysCache) or hasattr(c, "offset"))
        }
    )
    if kinds:
        raise MlxSpecError(
            f"{what} cannot roll back the {', '.join(kinds)} of this {model_type} model "
            "(recurrent layers); use --draft none"
        )


def _not_for_trees(cache: Sequence[Any]) -> List[str]:
    """The kinds of the cache's layers that cannot hold a tree: tree verification writes every
    node's K/V, then moves the accepted path's rows into place (tree.compact), which needs one
    row per position as in a plain KVCache or a BoundedKVCache after a multi-token update
    (BoundedKVCache.tree_mask); a recurrent layer runs the tree one depth at a time
    (tree.recurrent_by_depth). A layer with both (a CacheList) cannot; nor can a model's own
    sliding windows (mlx-lm masks them itself)."""
    return sorted(
        {
            type(c).__name__
            for c in cache
            if type(c) not in (KVCache, BoundedKVCache) and not isinstance(c, ArraysCache)
        }
    )


def holds_trees(cache: Sequence[Any]) -> bool:
    return not _not_for_trees(cache)


def check_tree(cache: Sequence[Any], model_type: str) -> None:
    kinds = _not_for_trees(cache)
    if kinds:
        raise MlxSpecError(
            f"tree drafts need plain KV caches or recurrent layers; this {model_type} model "
            f"uses {', '.join(kinds)}: draft a chain (--tree-budget 0)"
        )


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _rollback_rotating(c: RotatingKVCache, length: int) -> bool:
    """mlx-lm's sliding-window cache. A multi-token update leaves its entries in temporal order
    (the last max_size - 1 before it, the first `keep` of them kept, then the new ones): dropping
    the newest n is a slice, and exact while the window before `length` is still held. After a
    one-token update the buffer has rotated over the entries a rollback would need."""
    n = c.offset - length
    held = c.keys.shape[2] if c.keys is not None else 0
    if c.offset < c.max_size and c._idx == c.offset:  # not wrapped yet: index = position
        c.trim(n)
        return True
    if c._idx != held:
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
        return False  # the previous chunk's entries are gone
    if not c.is_trimmable():
        return False
    c.trim(n)
    return True


def _keep_rows(value, keep: int, fed: int):
    """A layer argument of a pass over `fed` positions, cut to its first `keep`: a mask
    [..., fed, offset + fed] loses the rows and columns of the dropped positions; anything else
    (None, "causal", a cache) stays as it is."""
    if not isinstance(value, mx.array) or value.ndim < 2:
        return value
    return value[..., :keep, : value.shape[-1] - (fed - keep)]


class Replay:
    """What one target pass records so that its recurrent layers can be rolled back to any
    length inside it: each layer whose cache holds recurrent state, the layer's inputs, and
    its caches' state before the pass (references: mlx arrays are never changed in place).
    Rolling back restores that state and runs those layers again over the kept positions,
    for the state they leave (their outputs are not needed). Exact: a layer's state after
    the kept positions depends only on its inputs there, which a causal model computed the
    same whatever followed. Costs a second pass of the recurrent layers (not of attention
    layers or the output head) over the kept positions, only when a draft was rejected."""

    def __init__(self, start: int):
        self.start = start  # positions cached before the pass
        self.fed = 0  # positions the pass fed
        self.calls = []
        self.rows = None  # the pass's positions in the order kept (None: as fed)

    def follow(self, rows: Sequence[int]) -> None:
        """Keep these of the pass's positions, in this order, instead of a prefix of them: a
        tree pass's accepted path (the state after it is the state after those inputs)."""
        self.rows = mx.array(list(rows))
        self.fed = len(rows)

    def record(self, layer, x, args, kwargs, cache) -> None:
        saved = [(c, list(c.cache) if isinstance(c, ArraysCache) else c.offset) for c in _layers([cache])]
        self.fed = x.shape[1]
        self.calls.append((layer, x, args, kwargs, saved))

    def roll_back(self, length: int) -> bool:
        keep = length - self.start
        if not 0 <= keep <= self.fed:
            return False
        states = []
        for layer, x, args, kwargs, saved in self.calls:
            for c, state in saved:
                if isinstance(c, ArraysCache):
                    c.cache = list(state)
                    states.append(c.cache)
                elif not _rollback_layer(c, state):
                    return False
            if keep:
                kept = x[:, :keep] if self.rows is None else x[:, self.rows[:keep]]
                layer(
                    kept,
                    *(_keep_rows(a, keep, self.fed) for a in args),
                    **{k: _keep_rows(v, keep, self.fed) for k, v in kwargs.items()},
                )
        mx.eval(states)
        return True


class Snapshots:
    """The recurrent layers' states at chosen lengths, for a cache that is fed one position at a
    time (a draft model drafting): references, since mlx arrays are never changed in place, so
    a snapshot costs nothing and restoring one is exact. Rolls back like a Replay (rollback_to),
    to a length where a snapshot was taken."""

    def __init__(self):
        self.saved = {}

    def take(self, cache: Sequence[Any], length: int) -> None:
        self.saved[length] = [(c, list(c.cache)) for c in _layers(cache) if isinstance(c, ArraysCache)]

    def roll_back(self, length: int) -> bool:
        if length not in self.saved:
            return False
        for c, state in self.saved[length]:
            c.cache = list(state)
        return True


def rollback_to(cache: List[Any], length: int, replay=None) -> bool:
    """Keep the first `length` positions of every layer's cache (per layer, so that a step
    interrupted half-way through its layers is repaired too). Recurrent layers roll back
    through the Replay of the last pass, when `length` falls inside it (or Snapshots taken at
    `length`). False when some layer
    cannot roll back exactly (no replay, a window or chunk moved past them): the caller then
    starts from a new cache. A recurrent layer does not know its length: call this only when
    something is to be dropped."""
    ok, recurrent = True, False
    for c in _layers(cache):
        if isinstance(c, ArraysCache):
            recurrent = True
        elif not _rollback_layer(c, length):
            ok = False
    if recurrent:
        ok = ok and replay is not None and replay.roll_back(length)
    return ok


class RaggedKVCache(_BaseCache):
    """One attention layer's keys and values for a batch of sequences of different lengths (a
    batched verification pass: each row its own context and its own accepted drafts). Row b
    holds its positions 0..lengths[b]-1 in columns 0..lengths[b]-1; a pass over N inputs per
    row writes each row's at its own end, and the mask lets row b's query i see columns
    <= lengths[b] + i, so what lies past a row's end (rejected drafts, padding) is never read
    and is overwritten later. Rolling a row back moves its length alone (RaggedRow.trim).

    mlx-lm's BatchKVCache aligns rows on the right and pads on the left, so rows that kept
    different numbers of drafts would have to be shifted (a copy of the whole cache per step);
    here they stay where they are. RoPE reads `offset`, one position per row."""

    step = 256

    def __init__(self):
        self.keys = self.values = None
        self.lengths: List[int] = []

    @property
    def offset(self):
        """Each row's position (RoPE's offset): one int while the rows are aligned."""
        return self.lengths[0] if len(set(self.lengths)) == 1 else mx.array(self.lengths)

    @property
    def state(self):
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        if window_size is not None:
            raise MlxSpecError("a ragged batch cache has no sliding window")
        if len(set(self.lengths)) == 1 and not return_array:  # aligned rows: as a KVCache's
            return "causal" if N > 1 else None
        ends = mx.array(self.lengths)[:, None, None, None] + mx.arange(N)[None, None, :, None]
        return mx.arange(max(self.lengths) + N)[None, None, None] <= ends

    def _reserve(self, columns: int, like_keys: mx.array, like_values: mx.array) -> None:
        have = 0 if self.keys is None else self.keys.shape[2]
        if columns <= have:
            return
        size = -(-columns // self.step) * self.step
        B, (_, H, _, Dk) = len(self.lengths), like_keys.shape
        pad = [(0, 0), (0, 0), (0, size - have), (0, 0)]
        if self.keys is None:
            self.keys = mx.zeros((B, H, size, Dk), like_keys.dtype)
            self.values = mx.zeros((B, H, size, like_values.shape[3]), like_values.dtype)
        else:
            self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)

    def update_and_fetch(self, keys, values):
        N = keys.shape[2]
        end = max(self.lengths) + N
        self._reserve(end, keys, values)
        if len(set(self.lengths)) == 1:
            start = self.lengths[0]
            self.keys[..., start : start + N, :] = keys
            self.values[..., start : start + N, :] = values
        else:
            rows = mx.arange(len(self.lengths))[:, None]
            columns = mx.array(self.lengths)[:, None] + mx.arange(N)[None]
            self.keys[rows, :, columns] = keys.transpose(0, 2, 1, 3)
            self.values[rows, :, columns] = values.transpose(0, 2, 1, 3)
        self.lengths = [n + N for n in self.lengths]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def add(self, cache: KVCache) -> None:
        """Append a sequence (a KVCache of one row) as the last row."""
        n = cache.offset
        if not self.lengths:
            self.keys = self.values = None
        if not n:  # a one-token prompt: nothing cached yet
            if self.keys is not None:
                self.keys = mx.concatenate([self.keys, mx.zeros_like(self.keys[:1])])
                self.values = mx.concatenate([self.values, mx.zeros_like(self.values[:1])])
            self.lengths.append(0)
            return
        keys, values = cache.keys[..., :n, :], cache.values[..., :n, :]
        self._reserve(n, keys, values)
        pad = [(0, 0), (0, 0), (0, self.keys.shape[2] - n), (0, 0)]
        self.keys = mx.concatenate([self.keys, mx.pad(keys, pad)])
        self.values = mx.concatenate([self.values, mx.pad(values, pad)])
        self.lengths.append(n)

    def take(self, row: int) -> KVCache:
        """Remove a row; it comes back as a KVCache of its own."""
        n = self.lengths[row]
        cache = KVCache()
        if n:
            # Gathered (a slice would be a view that keeps the whole batch's buffer alive).
            index = mx.array([row])
            cache.keys, cache.values = self.keys[index, :, :n], self.values[index, :, :n]
            cache.offset = n
            mx.eval(cache.keys, cache.values)
        keep = [i for i in range(len(self.lengths)) if i != row]
        self.lengths = [self.lengths[i] for i in keep]
        if keep and self.keys is not None:
            index = mx.array(keep)
            longest = -(-max(self.lengths) // self.step) * self.step  # release what no row needs
            self.keys, self.values = self.keys[index, :, :longest], self.values[index, :, :longest]
        elif not keep:
            self.keys = self.values = None
        return cache

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class RaggedRow(_BaseCache):
    """A view of one row of a RaggedKVCache, which rolls back like a KVCache (trim), so that
    the engine's own bookkeeping serves a row of a batch unchanged."""

    def __init__(self, batch: RaggedKVCache, row):
        self.batch, self.row = batch, row  # row: anything with an `index` the batch keeps current

    @property
    def offset(self) -> int:
        return self.batch.lengths[self.row.index]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.batch.lengths[self.row.index] -= n
        return n

    @property
    def state(self):
        return ()

    @property
    def nbytes(self) -> int:
        return 0


def batchable(cache: Sequence[Any], model_type: str) -> Optional[str]:
    """None when every layer's cache is a plain KVCache (what a ragged batch holds); else why
    the model's requests cannot share a pass."""
    kinds = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
    return f"this {model_type} model uses {', '.join(kinds)}" if kinds else None
