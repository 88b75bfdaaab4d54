"""Multi-token-prediction (MTP) modules as models ship them, loaded for their target.

An MTP module predicts the token after next from the target's hidden state at position t and
the embedding of token t+1: both are normed, concatenated and projected back to the hidden
size, run through one decoder layer of the target's own architecture (mlx-lm's layer class,
MoE or full attention as the checkpoint has it), then normed and projected to the vocabulary.
Position t of the module's cache holds the pair (token t+1, target hidden at t), as the
EAGLE-3 layer's does, so drafters/eagle.py drafts with either. Deeper drafts feed the module
its own output (vLLM's MTP proposer does the same).

Layouts, told apart by weight names (each as vLLM 0.33.0 reads it: deepseek_mtp.py lines
113-144 and 226-235, glm4_moe_mtp.py 106-128 and 181-191, mimo_mtp.py 67-88, qwen3_next_mtp.py
118-162 and qwen3_5_mtp.py 146-191; tests/test_mtp.py transcribes those forwards):
- DeepSeek-V3 / GLM-4.5 (and the default model's module, trained here): `model.layers.{N+i}.`
  {enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, the decoder layer}, N =
  num_hidden_layers, `num_nextn_predict_layers` of them; [embedding ; hidden]; the output is
  the layer's pre-norm residual stream, normed by shared_head.norm before the head.
- MiMo: `model.mtp_layers.{i}.`{token_layernorm, hidden_layernorm, input_proj,
  final_layernorm, the decoder layer}; [hidden ; embedding] (the other order); the output is
  final_layernorm'ed and the target's lm_head makes the logits.
- Qwen3-Next / Qwen3.5 (`mtp_num_hidden_layers`): `mtp.`{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, layers.{i}, norm};
  [embedding ; hidden]; the output is normed; the target's lm_head. Its norms store weight - 1
  (zero-centred), as the target's do.

The hidden state handed over is the target's last-layer output after its final norm, as the
target's forward returns it in vLLM (deepseek_v2.py 1589, qwen3_next.py 739); MiMo's module reads
it before the norm (mimo.py 87). What a deeper draft is fed: DeepSeek/GLM the pre-norm output
(glm4_moe_mtp.py 128; vLLM 0.33.0's DeepSeek model now feeds the normed one back, older vLLM the
pre-norm one, which is what the module trained here learned), MiMo and Qwen3-Next the normed one. Embeddings and a shared_head.head equal to the target's
are not loaded twice: the target's embedding is always used, and the target's output layer
where the checkpoint has no head of its own. Where a checkpoint has several modules, the first
drafts at every depth (the others are not loaded)."""

import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..errors import MlxSpecError
from . import vocabulary
from .checkpoint import check_not_pickled, one_line, read_config, safetensors_header


@dataclass(frozen=True)
class Layout:
    name: str
    prefix: str  # of module i's wrapper weights, with {i} and {n} (= num_hidden_layers)
    layer_prefix: str  # of module i's decoder layer
    embed_norm: str
    hidden_norm: str
    proj: str
    final_norm: str
    hidden_first: bool  # concatenation order [hidden ; embedding]
    normed_output: bool  # the module returns final_norm(out) and logits = lm_head(out)
    zero_first_position: bool = True  # the embedding at position 0 is zeroed
    normed_target_hidden: bool = True  # it reads the target's hidden state after the final norm
    zero_centred_norms: bool = False


LAYOUTS = {
    "deepseek": Layout(
        "deepseek",
        "model.layers.{n}.",
        "model.layers.{n}.",
        "enorm",
        "hnorm",
        "eh_proj",
        "shared_head.norm",
        hidden_first=False,
        normed_output=False,
    ),
    "mimo": Layout(
        "mimo",
        "model.mtp_layers.{i}.",
        "model.mtp_layers.{i}.",
        "token_layernorm",
        "hidden_layernorm",
        "input_proj",
        "final_layernorm",
        hidden_first=True,
        normed_output=True,
        normed_target_hidden=False,
    ),
    "qwen3_next": Layout(
        "qwen3_next",
        "mtp.",
        "mtp.layers.{i}.",
        "pre_fc_norm_embedding",
        "pre_fc_norm_hidden",
        "fc",
        "norm",
        hidden_first=False,
        normed_output=True,
        zero_first_position=False,
        zero_centred_norms=True,
    ),
}
WRAPPER = ("embed_norm", "hidden_norm", "proj", "final_norm")
# The decoder-layer norms that Qwen3-Next / Qwen3.5 store as weight - 1 (mlx-lm's sanitize list).
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def detect_layout(names, num_hidden_layers: int) -> Optional[Layout]:
    """The layout whose first module's projection is among the weight names."""
    for layout in LAYOUTS.values():
        if _prefix(layout.prefix, num_hidden_layers) + layout.proj + ".weight" in names:
            return layout
    return None


