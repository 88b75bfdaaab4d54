"""GGUF (llama.cpp) -> MLX model directory that `mlx_lm.load` reads.

What is written into the target directory:

- ``config.json``: an mlx-lm / Hugging Face style config (``model_type: llama``) with an mlx-lm
  ``"quantization"`` entry when tensors stay packed (``dtype="keep"``);
- ``model.safetensors``: weights under mlx-lm's names;
- ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``: a `tokenizers`
  tokenizer rebuilt from the GGUF metadata (vocabulary, merges, pre-tokenizer, special tokens,
  chat template);
- ``mlx_spec_conversion.json``: where the weights came from (source file, dtype, converter
  version), so a cached conversion can be checked.

Reading: the GGUF header (metadata, tensor table) is read with the gguf package's reader; each
tensor is checked to lie inside the file. When all tensors are F32 / F16 / Q4_0 / Q4_1 / Q8_0, ``mx.load``
reads them, the quantized ones as MLX affine triples (``.weight`` uint32, ``.scales``,
``.biases``; group size 32). Any other type (K-quants such as Q4_K / Q6_K, Q5_0, BF16, IQ*)
makes the whole file go through ``gguf.quants.dequantize`` instead. Note: mx.load (MLX 0.32)
accepts Q4_K without an error but returns wrong values for it, so the choice is made from
the tensor types, never from whether mx.load raises.

llama.cpp stores the rows of Llama ``attn_q`` / ``attn_k`` permuted for its RoPE layout; they are
put back in Hugging Face order here (for packed tensors the rows of weight, scales and biases
alike).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

import mlx_spec  # noqa: F401  (loads an optimized BLAS before mlx.core)
import mlx.core as mx

from mlx_spec.convert.output import CONVERSION_INFO_FILE, check_output, write_dir, write_json
from mlx_spec.errors import MlxSpecError

__all__ = [
    "DTYPES",
    "CONVERTER_VERSION",
    "CONVERSION_INFO_FILE",
    "REQUIRED_FILES",
    "convert_gguf",
    "read_gguf_metadata",
    "build_tokenizer",
    "is_converted_model",
]

# Bump when the output of convert_gguf changes in a way that makes old conversions stale.
CONVERTER_VERSION = 1
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    CONVERSION_INFO_FILE,
)

DTYPES = {
    "keep": None,
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}

# GGUF packs Q4_0 / Q4_1 / Q8_0 in blocks of 32 values; mx.load keeps that as the group size.
GGUF_GROUP_SIZE = 32

SUPPORTED_ARCHITECTURES = ("llama",)

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

# GGUF token types (llama.cpp's llama_token_type)
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 2, 3, 4
_TOKEN_UNUSED, _TOKEN_BYTE = 5, 6

# Pre-tokenizer regexes (what `tokenizer.ggml.pre` names), written for `tokenizers`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# pre name -> (kind, regex); kind: "bytelevel" (GPT-2 regex), "digits" (each digit alone, then
# the GPT-2 regex), "split" (a custom regex, then byte-level mapping without the GPT-2 regex)
_PRE_TOKENIZERS = {
    "default": ("bytelevel", None),
    "gpt2": ("bytelevel", None),
    "gpt-2": ("bytelevel", None),
    "smollm": ("digits", None),
    "starcoder": ("digits", None),
    "refact": ("digits", None),
    "llama-bpe": ("split", _LLAMA3_SPLIT),
    "llama3": ("split", _LLAMA3_SPLIT),
    "qwen2": ("split", _QWEN2_SPLIT),
}
# Pre-tokenizers for which llama.cpp does not apply BPE merges to a word already in the vocab.
_IGNORE_MERGES_PRE = {"llama-bpe", "llama3"}

ProgressFn = Callable[[int, int], None]


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

# ggml tensor types by number, with (values per block, bytes per block)
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16, _F64 = 0, 1, 2, 3, 8, 30, 28
_FLOAT_TYPES = {_F32, _F16, _BF16, _F64}
# Types mx.load hands back exactly: floats and the packed affine triples. (mx.load also
# accepts Q2_K / Q4_K / Q6_K / BF16, converting them to float16, but its Q4_K values are
# wrong in MLX 0.32 and BF16 loses range: those go through the gguf package.)
_MX_TYPES = {_F32, _F16, _Q4_0, _Q4_1, _Q8_0}
_MX_PACKED_TYPES = {_Q4_0, _Q4_1, _Q8_0}


class _TensorInfo:
    __slots__ = ("name", "shape", "qtype", "offset", "nbytes")

    def __init__(self, name, shape, qtype, offset, nbytes):
        self.name, self.shape, self.qtype, self.offset, self.nbytes = (
            name, shape, qtype, offset, nbytes)

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"type {self.qtype}"


def _check_file(path: Path) -> None:
    if not path.exists():
        raise MlxSpecError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise MlxSpecError(f"not a file: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise MlxSpecError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise MlxSpecError(f"not a GGUF file (bad magic number): {path}")


def _read_header(path: Path) -> Tuple[Dict[str, Any], List[_TensorInfo]]:
    """Metadata and tensor table of a GGUF file (v2/v3), read with the gguf package's reader
    (a memory map: only the header is read), every tensor checked to lie inside the file."""
    import gguf

    _check_file(path)
    try:
        size = path.stat().st_size
        reader = gguf.GGUFReader(str(path), "r")
        metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
        tables = [(t.name, tuple(reversed([int(d) for d in t.shape])), int(t.tensor_type), int(t.data_offset))
                  for t in reader.tensors]
    except OSError as e:
        raise MlxSpecError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, UnicodeDecodeError) as e:
        # the reader's own words: a version other than 2 and 3, a table past the end, ...
        raise MlxSpecError(f"truncated or corrupt GGUF file ({_one_line(e)}): {path}") from None
    infos = []
    for name, shape, qtype, offset in tables:
        if qtype not in gguf.GGML_QUANT_SIZES:
            raise MlxSpecError(f"unknown GGUF tensor type {qtype} for {name}: {path}")
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if shape and shape[-1] % block:
            raise MlxSpecError(f"corrupt GGUF file {path}: tensor {name} has a partial block")
        info = _TensorInfo(name, shape, qtype, offset, n // block * block_bytes)
        if info.offset + info.nbytes > size:
            raise MlxSpecError(
                f"truncated GGUF file (tensor {name} extends past the end): {path}"
            )
        infos.append(info)
    return metadata, infos


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    msg = msg[0] if msg else type(e).__name__
    return re.sub(r"^\[[a-z_]+\]\s*", "", msg)


class _Tensors:
    """A GGUF file's tensors grouped per base name ("blk.0.attn_q" -> weight, bias).

    Q4_0 / Q4_1 / Q8_0 tensors come from mx.load as MLX affine triples ("weight" uint32,
    "scales", "biases"; group size 32) when mx.load can read the whole file; every other
    type is read from the file and dequantized with the gguf package.
    """

    def __init__(self, path: Path, infos: List[_TensorInfo]):
        self.path = path
        self._infos: Dict[str, Dict[str, _TensorInfo]] = {}
        for info in infos:
            base, _, suffix = info.name.rpartition(".")
            if not base or suffix not in ("weight", "bias"):
                raise MlxSpecError(f"unexpected tensor name in GGUF file: {info.name}")
            self._infos.setdefault(base, {})[suffix] = info
        self._mx: Optional[Dict[str, mx.array]] = None
        types = {i.qtype for i in infos}
        if types & _MX_PACKED_TYPES and types <= _MX_TYPES:
            try:
                self._mx = mx.load(str(path))
            except Exception as e:  # noqa: BLE001  (RuntimeError / ValueError from mx.load)
                raise MlxSpecError(f"cannot read GGUF file {path}: {_one_line(e)}") from None
        self._data = None

    @property
    def reader(self) -> str:
        return "mlx" if self._mx is not None else "gguf"

    def names(self) -> List[str]:
        return list(self._infos)

    def params(self, base: str) -> set:
        """Which parameters ("weight", "bias") a tensor has; empty when absent."""
        return set(self._infos.get(base, ()))

    def quantized(self, base: str) -> bool:
        """Whether the file stores this tensor in a quantized type."""
        return any(i.qtype not in _FLOAT_TYPES for i in self._infos[base].values())

    def packed(self, base: str) -> bool:
        """Whether get() returns it as an MLX affine triple."""
        return self._mx is not None and self._infos[base]["weight"].qtype in _MX_PACKED_TYPES

    def shape(self, base: str) -> Tuple[int, ...]:
        """Logical shape of the ".weight" tensor, rows first."""
        return self._infos[base]["weight"].shape

    def get(self, base: str) -> Dict[str, mx.array]:
        out = {}
        for suffix, info in self._infos[base].items():
            if self._mx is not None:
                for part in (suffix, "scales", "biases") if suffix == "weight" else (suffix,):
                    key = f"{base}.{part}"
                    if key in self._mx:
                        out[part] = self._mx[key]
            else:
                out[suffix] = self._read(info)
        return out

    def _read(self, info: _TensorInfo) -> mx.array:
        import gguf

        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._data[info.offset : info.offset + info.nbytes]
        shape = info.shape or (1,)
        if info.qtype == _F32:
            return mx.array(raw.view(np.float32).reshape(shape))
        if info.qtype == _F16:
            return mx.array(raw.view(np.float16).reshape(shape))
        if info.qtype == _F64:
            return mx.array(raw.view(np.float64).astype(np.float32).reshape(shape))
        rows = raw.reshape(int(np.prod(shape[:-1], dtype=np.int64)), -1)
        try:
            values = gguf.quants.dequantize(np.asarray(rows), info.qtype)
        except NotImplementedError:
            raise MlxSpecError(
                f"unsupported GGUF tensor type {info.type_name} for {info.name}"
            ) from None
        arr = mx.array(np.asarray(values, dtype=np.float32).reshape(shape))
        return arr.astype(mx.bfloat16) if info.qtype == _BF16 else arr


def _open_gguf(path: Path) -> Tuple[Dict[str, Any], _Tensors]:
    metadata, infos = _read_header(path)
    return metadata, _Tensors(path, infos)


def read_gguf_metadata(gguf_path) -> Dict[str, Any]:
    """All metadata of a GGUF file as plain Python values (reads the header only;
    MlxSpecError on a bad file)."""
    metadata, _ = _read_header(Path(gguf_path).expanduser())
    return metadata


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


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


def _int(md: Dict[str, Any], key: str, default: Optional[int] = None) -> Optional[int]:
    v = md.get(key, default)
    if v is None:
        return None
    if isinstance(v, list):  # per-layer arrays: plain llama never varies them
        if not v or len(set(v)) != 1:
            raise MlxSpecError(f"unsupported GGUF metadata: {key} varies per layer")
        v = v[0]
    return int(v)


def _required_int(md: Dict[str, Any], key: str) -> int:
    v = _int(md, key)
    if v is None:
        raise MlxSpecError(f"GGUF metadata lacks {key}")
    return v


def _f32(v: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99e-06)."""
    return float(f"{float(v):.7g}")


