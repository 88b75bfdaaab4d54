"""The DFlash drafter (z-lab's "DFlashDraftModel"), loaded as published: a Hugging Face
directory with a Qwen3-style config.json and model.safetensors.

A few Qwen3 decoder layers fill a block [last verified token, mask, ..., mask] in one forward.
The target's hidden states (the tapped layers, concatenated) become context features
hidden_norm(fc(taps)); every draft layer attends from the block queries to
[k/v_proj(context) ; k/v_proj(block)], with no mask inside the block and a full view of the
context. RoPE positions are absolute: context 0..L-1, block L..L+block_size-1. The context
K/V never depend on the block, so only they are cached across rounds. There is no embedding
and no head here: the drafter uses the target's (head after the drafter's own `norm`).
"""

from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import MlxSpecError
from . import vocabulary
from .checkpoint import check_not_pickled, one_line, quantize_as_stored, read_config, read_weights

ARCHITECTURE = "DFlashDraftModel"


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    mask_token_id: int
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    block_size: int = 16
    target_layer_ids: Optional[List[int]] = None  # None: spread over the target (see load_dflash)
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None
    num_target_layers: Optional[int] = None  # the layers of the target it was trained on (z-lab's configs)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, params):
        # z-lab keeps the drafting fields in `dflash_config` (older configs at the top level);
        # transformers 5 moves rope_theta and the scaling into `rope_parameters`.
        merged = dict(params, **(params.get("dflash_config") or {}))
        rope = params.get("rope_parameters") or {}
        if "rope_theta" not in merged and "rope_theta" in rope:
            merged["rope_theta"] = rope["rope_theta"]
        if merged.get("rope_scaling") is None and rope:
            merged["rope_scaling"] = rope
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in merged]
        if missing:
            raise MlxSpecError(f"DFlash config.json lacks {', '.join(missing)}")
        return super().from_dict(merged)


