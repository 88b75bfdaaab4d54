"""The `mlx-spec` command line."""

import sys

import click

from .. import __version__
from .bench import bench
from .chat import chat
from .convert import convert
from .drafters import drafters
from .generate import generate
from .serve import serve
from .train import train


class OneLineErrors(click.Group):
    """Every error, usage errors included, is one line on stderr and a non-zero exit."""

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"Error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort:  # Ctrl-C: what was printed stays printed
            click.echo("Aborted.", err=True)
            sys.exit(130)


@click.group(cls=OneLineErrors)
@click.version_option(__version__, prog_name="mlx-spec")
def main():
    """Lossless speculative decoding on MLX."""


for command in (generate, chat, serve, convert, bench, train, drafters):
    main.add_command(command)
