import os

# Two xdist workers on two cores: each would run OpenBLAS with a thread per core, four busy
# threads on two cores (15 of 55 CPU-minutes went to the system). One BLAS thread per worker
# (set before OpenBLAS loads; servers and CLIs the tests start inherit it), unless given.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

# mlx_spec loads OpenBLAS before mlx.core is first imported (DESIGN.md: ~30x faster fp32
# matmuls on Linux); conftest runs before any test module imports mlx.
import mlx_spec  # noqa: E402,F401
