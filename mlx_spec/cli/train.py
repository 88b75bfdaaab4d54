import sys
from dataclasses import replace
from pathlib import Path

import click

from ..drafters import trainers
from ..models.checkpoint import FLOAT_DTYPES
from .common import echo_err, reports_errors


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


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(v) for v in value.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


KINDS = tuple(trainers())  # the sources with a trainer (drafters.DRAFTERS)


def _options_class(kind: str):
    """The options class of the trainer of `kind`: its module's OPTIONS."""
    import importlib

    return importlib.import_module(f"mlx_spec.train.{trainers()[kind]}").OPTIONS


def _default(name: str, kinds=KINDS) -> str:
    """The default of option `name`, as the options classes have it: "[4]", or per kind where
    they differ ("[eagle 4, dflash 2, ...]")."""
    values = {kind: getattr(_options_class(kind)(), name) for kind in kinds}
    if len(set(map(str, values.values()))) == 1:
        return f"[{next(iter(values.values()))}]"
    return "[" + ", ".join(f"{kind} {value}" for kind, value in values.items()) + "]"


def training_options(f):
    """What every `train` command shares. Option defaults are None: the options class of the
    kind holds the defaults (LoopOptions.given), which the help shows."""
    options = [
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
        click.option(
            "--steps",
            type=click.IntRange(1),
            default=None,
            help=f"Optimizer steps in all (a resumed run continues up to it) {_default('steps')}.",
        ),
        click.option(
            "--batch-size",
            "--batch",
            type=click.IntRange(1),
            default=None,
            help=f"Sequences per step {_default('batch_size')}.",
        ),
        click.option(
            "--lr",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help=f"Peak AdamW learning rate {_default('lr')}.",
        ),
        click.option(
            "--warmup",
            type=click.IntRange(0),
            default=None,
            help=f"Linear warmup steps, then cosine decay to lr/10 {_default('warmup')}.",
        ),
        click.option(
            "--weight-decay",
            type=click.FloatRange(0),
            default=None,
            help=f"AdamW weight decay {_default('weight_decay')}.",
        ),
        click.option(
            "--max-length",
            type=click.IntRange(4),
            default=None,
            help=f"Longest sequence (prompt + response) in tokens {_default('max_length')}.",
        ),
        click.option(
            "--save-every",
            type=click.IntRange(0),
            default=None,
            help=f"Checkpoint every N steps (0: only at the end) {_default('save_every')}.",
        ),
        click.option("--resume", is_flag=True, help="Continue from OUT/checkpoint."),
        click.option(
            "--init",
            default=None,
            help="Start from this published drafter's weights (a directory or a repo id, e.g. a "
            "shipped one); its shape and taps win over the shape options.",
        ),
        click.option(
            "--max-minutes",
            type=click.FloatRange(0),
            default=None,
            help="Stop after this many minutes of training, checkpointed (0: no limit); "
            f"--resume continues {_default('max_minutes')}.",
        ),
        click.option(
            "--seed",
            type=int,
            default=None,
            help=f"Initial weights, batch order and anchors {_default('seed')}.",
        ),
        click.option(
            "--dtype",
            default="auto",
            show_default=True,
            help="Target dtype (auto: float32 on the CPU). The drafter trains in float32.",
        ),
        click.option(
            "--save-dtype",
            type=click.Choice(list(FLOAT_DTYPES)),
            default=None,
            help=f"dtype of the published weights {_default('save_dtype')}.",
        ),
        click.option(
            "--feature-cache",
            default=None,
            help="Directory for the target's features (default: OUT/features).",
        ),
        click.option(
            "--eval-every",
            type=click.IntRange(0),
            default=None,
            help="Every N steps (and before the first, and at the end) log the drafter's tau at 4 "
            "drafts on the data's held-out prompts to OUT/train_log.jsonl (0: never) "
            f"{_default('eval_every')}.",
        ),
        click.option(
            "--eval-prompts",
            type=click.IntRange(1),
            default=None,
            help=f"Held-out prompts per evaluation, 32 tokens each {_default('eval_prompts')}.",
        ),
        click.option(
            "--eval-data",
            default=None,
            help="Take the held-out prompts from this `train data` directory instead of --data "
            "(runs on different data, evaluated on the same prompts).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


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


def _run_training(kind, train_fn, model_path, data_dir, out_dir, dtype, resume, feature_cache, **given):
    from ..api import model_path as resolve_model
    from ..hub import resolve
    from ..models.target import load_target
    from ..train.loop import load_sequences, resume_step, used_indices

    options = _options_class(kind).given(**given)
    sequences = load_sequences(data_dir, options.max_length)  # data errors before the target loads
    start = resume_step(out_dir, resume) if Path(out_dir).is_dir() else 0
    target = load_target(resolve_model(model_path), dtype)
    if options.init:
        options = replace(options, init=str(resolve(options.init, None, "drafter")))
    n = len(used_indices(len(sequences), options.batch_size, start, options.steps, options.seed))
    bars = _Bars(n, options.steps, start, kind)
    try:
        result = train_fn(
            target,
            data_dir,
            out_dir,
            options,
            resume=resume,
            feature_dir=feature_cache or "default",
            progress=bars.step,
            feature_progress=bars.feature,
        )
    finally:
        bars.close()
    last = f", last loss {result.losses[-1]:.3f}" if result.losses else ""
    echo_err(f"{result.step} steps{last} -> {result.path}")


labels_option = click.option(
    "--labels",
    type=click.Choice(["hard", "soft"]),
    default=None,
    help="hard: the data's next tokens; soft: the target's distribution at each position (from its "
    f"cached last-layer features; any text then teaches what the target would write) {_default('labels', ['eagle', 'mtp'])}.",
)


@train.command("eagle", short_help="Train an EAGLE-3 draft layer against the frozen target.")
@training_options
@labels_option
@click.option(
    "--ttt-steps",
    type=click.IntRange(1),
    default=None,
    help=f"Training-time test: steps the layer runs on its own outputs {_default('ttt_steps', ['eagle'])}.",
)
@click.option(
    "--draft-vocab-size",
    type=click.IntRange(1),
    default=None,
    help=f"Draft head size: the most frequent target tokens of the data {_default('draft_vocab_size', ['eagle'])}.",
)
@click.option(
    "--layer-ids",
    callback=_int_list,
    default=None,
    help="Fused target layers, EAGLE's convention (inputs of layers), e.g. 2,15,27 (default: 2, N//2, N-3).",
)
@reports_errors
def eagle(**given):
    """Train an EAGLE-3 draft layer (SafeAILab layout) against a frozen target."""
    from ..train.eagle import train_eagle

    _run_training("eagle", train_eagle, **given)


@train.command("dflash", short_help="Train a DFlash drafter against the frozen target.")
@training_options
@click.option(
    "--layers", type=click.IntRange(1), default=None, help=f"Drafter layers {_default('layers', ['dflash'])}."
)
@click.option(
    "--block-size",
    type=click.IntRange(2),
    default=None,
    help="Tokens per block: the anchor and the positions drafted from it in one pass "
    f"{_default('block_size', ['dflash'])}.",
)
@click.option(
    "--target-layers",
    callback=_int_list,
    default=None,
    help="Tapped target layers (output of layer i), e.g. 1,8,14,20,27 (default: spread "
    "from 1 to N-3, one per drafter layer, as z-lab).",
)
@click.option(
    "--blocks",
    "blocks_per_sequence",
    type=click.IntRange(1),
    default=None,
    help=f"Blocks (random anchors in the response) per sequence {_default('blocks_per_sequence', ['dflash'])}.",
)
@click.option(
    "--decay",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help=f"Loss weight of block position i: exp(-(i-1)/decay) {_default('decay', ['dflash'])}.",
)
@click.option(
    "--mask-token-id",
    type=click.IntRange(0),
    default=None,
    help="Token of the masked block positions (default: the tokenizer's unk token).",
)
@reports_errors
def dflash(**given):
    """Train a DFlash drafter (z-lab layout) against a frozen target."""
    from ..train.dflash import train_dflash

    _run_training("dflash", train_dflash, **given)


@train.command("mtp", short_help="Train an MTP module (DeepSeek-V3 layout) against the frozen target.")
@training_options
@click.option(
    "--ttt-steps",
    type=click.IntRange(1),
    default=None,
    help=f"Training-time test: depths the module runs on its own outputs {_default('ttt_steps', ['mtp'])}.",
)
@labels_option
@reports_errors
def mtp(**given):
    """Train an MTP module (DeepSeek-V3 layout: one decoder layer of the target's class, sharing
    its embedding and output layer) against a frozen Llama-family target."""
    from ..train.mtp import train_mtp

    _run_training("mtp", train_mtp, **given)


@train.command("medusa", short_help="Train compact Medusa heads against the frozen target.")
@training_options
@click.option(
    "--heads",
    type=click.IntRange(1),
    default=None,
    help=f"Heads: head i drafts the token i + 2 positions after the last verified one {_default('heads', ['medusa'])}.",
)
@click.option(
    "--layers",
    type=click.IntRange(0),
    default=None,
    help=f"Residual blocks per head {_default('layers', ['medusa'])}.",
)
@click.option(
    "--rows-per-head",
    type=click.IntRange(1),
    default=None,
    help=f"Labelled positions per head and step (the target's output layer is the cost) {_default('rows_per_head', ['medusa'])}.",
)
@reports_errors
def medusa(**given):
    """Train compact Medusa heads (FasterDecoding's layout, sharing the target's output layer)
    against a frozen target."""
    from ..train.medusa import train_medusa

    _run_training("medusa", train_medusa, **given)