def _prefix(template: str, num_hidden_layers: int, i: int = 0) -> str:
    return template.format(i=i, n=num_hidden_layers + i)


def _target_args(target):
    args = getattr(target.model, "args", None)
    if args is not None and not hasattr(args, "num_hidden_layers"):  # Qwen3.5: a text model inside
        args = getattr(getattr(target.model, "language_model", None), "args", None)
    if args is None or not hasattr(args, "num_hidden_layers"):
        raise MlxSpecError(
            f"MTP needs the model arguments of the target's mlx-lm port, which this "
            f"{target.model_type} model does not expose"
        )
    return args


def _layer_index(args, layout: Layout) -> int:
    """The index the module's decoder layer is built with: it decides MoE or dense, linear or
    full attention in mlx-lm's layer classes. DeepSeek/GLM number the module after the
    target's layers; Qwen3-Next's module is a full-attention layer."""
    if layout.name == "qwen3_next":
        return getattr(args, "full_attention_interval", 1) - 1
    return args.num_hidden_layers


def build_layer(target, layout: Layout) -> nn.Module:
    """A decoder layer of the target's own class, built as the module's (mlx-lm's code)."""
    args = _target_args(target)
    held = [layer for layer in target.layers if layer is not None]  # a pipeline stage holds some
    kinds = {type(layer) for layer in held}
    cls = next(iter(kinds)) if len(kinds) == 1 else None
    if layout.name == "qwen3_next":  # a full-attention layer of the hybrid
        cls = next((type(l) for l in held if not getattr(l, "is_linear", False)), cls)
    if cls is None:
        raise MlxSpecError(
            f"cannot tell which decoder layer an MTP module of this {target.model_type} model uses"
        )
    parameters = inspect.signature(cls.__init__).parameters
    index = _layer_index(args, layout)
    if "layer_idx" in parameters:
        return cls(args, layer_idx=index)
    if "layer_index" in parameters:
        return cls(args, layer_index=index)
    return cls(args)


