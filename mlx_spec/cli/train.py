import click

from .common import echo_err, reports_errors


@click.group("train")
def train():
    """Build drafter training data (and, as they land, train drafters)."""


@train.command("data")
@click.option("--target", "model_path", default=None, help="Target model directory (default: the embedded model).")
@click.option("--out", "out_dir", required=True, help="Output directory (train.jsonl, heldout.jsonl).")
@click.option("--limit", type=click.IntRange(1), default=None, help="Use only the first N prompts.")
@click.option("--max-tokens", type=click.IntRange(1), default=256, show_default=True, help="Longest response.")
@click.option("--batch-size", type=click.IntRange(1), default=8, show_default=True)
@click.option("--temp", type=float, default=0.0, show_default=True, help="0: greedy responses.")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@reports_errors
def data(model_path, out_dir, limit, max_tokens, batch_size, temp, dtype, seed):
    """Answer assembled prompts with the target; resumable, with a held-out split."""
    from ..models.target import load_target
    from ..train.data import build_prompts, generate_data

    if model_path is None:
        from ..models.default import default_model_path

        model_path = default_model_path()
    target = load_target(model_path, dtype)
    total = len(build_prompts(seed)[:limit])
    with click.progressbar(length=total, label="answering", file=click.get_text_stream("stderr")) as bar:
        counts = generate_data(target, out_dir, limit=limit, max_tokens=max_tokens, batch_size=batch_size,
                               temp=temp, seed=seed, progress=bar.update)
    echo_err(f"{counts['written']} written, {counts['skipped']} already there, {counts['total']} prompts -> {out_dir}")
