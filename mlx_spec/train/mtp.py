"""Training an MTP module (DeepSeek-V3 layout, one module) against a frozen target.

What is trained: the two input norms, eh_proj, one decoder layer of the target's own class and
shared_head.norm. What is not: the target, whose embedding and output layer the module shares
(so the published checkpoint has no shared_head.head and stays small). The decoder layer
starts as a copy of the target's last layer with its residual branches zeroed (o_proj,
down_proj) and eh_proj as [small ; identity]: the module starts as the target's own
next-token head (its input is the target's normed state; one position off) instead of noise,
which matters on a CPU budget of an hour.

Training-time test as for EAGLE-3 (train/eagle.py): row t of step 0 pairs token x_{t+1} with
the target's normed last hidden state at t and predicts x_{t+2}; step j feeds the module's own
output of step j-1 with token x_{t+1+j} and predicts x_{t+2+j}, attending to the step-0
entries of rows 0..t and its own chain: the cache a chain of MTP drafts sees at inference.
The loss is the cross-entropy over the module's vocabulary (the target's, or the reduced one of
a module continued with --init) against the data's tokens (hard labels) or the target's own
distribution there (soft labels: EAGLE's and HASS's, from the cached last-layer features, so
text the target did not write trains it towards what it would write), on the response positions
only (their rows are gathered before the output layer, the costliest matmul). Layers of the
Llama family (q/k/v/o projections, input and post-attention norms) only."""

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..config import setting
from ..drafters.eagle import EagleDrafter
from ..errors import MlxSpecError
from ..models import vocabulary
from ..models.mtp import LAYOUTS, Model, load_mtp
from .eagle import (
    LABELS_HELP,
    check_labels,
    cross_entropy,
    make_eagle_batch,
    target_distribution,
    target_head,
    top_label,
    ttt_steps,
)
from .loop import FeatureStore, LoopOptions, Trainer, TrainResult, cast_for_saving, train, write_checkpoint


@dataclass
class MTPOptions(LoopOptions):
    ttt_steps: int = setting(
        3, "Training-time test: depths the module runs on its own outputs.", type=("IntRange", 1)
    )
    ttt_decay: float = setting(
        0.8, "Weight of step j's loss: ttt_decay ** j.", type=("FloatRange", 0, None, True)
    )
    labels: str = setting("hard", LABELS_HELP, type=("Choice", ["hard", "soft"]))


def new_mtp_model(target, seed: int = 0) -> Model:
    layer = target.layers[-1]
    needed = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    if not all(hasattr(layer, a) for a in needed) or not hasattr(layer.self_attn, "q_proj"):
        raise MlxSpecError(
            f"training an MTP module needs a Llama-family target (q/k/v/o attention); "
            f"this one is {target.model_type}"
        )
    model = Model(target, LAYOUTS["deepseek"])
    model.layer.update(layer.parameters())  # a copy of the target's last layer, whose
    # residual branches start at zero: it was made for the residual stream, not a normed state
    model.layer.self_attn.o_proj.weight = mx.zeros_like(model.layer.self_attn.o_proj.weight)
    model.layer.mlp.down_proj.weight = mx.zeros_like(model.layer.mlp.down_proj.weight)
    H = target.hidden_size
    noise = mx.random.normal((H, H), key=mx.random.key(seed)) * (0.02 / np.sqrt(H))
    model.proj.weight = mx.concatenate([noise, mx.eye(H)], axis=1)  # [embedding ; hidden]
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def ttt_forward(model: Model, embeds: mx.array, hidden: mx.array, steps: int) -> List[mx.array]:
    """The module's outputs [b, n, H] at `steps` depths. embeds [b, n + steps - 1, H]: the
    target's embeddings of x_1, x_2, ...; hidden [b, n, H]: the target's normed last hidden
    states at 0..n-1. The module's own pieces, through train/eagle.py's training-time test."""
    n = hidden.shape[1]

    def step_input(hidden, j):
        e = embeds[:, j : j + n]
        if j == 0:  # position 0's embedding is zeroed (models/mtp.py)
            e = mx.concatenate([mx.zeros_like(e[:, :1]), e[:, 1:]], axis=1)
        x = model.proj(mx.concatenate([model.embed_norm(e), model.hidden_norm(hidden)], axis=-1))
        return x, model.layer.input_layernorm(x)

    return ttt_steps(model.layer, hidden, steps, step_input)


def mtp_loss(model: Model, embeds, hidden, rows, labels, step_weights):
    """rows[j], labels[j]: the flat indices (into b * n) of step j's trained rows and their
    labels: token indices (hard), or the target's probabilities over the module's vocabulary
    (soft, [rows, V]) -> (weighted mean cross-entropy, {"accuracy": step-0 top-1 accuracy, of
    the data's token or of the target's most likely one})."""
    outputs = ttt_forward(model, embeds, hidden, len(rows))
    total, accuracy = 0.0, None
    for j, out in enumerate(outputs):
        flat = out.reshape(-1, out.shape[-1])[rows[j]]
        logits = model.logits(flat)
        total = total + step_weights[j] * cross_entropy(logits, labels[j]).mean()
        if j == 0:
            accuracy = (mx.argmax(logits, axis=-1) == top_label(labels[0], logits)).mean()
    return total / sum(step_weights), {"accuracy": accuracy}


