"""`python -m mlx_spec`: the `mlx-spec` command line."""

from .cli import main

main(prog_name="mlx-spec")
