"""The EAGLE-3 draft layer, loaded as SafeAILab and vLLM speculators publish it.

One Llama decoder layer whose attention reads 2H-wide inputs [input_layernorm(embed(token)) ;
hidden_norm(hidden)], where `hidden` is either fc(concatenated target features) or the layer's
own pre-norm output of the previous draft step. Its head covers a reduced draft vocabulary
that maps to target ids through d2t: target_id = i + d2t[i].

Layouts: SafeAILab names the layer `midlayer.*` under a flat Llama config with
`draft_vocab_size` (and optionally `target_hidden_size`); speculators names it `layers.0.*`,
nests the Llama config in `transformer_layer_config` (only the fields that differ from
LlamaConfig's defaults) and adds `norm_before_residual` and `eagle_aux_hidden_state_layer_ids`.
Both ids conventions name the INPUT of a target layer: tap = id - 1 here (DESIGN.md).
"""

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.llama import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import MlxSpecError
from . import vocabulary
from .checkpoint import one_line, quantize_as_stored, read_config, read_weights


@dataclass
class ModelArgs:
    # Defaults are transformers' LlamaConfig defaults (speculators omits fields equal to
    # them), except the number of layers: EAGLE-3 has one.
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 1
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    mlp_bias: bool = False
    vocab_size: int = 32000  # the target's vocabulary
    draft_vocab_size: Optional[int] = None  # the head's; None = vocab_size
    target_hidden_size: Optional[int] = None  # None = hidden_size
    norm_before_residual: bool = False
    # Fused target layers in the EAGLE/vLLM convention (input of layer i); None = (2, N//2, N-3).
    aux_layer_ids: Optional[List[int]] = None
    # Facts about the checkpoint's weights rather than its config.
    fc_bias: bool = False
    has_embedding: bool = False

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.draft_vocab_size = self.draft_vocab_size or self.vocab_size
        self.target_hidden_size = self.target_hidden_size or self.hidden_size

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        """Either layout's config.json."""
        kind = config.get("speculators_model_type")
        if kind is not None and kind != "eagle3":
            raise MlxSpecError(f"speculators model type {kind!r} is not EAGLE-3")
        layer = config.get("transformer_layer_config", {}) if kind else config
        args = dict(layer)
        rope = layer.get("rope_parameters")  # transformers >= 5 nests rope_theta here
        if rope and "rope_theta" not in layer:
            args["rope_theta"] = rope.get("rope_theta", cls.rope_theta)
            if rope.get("rope_type", "default") != "default":
                args.setdefault("rope_scaling", rope)
        for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual"):
            if config.get(key) is not None:
                args[key] = config[key]
        if kind:  # vLLM, which serves speculators checkpoints, reads a missing one as True
            args.setdefault("norm_before_residual", True)
        nested = config.get("eagle_config") or {}  # where some HF-style exports put the ids
        args["aux_layer_ids"] = config.get("eagle_aux_hidden_state_layer_ids") or nested.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in args.items() if k in names})


def default_layer_ids(num_layers: int) -> List[int]:
    """EAGLE-3's low, middle and high features: the inputs of layers 2, N//2 and N-3."""
    return [2, num_layers // 2, num_layers - 3]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = args.head_dim**-0.5
        width, bias = 2 * args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(width, self.n_heads * args.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.n_kv_heads * args.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.n_kv_heads * args.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * args.head_dim, args.hidden_size, bias=bias)
        self.rope = initialize_rope(
            args.head_dim, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
        )

    def _rotate(self, x, offset, positions):
        if positions is None:
            return self.rope(x, offset=offset)
        # One position per row: the rows become the batch, whose offsets every rope variant
        # of mlx-lm passes to mx.fast.rope as a vector.
        return self.rope(x.transpose(2, 1, 0, 3), offset=positions).transpose(2, 1, 0, 3)

    def __call__(self, x, cache, positions=None, mask=None):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = self._rotate(q, cache.offset, positions)
        k = self._rotate(k, cache.offset, positions)
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm_before_residual = args.norm_before_residual
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, embeds, hidden, cache, positions=None, mask=None):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        h = residual + self.self_attn(x, cache, positions, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    """The draft layer with its fc, final norm, head and d2t: a FeatureDraftModel
    (drafters/eagle.py) that drafts trees too. `target_embed` embeds tokens when the checkpoint
    has no `embed_tokens` of its own (the usual case)."""

    supports_tree = True

    def __init__(self, args: ModelArgs, target_embed: Optional[Callable] = None):
        super().__init__()
        self.args = args
        if args.has_embedding:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self._target_embed = target_embed
        n_fused = len(args.aux_layer_ids) if args.aux_layer_ids else 3  # low, middle, high
        self.fc = nn.Linear(n_fused * args.target_hidden_size, args.hidden_size, bias=args.fc_bias)
        self.midlayer = DecoderLayer(args)
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.draft_vocab_size, bias=False)
        self.d2t = mx.zeros((args.draft_vocab_size,), mx.int32)

    # --- pieces a drafter combines (chain or tree) -----------------------------------------
    @property
    def taps(self) -> List[int]:
        """The target taps to fuse, in fc's order (DESIGN.md convention: output of layer i).
        SafeAILab and vLLM both collect them while running the layers: in ascending order."""
        return [i - 1 for i in sorted(self.args.aux_layer_ids)]

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens) if self.args.has_embedding else self._target_embed(tokens)

    def fuse(self, features: mx.array) -> mx.array:
        """[..., n_fused * target H] concatenated target taps -> the layer's hidden input."""
        return self.fc(features)

    def __call__(
        self,
        embeds: mx.array,
        hidden: mx.array,
        cache: List[KVCache],
        positions: Optional[mx.array] = None,
        mask=None,
    ) -> mx.array:
        """embeds, hidden [1, n, H] -> the layer's pre-norm output [1, n, H] (fed back as the
        next step's hidden). positions [n] (int) default to cache.offset + arange(n); mask
        defaults to causal; a tree passes both (node depths, ancestors + cached prefix)."""
        if mask is None and embeds.shape[1] > 1:
            mask = "causal"
        return self.midlayer(embeds, hidden, cache[0], positions, mask)

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def to_target(self, draft_ids: mx.array) -> mx.array:
        return draft_ids + self.d2t[draft_ids]

    @property
    def draft_vocab_size(self) -> int:
        return self.args.draft_vocab_size

    @property
    def draft_ids(self) -> mx.array:
        """The target id of each column of the head."""
        return self.to_target(mx.arange(self.args.draft_vocab_size))

    @staticmethod
    def make_cache() -> List[KVCache]:
        return [KVCache()]

    # --- weights -----------------------------------------------------------------------------
    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, w in weights.items():
            if name == "t2d":  # the reverse mask; d2t says everything needed
                continue
            if name.startswith("layers.0."):  # speculators' name for the layer
                name = "midlayer." + name[len("layers.0.") :]
            out[name] = w.astype(mx.int32) if name == "d2t" else w
        if "d2t" not in out and self.args.draft_vocab_size == self.args.vocab_size:
            out["d2t"] = self.d2t  # same vocabulary: the identity
        return out


