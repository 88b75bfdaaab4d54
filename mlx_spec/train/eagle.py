"""Training an EAGLE-3 draft layer against a frozen target.

What is trained: fc (the fused low/middle/high target features -> H), the decoder layer, the
final norm and the head over a reduced draft vocabulary. What is not: the target, whose
embedding the layer shares. The draft vocabulary is the `draft_vocab_size` target ids most
frequent in the responses of the training data; d2t[i] = target_id - i.

Training-time test (EAGLE-3): a sequence x_0..x_{T-1} with target features F_0..F_{T-1} gives
rows t = 0..T-2. Step 0 pairs token x_{t+1} with fc(F_t) (causal over the rows) and predicts
x_{t+2}; step j feeds, at row t, token x_{t+1+j} and the layer's own output of step j-1 at the
same row, at position t+j, and predicts x_{t+2+j}. Its attention sees the step-0 entries of
rows 0..t and its own chain's entries of steps 1..j: exactly the cache a chain of drafts
rooted at row t sees at inference (models/eagle3.py, drafters/eagle.py). The labels are the
data's tokens (hard: the target's own answers) or the target's distribution over the draft
vocabulary at each position (soft, as EAGLE-1 and HASS train: from its last-layer output,
cached beside the fused taps, so a sampled answer teaches the whole distribution and not one
draw of it); rows whose label lies in the prompt, or (hard) outside the draft vocabulary, are
masked. Step j's loss is weighted ttt_decay**j.

The result is written in SafeAILab's layout (config.json + model.safetensors with midlayer.*,
fc, norm, lm_head, d2t, t2d), which load_eagle3, vLLM and SafeAILab's EAGLE read."""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..config import setting
from ..drafters.eagle import EagleDrafter
from ..errors import MlxSpecError
from ..models import vocabulary
from ..models.eagle3 import Model, ModelArgs, default_layer_ids, load_eagle3
from .loop import (
    FeatureStore,
    LoopOptions,
    Trainer,
    TrainResult,
    cast_for_saving,
    layer_config,
    train,
    write_checkpoint,
)

LABELS_HELP = (
    "hard: the data's next tokens; soft: the target's distribution at each position (from its cached "
    "last-layer features; any text then teaches what the target would write)."
)


@dataclass
class EagleOptions(LoopOptions):
    ttt_steps: int = setting(
        7, "Training-time test: steps the layer runs on its own outputs.", type=("IntRange", 1)
    )
    ttt_decay: float = setting(
        0.8, "Weight of step j's loss: ttt_decay ** j.", type=("FloatRange", 0, None, True)
    )
    draft_vocab_size: int = setting(
        8192, "Draft head size: the most frequent target tokens of the data.", type=("IntRange", 1)
    )
    layer_ids: Optional[List[int]] = setting(
        None,
        "Fused target layers, EAGLE's convention (inputs of layers), e.g. 2,15,27 (default: 2, N//2, N-3).",
        type=("IntList",),
    )
    labels: str = setting("hard", LABELS_HELP, type=("Choice", ["hard", "soft"]))


# --- the model --------------------------------------------------------------------------------


def draft_vocabulary(sequences, vocab_size: int, draft_vocab_size: int) -> np.ndarray:
    """The `draft_vocab_size` target ids most frequent in the responses (ties: lower id first),
    sorted ascending."""
    return vocabulary.frequent_ids(
        (seq.tokens[seq.prompt_length :] for seq in sequences), vocab_size, draft_vocab_size
    )


def new_eagle_model(target, draft_ids: np.ndarray, layer_ids: Optional[Sequence[int]] = None) -> Model:
    """A freshly initialized EAGLE-3 layer shaped like one of the target's layers (MLX's own
    initializers: seed with mx.random.seed first), d2t from `draft_ids`."""
    n = target.num_layers
    layer_ids = list(layer_ids) if layer_ids else default_layer_ids(n)
    bad = [i for i in layer_ids if not 0 <= i <= n]
    if bad:
        raise MlxSpecError(
            f"EAGLE-3 fuses the inputs of target layers {layer_ids}, but layer ids "
            f"must lie in 0..{n} for this {n}-layer target (a target needs at least "
            "3 layers for the default ids 2, N//2, N-3)"
        )
    args = ModelArgs(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        draft_vocab_size=len(draft_ids),
        aux_layer_ids=layer_ids,
        **layer_config(target),
    )
    model = Model(args, target_embed=target.embed)
    model.d2t = vocabulary.d2t(draft_ids)
    model.freeze(keys=["d2t"], recurse=False)  # a mapping, not a weight
    mx.eval(model.parameters())
    return model