class Model(nn.Module):
    """One MTP module, a FeatureDraftModel (drafters/eagle.py), as the EAGLE-3 layer is: one
    drafter drafts with both (chains only: its layer takes no tree positions)."""

    supports_tree = False
    rows = None  # vocabulary.OutputRows of a reduced draft vocabulary; None: the whole head

    def __init__(self, target, layout: Layout, has_head: bool = False):
        super().__init__()
        self.layout = layout
        args = _target_args(target)
        hidden, eps = target.hidden_size, getattr(args, "rms_norm_eps", 1e-6)
        self.embed_norm = nn.RMSNorm(hidden, eps=eps)
        self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = build_layer(target, layout)
        self.final_norm = nn.RMSNorm(hidden, eps=eps)
        if has_head:
            self.head = nn.Linear(hidden, target.vocab_size, bias=False)
        self._target = target  # embedding, final norm and output layer are the target's
        self.taps = [target.num_layers - 1]
        self.draft_vocab_size = target.vocab_size

    def use_vocabulary(self, ids) -> None:
        """Draft over the target ids `ids` only (models/vocabulary.py)."""
        self.rows = vocabulary.OutputRows([self.head if "head" in self else self._target.output_layer], ids)
        self.draft_vocab_size = len(self.rows)

    @property
    def draft_ids(self) -> Optional[mx.array]:
        return None if self.rows is None else self.rows.ids

    def embed(self, tokens: mx.array) -> mx.array:
        return self._target.embed(tokens)

    def fuse(self, features: mx.array) -> mx.array:
        """The target's last-layer output -> the hidden state the module reads."""
        return self._target.final_norm(features) if self.layout.normed_target_hidden else features

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: List[KVCache]) -> mx.array:
        """embeds, hidden [1, n, H] -> the module's output [1, n, H], fed back as the next
        draft's hidden."""
        if cache[0].offset == 0 and self.layout.zero_first_position:
            embeds = mx.concatenate([mx.zeros_like(embeds[:, :1]), embeds[:, 1:]], axis=1)
        e, h = self.embed_norm(embeds), self.hidden_norm(hidden)
        x = self.proj(mx.concatenate([h, e] if self.layout.hidden_first else [e, h], axis=-1))
        mask = create_attention_mask(x, cache[0], return_array=True) if x.shape[1] > 1 else None
        out = self.layer(x, mask, cache[0])
        return self.final_norm(out) if self.layout.normed_output else out

    def logits(self, hidden: mx.array) -> mx.array:
        if not self.layout.normed_output:
            hidden = self.final_norm(hidden)
        if self.rows is not None:
            return self.rows(hidden)
        return self.head(hidden) if "head" in self else self._target.lm_head(hidden)

    @staticmethod
    def make_cache() -> List[KVCache]:
        return [KVCache()]

    def sanitize(self, weights: Dict[str, mx.array], num_hidden_layers: int) -> Dict[str, mx.array]:
        """The first module's published names -> this module's; the decoder layer's weights go
        through the target model's own sanitize (expert stacking, zero-centred norms, fp8)
        under the name of target layer 0, and back."""
        layout = self.layout
        prefix = _prefix(layout.prefix, num_hidden_layers)
        layer_prefix = _prefix(layout.layer_prefix, num_hidden_layers)
        wrapper = {getattr(layout, part): part for part in WRAPPER}
        wrapper["shared_head.head"] = "head"
        out, layer = {}, {}
        for name, w in weights.items():
            if name.startswith(prefix) and name[len(prefix) :].rsplit(".", 1)[0] in wrapper:
                part, kind = name[len(prefix) :].rsplit(".", 1)
                if layout.zero_centred_norms and "norm" in part:
                    w = w + 1.0
                out[f"{wrapper[part]}.{kind}"] = w
            elif name.startswith(layer_prefix) and not name.startswith(layer_prefix + "embed_tokens"):
                layer["model.layers.0." + name[len(layer_prefix) :]] = w
        published = dict(layer)
        sanitize = getattr(self._target.model, "sanitize", None)
        if sanitize is not None and layer:
            layer = sanitize(layer)
        for name, w in layer.items():  # a wrapping model may have prefixed it (language_model.)
            if "model.layers.0." in name:
                name = name.split("model.layers.0.", 1)[1]
                # Whether a sanitize shifts zero-centred norms depends on what else it sees
                # (Qwen3.5: a conv1d weight of the published shape): shift those it left alone.
                if (
                    layout.zero_centred_norms
                    and w.ndim == 1
                    and name.endswith(ZERO_CENTRED)
                    and mx.array_equal(w, published["model.layers.0." + name])
                ):
                    w = w + 1.0
                out["layer." + name] = w
        return out


# --- reading -------------------------------------------------------------------------------