def _check_against_target(args: ModelArgs, weights: dict, target, path: Path, bits=None) -> None:
    n = target.num_layers
    if args.num_hidden_layers != 1:
        raise MlxSpecError(
            f"{path}: EAGLE-3 with {args.num_hidden_layers} draft layers is not supported (1 expected)"
        )
    if args.hidden_act != "silu":
        raise MlxSpecError(f"{path}: activation {args.hidden_act!r} is not supported (silu expected)")
    for i in args.aux_layer_ids:
        if not 0 <= i <= n:
            raise MlxSpecError(
                f"{path}: fuses target layer {i}, outside this target's {n} layers "
                f"(layer ids name layer inputs: 0..{n})"
            )
    if not args.has_embedding and args.hidden_size != target.hidden_size:
        raise MlxSpecError(
            f"{path}: hidden size {args.hidden_size} differs from the target's "
            f"{target.hidden_size} and the checkpoint has no embed_tokens of its own"
        )
    fc_in = weights["fc.weight"].shape[1] if "fc.weight" in weights else None
    if fc_in is not None and "fc.scales" in weights:  # quantized: `bits`-bit values packed in uint32
        fc_in = fc_in * 32 // bits
    fused_width = len(args.aux_layer_ids) * target.hidden_size
    if args.target_hidden_size != target.hidden_size or fc_in not in (None, fused_width):
        raise MlxSpecError(
            f"{path}: its fc fuses {len(args.aux_layer_ids)} features of width "
            f"{args.target_hidden_size} (fc input {fc_in}); this target's hidden size is "
            f"{target.hidden_size}"
        )
    if args.vocab_size != target.vocab_size:
        raise MlxSpecError(
            f"{path}: trained for a {args.vocab_size}-token vocabulary; the target's has {target.vocab_size}"
        )
    if "d2t" not in weights:
        raise MlxSpecError(
            f"{path}: draft vocabulary of {args.draft_vocab_size} tokens but no d2t mapping to the target's"
        )
    if weights["d2t"].shape != (args.draft_vocab_size,):
        raise MlxSpecError(
            f"{path}: d2t has shape {tuple(weights['d2t'].shape)}, the draft vocabulary "
            f"{args.draft_vocab_size} tokens"
        )
    vocabulary.ids_from_d2t(weights["d2t"], target.vocab_size, path)


def load_eagle3(path, target) -> Model:
    """Load an EAGLE-3 checkpoint directory (either layout) for `target`, in the target's
    activation dtype. Every mismatch with the target is a one-line MlxSpecError."""
    path = Path(path)
    config = read_config(path, "EAGLE-3 drafter")
    try:
        args = ModelArgs.from_config(config)
    except (TypeError, AttributeError) as e:
        raise MlxSpecError(f"corrupt config.json in {path}: {one_line(e)}") from None
    args.aux_layer_ids = args.aux_layer_ids or default_layer_ids(target.num_layers)
    raw = read_weights(path)
    args.fc_bias = "fc.bias" in raw
    args.has_embedding = "embed_tokens.weight" in raw
    model = Model(args, target_embed=target.embed)
    weights = model.sanitize(raw)
    _check_against_target(args, weights, target, path, (config.get("quantization") or {}).get("bits"))
    try:
        quantize_as_stored(model, config, weights)
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise MlxSpecError(f"cannot load EAGLE-3 weights from {path}: {one_line(e)}") from None
    model.set_dtype(target.embed(mx.array([0])).dtype)  # the target's activations
    mx.eval(model.parameters())
    return model
