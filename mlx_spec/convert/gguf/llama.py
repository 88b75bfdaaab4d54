"""The llama architecture of GGUF files: its config (hyperparameters, rope scaling) and its
tensors under mlx-lm's names (llama.cpp's attn_q / attn_k row permutation undone)."""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from mlx_spec.errors import MlxSpecError

from .reader import GGUF_GROUP_SIZE, _Tensors, md_int

# GGUF tensor base name (after "blk.N.") -> mlx-lm module path (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp keeps that an mlx-lm model does not need as weights.
_CONFIG_ONLY_TENSORS = {"rope_freqs"}


def _bits_of(weight: mx.array, scales: mx.array) -> int:
    # packed uint32 columns * 32 bits == in_features * bits; in_features = groups * group size
    return (weight.shape[-1] * 32) // (scales.shape[-1] * GGUF_GROUP_SIZE)


def _llama3_rope_factors(dims, base, factor, low, high, orig):
    periods = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelens = 2 * np.pi * periods
    low_wl, high_wl = orig / low, orig / high
    smooth = (orig / wavelens - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelens > low_wl, factor, np.where(wavelens < high_wl, 1.0, medium))


def _rope_scaling_from_freqs(rope_freqs: np.ndarray, dims: int, base: float, context: int):
    """Llama 3.x stores its RoPE scaling as per-frequency factors; recover mlx-lm's 'llama3'."""
    factors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if factors.shape[0] != dims // 2:
        raise MlxSpecError(f"unsupported rope_freqs tensor of shape {tuple(rope_freqs.shape)}")
    if np.allclose(factors, 1.0):
        return None
    factor = float(np.round(factors.max(), 4))
    for orig in (8192, 4096, 2048, 16384, 32768, context):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):
            want = _llama3_rope_factors(dims, base, factor, low, high, orig)
            if np.allclose(want, factors, rtol=1e-3, atol=1e-4):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": orig,
                }
    raise MlxSpecError("unsupported GGUF rope_freqs: not a Llama 3 style RoPE scaling")


def _required_int(md: Dict[str, Any], key: str) -> int:
    v = md_int(md, key)
    if v is None:
        raise MlxSpecError(f"GGUF metadata lacks {key}")
    return v


def _f32(v: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99e-06)."""
    return float(f"{float(v):.7g}")


def llama_config(md: Dict[str, Any], tensors: _Tensors) -> Dict[str, Any]:
    a = "llama"
    if md.get(f"{a}.expert_count"):
        raise MlxSpecError("unsupported GGUF model: llama with experts (MoE)")
    hidden = _required_int(md, f"{a}.embedding_length")
    n_layers = _required_int(md, f"{a}.block_count")
    n_heads = _required_int(md, f"{a}.attention.head_count")
    n_kv = md_int(md, f"{a}.attention.head_count_kv", n_heads)
    ffn = _required_int(md, f"{a}.feed_forward_length")
    head_dim = md_int(md, f"{a}.attention.key_length", hidden // n_heads)
    if md_int(md, f"{a}.attention.value_length", head_dim) != head_dim:
        raise MlxSpecError("unsupported GGUF model: key and value head sizes differ")
    n_rot = md_int(md, f"{a}.rope.dimension_count", head_dim)
    if n_rot != head_dim:
        raise MlxSpecError(f"unsupported GGUF model: RoPE on {n_rot} of {head_dim} head dims")
    rope_theta = _f32(md.get(f"{a}.rope.freq_base", 10000.0))
    context = md_int(md, f"{a}.context_length", 2048)

    names = set(tensors.names())
    if "token_embd" not in names:
        raise MlxSpecError("GGUF file has no token_embd tensor")
    vocab = md_int(md, f"{a}.vocab_size")
    if vocab is None:
        vocab = tensors.shape("token_embd")[0]

    config: Dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "intermediate_size": ffn,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(md.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "rope_traditional": False,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "tie_word_embeddings": "output" not in names,
        "attention_bias": "bias" in tensors.params("blk.0.attn_q"),
        "mlp_bias": "bias" in tensors.params("blk.0.ffn_up"),
        "hidden_act": "silu",
    }

    scaling_type = md.get(f"{a}.rope.scaling.type")
    scaling_factor = md.get(f"{a}.rope.scaling.factor")
    if scaling_type == "linear" and scaling_factor not in (None, 0.0, 1.0):
        config["rope_scaling"] = {"type": "linear", "factor": _f32(scaling_factor)}
    elif scaling_type not in (None, "none", "linear"):
        raise MlxSpecError(f"unsupported GGUF RoPE scaling: {scaling_type}")
    if "rope_freqs" in names:
        freqs = np.array(tensors.get("rope_freqs")["weight"].astype(mx.float32))
        scaling = _rope_scaling_from_freqs(freqs, head_dim, rope_theta, context)
        if scaling is not None:
            if "rope_scaling" in config:
                raise MlxSpecError("unsupported GGUF RoPE scaling: linear and rope_freqs at once")
            config["rope_scaling"] = scaling

    if md.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(md["tokenizer.ggml.bos_token_id"])
    if md.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = int(md["tokenizer.ggml.padding_token_id"])
    eos_ids: List[int] = []
    for kind in ("eos", "eot", "eom"):
        i = md.get(f"tokenizer.ggml.{kind}_token_id")
        if i is not None and int(i) not in eos_ids:
            eos_ids.append(int(i))
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return config


def _mlx_module_path(base: str, n_layers: int) -> Optional[str]:
    if base in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[base]
    if base in _CONFIG_ONLY_TENSORS:
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_TENSORS and int(m.group(1)) < n_layers:
        return f"model.layers.{int(m.group(1))}.{_LAYER_TENSORS[m.group(2)]}"
    raise MlxSpecError(f"unexpected tensor in llama GGUF file: {base}")


def _unpermute_rows(a: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's RoPE row permutation of attn_q / attn_k (rows = axis 0)."""
    rows = a.shape[0]
    if rows % (2 * n_head):
        raise MlxSpecError(f"cannot un-permute {rows} rows over {n_head} heads")
    half = rows // n_head // 2
    rest = tuple(a.shape[1:])
    return a.reshape((n_head, half, 2) + rest).swapaxes(1, 2).reshape(a.shape)


