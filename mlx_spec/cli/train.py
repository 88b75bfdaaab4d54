import importlib
import re
import sys
from dataclasses import fields, replace
from pathlib import Path

import click

from ..drafters import trainers
from ..train.loop import LoopOptions
from .common import apply, echo_err, reports_errors, setting_option


@click.group(
    "train", short_help="Build drafter training data; train EAGLE-3, DFlash, MTP and Medusa drafters."
)
def train():
    """Build drafter training data; train EAGLE-3, DFlash, MTP and Medusa drafters against a
    frozen target."""


@train.command("data", short_help="Answer assembled prompts with the target (resumable).")
@click.option(
    "--model",
    "--target",
    "model_path",
    default=None,
    help="Target model: a directory or a Hugging Face repo id (default: the embedded model).",
)
@click.option("--out", "out_dir", required=True, help="Output directory (train.jsonl, heldout.jsonl).")
@click.option("--limit", type=click.IntRange(1), default=None, help="Use only the first N prompts.")
@click.option(
    "--max-tokens", type=click.IntRange(1), default=256, show_default=True, help="Longest response."
)
@click.option(
    "--batch-size",
    type=click.IntRange(1),
    default=32,
    show_default=True,
    help="Sequences decoded together (32: ~10x the one-sequence rate on 2 CPU cores).",
)
@click.option("--temp", type=float, default=0.0, show_default=True, help="0: greedy responses.")
@click.option("--dtype", default="auto", show_default=True, help="Target dtype (auto: float32 on the CPU).")
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Order of the assembled prompts (and the sampling noise when --temp > 0).",
)
@click.option(
    "--fixed-text",
    is_flag=True,
    help="Write installed packages' documentation and code as the answers instead (text the "
    "target did not write: train with --labels soft); seconds, not a generation.",
)
@click.option(
    "--prompts-file",
    default=None,
    help="Answer the prompts of this JSONL file (.gz: gzipped) instead of the assembled ones, in "
    'its order: rows {"id", "prompt"} or {"id", "turns": [TEXT, TEXT]} (or the bench\'s '
    "layout). Real prompts: benchmarks/training/real/prompts.jsonl.gz.",
)
@click.option(
    "--max-minutes",
    type=click.FloatRange(min=0),
    default=None,
    help="Start no batch after this many minutes (run again to continue: resumable).",
)
@reports_errors
def data(
    model_path,
    out_dir,
    limit,
    max_tokens,
    batch_size,
    temp,
    dtype,
    seed,
    fixed_text,
    prompts_file,
    max_minutes,
):
    """Answer assembled prompts (or --prompts-file's) with the target; resumable, with a held-out
    split (a hash of each prompt's id)."""
    from ..api import model_path as resolve_model
    from ..models.target import load_target
    from ..train.data import build_prompts, generate_data, load_prompts_file, write_fixed_text

    if fixed_text and prompts_file:
        raise click.UsageError("--fixed-text writes text, not answers to prompts: give it or --prompts-file")
    # A file's prompts are answered in its order, a window of batches at a time (a run cut
    # short has answered a sample of the file); the assembled ones all at once, shortest first.
    prompts = load_prompts_file(prompts_file) if prompts_file else None
    target = load_target(resolve_model(model_path), dtype)
    if fixed_text:
        counts = write_fixed_text(target.tokenizer, out_dir, limit=limit, seed=seed)
        echo_err(
            f"{counts['written']} written, {counts['skipped']} already there, {counts['total']} texts -> "
            f"{out_dir}: {counts['train']} in train.jsonl, {counts['heldout']} in heldout.jsonl"
        )
        return
    total = len((build_prompts(seed) if prompts is None else prompts)[:limit])
    with click.progressbar(length=total, label="answering", file=sys.stderr) as bar:
        counts = generate_data(
            target,
            out_dir,
            limit=limit,
            max_tokens=max_tokens,
            batch_size=batch_size,
            temp=temp,
            seed=seed,
            progress=bar.update,
            prompts=prompts,
            window=None if prompts is None else 8 * batch_size,
            max_minutes=max_minutes,
        )
    echo_err(
        f"{counts['written']} written, {counts['skipped']} already there, {counts['total']} prompts -> "
        f"{out_dir}: {counts['train']} in train.jsonl, {counts['heldout']} in heldout.jsonl"
    )
    if counts["stopped"]:
        echo_err(
            f"stopped after --max-minutes {max_minutes:g}: {counts['stopped']} prompts left "
            "(run again to continue)"
        )
    if counts["waiting"]:
        echo_err(f"{counts['waiting']} second turns wait for their first turn (beyond --limit)")
    if not counts["heldout"]:
        echo_err(
            "heldout.jsonl is not written: a hash of each prompt's id puts ~5% of the prompts there, "
            "and none of these fell in it (use more prompts, or a larger --limit)"
        )


