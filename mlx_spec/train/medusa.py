"""Training compact Medusa heads against a frozen target.

What is trained: each head's residual blocks (x + SiLU(W x + b)); the output layer is the
target's (compact variant, models/medusa.py), so the heads stay small. W starts at zero, as
Medusa's authors initialize it: each head starts as the target's own next-token head, one
position early. Head i at row t reads the target's normed last hidden state at t and learns
x_{t+2+i}; only response positions are labels. The target's output layer is the costly part
of a step, so each head trains on at most `rows_per_head` rows of the batch, drawn from
(seed, step) like every random choice of the training loop (train/loop.py)."""

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..drafters.medusa import MedusaDrafter
from ..errors import MlxSpecError
from ..models.medusa import Model, ModelArgs, save_medusa
from .loop import (
    DevEvaluation,
    FeatureStore,
    LoopOptions,
    TrainResult,
    batch_indices,
    load_sequences,
    resume_step,
    run_loop,
    step_rng,
    used_indices,
)


@dataclass
class MedusaOptions(LoopOptions):
    lr: float = 1e-3
    heads: int = 4
    layers: int = 1  # residual blocks per head
    rows_per_head: int = 256  # labelled rows per head and step
    head_decay: float = 0.8  # weight of head i's loss: head_decay ** i


OPTIONS = MedusaOptions  # what `mlx-spec train medusa` reads (cli/train.py)


def new_medusa_model(target, heads: int, layers: int) -> Model:
    model = Model(ModelArgs(heads, layers, target.hidden_size, target.vocab_size, shared_head=True), target)
    for blocks in model.blocks:
        for block in blocks:
            block.linear.weight = mx.zeros_like(block.linear.weight)
    mx.eval(model.parameters())
    return model


def medusa_loss(model: Model, hidden, rows, labels, head_weights):
    """hidden [rows, H] (normed); rows[i], labels[i]: head i's rows and labels."""
    total, accuracy = 0.0, None
    for i in range(len(rows)):
        x = hidden[rows[i]]
        for block in model.blocks[i]:
            x = block(x)
        logits = model._target.lm_head(x)
        total = total + head_weights[i] * nn.losses.cross_entropy(logits, labels[i], reduction="mean")
        if i == 0:
            accuracy = (mx.argmax(logits, axis=-1) == labels[0]).mean()
    return total / sum(head_weights), {"accuracy": accuracy}


def make_medusa_batch(model: Model, store: FeatureStore, sequences, heads: int, rows_per_head: int, rng):
    """(hidden states of every row of the batch, each head's sampled rows and labels)."""
    features, rows, labels, offset = [], [[] for _ in range(heads)], [[] for _ in range(heads)], 0
    for seq in sequences:
        T = len(seq.tokens)
        features.append(store.get(seq)[: T - 1])
        for i in range(heads):
            for t in range(T - 1):
                if seq.prompt_length <= t + 2 + i <= T - 1:
                    rows[i].append(offset + t)
                    labels[i].append(seq.tokens[t + 2 + i])
        offset += T - 1
    for i in range(heads):
        if not rows[i]:  # every sequence too short for this head
            rows[i], labels[i] = [0], [sequences[0].tokens[-1]]
        if len(rows[i]) > rows_per_head:
            pick = np.sort(rng.choice(len(rows[i]), rows_per_head, replace=False))
            rows[i], labels[i] = [rows[i][j] for j in pick], [labels[i][j] for j in pick]
    hidden = model.fuse(mx.concatenate(features, axis=0)).astype(mx.float32)
    return hidden, [mx.array(r) for r in rows], [mx.array(l) for l in labels]


def train_medusa(
    target,
    data_dir,
    out_dir,
    options: Optional[MedusaOptions] = None,
    resume: bool = False,
    feature_dir="default",
    progress: Optional[Callable[[dict], None]] = None,
    feature_progress: Optional[Callable[[int], None]] = None,
) -> TrainResult:
    """Train compact Medusa heads for `target`; write them to out_dir (FasterDecoding's layout,
    without output layers), loadable with --draft medusa --draft-model out_dir."""
    o = options or MedusaOptions()
    if min(o.heads, o.rows_per_head, o.batch_size, o.steps) < 1 or o.layers < 0:
        raise MlxSpecError("--heads, --rows-per-head, --batch-size and --steps must be >= 1, --layers >= 0")
    out_dir = Path(out_dir)
    sequences = load_sequences(data_dir, o.max_length)
    evaluate = (
        DevEvaluation(target, o.eval_data or data_dir, lambda m: MedusaDrafter(target, m), o.eval_prompts)
        if o.eval_every
        else None
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    start = resume_step(out_dir, resume)
    if o.init and not start:
        from ..models.medusa import load_medusa

        model = load_medusa(o.init, target)
        model.set_dtype(mx.float32)
    else:
        model = new_medusa_model(target, o.heads, o.layers)
    store = FeatureStore(
        target, [target.num_layers - 1], out_dir / "features" if feature_dir == "default" else feature_dir
    )
    store.prepare(
        [sequences[i] for i in used_indices(len(sequences), o.batch_size, start, o.steps, o.seed)],
        feature_progress,
    )
    head_weights = [o.head_decay**i for i in range(model.args.num_heads)]

    def make_batch(step):
        batch = [sequences[i] for i in batch_indices(len(sequences), o.batch_size, step, o.seed)]
        hidden, rows, labels = make_medusa_batch(
            model, store, batch, model.args.num_heads, o.rows_per_head, step_rng(o.seed, step)
        )
        return (hidden, rows, labels, head_weights), sum(len(r) for r in rows)

    architecture = {
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "heads": model.args.num_heads,
        "layers": model.args.num_layers,
    }
    result = run_loop(
        "medusa",
        model,
        medusa_loss,
        make_batch,
        o,
        out_dir,
        architecture,
        {"medusa": asdict(o)},
        resume,
        progress,
        evaluate,
    )
    result.path = save_medusa(model, out_dir, getattr(mx, o.save_dtype))
    return result
