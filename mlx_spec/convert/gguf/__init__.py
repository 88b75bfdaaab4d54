"""GGUF (llama.cpp) -> MLX model directory that `mlx_lm.load` reads.

What is written into the target directory:

- ``config.json``: an mlx-lm / Hugging Face style config (``model_type: llama``) with an mlx-lm
  ``"quantization"`` entry when tensors stay packed (``dtype="keep"``);
- ``model.safetensors``: weights under mlx-lm's names;
- ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``: a `tokenizers`
  tokenizer rebuilt from the GGUF metadata (vocabulary, merges, pre-tokenizer, special tokens,
  chat template);
- ``mlx_spec_conversion.json``: where the weights came from (source file, dtype, converter
  version), so a cached conversion can be checked.

Reading: the GGUF header (metadata, tensor table) is read with the gguf package's reader; each
tensor is checked to lie inside the file. When all tensors are F32 / F16 / Q4_0 / Q4_1 / Q8_0, ``mx.load``
reads them, the quantized ones as MLX affine triples (``.weight`` uint32, ``.scales``,
``.biases``; group size 32). Any other type (K-quants such as Q4_K / Q6_K, Q5_0, BF16, IQ*)
makes the whole file go through ``gguf.quants.dequantize`` instead. Note: mx.load (MLX 0.32)
accepts Q4_K without an error but returns wrong values for it, so the choice is made from
the tensor types, never from whether mx.load raises.

llama.cpp stores the rows of Llama ``attn_q`` / ``attn_k`` permuted for its RoPE layout; they are
put back in Hugging Face order here (for packed tensors the rows of weight, scales and biases
alike).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import mlx.core as mx

from mlx_spec.convert.output import CONVERSION_INFO_FILE, check_output, write_dir, write_json
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.checkpoint import FLOAT_DTYPES

from .llama import llama_config, llama_weights
from .reader import GGUF_GROUP_SIZE, _open_gguf, read_gguf_metadata
from .tokenizer import build_tokenizer

__all__ = [
    "DTYPES",
    "CONVERTER_VERSION",
    "CONVERSION_INFO_FILE",
    "REQUIRED_FILES",
    "convert_gguf",
    "read_gguf_metadata",
    "build_tokenizer",
    "is_converted_model",
]

# Bump when the output of convert_gguf changes in a way that makes old conversions stale.
CONVERTER_VERSION = 1
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    CONVERSION_INFO_FILE,
)

DTYPES = {"keep": None, **FLOAT_DTYPES}

SUPPORTED_ARCHITECTURES = ("llama",)

ProgressFn = Callable[[int, int], None]


def is_converted_model(path) -> bool:
    """True when `path` holds a finished conversion by this converter version."""
    path = Path(path)
    if not all((path / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        info = json.loads((path / CONVERSION_INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("converter_version") == CONVERTER_VERSION


def _quantization_config(quant: Dict[str, Dict[str, int]]) -> Optional[Dict[str, Any]]:
    if not quant:
        return None
    default_bits, _ = Counter(q["bits"] for q in quant.values()).most_common(1)[0]
    cfg: Dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": default_bits}
    for path in sorted(quant):
        q = quant[path]
        if q["bits"] != default_bits or q["group_size"] != GGUF_GROUP_SIZE:
            cfg[path] = dict(q)
    return cfg


def convert_gguf(
    gguf_path,
    mlx_path,
    dtype: str = "keep",
    *,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    overwrite: bool = False,
    progress: Optional[ProgressFn] = None,
) -> Path:
    """Convert a llama.cpp GGUF file into an mlx-lm model directory; returns that directory.

    dtype: "keep" keeps Q4_0/Q4_1/Q8_0 tensors packed (mlx-lm affine quantization, group size
    32, float16 scales and biases, per-module bits in config "quantization"), float tensors
    as stored (llama.cpp's norms are float32), and stores other quantized types (K-quants,
    Q5_0, IQ*, ...) dequantized to float16; "float32" / "float16" / "bfloat16" dequantize
    everything to that dtype (float32 is what runs fast on the MLX CPU backend).
    quantize: re-quantize every weight matrix that does not stay packed (K-quants and the other
    types the gguf package dequantizes, float matrices) to MLX's affine q_bits / q_group_size,
    instead of storing it dequantized; Q4_0/Q4_1/Q8_0 tensors kept packed stay as they are.
    overwrite: replace an existing non-empty `mlx_path` (default: refuse).
    progress: called as progress(done, total) after each tensor.
    """
    if dtype not in DTYPES:
        raise MlxSpecError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    gguf_path = Path(gguf_path).expanduser()
    mlx_path = check_output(mlx_path, overwrite)

    md, tensors = _open_gguf(gguf_path)
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise MlxSpecError(f"unsupported GGUF architecture: {arch}")
    config = llama_config(md, tensors)
    tok, tok_config, special_map = build_tokenizer(md)

    weights, quant = llama_weights(tensors, config, DTYPES[dtype], quantize, q_bits, q_group_size, progress)

    qcfg = _quantization_config(quant)
    if qcfg is not None:
        config["quantization"] = qcfg
        config["quantization_config"] = qcfg
    info = {
        "converter_version": CONVERTER_VERSION,
        "source": str(gguf_path.resolve()),
        "source_size": gguf_path.stat().st_size,
        "dtype": dtype,
        "requantized": {"bits": q_bits, "group_size": q_group_size} if quantize else None,
        "reader": tensors.reader,
        "gguf_architecture": arch,
        "gguf_name": md.get("general.name"),
        "gguf_file_type": md.get("general.file_type"),
    }

    def fill(tmp: Path) -> None:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        tok.save(str(tmp / "tokenizer.json"))
        write_json(tmp / "tokenizer_config.json", tok_config)
        write_json(tmp / "special_tokens_map.json", special_map)
        write_json(tmp / "config.json", config)

    return write_dir(mlx_path, fill, info)