@train.command(
    "vocab", short_help="Give a drafter a reduced draft vocabulary (the most frequent answer tokens)."
)
@click.option(
    "--data",
    "data_dir",
    required=True,
    help="Training data directory (`train data`): its answers are counted.",
)
@click.option(
    "--drafter",
    "drafter_dir",
    required=True,
    help="Drafter directory (MTP, Medusa, DFlash); draft_vocab.safetensors is written there.",
)
@click.option(
    "--size", type=click.IntRange(1), default=8192, show_default=True, help="Tokens in the draft vocabulary."
)
@click.option(
    "--vocab-size",
    type=click.IntRange(1),
    default=None,
    help="The target's vocabulary size (default: read from the drafter's config.json).",
)
@reports_errors
def vocab(data_dir, drafter_dir, size, vocab_size):
    """Write DRAFTER/draft_vocab.safetensors: the --size target ids most frequent in the training
    answers. The drafter's head then covers those rows only (a draft costs less; tokens outside
    it are never drafted, output stays exact). Delete the file to draft over the whole
    vocabulary again."""
    import numpy as np

    from ..errors import MlxSpecError
    from ..models import vocabulary
    from ..models.checkpoint import read_config
    from ..train.data import read_split

    answers = [row["response_tokens"] for row in read_split(data_dir, "train")]
    if not answers:
        raise MlxSpecError(
            f"no answers in {data_dir}/train.jsonl: run `mlx-spec train data --out {data_dir}` first"
        )
    if vocab_size is None:
        config = read_config(drafter_dir, "drafter")
        vocab_size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        if not vocab_size:
            raise MlxSpecError(f"{drafter_dir}/config.json has no vocab_size: pass --vocab-size")
    ids = vocabulary.frequent_ids(answers, int(vocab_size), size)
    seen = sum(len(a) for a in answers)
    covered = sum(int(np.isin(a, ids).sum()) for a in answers)
    path = vocabulary.write(drafter_dir, ids)
    echo_err(
        f"{len(ids)} of {vocab_size} tokens cover {covered / seen:.2%} of {seen} answer tokens -> {path}"
    )


KINDS = tuple(trainers())  # the sources with a trainer (drafters.DRAFTERS)


def _trainer(kind: str):
    """The Trainer class of `kind`: its module's TRAINER."""
    return importlib.import_module(f"mlx_spec.train.{trainers()[kind]}").TRAINER


def options_of(options_class):
    """The click options of a trainer's options class, from its fields (flags, help, types and
    defaults are read there; a field a trainer redefines for another default keeps the help of
    LoopOptions')."""
    shared = {f.name: f.metadata for f in fields(LoopOptions)}
    return [setting_option(f, f.metadata or shared[f.name]) for f in fields(options_class)]


# What every `train KIND` command takes besides its options class's fields.
RUN_OPTIONS = [
    click.option(
        "--model",
        "--target",
        "model_path",
        default=None,
        help="Target model: a directory or a Hugging Face repo id (default: the embedded model).",
    ),
    click.option("--data", "data_dir", required=True, help="Output of `mlx-spec train data`."),
    click.option(
        "--out",
        "out_dir",
        required=True,
        help="Drafter directory: the published checkpoint, checkpoint/ (to resume), "
        "features/ (the target's cached features), train_log.jsonl.",
    ),
    click.option("--resume", is_flag=True, help="Continue from OUT/checkpoint."),
    click.option(
        "--dtype",
        default="auto",
        show_default=True,
        help="Target dtype (auto: float32 on the CPU). The drafter trains in float32.",
    ),
    click.option(
        "--feature-cache", default=None, help="Directory for the target's features (default: OUT/features)."
    ),
]


class _Bars:
    """Two progress bars on stderr, one after the other: the target's features (computed once,
    then cached), and the training steps with loss and tokens/s."""

    def __init__(self, n_features, steps, start, label):
        self.n_features, self.steps, self.start, self.label = n_features, steps, start, label
        self.features = self.training = None

    def feature(self, k):
        if self.features is None:
            self.features = click.progressbar(
                length=self.n_features, label="target features", file=sys.stderr
            )
            self.features.__enter__()
        self.features.update(k)

    def step(self, record):
        from ..train.loop import progress_bar

        if self.training is None:
            self.close()
            self.training, self.on_step = progress_bar(self.steps, self.start, self.label)
            self.training.__enter__()
        self.on_step(record)

    def close(self):
        for name in ("features", "training"):
            bar = getattr(self, name)
            if bar is not None:
                bar.__exit__(None, None, None)
                setattr(self, name, None)


def _run_training(kind, model_path, data_dir, out_dir, dtype, resume, feature_cache, **given):
    from ..api import model_path as resolve_model
    from ..hub import resolve
    from ..models.target import load_target
    from ..train.loop import load_sequences, resume_step, train, used_indices

    trainer = _trainer(kind)
    options = trainer.options_class.given(**given)
    sequences = load_sequences(data_dir, options.max_length)  # data errors before the target loads
    start = resume_step(out_dir, resume) if Path(out_dir).is_dir() else 0
    target = load_target(resolve_model(model_path), dtype)
    if options.init:
        options = replace(options, init=str(resolve(options.init, None, "drafter")))
    n = len(used_indices(len(sequences), options.batch_size, start, options.steps, options.seed))
    bars = _Bars(n, options.steps, start, kind)
    try:
        result = train(
            trainer(target, options),
            data_dir,
            out_dir,
            resume=resume,
            feature_dir=feature_cache or "default",
            progress=bars.step,
            feature_progress=bars.feature,
        )
    finally:
        bars.close()
    last = f", last loss {result.losses[-1]:.3f}" if result.losses else ""
    echo_err(f"{result.step} steps{last} -> {result.path}")


def _command(kind: str) -> click.Command:
    """`mlx-spec train KIND`: its help is its trainer's docstring, its options its options
    class's fields and RUN_OPTIONS."""
    trainer = _trainer(kind)

    def run(**given):
        _run_training(kind, **given)

    run.__doc__ = trainer.__doc__
    summary = re.sub(r" \([^)]*\)", "", " ".join(trainer.__doc__.split()).split(". ")[0]).rstrip(".") + "."
    return click.command(kind, short_help=summary)(
        apply(reports_errors(run), RUN_OPTIONS + options_of(trainer.options_class))
    )


for _kind in KINDS:
    train.add_command(_command(_kind))
