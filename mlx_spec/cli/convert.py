"""`mlx-spec convert`: a llama.cpp GGUF file -> an MLX model directory that mlx-lm loads."""

from __future__ import annotations

import sys

import click

from mlx_spec.errors import MlxSpecError


@click.command("convert", short_help="Convert a GGUF file to an MLX model directory.")
@click.option(
    "--gguf",
    "gguf_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=str),
    help="GGUF file to convert (llama architecture; Q4_0/Q4_1/Q8_0 stay packed, "
    "K-quants are dequantized).",
)
@click.option(
    "--mlx-path",
    required=True,
    type=click.Path(file_okay=False, path_type=str),
    help="Directory to write the MLX model to (must not exist or be empty).",
)
@click.option(
    "--dtype",
    type=click.Choice(["keep", "float32", "float16", "bfloat16"]),
    default="keep",
    show_default=True,
    help="keep: leave quantized tensors packed (mlx-lm quantization, group size 32); "
    "otherwise dequantize every weight to this dtype (float32 is fastest on CPU).",
)
@click.option(
    "--overwrite", is_flag=True, help="Replace --mlx-path if it already holds files."
)
def convert(gguf_path: str, mlx_path: str, dtype: str, overwrite: bool) -> None:
    """Convert a GGUF file to an MLX model directory (config.json, model.safetensors,
    tokenizer.json with the chat template)."""
    from mlx_spec.convert.gguf import convert_gguf

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = click.progressbar(length=total, label="converting tensors", file=sys.stderr)
            bar.__enter__()
        bar.update(done - bar.pos)

    try:
        out = convert_gguf(
            gguf_path, mlx_path, dtype=dtype, overwrite=overwrite, progress=progress
        )
    except MlxSpecError as e:
        raise click.ClickException(str(e)) from None
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    click.echo(f"wrote {out}")