def _convert_tensor(
    parts: Dict[str, mx.array], target, dequantized_src: bool
) -> Tuple[Dict[str, mx.array], Optional[Dict[str, int]]]:
    """Apply the dtype policy to one tensor. Returns (params, quantization or None).

    target None ("keep"): packed triples stay packed; float tensors keep their stored dtype
    (llama.cpp stores norms in float32, which keeps activations in float32: on the MLX CPU
    backend float16 activations are ~30x slower); tensors the gguf package had to dequantize
    become float16.
    """
    if "scales" in parts:  # MLX affine triple (from mx.load)
        w, s, b = parts["weight"], parts["scales"], parts["biases"]
        bits = _bits_of(w, s)
        if target is None:
            return dict(parts), {"group_size": GGUF_GROUP_SIZE, "bits": bits}
        deq = mx.dequantize(
            w,
            s.astype(mx.float32),
            b.astype(mx.float32),
            group_size=GGUF_GROUP_SIZE,
            bits=bits,
        )
        out = {"weight": deq.astype(target)}
        if "bias" in parts:
            out["bias"] = parts["bias"].astype(target)
        return out, None
    if target is None and dequantized_src:
        target = mx.float16
    if target is None:
        return dict(parts), None
    return {k: v.astype(target) for k, v in parts.items()}, None


def llama_weights(
    tensors: _Tensors,
    config: Dict[str, Any],
    target,
    quantize: bool,
    q_bits: int,
    q_group_size: int,
    progress: Optional[Callable[[int, int], None]] = None,
):
    """The model's weights under mlx-lm's names, and the quantization of those kept packed or
    re-quantized: (weights, {module: {bits, group_size}}). target: the dtype (None: "keep")."""
    names = tensors.names()

    n_layers = config["num_hidden_layers"]
    weights: Dict[str, mx.array] = {}
    quant: Dict[str, Dict[str, int]] = {}
    total = len(names)
    for i, base in enumerate(names):
        module = _mlx_module_path(base, n_layers)
        if module is not None:
            parts = tensors.get(base)
            n_head = None
            if base.endswith(".attn_q"):
                n_head = config["num_attention_heads"]
            elif base.endswith(".attn_k"):
                n_head = config["num_key_value_heads"]
            if n_head is not None:
                parts = {k: _unpermute_rows(v, n_head) for k, v in parts.items()}
            # quantized in the file but not handed back packed: already dequantized
            dequantized = tensors.quantized(base) and not tensors.packed(base)
            out, q = _convert_tensor(parts, target, dequantized)
            w = out.get("weight")
            if quantize and q is None and w is not None and w.ndim == 2 and w.shape[-1] % q_group_size == 0:
                out["weight"], out["scales"], out["biases"] = mx.quantize(
                    w, group_size=q_group_size, bits=q_bits
                )
                q = {"group_size": q_group_size, "bits": q_bits}
            for k, v in out.items():
                weights[f"{module}.{k}"] = v
            if q is not None:
                quant[module] = q
            mx.eval(list(out.values()))
        if progress is not None:
            progress(i + 1, total)

    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(n_layers):
        for mod in _LAYER_TENSORS.values():
            expected.add(f"model.layers.{layer}.{mod}.weight")
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    missing = sorted(expected - set(weights))
    if missing:
        more = " ..." if len(missing) > 3 else ""
        raise MlxSpecError(f"GGUF file lacks tensors: {', '.join(missing[:3])}{more}")

    return weights, quant