def _weight_files(path: Path) -> List[Path]:
    check_not_pickled(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MlxSpecError(f"no *.safetensors weights in {path}")
    return files


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_mtp_name(name: str, num_hidden_layers: int) -> bool:
    """A tensor of an MTP module in any layout (DeepSeek's are the layers past the target's)."""
    if name.startswith(("mtp.", "model.mtp_layers.")):
        return True
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= num_hidden_layers


def read_mtp_weights(path, num_hidden_layers: int) -> Dict[str, mx.array]:
    """The MTP tensors of a checkpoint directory: the shards the index names for them (a
    whole model's other shards are not opened), else every *.safetensors file."""
    path = Path(path)
    files = _weight_files(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MlxSpecError(f"corrupt {index}: {one_line(e)}") from None
        wanted = {f for name, f in weight_map.items() if is_mtp_name(name, num_hidden_layers)}
        missing = [f for f in wanted if not (path / f).is_file()]
        if missing:
            raise MlxSpecError(f"{path}: the index names {sorted(missing)[0]}, which is missing")
        files = [path / f for f in sorted(wanted)]
    weights = {}
    for f in files:
        try:
            tensors = mx.load(str(f))
        except Exception as e:  # mlx raises several types for a bad file
            raise MlxSpecError(f"cannot read {f}: {one_line(e)}") from None
        weights.update({k: v for k, v in tensors.items() if is_mtp_name(k, num_hidden_layers)})
    return weights


SIDECAR = "mtp"  # <converted model>/mtp: what `convert --hf-path` keeps of the original's MTP weights


def has_mtp_weights(path, num_hidden_layers: int) -> bool:
    """Whether the directory's weights (by the index, else by each file's names) hold an MTP
    module, without reading any tensor."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            return any(is_mtp_name(n, num_hidden_layers) for n in json.loads(index.read_text())["weight_map"])
        return any(
            is_mtp_name(n, num_hidden_layers)
            for f in path.glob("*.safetensors")
            for n in safetensors_header(f)[0]
            if n != "__metadata__"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def own_mtp_module(target) -> Optional[Path]:
    """The directory holding the target's own MTP module: the sidecar next to a converted model,
    or the target's directory (an original checkpoint); None where it has none."""
    if target.path:
        for candidate in (Path(target.path) / SIDECAR, Path(target.path)):
            if (candidate / "config.json").is_file() and has_mtp_weights(candidate, target.num_layers):
                return candidate
    return None


def find_mtp(target, draft_model=None) -> Path:
    """Where --draft mtp reads the module from: --draft-model, else the sidecar next to a
    converted model, else the target's own directory (an original Hugging Face checkpoint),
    else the module shipped for the default model."""
    from .default import shipped_drafter

    if draft_model:
        return Path(draft_model)
    own = own_mtp_module(target)
    if own is not None:
        return own
    shipped = shipped_drafter("mtp", target.path)
    if shipped:
        return shipped
    raise MlxSpecError(
        f"this {target.model_type} model has no MTP weights: convert its original "
        "checkpoint with `mlx-spec convert --hf-path` (it keeps them), or pass that "
        "checkpoint with --draft-model DIR"
    )


def load_mtp(path, target) -> Model:
    """The first MTP module of the checkpoint directory `path` (the original Hugging Face
    directory of the target, or the sidecar `convert --hf-path` writes), for `target`.
    Every mismatch is a one-line MlxSpecError."""
    path = Path(path)
    config = read_config(path, "MTP checkpoint")
    n = int(
        config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers") or 0
    )
    if n != target.num_layers:
        raise MlxSpecError(
            f"{path}: its config has {n} layers, the target has {target.num_layers}: "
            "these MTP weights belong to another model"
        )
    weights = read_mtp_weights(path, n)
    layout = detect_layout(weights, n)
    if layout is None:
        raise MlxSpecError(
            f"{path} has no MTP weights (none named mtp.*, model.mtp_layers.* or model.layers.{n}.eh_proj)"
        )
    prefix = _prefix(layout.prefix, n)
    proj = weights[prefix + layout.proj + ".weight"]
    if proj.shape[0] != target.hidden_size:
        raise MlxSpecError(
            f"{path}: its MTP module has hidden size {proj.shape[0]}, the target's is {target.hidden_size}"
        )
    head = weights.get(prefix + "shared_head.head.weight")
    if head is not None and head.shape[0] != target.vocab_size:
        raise MlxSpecError(
            f"{path}: its MTP head covers {head.shape[0]} tokens, the target's vocabulary {target.vocab_size}"
        )
    model = Model(target, layout, has_head=head is not None)
    try:
        model.load_weights(list(model.sanitize(weights, n).items()), strict=True)
    except (ValueError, KeyError) as e:
        raise MlxSpecError(f"cannot load MTP weights from {path}: {one_line(e)}") from None
    model.set_dtype(target.embed(mx.array([0])).dtype)
    q = target.config.get("quantization")
    if q and target.dtype == "keep":  # a quantized target keeps its weights quantized: so does its module
        nn.quantize(
            model,
            group_size=q["group_size"],
            bits=q["bits"],
            class_predicate=lambda _, m: (
                hasattr(m, "to_quantized") and m.weight.shape[-1] % q["group_size"] == 0
            ),
        )
    mx.eval(model.parameters())
    ids = vocabulary.read(path, target.vocab_size)
    if ids is not None:
        model.use_vocabulary(ids)
    return model