def target_to_draft(model: Model) -> np.ndarray:
    """[target vocab] -> draft id, or -1 outside the draft vocabulary."""
    return vocabulary.columns(
        np.arange(model.args.draft_vocab_size) + np.array(model.d2t), model.args.vocab_size
    )


# --- training-time test ------------------------------------------------------------------------


def _chain_attention(q, keys, values, scale):
    """q [b, heads, n, d]. Row t attends to rows 0..t of keys[0] (the step-0 entries: real
    pairs, causal) and to row t of keys[1:] (its own chain's later steps, itself included)."""
    if len(keys) == 1:
        return mx.fast.scaled_dot_product_attention(q, keys[0], values[0], scale=scale, mask="causal")
    b, h, n, d = q.shape
    kv_heads = keys[0].shape[1]
    q = (q * scale).reshape(b, kv_heads, h // kv_heads, n, d)
    scores = q @ keys[0][:, :, None].swapaxes(-1, -2)  # [b, kv, rep, n, n]
    causal = mx.arange(n)[:, None] >= mx.arange(n)[None]
    scores = mx.where(causal, scores, mx.array(-mx.inf, scores.dtype))
    own = [(q * k[:, :, None]).sum(-1, keepdims=True) for k in keys[1:]]  # [b, kv, rep, n, 1]
    probs = mx.softmax(mx.concatenate([scores] + own, axis=-1), axis=-1, precise=True)
    out = probs[..., :n] @ values[0][:, :, None]
    for i, v in enumerate(values[1:]):
        out = out + probs[..., n + i : n + i + 1] * v[:, :, None]
    return out.reshape(b, h, n, d)


def chain_attention_step(attn, x: mx.array, keys: List[mx.array], values: List[mx.array], j: int) -> mx.array:
    """Step j of a training-time test through a Llama-style attention (q/k/v/o projections,
    rope): x [b, n, width], row t at position t + j. Appends the step's keys and values to the
    chain's and returns the attention's output [b, n, H] (before the residual)."""
    b, n, _ = x.shape
    q = attn.q_proj(x).reshape(b, n, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    keys.append(attn.rope(k, offset=j))
    values.append(v)
    out = _chain_attention(attn.rope(q, offset=j), keys, values, attn.scale)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def ttt_steps(layer, hidden: mx.array, steps: int, step_input: Callable) -> List[mx.array]:
    """A training-time test through a Llama-style decoder layer: its outputs [b, n, H] at
    `steps` steps, step j fed with step j - 1's output (`hidden` at step 0) and attending with
    the chain mask above; step_input(hidden, j) -> (the residual, the attention's input)."""
    outputs, keys, values = [], [], []
    for j in range(steps):
        residual, x = step_input(hidden, j)
        h = residual + chain_attention_step(layer.self_attn, x, keys, values, j)
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        outputs.append(hidden)
    return outputs


def ttt_forward(model: Model, embeds: mx.array, fused: mx.array, steps: int) -> List[mx.array]:
    """The layer's pre-norm outputs [b, n, H] of `steps` training-time-test steps.

    embeds [b, n + steps - 1, H]: the target's embeddings of x_1, x_2, ... (row t of step j
    reads embeds[:, t + j]); fused [b, n, H]: fc of the target features F_0..F_{n-1}. Composes
    the model's own modules (models/eagle3.py DecoderLayer)."""
    layer, n = model.midlayer, fused.shape[1]

    def step_input(hidden, j):
        normed = layer.hidden_norm(hidden)
        x = mx.concatenate([layer.input_layernorm(embeds[:, j : j + n]), normed], axis=-1)
        return (normed if layer.norm_before_residual else hidden), x

    return ttt_steps(layer, fused, steps, step_input)


def cross_entropy(logits: mx.array, labels: mx.array) -> mx.array:
    """Per-row cross-entropy against draft ids (hard labels, [...]) or distributions over the
    draft vocabulary (soft, [..., V] like the logits)."""
    if labels.ndim == logits.ndim:
        return -(labels * nn.log_softmax(logits, axis=-1)).sum(axis=-1)
    return nn.losses.cross_entropy(logits, labels, reduction="none")


def top_label(labels: mx.array, logits: mx.array) -> mx.array:
    """The label top-1 accuracy counts: the data's token, or the target's most likely one."""
    return mx.argmax(labels, axis=-1) if labels.ndim == logits.ndim else labels


def eagle_loss(model: Model, embeds, features, labels, weights, step_weights):
    """labels [steps, b, n] draft ids, or [steps, b, n, V] the target's distributions; weights
    [steps, b, n] 0/1 masks -> (weighted mean cross-entropy, {"accuracy": step-0 top-1 accuracy})."""
    outputs = ttt_forward(model, embeds, model.fuse(features), labels.shape[0])
    total, accuracy = 0.0, None
    for j, hidden in enumerate(outputs):
        logits = model.logits(hidden)
        count = mx.maximum(weights[j].sum(), 1)
        total = total + step_weights[j] * (cross_entropy(logits, labels[j]) * weights[j]).sum() / count
        if j == 0:
            accuracy = (
                (mx.argmax(logits, axis=-1) == top_label(labels[0], logits)) * weights[0]
            ).sum() / count
    return total / sum(step_weights), {"accuracy": accuracy}


def target_head(target, model) -> Callable[[mx.array], mx.array]:
    """The target's output layer over a drafter's vocabulary (the target's own rows, never the
    drafter's head): what soft labels are computed with."""
    ids = model.draft_ids
    if ids is None:
        return target.lm_head
    return vocabulary.OutputRows([target.output_layer], np.array(ids))


def target_distribution(target, head, last: mx.array) -> mx.array:
    """The target's distribution of the next token (over head's vocabulary, renormalized there)
    from its last layer's output `last` [..., H] at each position: soft labels."""
    return mx.stop_gradient(mx.softmax(head(target.final_norm(last)).astype(mx.float32), axis=-1))


def make_eagle_batch(
    target, model: Model, store: FeatureStore, sequences, steps: int, to_draft: np.ndarray, soft_head=None
):
    """(embeds, features, labels, weights) for the sequences, right-padded; see the module doc.
    soft_head (target_head): the store's last tap is the target's last layer, and the labels
    are its distributions (the features returned are the others)."""
    b = len(sequences)
    n = max(len(s.tokens) for s in sequences) - 1
    tokens = np.zeros((b, n + steps + 1), np.int64)
    features = []
    labels = np.zeros((steps, b, n), np.int64)
    weights = np.zeros((steps, b, n), np.float32)
    rows = np.arange(n)
    for i, seq in enumerate(sequences):
        T = len(seq.tokens)
        tokens[i, :T] = seq.tokens
        f = store.get(seq)[: T - 1]
        features.append(mx.pad(f, [(0, n - (T - 1)), (0, 0)]) if T - 1 < n else f)
        for j in range(steps):
            where = rows + 2 + j  # the label's position in the sequence
            ids = to_draft[tokens[i, np.minimum(where, T - 1)]]
            valid = (where <= T - 1) & (where >= seq.prompt_length) & ((ids >= 0) | (soft_head is not None))
            labels[j, i] = np.where(valid, ids, 0)
            weights[j, i] = valid
    embeds = target.embed(mx.array(tokens[:, 1 : n + steps])).astype(mx.float32)
    features, labels = mx.stack(features), mx.array(labels)
    if soft_head is not None:
        # Row t of step j predicts position t+2+j: the target's output at t+1+j (past the
        # sequence only where the weight is 0).
        H = target.hidden_size
        features, probs = features[..., :-H], target_distribution(target, soft_head, features[..., -H:])
        labels = mx.stack([mx.pad(probs[:, 1 + j :], [(0, 0), (0, 1 + j), (0, 0)]) for j in range(steps)])
    return embeds, features, labels, mx.array(weights)


def check_labels(labels: str) -> None:
    if labels not in ("hard", "soft"):
        raise MlxSpecError(f"--labels is hard or soft, not {labels!r}")


# --- the published checkpoint -------------------------------------------------------------------


def save_eagle3(model: Model, path, dtype: str = "float32") -> Path:
    """SafeAILab's layout: a Llama config with one layer and draft_vocab_size, and
    model.safetensors with midlayer.*, fc, norm, lm_head, d2t (int64) and t2d (bool)."""
    args, path = model.args, Path(path)
    weights = dict(tree_flatten(model.parameters()))
    d2t = np.array(weights.pop("d2t")).astype(np.int64)
    t2d = np.zeros(args.vocab_size, bool)
    t2d[np.arange(len(d2t)) + d2t] = True
    weights = cast_for_saving(weights, dtype)
    weights["d2t"], weights["t2d"] = mx.array(d2t), mx.array(t2d)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": args.vocab_size,
        "draft_vocab_size": args.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(args.aux_layer_ids),
        "torch_dtype": dtype,
    }
    if args.rope_scaling:
        config["rope_scaling"] = args.rope_scaling
    return write_checkpoint(path, config, weights)


# --- the run -------------------------------------------------------------------------------------


class EagleTrainer(Trainer):
    """Train an EAGLE-3 draft layer (SafeAILab layout) against a frozen target."""

    kind = "eagle"
    options_class = EagleOptions

    def check(self):
        o = self.options
        if o.ttt_steps < 1 or o.draft_vocab_size < 1:
            raise MlxSpecError("--ttt-steps and --draft-vocab-size must be >= 1")
        check_labels(o.labels)

    def new_model(self, sequences):
        target, o = self.target, self.options
        return new_eagle_model(
            target, draft_vocabulary(sequences, target.vocab_size, o.draft_vocab_size), o.layer_ids
        )

    def load(self, path):  # its own draft vocabulary and taps
        model = load_eagle3(path, self.target)
        model.freeze(keys=["d2t"], recurse=False)
        return model

    def prepare(self, model):
        o = self.options
        self.soft_head = target_head(self.target, model) if o.labels == "soft" else None
        self.step_weights = [o.ttt_decay**j for j in range(o.ttt_steps)]
        self.to_draft = None  # after a resume, d2t is the checkpoint's: read at the first batch

    def drafter(self, model):
        return EagleDrafter(model, self.target.vocab_size)

    def taps(self, model):  # soft labels come from the target's last layer, cached as one more tap
        return list(model.taps) + ([self.target.num_layers - 1] if self.soft_head is not None else [])

    def batch(self, model, store, sequences, step):
        if self.to_draft is None:
            self.to_draft = target_to_draft(model)
        inputs = make_eagle_batch(
            self.target, model, store, sequences, self.options.ttt_steps, self.to_draft, self.soft_head
        )
        return (*inputs, self.step_weights), sum(len(s.tokens) for s in sequences)

    def loss(self, model, *batch):
        return eagle_loss(model, *batch)

    def architecture(self, model):
        return {
            "hidden_size": self.target.hidden_size,
            "target_layers": self.target.num_layers,
            "vocab_size": self.target.vocab_size,
            "draft_vocab_size": model.args.draft_vocab_size,
            "layer_ids": list(model.args.aux_layer_ids),
        }

    def save(self, model, out_dir):
        return save_eagle3(model, out_dir, self.options.save_dtype)


def train_eagle(target, data_dir, out_dir, options: Optional[EagleOptions] = None, **run) -> TrainResult:
    """Train an EAGLE-3 layer for `target` (SafeAILab layout in out_dir); run: as loop.train's."""
    return train(EagleTrainer(target, options or EagleOptions()), data_dir, out_dir, **run)


TRAINER = EagleTrainer  # what `mlx-spec train eagle` runs (cli/train.py)
