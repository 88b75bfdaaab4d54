"""Training compact Medusa heads against a frozen target.

What is trained: each head's residual blocks (x + SiLU(W x + b)); the output layer is the
target's (compact variant, models/medusa.py), so the heads stay small. W starts at zero, as
Medusa's authors initialize it: each head starts as the target's own next-token head, one
position early. Head i at row t reads the target's normed last hidden state at t and learns
x_{t+2+i}; only response positions are labels. The target's output layer is the costly part
of a step, so each head trains on at most `rows_per_head` rows of the batch, drawn from
(seed, step) like every random choice of the training loop (train/loop.py)."""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import setting
from ..drafters.medusa import MedusaDrafter
from ..errors import MlxSpecError
from ..models.medusa import Model, ModelArgs, load_medusa, save_medusa
from .loop import FeatureStore, LoopOptions, Trainer, TrainResult, step_rng, train


@dataclass
class MedusaOptions(LoopOptions):
    lr: float = 1e-3
    heads: int = setting(
        4, "Heads: head i drafts the token i + 2 positions after the last verified one.", type=("IntRange", 1)
    )
    layers: int = setting(1, "Residual blocks per head.", type=("IntRange", 0))
    rows_per_head: int = setting(
        256,
        "Labelled positions per head and step (the target's output layer is the cost).",
        type=("IntRange", 1),
    )
    head_decay: float = setting(
        0.8, "Weight of head i's loss: head_decay ** i.", type=("FloatRange", 0, None, True)
    )


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


class MedusaTrainer(Trainer):
    """Train compact Medusa heads (FasterDecoding's layout, sharing the target's output layer)
    against a frozen target."""

    kind = "medusa"
    options_class = MedusaOptions

    def check(self):
        o = self.options
        if min(o.heads, o.rows_per_head) < 1 or o.layers < 0:
            raise MlxSpecError("--heads and --rows-per-head must be >= 1, --layers >= 0")

    def new_model(self, sequences):
        return new_medusa_model(self.target, self.options.heads, self.options.layers)

    def load(self, path):
        return load_medusa(path, self.target)

    def prepare(self, model):
        self.head_weights = [self.options.head_decay**i for i in range(model.args.num_heads)]

    def drafter(self, model):
        return MedusaDrafter(self.target, model)

    def taps(self, model):
        return [self.target.num_layers - 1]

    def batch(self, model, store, sequences, step):
        o = self.options
        hidden, rows, labels = make_medusa_batch(
            model, store, sequences, model.args.num_heads, o.rows_per_head, step_rng(o.seed, step)
        )
        return (hidden, rows, labels, self.head_weights), sum(len(r) for r in rows)

    def loss(self, model, *batch):
        return medusa_loss(model, *batch)

    def architecture(self, model):
        return {
            "hidden_size": self.target.hidden_size,
            "vocab_size": self.target.vocab_size,
            "heads": model.args.num_heads,
            "layers": model.args.num_layers,
        }

    def save(self, model, out_dir):
        return save_medusa(model, out_dir, getattr(mx, self.options.save_dtype))


def train_medusa(target, data_dir, out_dir, options: Optional[MedusaOptions] = None, **run) -> TrainResult:
    """Train compact Medusa heads for `target` (FasterDecoding's layout in out_dir, without
    output layers; loadable with --draft medusa --draft-model out_dir); run: as loop.train's."""
    return train(MedusaTrainer(target, options or MedusaOptions()), data_dir, out_dir, **run)


TRAINER = MedusaTrainer  # what `mlx-spec train medusa` runs (cli/train.py)
