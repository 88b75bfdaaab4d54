"""Training a DFlash drafter (z-lab's "DFlashDraftModel") against a frozen target.

Recipe (DFlash paper, DESIGN.md): the drafter's layers, fc, hidden_norm and final norm are
trained; the target, its embedding and its head are frozen and shared. For each sequence,
anchors are sampled among the positions a drafting round can start from: the last prompt token
and every response token but the last. Block j = [x_a, mask x (block_size - 1)] at positions
a..a+block_size-1 predicts x_{a+1}..x_{a+block_size-1}. All blocks of a sequence go through the
drafter in ONE forward with a block-sparse mask: a block's queries see the context features of
positions < a (the target has computed features for exactly those when it drafts from x_a:
x_a is the token it has just committed, see drafters/dflash.py) and the whole of their own
block, nothing of the other blocks. Position i of a block has loss weight exp(-(i-1)/decay):
one early mistake invalidates the rest of the block.

The result is written in z-lab's layout (config.json with architectures ["DFlashDraftModel"],
block_size, dflash_config {mask_token_id, target_layer_ids} + model.safetensors), which
load_dflash reads."""

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..config import setting
from ..drafters.dflash import DFlashDrafter
from ..errors import MlxSpecError
from ..models.dflash import ARCHITECTURE, DFlashModel, ModelArgs, load_dflash, spread_layer_ids
from .loop import (
    FeatureStore,
    LoopOptions,
    Trainer,
    TrainResult,
    cast_for_saving,
    layer_config,
    step_rng,
    train,
    write_checkpoint,
)


@dataclass
class DFlashOptions(LoopOptions):
    batch_size: int = 2
    lr: float = 6e-4
    layers: int = setting(2, "Drafter layers.", type=("IntRange", 1))
    block_size: int = setting(
        16,
        "Tokens per block: the anchor and the positions drafted from it in one pass.",
        type=("IntRange", 2),
    )
    target_layers: Optional[List[int]] = setting(
        None,
        "Tapped target layers (output of layer i), e.g. 1,8,14,20,27 (default: spread from 1 to N-3, "
        "one per drafter layer, as z-lab).",
        type=("IntList",),
    )
    blocks_per_sequence: int = setting(
        32, "Blocks (random anchors in the response) per sequence.", flag="--blocks", type=("IntRange", 1)
    )
    decay: float = setting(
        7.0, "Loss weight of block position i: exp(-(i-1)/decay).", type=("FloatRange", 0, None, True)
    )
    mask_token_id: Optional[int] = setting(
        None,
        "Token of the masked block positions (default: the tokenizer's unk token).",
        type=("IntRange", 0),
    )


# --- pieces (unit-tested) ----------------------------------------------------------------------


def position_weights(block_size: int, decay: float) -> np.ndarray:
    """Loss weight per block position: 0 for the anchor (given, not predicted), then
    exp(-(i-1)/decay) for i = 1..block_size-1 (1, e^(-1/decay), ...)."""
    w = np.zeros(block_size, np.float32)
    w[1:] = np.exp(-np.arange(block_size - 1) / decay)
    return w


def block_mask(
    anchors: Sequence[int], block_size: int, context_length: int, window: Optional[int] = None
) -> np.ndarray:
    """Boolean [N*B, context_length + N*B] (True = may attend) for blocks at `anchors`: the
    queries of block j see context positions < anchors[j] and every position of block j.
    window: a sliding-window layer's limit on the context (query position - key position <
    window), as models/dflash.py applies at inference."""
    anchors = np.asarray(anchors, np.int64)
    n, B = len(anchors), block_size
    block_of_row = np.repeat(np.arange(n), B)
    query_pos = (anchors[:, None] + np.arange(B)[None]).reshape(-1)
    keys = np.arange(context_length)
    context = keys[None] < anchors[block_of_row][:, None]
    if window is not None:
        context &= query_pos[:, None] - keys[None] < window
    own = block_of_row[:, None] == block_of_row[None]
    return np.concatenate([context, own], axis=1)


def sample_anchors(rng: np.random.Generator, prompt_length: int, length: int, count: int) -> np.ndarray:
    """Up to `count` distinct sorted anchors among prompt_length-1 .. length-2 (a block starts at
    the last prompt token or a response token, and predicts at least one token)."""
    candidates = np.arange(max(prompt_length - 1, 0), length - 1)
    if len(candidates) <= count:
        return candidates
    return np.sort(rng.choice(candidates, count, replace=False))


