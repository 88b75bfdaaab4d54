"""mlx-spec: lossless speculative decoding on MLX."""

import ctypes
import glob
import os
import sys


def _load_optimized_blas():
    # The Linux mlx[cpu] wheel links a reference BLAS (fp32 1024^3 matmul: ~370 ms). Loading
    # OpenBLAS globally before mlx.core is imported makes MLX resolve its BLAS symbols there
    # (~12 ms). Set MLX_SPEC_NO_OPENBLAS=1 to opt out.
    if not sys.platform.startswith("linux") or os.environ.get("MLX_SPEC_NO_OPENBLAS"):
        return None
    if "mlx.core" in sys.modules:
        return None
    patterns = [
        "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
        "/usr/lib/*-linux-gnu/libopenblas.so.0",
        "/usr/lib64/libopenblas.so.0",
    ]
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return path
            except OSError:
                continue
    return None


BLAS_PATH = _load_optimized_blas()

__version__ = "0.1.0"
