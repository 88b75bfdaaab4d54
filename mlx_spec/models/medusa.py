"""Medusa heads, loaded as published, for their target.

Head i (0-based) reads the target's last hidden state (after its final norm) at position t and
predicts token t + 2 + i: it is `num_layers` residual blocks x + SiLU(W x + b), then an output
layer, its own (published Medusa) or the target's (the compact variant trained here, which
keeps the heads small).

Layouts (each mapped to vLLM's names, which this module uses):
- FasterDecoding/Medusa: `medusa_lm_head.safetensors` with `{i}.{j}.linear.{weight,bias}`
  (block j of head i) and `{i}.{num_layers}.weight` (its output layer); config.json with
  `medusa_num_heads`, `medusa_num_layers`. A whole-model save prefixes the keys with
  `medusa_head.`. A pickled `medusa_lm_head.pt` is refused (convert it to safetensors first).
- vLLM: `blocks.{i}.layers.{j}.{weight,bias}`, `lm_heads.{i}.weight`; config `num_heads`,
  `num_hidden_layers`.
- Compact: either layout without the output layers; config `medusa_shared_head: true`."""

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxSpecError
from . import vocabulary
from .checkpoint import PICKLED, one_line, quantize_as_stored, read_config

WEIGHT_FILES = ("medusa_lm_head.safetensors", "model.safetensors")


@dataclass
class ModelArgs:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    shared_head: bool = False  # the heads use the target's output layer

    @classmethod
    def from_config(cls, config: dict, hidden_size: int, vocab_size: int) -> "ModelArgs":
        heads = config.get("medusa_num_heads", config.get("num_heads"))
        layers = config.get("medusa_num_layers", config.get("num_hidden_layers"))
        if not isinstance(heads, int) or not isinstance(layers, int) or heads < 1 or layers < 0:
            raise ValueError(
                "medusa_num_heads / medusa_num_layers (or num_heads / num_hidden_layers) "
                "missing or not counts"
            )
        return cls(
            heads,
            layers,
            int(config.get("hidden_size") or hidden_size),
            int(config.get("vocab_size") or vocab_size),
            bool(config.get("medusa_shared_head", False)),
        )


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def __call__(self, x):
        return x + nn.silu(self.linear(x))


class Model(nn.Module):
    rows = None  # per head, vocabulary.OutputRows of a reduced draft vocabulary; None: whole heads

    def __init__(self, args: ModelArgs, target):
        super().__init__()
        self.args = args
        self.blocks = [
            [ResBlock(args.hidden_size) for _ in range(args.num_layers)] for _ in range(args.num_heads)
        ]
        if not args.shared_head:
            self.lm_heads = [
                nn.Linear(args.hidden_size, args.vocab_size, bias=False) for _ in range(args.num_heads)
            ]
        self._target = target

    def use_vocabulary(self, ids) -> None:
        """Draft over the target ids `ids` only (models/vocabulary.py)."""
        self.rows = vocabulary.OutputRows(
            [self._target.output_layer] if self.args.shared_head else self.lm_heads, ids
        )

    @property
    def draft_ids(self) -> Optional[mx.array]:
        return None if self.rows is None else self.rows.ids

    def fuse(self, features: mx.array) -> mx.array:
        """The target's last-layer output -> what the heads read (after its final norm)."""
        return self._target.final_norm(features)

    def __call__(self, hidden: mx.array, n: int) -> mx.array:
        """hidden [..., H] (normed) -> logits [n, ..., V] of the first n heads."""
        out = []
        for i in range(n):
            x = hidden
            for block in self.blocks[i]:
                x = block(x)
            if self.rows is not None:
                out.append(self.rows(x, 0 if self.args.shared_head else i))
            else:
                out.append(self._target.lm_head(x) if self.args.shared_head else self.lm_heads[i](x))
        return mx.stack(out)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """FasterDecoding's names (with or without `medusa_head.`) -> vLLM's."""
        L, out = self.args.num_layers, {}
        for name, w in weights.items():
            name = name[len("medusa_head.") :] if name.startswith("medusa_head.") else name
            m = re.fullmatch(r"(\d+)\.(\d+)\.(linear\.)?(weight|bias|scales|biases)", name)
            if m:
                i, j, kind = int(m.group(1)), int(m.group(2)), m.group(4)
                name = (
                    f"lm_heads.{i}.{kind}" if j == L and not m.group(3) else f"blocks.{i}.{j}.linear.{kind}"
                )
            else:
                m = re.fullmatch(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias|scales|biases)", name)
                if m:
                    name = f"blocks.{m.group(1)}.{m.group(2)}.linear.{m.group(3)}"
            out[name] = w
        return out