def spread_layer_ids(num_target_layers: int, count: int) -> List[int]:
    """z-lab's default taps: `count` layers spread evenly from layer 1 to layer N-3 (rounded
    half to even, as Python's round does in z-lab's code: 30 layers, 5 taps -> 1 8 14 20 27)."""
    if count == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [int(round(first + i * (last - first) / (count - 1))) for i in range(count)]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, sliding_window: Optional[int]):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        head_dim, dim, bias = args.head_dim, args.hidden_size, args.attention_bias
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)

    def keys_values(self, x: mx.array, rope, offset: int):
        """Keys and values [1, kv_heads, n, head_dim] of x [1, n, H] at positions offset.."""
        B, n, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(B, n, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(keys, offset=offset), values

    def __call__(self, x: mx.array, cache: KVCache, rope) -> mx.array:
        B, L, _ = x.shape
        offset = cache.offset  # the block sits right after the cached context
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        queries = rope(queries, offset=offset)
        keys, values = self.keys_values(x, rope, offset)
        mask = None
        if offset:
            # Context keys a sliding window cannot reach for any block query are not read.
            start = 0 if self.sliding_window is None else max(0, offset - self.sliding_window + 1)
            keys = mx.concatenate([cache.keys[..., start:offset, :], keys], axis=2)
            values = mx.concatenate([cache.values[..., start:offset, :], values], axis=2)
            if self.sliding_window is not None:
                query_pos = offset + mx.arange(L)[:, None]
                key_pos = mx.arange(start, offset + L)[None]
                mask = (key_pos >= offset) | (query_pos - key_pos < self.sliding_window)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, sliding_window: Optional[int]):
        super().__init__()
        self.self_attn = Attention(args, sliding_window)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache, rope) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache, rope)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    rows = None  # vocabulary.OutputRows of a reduced draft vocabulary; None: the target's lm_head

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        H = args.hidden_size
        self.fc = nn.Linear(len(args.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        layer_types = args.layer_types or ["full_attention"] * args.num_hidden_layers
        self.layers = [
            DecoderLayer(args, args.sliding_window if layer_types[i] == "sliding_attention" else None)
            for i in range(args.num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            args.head_dim, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
        )

    def use_vocabulary(self, ids, target) -> None:
        """Draft over the target ids `ids` only, with those rows of the target's output layer."""
        self.rows = vocabulary.OutputRows([target.output_layer], ids)

    @property
    def draft_ids(self) -> Optional[mx.array]:
        return None if self.rows is None else self.rows.ids

    def make_cache(self) -> List[KVCache]:
        """One context K/V cache per layer: chunk-grown, rolled back by offset."""
        return [KVCache() for _ in self.layers]

    def append_context(self, taps: mx.array, cache: List[KVCache]) -> None:
        """Cache the K/V of the next context positions; taps [1, n, len(ids) * H] are the
        target's tapped hidden states concatenated in target_layer_ids order."""
        context = self.hidden_norm(self.fc(taps))
        for layer, c in zip(self.layers, cache):
            c.update_and_fetch(*layer.self_attn.keys_values(context, self.rope, c.offset))

    def __call__(self, block: mx.array, cache: List[KVCache]) -> mx.array:
        """block [1, B, H]: the target's embeddings of the block tokens, placed right after
        the cached context -> final-normed hidden states [1, B, H] (for the target's lm_head)."""
        h = block
        for layer, c in zip(self.layers, cache):
            h = layer(h, c, self.rope)
        return self.norm(h)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        # Some exports nest everything under `model.` and carry rotary buffers (recomputed here).
        return {k.removeprefix("model."): v for k, v in weights.items() if "rotary_emb" not in k}


def _read_config(path: Path) -> dict:
    config = read_config(path, "DFlash drafter")
    if ARCHITECTURE not in (config.get("architectures") or []):
        raise MlxSpecError(
            f"not a DFlash drafter: {path}/config.json has architectures "
            f'{config.get("architectures")}, expected ["{ARCHITECTURE}"]'
        )
    return config


def _check(args: ModelArgs, target) -> None:
    """The config is consistent, and the drafter fits this target."""
    if args.block_size < 2:
        raise MlxSpecError(f"DFlash block size must be >= 2, got {args.block_size}")
    if args.layer_types is not None and len(args.layer_types) != args.num_hidden_layers:
        raise MlxSpecError(
            f"DFlash config.json has {len(args.layer_types)} layer_types for {args.num_hidden_layers} layers"
        )
    if "sliding_attention" in (args.layer_types or []) and not args.sliding_window:
        raise MlxSpecError("DFlash config.json has sliding_attention layers but no sliding_window")
    if args.num_target_layers is not None and args.num_target_layers != target.num_layers:
        raise MlxSpecError(
            f"this DFlash drafter was trained on a target of {args.num_target_layers} layers; "
            f"this one has {target.num_layers}"
        )
    if args.hidden_size != target.hidden_size:
        raise MlxSpecError(
            f"DFlash drafter hidden size {args.hidden_size} does not match the target's {target.hidden_size}"
        )
    for i in args.target_layer_ids:
        if not -1 <= i < target.num_layers:
            raise MlxSpecError(
                f"DFlash drafter taps target layer {i}, but the target has "
                f"{target.num_layers} layers (0..{target.num_layers - 1})"
            )
    if not 0 <= args.mask_token_id < target.vocab_size:
        raise MlxSpecError(
            f"DFlash mask token id {args.mask_token_id} is outside the target's "
            f"vocabulary ({target.vocab_size} tokens)"
        )


def load_dflash(path, target) -> DFlashModel:
    """Load a z-lab DFlash drafter directory for `target` (a models.target.Target)."""
    path = Path(path)
    config = _read_config(path)
    args = ModelArgs.from_dict(config)
    if args.target_layer_ids is None:
        args.target_layer_ids = spread_layer_ids(target.num_layers, args.num_hidden_layers)
    check_not_pickled(path)
    _check(args, target)
    model = DFlashModel(args)
    weights = model.sanitize(read_weights(path))
    try:
        quantize_as_stored(model, config, weights)
        model.load_weights(list(weights.items()), strict=True)
    except Exception as e:  # mlx raises several types for mismatched weights
        raise MlxSpecError(f"cannot load DFlash drafter {path}: {one_line(e)}") from None
    # Compute in the dtype of the target's hidden states (bf16 checkpoints on an fp32 CPU target).
    model.set_dtype(target.embed(mx.array([0])).dtype)
    mx.eval(model.parameters())
    ids = vocabulary.read(path, target.vocab_size)
    if ids is not None:
        model.use_vocabulary(ids, target)
    return model
