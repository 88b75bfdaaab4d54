"""Reading a checkpoint directory (config.json + safetensors), with a one-line error for each
way it can be bad. Safetensors only: pickled weights (*.bin, *.pt) are refused, never opened."""

import json
import re
from pathlib import Path

import mlx.core as mx

from ..errors import MlxSpecError

PICKLED = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# The float dtypes weights are cast to, by name: the one table --dtype, --save-dtype and the
# converters read.
FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def one_line(e: BaseException) -> str:
    """The first line of an exception's message, without a leading "[tag] " (the gguf
    package's)."""
    lines = str(e).strip().splitlines()
    return re.sub(r"^\[[a-z_]+\]\s*", "", lines[0]) if lines else type(e).__name__


def read_config(path, what: str) -> dict:
    """config.json of the directory `path`; `what` names the checkpoint in errors."""
    path = Path(path)
    if not path.is_dir():
        raise MlxSpecError(f"{what} not found: {path} is not a directory")
    if not (path / "config.json").is_file():
        raise MlxSpecError(f"not a {what} directory: {path} has no config.json")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MlxSpecError(f"corrupt config.json in {path}: {one_line(e)}") from None
    if not isinstance(config, dict):
        raise MlxSpecError(f"corrupt config.json in {path}: not a JSON object")
    return config


# What config.json says a checkpoint is (checkpoint_kind), in words; the --draft values that
# read each kind are the registry's (drafters.DRAFTERS, Source.checkpoint).
KINDS = {
    "dflash": "a DFlash drafter",
    "eagle": "an EAGLE-3 drafter",
    "medusa": "Medusa heads",
    "model": "a language model",
}


def checkpoint_kind(config: dict):
    """'dflash', 'eagle', 'medusa' or 'model' (a whole language model), from config.json;
    None when it says none of these."""
    architectures = [str(a) for a in config.get("architectures") or []]
    if (
        "DFlashDraftModel" in architectures
        or "dflash_config" in config
        or config.get("speculators_model_type") == "dflash"  # the speculators format's DFlash
    ):
        return "dflash"
    if (
        config.get("speculators_model_type")
        or any("eagle" in a.lower() for a in architectures)
        or "eagle_aux_hidden_state_layer_ids" in config
        or "draft_vocab_size" in config
    ):
        return "eagle"
    if "medusa_num_heads" in config or config.get("model_type") == "medusa":
        return "medusa"
    if "model_type" in config:
        return "model"
    return None


def check_not_pickled(path) -> None:
    path = Path(path)
    if not list(path.glob("*.safetensors")) and any(f.suffix in PICKLED for f in path.iterdir()):
        raise MlxSpecError(
            f"{path} holds pickled weights only; mlx-spec loads safetensors and GGUF, "
            "never pickles (convert them with a tool you trust first)"
        )


def safetensors_header(path):
    """(header, data start) of a safetensors file, read alone: the JSON header (tensor name ->
    dtype, shape, data_offsets relative to the data start; and "__metadata__") and the byte
    where tensor data starts. ValueError when the file cannot hold the header it announces."""
    path = Path(path)
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if 8 + size > path.stat().st_size:
            raise ValueError("header extends past the end of the file")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, 8 + size


def quantize_as_stored(model, config: dict, weights: dict) -> None:
    """Where config.json carries mlx-lm's "quantization" ({group_size, bits}), make quantized
    the layers whose stored weights have scales (as mlx_lm.load does), before loading them."""
    import mlx.nn as nn

    q = config.get("quantization")
    if q:
        nn.quantize(
            model,
            group_size=q["group_size"],
            bits=q["bits"],
            class_predicate=lambda name, module: f"{name}.scales" in weights,
        )


# A drafter's reduced vocabulary (models/vocabulary.py), kept next to its weights, not among them.
DRAFT_VOCABULARY = "draft_vocab.safetensors"


def read_weights(path) -> dict:
    """Every tensor of the directory's *.safetensors files (but a draft vocabulary)."""
    path = Path(path)
    check_not_pickled(path)
    files = sorted(f for f in path.glob("*.safetensors") if f.name != DRAFT_VOCABULARY)
    if not files:
        raise MlxSpecError(f"no *.safetensors weights in {path}")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises several types for a bad file
            raise MlxSpecError(f"cannot read {f}: {one_line(e)}") from None
    return weights