def _weights(path: Path) -> Dict[str, mx.array]:
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            try:
                return mx.load(str(path / name))
            except Exception as e:  # mlx raises several types for a bad file
                raise MlxSpecError(f"cannot read {path / name}: {one_line(e)}") from None
    pickled = sorted(f.name for f in path.iterdir() if f.suffix in PICKLED)
    if pickled:
        raise MlxSpecError(
            f"{path} holds Medusa heads as a pickle ({pickled[0]}), which mlx-spec never "
            "opens: convert it to safetensors first (safetensors.torch.save_file)"
        )
    raise MlxSpecError(f"no Medusa weights in {path} (expected {' or '.join(WEIGHT_FILES)})")


def load_medusa(path, target) -> Model:
    """Medusa heads (any layout above) for `target`; every mismatch a one-line MlxSpecError."""
    path = Path(path)
    config = read_config(path, "Medusa heads")
    weights = _weights(path)
    try:
        args = ModelArgs.from_config(config, target.hidden_size, target.vocab_size)
    except ValueError as e:
        raise MlxSpecError(f"corrupt Medusa config in {path}: {one_line(e)}") from None
    model = Model(args, target)
    weights = model.sanitize(weights)
    if not any(k.startswith("lm_heads.") for k in weights) and not args.shared_head:
        args.shared_head = True  # no output layers: the compact variant, whatever the config says
        model = Model(args, target)
    block = weights.get("blocks.0.0.linear.weight")
    width = block.shape[1] if block is not None else args.hidden_size
    bits = (config.get("quantization") or {}).get("bits")
    if "blocks.0.0.linear.scales" in weights and bits:  # bits-wide values packed in uint32
        width = width * 32 // bits
    if width != target.hidden_size or args.hidden_size != target.hidden_size:
        raise MlxSpecError(
            f"{path}: Medusa heads for hidden size {width}, the target's is {target.hidden_size}"
        )
    head = weights.get("lm_heads.0.weight")
    vocab = head.shape[0] if head is not None else args.vocab_size
    if vocab != target.vocab_size:
        raise MlxSpecError(
            f"{path}: Medusa heads over {vocab} tokens, the target's vocabulary has {target.vocab_size}"
        )
    try:
        quantize_as_stored(model, config, weights)
        model.load_weights(list(weights.items()), strict=True)
    except (ValueError, KeyError) as e:
        raise MlxSpecError(f"cannot load Medusa heads from {path}: {one_line(e)}") from None
    model.set_dtype(target.embed(mx.array([0])).dtype)
    mx.eval(model.parameters())
    ids = vocabulary.read(path, target.vocab_size)
    if ids is not None:
        model.use_vocabulary(ids)
    return model


def save_medusa(model: Model, path, dtype=mx.float32) -> Path:
    """FasterDecoding's layout (compact: without output layers): config.json +
    medusa_lm_head.safetensors."""
    from mlx.utils import tree_flatten

    path, args = Path(path), model.args
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        parts = name.split(".")
        if parts[0] == "blocks":  # blocks.i.j.linear.kind
            weights[f"{parts[1]}.{parts[2]}.linear.{parts[4]}"] = w.astype(dtype)
        else:  # lm_heads.i.weight
            weights[f"{parts[1]}.{args.num_layers}.weight"] = w.astype(dtype)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "medusa_num_heads": args.num_heads,
        "medusa_num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "vocab_size": args.vocab_size,
        "medusa_shared_head": args.shared_head,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "medusa_lm_head.safetensors"), weights, metadata={"format": "pt"})
    return path
