"""Reading a checkpoint directory (config.json + safetensors), with a one-line error for each
way it can be bad. Safetensors only: pickled weights (*.bin, *.pt) are refused, never opened."""

import json
from pathlib import Path

import mlx.core as mx

from ..errors import MlxSpecError

PICKLED = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def one_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


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


def check_not_pickled(path) -> None:
    path = Path(path)
    if not list(path.glob("*.safetensors")) and any(f.suffix in PICKLED for f in path.iterdir()):
        raise MlxSpecError(f"{path} holds pickled weights only; mlx-spec loads safetensors and GGUF, "
                           "never pickles (convert them with a tool you trust first)")


def read_weights(path) -> dict:
    """Every tensor of the directory's *.safetensors files."""
    path = Path(path)
    check_not_pickled(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MlxSpecError(f"no *.safetensors weights in {path}")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises several types for a bad file
            raise MlxSpecError(f"cannot read {f}: {one_line(e)}") from None
    return weights
