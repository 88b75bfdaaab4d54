"""Where every conversion writes: a directory that appears whole or not at all."""

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable

from ..errors import MlxSpecError

CONVERSION_INFO_FILE = "mlx_spec_conversion.json"


def check_output(mlx_path, overwrite: bool) -> Path:
    """The output directory, resolved ("." has no name to build siblings from); a one-line
    error before any work when it is a file, or holds files and `overwrite` is not given."""
    mlx_path = Path(mlx_path).expanduser().resolve()
    if mlx_path.exists() and not mlx_path.is_dir():
        raise MlxSpecError(f"output path exists and is not a directory: {mlx_path}")
    if mlx_path.is_dir() and any(mlx_path.iterdir()) and not overwrite:
        raise MlxSpecError(f"output directory is not empty: {mlx_path} (--overwrite replaces it)")
    return mlx_path


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_dir(mlx_path: Path, fill: Callable[[Path], None], info: dict) -> Path:
    """fill(tmp) writes the files into a temporary sibling directory; `info` (where the weights
    came from) is written last, as CONVERSION_INFO_FILE, then the directory is renamed into
    place, replacing what was there. An interrupted conversion leaves no half-written output."""
    parent = mlx_path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".{mlx_path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
    except OSError as e:
        raise MlxSpecError(f"cannot write to {parent}: {e.strerror or e}") from None
    try:
        fill(tmp)
        write_json(tmp / CONVERSION_INFO_FILE, info)
        _replace_dir(tmp, mlx_path)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise MlxSpecError(f"cannot write {mlx_path}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return mlx_path


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished `src` dir to `dst`, replacing what is there (rename, not copy)."""
    old = None
    if dst.exists():
        if dst.is_dir() and not any(dst.iterdir()):
            dst.rmdir()
        else:
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            if old.exists():
                shutil.rmtree(old)
            os.rename(dst, old)
    try:
        os.rename(src, dst)
    except OSError:
        if old is not None:
            os.rename(old, dst)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
