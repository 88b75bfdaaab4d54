import click

from .common import reports_errors


@click.command("drafters", short_help="The drafters published for a model, and which are in the cache.")
@click.argument("model", required=False)
@reports_errors
def drafters(model):
    """The drafters registered for MODEL (a Hugging Face repo id or a directory; default: every
    registered one), whether each is in the Hugging Face cache, and those shipped for the default
    model: what --draft auto chooses from."""
    from pathlib import Path

    from ..auto import model_names, published_for, registry
    from ..hub import cached
    from ..models.default import DEFAULT_MODEL_NAME, SHIPPED_DRAFTERS

    if model is None:
        entries = registry()
    else:
        entries = published_for(model_names(model) if Path(model).exists() else [model])
        if not entries:
            click.echo(
                f"No drafter is registered for {model}: --draft auto runs its own MTP module if its "
                "checkpoint has one, else suffix decoding."
            )
    target = None
    for entry in entries:
        if entry.target != target:
            target = entry.target
            click.echo(target)
        where = "in the cache" if cached(entry.repo) else "not downloaded"
        click.echo(
            f"  --draft {entry.kind:<7} {entry.repo:<48} {where}"
            + (f"; {entry.notes}" if entry.notes else "")
        )
    shipped = sorted(p.name for p in SHIPPED_DRAFTERS.iterdir() if (p / "config.json").is_file())
    if model is None:
        click.echo(
            f"Shipped for {DEFAULT_MODEL_NAME} (the default model, trained here): "
            f"{', '.join('--draft ' + name for name in shipped)} ({SHIPPED_DRAFTERS})"
        )