def _llama_config(md: Dict[str, Any], tensors: _Tensors) -> Dict[str, Any]:
    a = "llama"
    if md.get(f"{a}.expert_count"):
        raise MlxSpecError("unsupported GGUF model: llama with experts (MoE)")
    hidden = _required_int(md, f"{a}.embedding_length")
    n_layers = _required_int(md, f"{a}.block_count")
    n_heads = _required_int(md, f"{a}.attention.head_count")
    n_kv = _int(md, f"{a}.attention.head_count_kv", n_heads)
    ffn = _required_int(md, f"{a}.feed_forward_length")
    head_dim = _int(md, f"{a}.attention.key_length", hidden // n_heads)
    if _int(md, f"{a}.attention.value_length", head_dim) != head_dim:
        raise MlxSpecError("unsupported GGUF model: key and value head sizes differ")
    n_rot = _int(md, f"{a}.rope.dimension_count", head_dim)
    if n_rot != head_dim:
        raise MlxSpecError(f"unsupported GGUF model: RoPE on {n_rot} of {head_dim} head dims")
    rope_theta = _f32(md.get(f"{a}.rope.freq_base", 10000.0))
    context = _int(md, f"{a}.context_length", 2048)

    names = set(tensors.names())
    if "token_embd" not in names:
        raise MlxSpecError("GGUF file has no token_embd tensor")
    vocab = _int(md, f"{a}.vocab_size")
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


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _split_merge(m: str) -> Tuple[str, str]:
    # like llama.cpp: the separator is the first space after the first character
    i = m.find(" ", 1)
    if i < 0:
        raise MlxSpecError(f"bad BPE merge in GGUF metadata: {m!r}")
    return m[:i], m[i + 1 :]


def build_tokenizer(md: Dict[str, Any]):
    """A `tokenizers.Tokenizer` plus tokenizer_config / special_tokens_map dicts from metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import processors

    kind = md.get("tokenizer.ggml.model")
    if kind is None:
        raise MlxSpecError("GGUF file has no tokenizer (tokenizer.ggml.model missing)")
    if kind != "gpt2":
        raise MlxSpecError(f"unsupported tokenizer: tokenizer.ggml.model = {kind}")
    pre = md.get("tokenizer.ggml.pre", "default") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise MlxSpecError(f"unsupported tokenizer: tokenizer.ggml.pre = {pre}")

    tokens: List[str] = list(md.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise MlxSpecError("GGUF file has no tokenizer.ggml.tokens")
    types = list(md.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise MlxSpecError("GGUF tokenizer.ggml.token_type and tokens differ in length")
    merges = [_split_merge(m) for m in (md.get("tokenizer.ggml.merges") or [])]

    vocab: Dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated string keeps its first id

    model = models.BPE(
        vocab=vocab,
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre in _IGNORE_MERGES_PRE,
    )
    tok = Tokenizer(model)

    pre_kind, regex = _PRE_TOKENIZERS[pre]
    if pre_kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre_kind == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()

    specials = [t for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL]
    user = [t for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED]
    if specials:
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in specials]
        )
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def token_id(kind: str) -> Optional[int]:
        i = md.get(f"tokenizer.ggml.{kind}_token_id")
        return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

    ids = {k: token_id(k) for k in ("bos", "eos", "padding", "unknown")}
    names = {k: (tokens[i] if i is not None else None) for k, i in ids.items()}
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False)) and ids["bos"] is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and ids["eos"] is not None

    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos or add_eos:
        bos, eos = names["bos"], names["eos"]

        def seq(piece: str, type_id: int) -> List[str]:
            return (
                ([f"{bos}:{type_id}"] if add_bos else [])
                + [f"{piece}:{type_id}"]
                + ([f"{eos}:{type_id}"] if add_eos else [])
            )

        used = {bos: ids["bos"]} if add_bos else {}
        if add_eos:
            used[eos] = ids["eos"]
        template = processors.TemplateProcessing(
            single=" ".join(seq("$A", 0)),
            pair=" ".join(seq("$A", 0) + seq("$B", 1)),
            special_tokens=list(used.items()),
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level

    special_map: Dict[str, Any] = {}
    for key, kind in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"),
                      ("unk_token", "unknown")):
        if names[kind] is not None:
            special_map[key] = names[kind]
    extra = [t for t in specials if t not in special_map.values()]
    if extra:
        special_map["additional_special_tokens"] = extra

    tok_config: Dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _int(md, f"{md.get('general.architecture')}.context_length", 2048),
        **{k: v for k, v in special_map.items() if k != "additional_special_tokens"},
    }
    template = md.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        tok_config["chat_template"] = template
    return tok, tok_config, special_map


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def is_converted_model(path) -> bool:
    """True when `path` holds a finished conversion by this converter version."""
    path = Path(path)
    if not all((path / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        info = json.loads((path / CONVERSION_INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("converter_version") == CONVERTER_VERSION


def _quantization_config(quant: Dict[str, Dict[str, int]]) -> Optional[Dict[str, Any]]:
    if not quant:
        return None
    default_bits, _ = Counter(q["bits"] for q in quant.values()).most_common(1)[0]
    cfg: Dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": default_bits}
    for path in sorted(quant):
        q = quant[path]
        if q["bits"] != default_bits or q["group_size"] != GGUF_GROUP_SIZE:
            cfg[path] = dict(q)
    return cfg


def convert_gguf(
    gguf_path,
    mlx_path,
    dtype: str = "keep",
    *,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    overwrite: bool = False,
    progress: Optional[ProgressFn] = None,
) -> Path:
    """Convert a llama.cpp GGUF file into an mlx-lm model directory; returns that directory.

    dtype: "keep" keeps Q4_0/Q4_1/Q8_0 tensors packed (mlx-lm affine quantization, group size
    32, float16 scales and biases, per-module bits in config "quantization"), float tensors
    as stored (llama.cpp's norms are float32), and stores other quantized types (K-quants,
    Q5_0, IQ*, ...) dequantized to float16; "float32" / "float16" / "bfloat16" dequantize
    everything to that dtype (float32 is what runs fast on the MLX CPU backend).
    quantize: re-quantize every weight matrix that does not stay packed (K-quants and the other
    types the gguf package dequantizes, float matrices) to MLX's affine q_bits / q_group_size,
    instead of storing it dequantized; Q4_0/Q4_1/Q8_0 tensors kept packed stay as they are.
    overwrite: replace an existing non-empty `mlx_path` (default: refuse).
    progress: called as progress(done, total) after each tensor.
    """
    if dtype not in DTYPES:
        raise MlxSpecError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    gguf_path = Path(gguf_path).expanduser()
    mlx_path = check_output(mlx_path, overwrite)

    md, tensors = _open_gguf(gguf_path)
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise MlxSpecError(f"unsupported GGUF architecture: {arch}")
    config = _llama_config(md, tensors)
    tok, tok_config, special_map = build_tokenizer(md)

    target = DTYPES[dtype]
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
                out["weight"], out["scales"], out["biases"] = mx.quantize(w, group_size=q_group_size, bits=q_bits)
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

    qcfg = _quantization_config(quant)
    if qcfg is not None:
        config["quantization"] = qcfg
        config["quantization_config"] = qcfg
    info = {
        "converter_version": CONVERTER_VERSION,
        "source": str(gguf_path.resolve()),
        "source_size": gguf_path.stat().st_size,
        "dtype": dtype,
        "requantized": {"bits": q_bits, "group_size": q_group_size} if quantize else None,
        "reader": tensors.reader,
        "gguf_architecture": arch,
        "gguf_name": md.get("general.name"),
        "gguf_file_type": md.get("general.file_type"),
    }

    def fill(tmp: Path) -> None:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        tok.save(str(tmp / "tokenizer.json"))
        write_json(tmp / "tokenizer_config.json", tok_config)
        write_json(tmp / "special_tokens_map.json", special_map)
        write_json(tmp / "config.json", config)

    return write_dir(mlx_path, fill, info)

