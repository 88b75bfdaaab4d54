import sys
from dataclasses import replace
from pathlib import Path

import click

from .common import echo_err, reports_errors


@click.group("train", short_help="Build drafter training data; train EAGLE-3, DFlash, MTP and Medusa drafters.")
def train():
    """Build drafter training data; train EAGLE-3, DFlash, MTP and Medusa drafters against a
    frozen target."""


@train.command("data", short_help="Answer assembled prompts with the target (resumable).")
@click.option("--model", "--target", "model_path", default=None,
              help="Target model: a directory or a Hugging Face repo id (default: the embedded model).")
@click.option("--out", "out_dir", required=True, help="Output directory (train.jsonl, heldout.jsonl).")
@click.option("--limit", type=click.IntRange(1), default=None, help="Use only the first N prompts.")
@click.option("--max-tokens", type=click.IntRange(1), default=256, show_default=True, help="Longest response.")
@click.option("--batch-size", type=click.IntRange(1), default=32, show_default=True,
              help="Sequences decoded together (32: ~10x the one-sequence rate on 2 CPU cores).")
@click.option("--temp", type=float, default=0.0, show_default=True, help="0: greedy responses.")
@click.option("--dtype", default="auto", show_default=True,
              help="Target dtype (auto: float32 on the CPU).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Order of the prompts (and the sampling noise when --temp > 0).")
