"""`mlx-spec convert`: a Hugging Face checkpoint directory (through mlx-lm's converter) or a
llama.cpp GGUF file -> an MLX model directory that mlx-lm loads."""

from __future__ import annotations

import sys

import click

from ..models.checkpoint import FLOAT_DTYPES
from .common import reports_errors


@click.command("convert", short_help="Convert a Hugging Face directory or a GGUF file to MLX.")
@click.option(
    "--hf-path",
    default=None,
    type=click.Path(path_type=str),
    help="Hugging Face checkpoint (config.json + safetensors), a directory or a repo id, of "
    "an architecture mlx-lm runs; converted by mlx-lm.",
)
@click.option(
    "--gguf",
    "gguf_path",
    default=None,
    type=click.Path(dir_okay=False, path_type=str),
    help="GGUF file to convert (llama architecture; Q4_0/Q4_1/Q8_0 stay packed, "
    "K-quants are dequantized, or re-quantized with -q).",
)
@click.option(
    "--drafter",
    "drafter_path",
    default=None,
    type=click.Path(path_type=str),
    help="DFlash (z-lab), EAGLE-3 (SafeAILab, speculators) or Medusa checkpoint (a directory or "
    "a repo id): cast "
    "(--dtype) and/or quantized (-q), checked to load for --model.",
)
@click.option(
    "--model",
    "model_path",
    default=None,
    help="--drafter: the target it drafts for, a directory or a repo id (default: the embedded model).",
)
@click.option(
    "--revision", default=None, help="--hf-path/--drafter repo id: its revision (branch, tag, commit)."
)
@click.option(
    "--mlx-path",
    required=True,
    type=click.Path(file_okay=False, path_type=str),
    help="Directory to write the MLX model to (must not exist or be empty).",
)
@click.option(
    "--dtype",
    type=click.Choice(["keep", *FLOAT_DTYPES]),
    default="keep",
    show_default=True,
    help="keep: the checkpoint's own dtype (GGUF: quantized tensors stay packed, mlx-lm "
    "quantization, group size 32); otherwise cast (GGUF: dequantize) every weight to "
    "this dtype (float32 is fastest on CPU).",
)
@click.option(
    "-q",
    "--quantize",
    is_flag=True,
    help="Quantize the linear layers (mlx-lm's affine scheme); --gguf: those the file "
    "does not keep packed (K-quants re-quantized instead of dequantized).",
)
@click.option(
    "--q-bits",
    type=click.Choice(["2", "3", "4", "5", "6", "8"]),
    default="4",
    show_default=True,
    help="Bits per weight with -q.",
)
@click.option(
    "--q-group-size",
    type=click.Choice(["32", "64", "128"]),
    default="64",
    show_default=True,
    help="Weights sharing one scale and bias with -q.",
)
@click.option("--overwrite", is_flag=True, help="Replace --mlx-path if it already holds files.")
@reports_errors
def convert(
    hf_path,
    gguf_path,
    drafter_path,
    model_path,
    revision,
    mlx_path,
    dtype,
    quantize,
    q_bits,
    q_group_size,
    overwrite,
) -> None:
    """Convert a local Hugging Face checkpoint directory (delegating to mlx-lm's converter,
    optionally quantized), a GGUF file, or a DFlash / EAGLE-3 drafter, to an MLX directory,
    written atomically, with mlx_spec_conversion.json recording where the weights came from."""
    if sum(source is not None for source in (hf_path, gguf_path, drafter_path)) != 1:
        raise click.UsageError("give one source: --hf-path DIR|REPO, --gguf FILE or --drafter DIR|REPO")
    if model_path is not None and drafter_path is None:
        raise click.UsageError("--model names the target of a --drafter")
    bar = None

    def progress(done: int, total: int, item: str = "") -> None:
        # The bar appears at the first update, after the checks that may refuse the input.
        nonlocal bar
        if bar is None:
            bar = click.progressbar(
                length=total, label="converting", file=sys.stderr, item_show_func=lambda shown: shown
            )
            bar.__enter__()
        bar.update(done - bar.pos, item)

    try:
        if drafter_path is not None:
            from mlx_spec.api import model_path as resolve_model
            from mlx_spec.convert.drafter import convert_drafter
            from mlx_spec.hub import resolve
            from mlx_spec.models.target import load_target

            target = load_target(resolve_model(model_path), "auto")
            out = convert_drafter(
                resolve(drafter_path, revision, "drafter"),
                mlx_path,
                target,
                dtype=None if dtype == "keep" else dtype,
                quantize=quantize,
                q_bits=int(q_bits),
                q_group_size=int(q_group_size),
                overwrite=overwrite,
                progress=progress,
            )
        elif hf_path is not None:
            from mlx_spec.convert.hf import convert_hf
            from mlx_spec.hub import resolve

            out = convert_hf(
                resolve(hf_path, revision, "model"),
                mlx_path,
                quantize=quantize,
                q_bits=int(q_bits),
                q_group_size=int(q_group_size),
                dtype=None if dtype == "keep" else dtype,
                overwrite=overwrite,
                progress=progress,
            )
        else:
            from mlx_spec.convert.gguf import convert_gguf

            out = convert_gguf(
                gguf_path,
                mlx_path,
                dtype=dtype,
                quantize=quantize,
                q_bits=int(q_bits),
                q_group_size=int(q_group_size),
                overwrite=overwrite,
                progress=progress,
            )
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    click.echo(f"wrote {out}")
