"""A drafter's reduced vocabulary: the target ids its head covers, the most frequent tokens of
the target's answers (FR-Spec, arXiv 2502.14856; EAGLE-3's d2t). A draft head over the target's
whole vocabulary (MTP, Medusa and DFlash use the target's own output layer) reads every row of
it for every draft, about a fifth of a target pass for the default model; over 8192 rows, a
sixth of that. Tokens outside the subset get draft probability 0, which verification covers
(the target's token or the residual), so output stays exact; only acceptance can drop.

Stored the way EAGLE-3 stores its own (`d2t`: target id = i + d2t[i]), in a file of its own
next to the drafter's published weights, which stay as published: DRAFTER/draft_vocab.safetensors.
The head's rows are taken from the output layer the drafter uses (float or quantized) at load."""

from pathlib import Path
from typing import Iterable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import MlxSpecError
from .checkpoint import DRAFT_VOCABULARY as FILE
from .checkpoint import one_line


def frequent_ids(token_lists: Iterable[Sequence[int]], vocab_size: int, size: int) -> np.ndarray:
    """The `size` ids most frequent in the token lists (ties: lower id first), ascending."""
    counts = np.zeros(vocab_size, np.int64)
    for tokens in token_lists:
        np.add.at(counts, np.asarray(tokens, np.int64), 1)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return np.sort(order[: min(size, vocab_size)])


def d2t(ids: np.ndarray) -> mx.array:
    return mx.array(np.asarray(ids) - np.arange(len(ids)), mx.int32)


def ids_from_d2t(offsets, vocab_size: int, where) -> np.ndarray:
    """The target ids of a d2t mapping, checked against the target's vocabulary (one line)."""
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or not len(offsets):
        raise MlxSpecError(f"{where}: d2t has shape {offsets.shape}, not [draft vocabulary]")
    ids = np.arange(len(offsets)) + offsets.astype(np.int64)
    lo, hi, distinct = int(ids.min()), int(ids.max()), len(np.unique(ids))
    if lo < 0 or hi >= vocab_size or distinct != len(ids):
        raise MlxSpecError(
            f"{where}: d2t maps the draft vocabulary to ids {lo}..{hi} "
            f"({distinct} distinct), not into the target's 0..{vocab_size - 1}"
        )
    return ids


def columns(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """[target vocab] -> the column of a drafter over `ids`, -1 outside them."""
    out = np.full(vocab_size, -1, np.int64)
    out[np.asarray(ids)] = np.arange(len(ids))
    return out


def write(directory, ids: np.ndarray) -> Path:
    path = Path(directory) / FILE
    mx.save_safetensors(str(path), {"d2t": d2t(ids)}, metadata={"format": "mlx"})
    return path


def read(directory, vocab_size: int) -> Optional[np.ndarray]:
    """The target ids of DRAFTER/draft_vocab.safetensors, or None where there is none."""
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    try:
        offsets = mx.load(str(path))["d2t"]
    except Exception as e:  # mlx raises several types for a bad file
        raise MlxSpecError(f"cannot read {path}: {one_line(e)}") from None
    return ids_from_d2t(offsets, vocab_size, path)


class OutputRows:
    """The rows `ids` of one or more output layers (nn.Linear, an embedding used as one, or
    their quantized forms; several for Medusa's heads) as linear layers over the draft
    vocabulary; `ids` says which target id each column is. Deliberately not an nn.Module: the
    rows are a view of weights the drafter or the target already has, never trained, saved or
    quantized as the drafter's own."""

    def __init__(self, layers: Sequence[nn.Module], ids: np.ndarray):
        index = mx.array(np.asarray(ids, np.int32))
        self.ids = index
        self.heads = []  # per layer: weight, scales, biases, bias, quantization
        for layer in layers:
            arrays = [
                layer[name][index] if name in layer else None
                for name in ("weight", "scales", "biases", "bias")
            ]
            quantization = (
                (layer.group_size, layer.bits, getattr(layer, "mode", "affine"))
                if arrays[1] is not None
                else None
            )
            mx.eval(*(a for a in arrays if a is not None))
            self.heads.append((*arrays, quantization))

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __call__(self, x: mx.array, head: int = 0) -> mx.array:
        weight, scales, biases, bias, quantization = self.heads[head]
        if quantization:
            group_size, bits, mode = quantization
            y = mx.quantized_matmul(
                x,
                weight,
                scales=scales,
                biases=biases,
                transpose=True,
                group_size=group_size,
                bits=bits,
                mode=mode,
            )
        else:
            y = x @ weight.T
        return y if bias is None else y + bias
