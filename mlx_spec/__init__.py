"""mlx-spec: lossless speculative decoding on MLX."""

import ctypes
import glob
import os
import sys
import warnings


def _load_optimized_blas():
    # The Linux mlx[cpu] wheel links a reference BLAS (fp32 1024^3 matmul: ~370 ms). Loading
    # OpenBLAS globally before mlx.core is imported makes MLX resolve its BLAS symbols there
    # (~12 ms). Set MLX_SPEC_NO_OPENBLAS=1 to opt out.
    if not sys.platform.startswith("linux") or os.environ.get("MLX_SPEC_NO_OPENBLAS"):
        return None
    patterns = [
        "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
        "/usr/lib/*-linux-gnu/libopenblas.so.0",
        "/usr/lib64/libopenblas.so.0",
    ]
    found = [path for pattern in patterns for path in sorted(glob.glob(pattern))]
    if "mlx.core" in sys.modules:
        # Too late: MLX has resolved its BLAS symbols. Silent, this halves the speed of a script
        # that imports mlx first (the target's output layer: 25 ms instead of 11 ms here).
        if found:
            warnings.warn(
                "mlx.core was imported before mlx_spec, so MLX keeps its reference BLAS "
                "(float32 matmuls 2-30x slower on the CPU): import mlx_spec first",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    for path in found:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        except OSError:
            continue
    return None


BLAS_PATH = _load_optimized_blas()

__version__ = "0.1.0"

__all__ = ["load", "generate", "stream_generate", "batch_generate", "GenerationResponse", "BatchResponse"]


def __getattr__(name):
    # The Python API (api.py), imported on first use: `import mlx_spec` stays light for the CLI.
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'mlx_spec' has no attribute {name!r}")
