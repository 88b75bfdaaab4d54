"""The target adapter: any mlx-lm model, run by its own code, with hidden-state taps.

Tap convention (DESIGN.md): taps[i] is the OUTPUT of decoder layer i; taps[-1] is the
embedding output (the input of layer 0).
"""

import re
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache import is_cache, is_recurrent
from ..errors import MlxSpecError
from .checkpoint import FLOAT_DTYPES, check_not_pickled, one_line, read_config

DTYPES = ("auto", *FLOAT_DTYPES, "keep")
# Files one of which a tokenizer loads from (besides *.tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


class _TapLayer:
    """Stands in for a decoder layer during one forward: records its input/output and,
    for tree passes, replaces the mask the model built with the caller's and hands recurrent
    layers to the tree's own runner (one state cannot hold several branches)."""

    def __init__(self, layer, index, taps, want, mask, replay, recurrent):
        self._layer, self._index, self._taps, self._want, self._mask, self._replay, self._recurrent = (
            layer,
            index,
            taps,
            want,
            mask,
            replay,
            recurrent,
        )

    def __getattr__(self, name):  # models read attributes such as `use_sliding`
        return getattr(self._layer, name)

    def __call__(self, x, *args, **kwargs):
        # Layers differ in how they take mask and cache: (x, mask, cache) mostly, (x, cache,
        # attn_mask, ...) in Falcon-H1. A tree's mask replaces the first positional one, or the
        # `mask` keyword; a recurrent layer of a tree pass runs one sequence per node (no mask).
        if self._index == 0 and -1 in self._want:
            self._taps[-1] = x
        cache = kwargs.get("cache", next((a for a in args if is_cache(a)), None))
        recurrent = cache is not None and is_recurrent(cache)
        if self._mask is not None:
            mask = None if recurrent else self._mask
            if args and "mask" not in kwargs:
                args = (mask,) + args[1:]
            else:
                kwargs["mask"] = mask
        if recurrent and self._replay is not None:
            self._replay.record(self._layer, x, args, kwargs, cache)
        if recurrent and self._recurrent is not None:

            def call(inputs, state):  # the layer over `inputs` from the cache `state`
                swap = lambda a: state if a is cache else a  # noqa: E731
                return self._layer(inputs, *map(swap, args), **{k: swap(v) for k, v in kwargs.items()})

            out = self._recurrent(call, x, cache)
        else:
            out = self._layer(x, *args, **kwargs)
        if self._index in self._want:
            self._taps[self._index] = out
        return out


