"""The `mlx-spec` command line."""

import click

from .. import __version__
from .chat import chat
from .generate import generate


@click.group()
@click.version_option(__version__, prog_name="mlx-spec")
def main():
    """Lossless speculative decoding on MLX."""


main.add_command(generate)
main.add_command(chat)

try:
    from .convert import convert

    main.add_command(convert)
except ImportError:  # pragma: no cover - written alongside
    pass
