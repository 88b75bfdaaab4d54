"""`mlx-spec convert --hf-path`: a local Hugging Face checkpoint directory -> an MLX directory.

The conversion itself is mlx-lm's (`mlx_lm.convert`: its model ports, sanitize, quantization);
this adds what a user needs around it: a one-line error for each bad input before any work
(not a directory, a corrupt config, an architecture mlx-lm has no port for, shards the index
names but the directory lacks or that are cut short, pickled weights only), an atomic write,
a record of where the weights came from, and the model's MTP module, which mlx-lm's sanitize
drops: its tensors, under their published names, go to OUT/mtp (config.json + safetensors),
where --draft mtp finds them (models/mtp.py)."""

import json
from pathlib import Path
from typing import Callable, Optional

from ..errors import MlxSpecError
from ..models.checkpoint import check_not_pickled, one_line, read_config, safetensors_header
from .output import check_output, write_dir

QUANT_BITS = (2, 3, 4, 5, 6, 8)


def check_hf_dir(path: Path) -> dict:
    """config.json of a complete, safetensors checkpoint of an architecture mlx-lm runs."""
    config = read_config(path, "Hugging Face checkpoint")
    check_not_pickled(path)
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except (ValueError, KeyError) as e:
        raise MlxSpecError(
            f"{path}: {one_line(e)} (mlx-lm has no port of model_type {config.get('model_type')!r})"
        ) from None
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise MlxSpecError(f"corrupt {index}: {one_line(e)}") from None
        missing = sorted(name for name in named if not (path / name).is_file())
        if missing:
            raise MlxSpecError(
                f"{path} lacks {len(missing)} of the {len(named)} shards its index "
                f"names: {', '.join(missing[:3])}"
            )
    if not files:
        raise MlxSpecError(f"no *.safetensors weights in {path}")
    for f in files:
        _check_safetensors(f)
    return config


def _check_safetensors(f: Path) -> None:
    """A header that parses and tensors that end inside the file (a cut-off download)."""
    try:
        header, start = safetensors_header(f)
        end = start + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise MlxSpecError(f"{f} is not a safetensors file") from None
    if end > f.stat().st_size:
        raise MlxSpecError(f"{f} is truncated: its tensors need {end} bytes, the file has {f.stat().st_size}")


def convert_hf(
    hf_path,
    mlx_path,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    dtype: Optional[str] = None,
    overwrite: bool = False,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> Path:
    """Convert with mlx-lm into `mlx_path`; returns it. progress(done, total, stage) after
    each of the three stages."""
    hf_path = Path(hf_path).expanduser().resolve()
    mlx_path = check_output(mlx_path, overwrite)
    if quantize and q_bits not in QUANT_BITS:
        raise MlxSpecError(f"--q-bits must be one of {', '.join(map(str, QUANT_BITS))}, got {q_bits}")
    config = check_hf_dir(hf_path)
    if progress:
        progress(1, 3, "checked")

    # An already quantized source (an mlx-community directory): mlx-lm's quantization skips its
    # quantized layers and its cast reaches only their scales, so asked for bits or a dtype it
    # is dequantized first (to `dtype`, else its scales' dtype), then quantized as asked.
    source_quantization = config.get("quantization")
    requantize = bool(source_quantization) and (quantize or dtype is not None)

    def fill(tmp: Path) -> None:
        import io
        import shutil
        import tempfile
        from contextlib import redirect_stdout

        from mlx_lm.convert import convert

        if progress:
            progress(2, 3, "converting")
        tmp.rmdir()  # mlx-lm refuses an existing output directory
        with redirect_stdout(io.StringIO()), tempfile.TemporaryDirectory(dir=tmp.parent) as scratch:
            # (its [INFO] lines are silenced: the CLI shows a bar instead)
            source = hf_path
            if requantize:
                source = Path(scratch) / "dequantized"
                convert(str(hf_path), str(source), dtype=dtype, dequantize=True)
                if not quantize:
                    shutil.move(str(source), str(tmp))
            if not requantize or quantize:
                convert(
                    str(source),
                    str(tmp),
                    quantize=quantize,
                    q_bits=q_bits if quantize else None,
                    q_group_size=q_group_size if quantize else None,
                    dtype=None if requantize else dtype,
                )
        if progress:
            progress(3, 3, "writing")
        write_mtp_sidecar(hf_path, config, tmp, dtype)

    written = (
        {"bits": q_bits, "group_size": q_group_size}
        if quantize
        else None
        if requantize
        else source_quantization
    )
    info = {
        "source": str(hf_path),
        "format": "huggingface",
        "model_type": config.get("model_type"),
        "converter": "mlx_lm.convert",
        "dtype": dtype,
        "quantization": written,
        "dequantized_from": source_quantization if requantize else None,
    }
    return write_dir(mlx_path, fill, info)


def write_mtp_sidecar(hf_path: Path, config: dict, out: Path, dtype: Optional[str]) -> bool:
    """Copy the checkpoint's MTP tensors (cast to `dtype` when given) to out/mtp; False when it
    has none."""
    import mlx.core as mx

    from ..models.mtp import SIDECAR, has_mtp_weights, read_mtp_weights

    n = int(
        config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers") or 0
    )
    if not has_mtp_weights(hf_path, n):
        return False
    weights = read_mtp_weights(hf_path, n)
    if dtype:
        weights = {
            k: v.astype(getattr(mx, dtype)) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    sidecar = out / SIDECAR
    sidecar.mkdir()
    (sidecar / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(sidecar / "model.safetensors"), weights, metadata={"format": "pt"})
    return True