def block_sparse_forward(
    model: DFlashModel, context: mx.array, blocks: mx.array, anchors: mx.array, masks: Sequence[mx.array]
) -> mx.array:
    """All blocks of each sequence in one pass, composing the model's own modules.

    context [b, L, len(ids)*H]: target features of positions 0..L-1; blocks [b, N*B, H]: the
    target's embeddings of the block tokens; anchors [b, N] (int); masks: one per layer,
    [b, 1, N*B, L + N*B] bool (block_mask, with the layer's sliding window if it has one).
    Returns final-normed hidden states [b, N*B, H], equal to the inference forward of each
    block alone over the context before its anchor (the model lacks a multi-block hook)."""
    b, NB, _ = blocks.shape
    N = anchors.shape[1]
    B = NB // N
    offsets = anchors.reshape(-1)

    def rope_blocks(x, offset=0):
        # [b, heads, N*B, d] -> one rope call with a per-block start: anchor + arange(B)
        h, d = x.shape[1], x.shape[-1]
        y = x.reshape(b, h, N, B, d).transpose(0, 2, 1, 3, 4).reshape(b * N, h, B, d)
        y = model.rope(y, offset=offsets)
        return y.reshape(b, N, h, B, d).transpose(0, 2, 1, 3, 4).reshape(b, h, NB, d)

    ctx = model.hidden_norm(model.fc(context))
    h = blocks
    for layer, mask in zip(model.layers, masks):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_norm(attn.q_proj(x).reshape(b, NB, attn.n_heads, -1)).transpose(0, 2, 1, 3)
        context_k, context_v = attn.keys_values(ctx, model.rope, 0)
        block_k, block_v = attn.keys_values(x, rope_blocks, 0)
        keys = mx.concatenate([context_k, block_k], axis=2)
        values = mx.concatenate([context_v, block_v], axis=2)
        out = mx.fast.scaled_dot_product_attention(rope_blocks(q), keys, values, scale=attn.scale, mask=mask)
        h = h + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, NB, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


# --- the model ------------------------------------------------------------------------------------


def default_mask_token_id(target) -> int:
    """A token that never occurs in chat data: the tokenizer's unknown token (SmolLM2:
    <|endoftext|>), else the last id of the vocabulary."""
    unk = getattr(getattr(target, "tokenizer", None), "unk_token_id", None)
    return int(unk) if unk is not None and 0 <= unk < target.vocab_size else target.vocab_size - 1


def new_dflash_model(
    target,
    layers: int,
    block_size: int,
    target_layer_ids: Optional[Sequence[int]] = None,
    mask_token_id: Optional[int] = None,
) -> DFlashModel:
    """A freshly initialized drafter shaped like the target's layers (MLX's initializers: seed
    with mx.random.seed first)."""
    n = target.num_layers
    if layers < 1 or block_size < 2:
        raise MlxSpecError(f"DFlash needs --layers >= 1 and --block-size >= 2 (got {layers}, {block_size})")
    ids = list(target_layer_ids) if target_layer_ids else spread_layer_ids(n, layers)
    bad = [i for i in ids if not -1 <= i < n]
    if bad:
        raise MlxSpecError(
            f"--target-layers {bad[0]} is outside this target's layers -1..{n - 1} "
            "(i = output of layer i, -1 = the embedding)"
        )
    mask_token_id = default_mask_token_id(target) if mask_token_id is None else mask_token_id
    if not 0 <= mask_token_id < target.vocab_size:
        raise MlxSpecError(
            f"mask token id {mask_token_id} is outside the target's vocabulary ({target.vocab_size} tokens)"
        )
    if float(mx.abs(target.embed(mx.array([mask_token_id]))).max()) == 0:
        raise MlxSpecError(
            f"the target's embedding of mask token {mask_token_id} is all zeros: "
            "choose another with --mask-token-id"
        )
    args = ModelArgs(
        hidden_size=target.hidden_size,
        num_hidden_layers=layers,
        mask_token_id=int(mask_token_id),
        block_size=block_size,
        target_layer_ids=ids,
        **layer_config(target),
    )
    model = DFlashModel(args)
    mx.eval(model.parameters())
    return model


# --- loss and batches -----------------------------------------------------------------------------


def make_dflash_loss(target):
    def loss_fn(model, context, blocks, anchors, masks, labels, weights):
        """labels, weights [b, N, B-1]: the tokens after each anchor and their loss weights."""
        b, N, P = labels.shape
        hidden = block_sparse_forward(model, context, blocks, anchors, masks)
        hidden = hidden.reshape(b, N, P + 1, -1)[:, :, 1:]  # the anchor predicts nothing
        logits = target.lm_head(hidden).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")
        loss = (ce * weights).sum() / mx.maximum(weights.sum(), 1e-6)
        valid = weights > 0
        correct = (mx.argmax(logits, axis=-1) == labels) & valid
        blocks_used = mx.maximum(valid[..., 0].sum(), 1)
        accuracy = correct[..., 0].sum() / blocks_used
        # drafts of a block accepted under greedy verification: the correct prefix
        accepted = mx.cumprod(correct.astype(mx.float32), axis=-1).sum() / blocks_used
        return loss, {"accuracy": accuracy, "accepted": accepted}

    return loss_fn