def target_probabilities(target, head, features: mx.array, rows: mx.array, j: int) -> mx.array:
    """Soft labels of step j's rows: the target's distribution over the module's vocabulary at
    the labelled position (renormalized there; head: target_head), from its last-layer output
    one position before it (feature t + 1 + j of row t's sequence; flat indices into b * n:
    a labelled row has t + 2 + j <= its length - 1, so that feature is its own, not padding)."""
    return target_distribution(target, head, features.reshape(-1, features.shape[-1])[rows + 1 + j])


def draft_index(model: Model, vocab_size: int) -> np.ndarray:
    """Target id -> the module's output index: itself, or with a reduced draft vocabulary
    (a drafter continued with --init) its column, -1 where it has none (such labels are not
    trained: the module cannot draft them)."""
    ids = model.draft_ids
    return np.arange(vocab_size) if ids is None else vocabulary.columns(np.array(ids), vocab_size)


def make_mtp_batch(target, model: Model, store: FeatureStore, sequences, steps: int, soft_head=None):
    """(embeds, normed hidden, rows, labels): EAGLE-3's batch (train/eagle.py) over the
    module's vocabulary, with each step's labelled rows gathered (flat indices into b * n);
    soft_head (target_head): labels are the target's probabilities (target_probabilities)."""
    index = draft_index(model, target.vocab_size)
    embeds, features, labels, weights = make_eagle_batch(target, model, store, sequences, steps, index)
    labels, weights = np.array(labels).reshape(steps, -1), np.array(weights).reshape(steps, -1)
    rows = [np.flatnonzero(w) for w in weights]
    if not len(rows[0]):  # a batch without responses: a harmless row (cannot happen with real data)
        first = sequences[0].tokens
        rows, labels = (
            [np.array([0])] * steps,
            np.full((steps, 1), max(0, index[first[2]]) if len(first) > 2 else 0),
        )
        soft_head = None
    else:
        labels = [labels[j][r] for j, r in enumerate(rows)]
    rows = [mx.array(r) for r in rows]
    labels = (
        [target_probabilities(target, soft_head, features, r, j) for j, r in enumerate(rows)]
        if soft_head is not None
        else [mx.array(l) for l in labels]
    )
    return embeds, model.fuse(features).astype(mx.float32), rows, labels


def save_mtp(model: Model, target, path, dtype: str = "float32") -> Path:
    """The module as DeepSeek-V3 publishes one: model.layers.{N}.{enorm, hnorm, eh_proj,
    shared_head.norm, <the decoder layer>} in model.safetensors, next to the target's
    config.json with num_nextn_predict_layers = 1 (what load_mtp reads)."""
    path, n = Path(path), target.num_layers
    names = {
        "embed_norm": "enorm",
        "hidden_norm": "hnorm",
        "proj": "eh_proj",
        "final_norm": "shared_head.norm",
    }
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        part, rest = name.split(".", 1)
        weights[f"model.layers.{n}.{rest if part == 'layer' else names[part] + '.' + rest}"] = w
    config = dict(target.config, num_nextn_predict_layers=1, torch_dtype=dtype)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    return write_checkpoint(path, config, cast_for_saving(weights, dtype))


class MTPTrainer(Trainer):
    """Train an MTP module (DeepSeek-V3 layout: one decoder layer of the target's class, sharing
    its embedding and output layer) against a frozen Llama-family target."""

    kind = "mtp"
    options_class = MTPOptions

    def check(self):
        if self.options.ttt_steps < 1:
            raise MlxSpecError("--ttt-steps must be >= 1")
        check_labels(self.options.labels)

    def new_model(self, sequences):
        return new_mtp_model(self.target, self.options.seed)

    def load(self, path):
        return load_mtp(path, self.target)

    def prepare(self, model):
        o = self.options
        if o.init and model.draft_ids is None:  # resumed: the draft vocabulary is not in the checkpoint
            ids = vocabulary.read(o.init, self.target.vocab_size)
            if ids is not None:
                model.use_vocabulary(ids)
        self.soft_head = target_head(self.target, model) if o.labels == "soft" else None
        self.step_weights = [o.ttt_decay**j for j in range(o.ttt_steps)]

    def drafter(self, model):
        return EagleDrafter(model, self.target.vocab_size)

    def batch(self, model, store, sequences, step):
        inputs = make_mtp_batch(self.target, model, store, sequences, self.options.ttt_steps, self.soft_head)
        return (*inputs, self.step_weights), sum(len(s.tokens) for s in sequences)

    def loss(self, model, *batch):
        return mtp_loss(model, *batch)

    def architecture(self, model):
        target = self.target
        return {
            "hidden_size": target.hidden_size,
            "target_layers": target.num_layers,
            "vocab_size": target.vocab_size,
            "layout": "deepseek",
        }

    def save(self, model, out_dir):
        path = save_mtp(model, self.target, out_dir, self.options.save_dtype)
        if model.draft_ids is not None:  # the draft vocabulary it was trained over goes with it
            vocabulary.write(out_dir, np.array(model.draft_ids))
        return path


def train_mtp(target, data_dir, out_dir, options: Optional[MTPOptions] = None, **run) -> TrainResult:
    """Train an MTP module for `target` (DeepSeek layout in out_dir, loadable with --draft mtp
    --draft-model out_dir); run: as loop.train's."""
    return train(MTPTrainer(target, options or MTPOptions()), data_dir, out_dir, **run)


TRAINER = MTPTrainer  # what `mlx-spec train mtp` runs (cli/train.py)
