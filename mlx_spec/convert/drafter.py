"""`mlx-spec convert --drafter`: a published DFlash (z-lab), EAGLE-3 (SafeAILab, speculators) or
Medusa (FasterDecoding, vLLM) checkpoint -> a directory the loaders read, cast to a dtype and
optionally quantized.

The loaders read both published layouts directly, so the config and the weight names stay as
published; what changes is the dtype and, with quantization, every linear layer (mlx-lm's
affine scheme, recorded as its "quantization" entry, which the loaders honour). The result is
loaded for the target first and again before it is moved into place: a drafter made for another
target, or one that does not load, is refused in one line and nothing is written."""

import shutil
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from ..drafters import loaders
from ..errors import MlxSpecError
from ..models.checkpoint import (
    DRAFT_VOCABULARY,
    FLOAT_DTYPES,
    KINDS,
    checkpoint_kind,
    read_config,
    read_weights,
)
from .output import check_output, write_dir, write_json


def _convert_weights(weights: dict, dtype, quantize: bool, q_bits: int, q_group_size: int) -> dict:
    out = {}
    for name, w in weights.items():
        if not mx.issubdtype(w.dtype, mx.floating):  # EAGLE-3's d2t / t2d maps
            out[name] = w
            continue
        w = w.astype(dtype) if dtype is not None else w
        # Linear (and embedding) weights: 2-D, a whole number of groups per row.
        if quantize and name.endswith(".weight") and w.ndim == 2 and w.shape[-1] % q_group_size == 0:
            stem = name[: -len(".weight")]
            out[name], out[f"{stem}.scales"], out[f"{stem}.biases"] = mx.quantize(
                w, group_size=q_group_size, bits=q_bits
            )
        else:
            out[name] = w
    return out


def convert_drafter(
    path,
    mlx_path,
    target,
    dtype: Optional[str] = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    overwrite: bool = False,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> Path:
    path = Path(path).expanduser().resolve()
    mlx_path = check_output(mlx_path, overwrite)
    config = read_config(path, "drafter checkpoint")
    kind = checkpoint_kind(config)
    if kind not in loaders():
        what = KINDS[kind] if kind else "no drafter mlx-spec knows"
        hint = "; convert a model with --hf-path" if kind == "model" else ""
        raise MlxSpecError(
            f"{path} holds {what}: --drafter converts DFlash, EAGLE-3 and Medusa checkpoints{hint}"
        )
    load_drafter(kind, path, target)  # made for this target? (one line if not, before any work)
    weights = read_weights(path)
    if progress:
        progress(1, 3, "read")
    weights = _convert_weights(
        weights, FLOAT_DTYPES[dtype] if dtype else None, quantize, q_bits, q_group_size
    )
    mx.eval(weights)
    config = dict(config)
    if dtype:
        config["torch_dtype"] = dtype
    if quantize:
        config["quantization"] = {"group_size": q_group_size, "bits": q_bits}

    def fill(tmp: Path) -> None:
        write_json(tmp / "config.json", config)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        if (path / DRAFT_VOCABULARY).is_file():  # a reduced draft vocabulary goes along
            shutil.copyfile(path / DRAFT_VOCABULARY, tmp / DRAFT_VOCABULARY)
        if progress:
            progress(2, 3, "written")
        try:  # what was written loads too
            load_drafter(kind, tmp, target)
        except MlxSpecError as e:
            raise MlxSpecError(str(e).replace(str(tmp), str(mlx_path))) from None
        if progress:
            progress(3, 3, "loads")

    info = {"source": str(path), "format": kind, "dtype": dtype, "quantization": config.get("quantization")}
    return write_dir(mlx_path, fill, info)


def load_drafter(kind: str, path, target):
    return loaders()[kind](path, target)