class Target:
    """Wraps an mlx-lm model: `forward(tokens, cache, taps)` -> (logits, {layer: hidden})."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        config: Optional[dict] = None,
        path: Optional[str] = None,
        dtype: str = "keep",
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or {}
        self.path = path
        self.dtype = dtype
        # The list the model iterates: some models' `layers` is a fresh slice of it (mlx-lm's
        # pipeline models), in which a wrapped layer would not be seen.
        inner = getattr(getattr(model, "model", None), "layers", None)
        self.layers = inner if isinstance(inner, list) else model.layers
        self.num_layers = len(self.layers)
        self._inner = getattr(model, "model", None) or getattr(model, "backbone", None)
        self.eos_token_ids = sorted(getattr(tokenizer, "eos_token_ids", None) or ())

    # --- the forward pass -------------------------------------------------------------
    def forward(
        self, tokens: mx.array, cache, taps: Iterable[int] = (), mask=None, replay=None, recurrent=None
    ):
        """tokens [1, n] -> (logits [1, n, V], {layer_id: hidden [1, n, H]}).

        The model's own __call__ runs (embedding, mask, layers, norm, head); chosen layers are
        wrapped for the duration of the call to capture their outputs (no second pass), and
        recurrent layers to record what `replay` (cache.Replay) needs to roll them back. A tree
        pass gives its `mask` and runs recurrent layers itself: recurrent(call, x, cache) -> out,
        where call(inputs, cache) runs the layer."""
        want = set(taps)
        if not want and mask is None and replay is None and recurrent is None:
            return self.model(tokens, cache=cache), {}
        for i in want:
            if not -1 <= i < self.num_layers:
                raise MlxSpecError(f"tap layer {i} is outside the target's {self.num_layers} layers")
        captured: Dict[int, mx.array] = {}
        originals = list(self.layers)
        try:
            for i, layer in enumerate(originals):
                self.layers[i] = _TapLayer(layer, i, captured, want, mask, replay, recurrent)
            logits = self.model(tokens, cache=cache)
        finally:
            self.layers[:] = originals
        return logits, captured

    # --- pieces that drafters share with the target (no copies) -----------------------
    @property
    def embed_tokens(self):
        return self._part(("embed_tokens", "embeddings"), "input embedding")

    def _part(self, names, what):
        """A piece of the model that feature drafters share, under the names mlx-lm's ports
        give it; a one-line error where this architecture has none of them."""
        for name in names:
            part = getattr(self._inner, name, None)
            if part is not None:
                return part
        raise MlxSpecError(
            f"feature drafters need the target's {what}, which this {self.model_type} "
            "model does not expose where mlx-spec looks: use --draft lookup or model"
        )

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens)

    def lm_head(self, hidden: mx.array) -> mx.array:
        """The output projection alone (drafters apply their own final norm first)."""
        if getattr(self.model, "lm_head", None) is not None:
            return self.model.lm_head(hidden)
        return self.embed_tokens.as_linear(hidden)

    @property
    def output_layer(self):
        """The module lm_head applies: the model's lm_head, else (tied) the input embedding."""
        head = getattr(self.model, "lm_head", None)
        return head if head is not None else self.embed_tokens

    @property
    def final_norm(self):
        return self._part(("norm", "norm_f", "final_layernorm"), "final norm")

    def head(self, hidden: mx.array) -> mx.array:
        """The target's final norm + output projection, applied to a last-layer hidden state."""
        return self.lm_head(self.final_norm(hidden))

    # --- facts about the model -----------------------------------------------------------
    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", type(self.model).__module__.rsplit(".", 1)[-1]))

    @property
    def hidden_size(self) -> int:
        return int(self.config.get("hidden_size") or self.config["text_config"]["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or self.config["text_config"]["vocab_size"])

    @property
    def context_length(self) -> Optional[int]:
        cfg = self.config.get("text_config", self.config)
        for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
            if cfg.get(key):
                return int(cfg[key])
        return None


def _on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def apply_dtype(model: nn.Module, dtype: str) -> str:
    """Apply --dtype; returns the dtype actually used ("keep" when nothing was changed).

    auto: keep quantized weights on a GPU, dequantize to float32 on the CPU, where
    quantized and half-precision matmuls are slow (DESIGN.md measurements)."""
    if dtype not in DTYPES:
        raise MlxSpecError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if dtype == "auto":
        dtype = "keep" if _on_gpu() else "float32"
    if dtype == "keep":
        return dtype
    from mlx_lm.utils import dequantize_model

    dequantize_model(model)
    model.set_dtype(getattr(mx, dtype))  # lazily: the caller evaluates (the shard it keeps)
    return dtype


def load_target(path, dtype: str = "auto", shard: Optional[Callable] = None) -> Target:
    """Load an mlx-lm model directory (no hub access) as a Target. shard(model, config): split
    the lazily loaded model (distributed.shard_model) before its weights are read."""
    from mlx_lm.utils import load_model, load_tokenizer

    path = Path(path)
    config = read_config(path, "model")
    if not isinstance(config.get("model_type"), str):
        raise MlxSpecError(
            f"cannot load model {path}: its config.json has no 'model_type': a model's config "
            'names its architecture ("model_type": "llama", ...) and its sizes, as Hugging Face '
            "checkpoints and mlx_lm.convert write it"
        )
    check_not_pickled(path)
    try:
        model, config = load_model(path, lazy=True)
    except Exception as e:  # mlx-lm raises many types for bad files; keep it to one line
        missing = re.search(r"missing \d+ required (?:positional |keyword-only )?arguments?: (.*)", str(e))
        if isinstance(e, TypeError) and missing:  # ModelArgs(**config) without a field it needs
            fields = missing.group(1).replace("'", "").replace(" and ", " ").replace(",,", ",")
            raise MlxSpecError(
                f"cannot load model {path}: its config.json lacks what the {config['model_type']} "
                f"architecture needs: {fields}"
            ) from None
        raise MlxSpecError(f"cannot load model {path}: {one_line(e)}") from None
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        if not any((path / name).is_file() for name in TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
            raise MlxSpecError(
                f"cannot load model {path}: it has no tokenizer.json (nor tokenizer.model, "
                "vocab.json or *.tiktoken): copy the tokenizer files of the model it was "
                "converted from"
            ) from None
        raise MlxSpecError(f"cannot load the tokenizer of {path}: {one_line(e).rstrip(':')}") from None
    used = apply_dtype(model, dtype)
    if shard is not None:
        shard(model, config)
    mx.eval(model.parameters())
    return Target(model, tokenizer, config, path=str(path), dtype=used)