def make_dflash_batch(
    target,
    model: DFlashModel,
    store: FeatureStore,
    sequences,
    rng,
    blocks_per_sequence: int,
    weights_by_position: np.ndarray,
):
    """(context, blocks, anchors, masks, labels, weights) for the sequences (see the module doc),
    padded to the same number of blocks (padding blocks have weight 0) and context length."""
    B, mask_id = model.args.block_size, model.args.mask_token_id
    anchors = [sample_anchors(rng, s.prompt_length, len(s.tokens), blocks_per_sequence) for s in sequences]
    N = max(1, max(len(a) for a in anchors))
    L = max(1, max(int(a.max()) if len(a) else 0 for a in anchors))  # context keys < anchor
    b = len(sequences)
    anchor_rows = np.zeros((b, N), np.int64)
    tokens = np.full((b, N, B), mask_id, np.int64)
    labels = np.zeros((b, N, B - 1), np.int64)
    weights = np.zeros((b, N, B - 1), np.float32)
    context = []
    for i, (seq, a) in enumerate(zip(sequences, anchors)):
        T, x = len(seq.tokens), np.array(seq.tokens)
        f = store.get(seq)[: min(L, T)]
        context.append(mx.pad(f, [(0, L - f.shape[0]), (0, 0)]) if f.shape[0] < L else f)
        k = len(a)
        anchor_rows[i, :k] = a
        anchor_rows[i, k:] = a[-1] if k else 0  # padding blocks: weight 0
        tokens[i, :k, 0] = x[a]
        where = a[:, None] + np.arange(1, B)[None]  # [k, B-1] positions of the labels
        labels[i, :k] = x[np.minimum(where, T - 1)]
        weights[i, :k] = weights_by_position[1:][None] * (where <= T - 1)
    by_window = {}
    for layer in model.layers:
        w = layer.self_attn.sliding_window
        if w not in by_window:
            by_window[w] = mx.array(np.stack([block_mask(r, B, L, w) for r in anchor_rows]))[:, None]
    masks = [by_window[layer.self_attn.sliding_window] for layer in model.layers]
    blocks = target.embed(mx.array(tokens.reshape(b, N * B))).astype(mx.float32)
    return (mx.stack(context), blocks, mx.array(anchor_rows), masks, mx.array(labels), mx.array(weights))


# --- the published checkpoint -------------------------------------------------------------------


def save_dflash(model: DFlashModel, target, path, dtype: str = "float32") -> Path:
    """z-lab's layout: a Qwen3-style config.json with architectures ["DFlashDraftModel"],
    block_size and dflash_config {mask_token_id, target_layer_ids}; model.safetensors with fc,
    hidden_norm, layers.N.*, norm (no embedding, no head: the target's)."""
    args, path = model.args, Path(path)
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": target.vocab_size,
        "num_target_layers": target.num_layers,
        "block_size": args.block_size,
        "dflash_config": {
            "mask_token_id": args.mask_token_id,
            "target_layer_ids": list(args.target_layer_ids),
        },
        "torch_dtype": dtype,
    }
    if args.rope_scaling:
        config["rope_scaling"] = args.rope_scaling
    return write_checkpoint(path, config, cast_for_saving(dict(tree_flatten(model.parameters())), dtype))


# --- the run -------------------------------------------------------------------------------------


class DFlashTrainer(Trainer):
    """Train a DFlash drafter (z-lab layout) against a frozen target."""

    kind = "dflash"
    options_class = DFlashOptions

    def check(self):
        o = self.options
        if o.blocks_per_sequence < 1 or not o.decay > 0:
            raise MlxSpecError("--blocks must be >= 1, --decay > 0")

    def new_model(self, sequences):
        o = self.options
        return new_dflash_model(self.target, o.layers, o.block_size, o.target_layers, o.mask_token_id)

    def load(self, path):  # its own shape, taps and mask token
        return load_dflash(path, self.target)

    def prepare(self, model):
        self.weights_by_position = position_weights(model.args.block_size, self.options.decay)
        self.loss_fn = make_dflash_loss(self.target)

    def drafter(self, model):
        return DFlashDrafter(self.target, model)

    def taps(self, model):
        return model.args.target_layer_ids

    def batch(self, model, store, sequences, step):
        o = self.options
        inputs = make_dflash_batch(
            self.target,
            model,
            store,
            sequences,
            step_rng(o.seed, step),
            o.blocks_per_sequence,
            self.weights_by_position,
        )
        return inputs, int(np.prod(inputs[1].shape[:2]))  # block positions

    def loss(self, model, *batch):
        return self.loss_fn(model, *batch)

    def architecture(self, model):
        args = model.args
        return {
            "hidden_size": self.target.hidden_size,
            "target_layers": self.target.num_layers,
            "layers": args.num_hidden_layers,
            "block_size": args.block_size,
            "target_layer_ids": list(args.target_layer_ids),
            "mask_token_id": args.mask_token_id,
        }

    def save(self, model, out_dir):
        return save_dflash(model, self.target, out_dir, self.options.save_dtype)


def train_dflash(target, data_dir, out_dir, options: Optional[DFlashOptions] = None, **run) -> TrainResult:
    """Train a DFlash drafter for `target` (z-lab's layout in out_dir); run: as loop.train's."""
    return train(DFlashTrainer(target, options or DFlashOptions()), data_dir, out_dir, **run)


TRAINER = DFlashTrainer  # what `mlx-spec train dflash` runs (cli/train.py)