@reports_errors
def data(model_path, out_dir, limit, max_tokens, batch_size, temp, dtype, seed):
    """Answer assembled prompts with the target; resumable, with a held-out split."""
    from ..api import model_path as resolve_model
    from ..models.target import load_target
    from ..train.data import build_prompts, generate_data

    target = load_target(resolve_model(model_path), dtype)
    total = len(build_prompts(seed)[:limit])
    with click.progressbar(length=total, label="answering", file=sys.stderr) as bar:
        counts = generate_data(target, out_dir, limit=limit, max_tokens=max_tokens, batch_size=batch_size,
                               temp=temp, seed=seed, progress=bar.update)
    echo_err(f"{counts['written']} written, {counts['skipped']} already there, {counts['total']} prompts -> "
             f"{out_dir}: {counts['train']} in train.jsonl, {counts['heldout']} in heldout.jsonl")
    if not counts["heldout"]:
        echo_err("heldout.jsonl is not written: a hash of each prompt's id puts ~5% of the prompts there, "
                 "and none of these fell in it (use more prompts, or a larger --limit)")


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(v) for v in value.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def training_options(f):
    """What every `train` command shares."""
    options = [
        click.option("--model", "--target", "model_path", default=None,
                     help="Target model: a directory or a Hugging Face repo id (default: the embedded model)."),
        click.option("--data", "data_dir", required=True, help="Output of `mlx-spec train data`."),
        click.option("--out", "out_dir", required=True,
                     help="Drafter directory: the published checkpoint, checkpoint/ (to resume), "
                          "features/ (the target's cached features), train_log.jsonl."),
        click.option("--steps", type=click.IntRange(1), default=2000, show_default=True,
                     help="Optimizer steps in all (a resumed run continues up to it)."),
        click.option("--batch-size", "--batch", type=click.IntRange(1), default=None,
                     help="Sequences per step [eagle, mtp, medusa: 4; dflash: 2]."),
        click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Peak AdamW learning rate [eagle, mtp: 3e-4; dflash: 6e-4; medusa: 1e-3]."),
        click.option("--warmup", type=click.IntRange(0), default=50, show_default=True,
                     help="Linear warmup steps, then cosine decay to lr/10."),
        click.option("--weight-decay", type=click.FloatRange(0), default=0.0, show_default=True,
                     help="AdamW weight decay."),
        click.option("--max-length", type=click.IntRange(4), default=1024, show_default=True,
                     help="Longest sequence (prompt + response) in tokens."),
        click.option("--save-every", type=click.IntRange(0), default=200, show_default=True,
                     help="Checkpoint every N steps (0: only at the end)."),
        click.option("--resume", is_flag=True, help="Continue from OUT/checkpoint."),
        click.option("--init", "init_dir", default=None,
                     help="Start from this published drafter's weights (a directory or a repo id, e.g. a "
                          "shipped one); "
                          "its shape and taps win over the shape options."),
        click.option("--max-minutes", type=click.FloatRange(0), default=0, show_default=True,
                     help="Stop after this many minutes of training, checkpointed (0: no limit); "
                          "--resume continues."),
        click.option("--seed", type=int, default=0, show_default=True,
                     help="Initial weights, batch order and anchors."),
        click.option("--dtype", default="auto", show_default=True,
                     help="Target dtype (auto: float32 on the CPU). The drafter trains in float32."),
        click.option("--save-dtype", type=click.Choice(["float32", "float16", "bfloat16"]),
                     default="float32", show_default=True, help="dtype of the published weights."),
        click.option("--feature-cache", default=None,
                     help="Directory for the target's features (default: OUT/features)."),
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
            self.features = click.progressbar(length=self.n_features, label="target features",
                                              file=sys.stderr)
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


def _run_training(label, train_fn, options, model_path, data_dir, out_dir, dtype, resume, feature_cache):
    from ..api import model_path as resolve_model
    from ..hub import resolve
    from ..models.target import load_target
    from ..train.loop import load_sequences, resume_step, used_indices

    sequences = load_sequences(data_dir, options.max_length)   # data errors before the target loads
    start = resume_step(out_dir, resume) if Path(out_dir).is_dir() else 0
    target = load_target(resolve_model(model_path), dtype)
    if options.init:
        options = replace(options, init=str(resolve(options.init, None, "drafter")))
    n = len(used_indices(len(sequences), options.batch_size, start, options.steps, options.seed))
    bars = _Bars(n, options.steps, start, label)
    try:
        result = train_fn(target, data_dir, out_dir, options, resume=resume,
                          feature_dir=feature_cache or "default", progress=bars.step,
                          feature_progress=bars.feature)
    finally:
        bars.close()
    last = f", last loss {result.losses[-1]:.3f}" if result.losses else ""
    echo_err(f"{result.step} steps{last} -> {result.path}")


@train.command("eagle", short_help="Train an EAGLE-3 draft layer against the frozen target.")
@training_options
@click.option("--ttt-steps", type=click.IntRange(1), default=7, show_default=True,
              help="Training-time test: steps the layer runs on its own outputs.")
@click.option("--draft-vocab-size", type=click.IntRange(1), default=8192, show_default=True,
              help="Draft head size: the most frequent target tokens of the data.")
@click.option("--layer-ids", callback=_int_list, default=None,
              help="Fused target layers, EAGLE's convention (inputs of layers), e.g. 2,15,27 "
                   "(default: 2, N//2, N-3).")
@reports_errors
def eagle(model_path, data_dir, out_dir, steps, batch_size, lr, warmup, weight_decay, max_length, save_every,
          resume, init_dir, max_minutes, seed, dtype, save_dtype, feature_cache, ttt_steps, draft_vocab_size, layer_ids):
    """Train an EAGLE-3 draft layer (SafeAILab layout) against a frozen target."""
    from ..train.eagle import EagleOptions, train_eagle

    options = EagleOptions(steps=steps, batch_size=batch_size or 4, lr=lr or 3e-4, warmup=warmup,
                           weight_decay=weight_decay, ttt_steps=ttt_steps, draft_vocab_size=draft_vocab_size,
                           max_length=max_length, save_every=save_every, seed=seed, save_dtype=save_dtype,
                           layer_ids=layer_ids, init=init_dir, max_minutes=max_minutes)
    _run_training("eagle", train_eagle, options, model_path, data_dir, out_dir, dtype, resume, feature_cache)


@train.command("dflash", short_help="Train a DFlash drafter against the frozen target.")
@training_options
@click.option("--layers", type=click.IntRange(1), default=2, show_default=True, help="Drafter layers.")
@click.option("--block-size", type=click.IntRange(2), default=16, show_default=True,
              help="Tokens per block: the anchor and the positions drafted from it in one pass.")
@click.option("--target-layers", callback=_int_list, default=None,
              help="Tapped target layers (output of layer i), e.g. 1,8,14,20,27 (default: spread "
                   "from 1 to N-3, one per drafter layer, as z-lab).")
@click.option("--blocks", "blocks_per_sequence", type=click.IntRange(1), default=32, show_default=True,
              help="Blocks (random anchors in the response) per sequence.")
@click.option("--decay", type=click.FloatRange(min=0, min_open=True), default=7.0, show_default=True,
              help="Loss weight of block position i: exp(-(i-1)/decay).")
@click.option("--mask-token-id", type=click.IntRange(0), default=None,
              help="Token of the masked block positions (default: the tokenizer's unk token).")
@reports_errors
def dflash(model_path, data_dir, out_dir, steps, batch_size, lr, warmup, weight_decay, max_length, save_every,
           resume, init_dir, max_minutes, seed, dtype, save_dtype, feature_cache, layers, block_size, target_layers,
           blocks_per_sequence, decay, mask_token_id):
    """Train a DFlash drafter (z-lab layout) against a frozen target."""
    from ..train.dflash import DFlashOptions, train_dflash

    options = DFlashOptions(steps=steps, batch_size=batch_size or 2, lr=lr or 6e-4, warmup=warmup,
                            weight_decay=weight_decay, layers=layers, block_size=block_size,
                            target_layers=target_layers, blocks_per_sequence=blocks_per_sequence, decay=decay,
                            mask_token_id=mask_token_id, max_length=max_length, save_every=save_every,
                            seed=seed, save_dtype=save_dtype, init=init_dir, max_minutes=max_minutes)
    _run_training("dflash", train_dflash, options, model_path, data_dir, out_dir, dtype, resume, feature_cache)


@train.command("mtp", short_help="Train an MTP module (DeepSeek-V3 layout) against the frozen target.")
@training_options
@click.option("--ttt-steps", type=click.IntRange(1), default=3, show_default=True,
              help="Training-time test: depths the module runs on its own outputs.")
@reports_errors
def mtp(model_path, data_dir, out_dir, steps, batch_size, lr, warmup, weight_decay, max_length, save_every,
        resume, init_dir, max_minutes, seed, dtype, save_dtype, feature_cache, ttt_steps):
    """Train an MTP module (DeepSeek-V3 layout: one decoder layer of the target's class, sharing
    its embedding and output layer) against a frozen Llama-family target."""
    from ..train.mtp import MTPOptions, train_mtp

    options = MTPOptions(steps=steps, batch_size=batch_size or 4, lr=lr or 3e-4, warmup=warmup,
                         weight_decay=weight_decay, ttt_steps=ttt_steps, max_length=max_length,
                         save_every=save_every, seed=seed, save_dtype=save_dtype, init=init_dir,
                         max_minutes=max_minutes)
    _run_training("mtp", train_mtp, options, model_path, data_dir, out_dir, dtype, resume, feature_cache)


@train.command("medusa", short_help="Train compact Medusa heads against the frozen target.")
@training_options
@click.option("--heads", type=click.IntRange(1), default=4, show_default=True,
              help="Heads: head i drafts the token i + 2 positions after the last verified one.")
@click.option("--layers", type=click.IntRange(0), default=1, show_default=True,
              help="Residual blocks per head.")
@click.option("--rows-per-head", type=click.IntRange(1), default=256, show_default=True,
              help="Labelled positions per head and step (the target's output layer is the cost).")
@reports_errors
def medusa(model_path, data_dir, out_dir, steps, batch_size, lr, warmup, weight_decay, max_length, save_every,
           resume, init_dir, max_minutes, seed, dtype, save_dtype, feature_cache, heads, layers, rows_per_head):
    """Train compact Medusa heads (FasterDecoding's layout, sharing the target's output layer)
    against a frozen target."""
    from ..train.medusa import MedusaOptions, train_medusa

    options = MedusaOptions(steps=steps, batch_size=batch_size or 4, lr=lr or 1e-3, warmup=warmup,
                            weight_decay=weight_decay, heads=heads, layers=layers, rows_per_head=rows_per_head,
                            max_length=max_length, save_every=save_every, seed=seed, save_dtype=save_dtype,
                            init=init_dir, max_minutes=max_minutes)
    _run_training("medusa", train_medusa, options, model_path, data_dir, out_dir, dtype, resume, feature_cache)
