# mlx_spec loads OpenBLAS before mlx.core is first imported (DESIGN.md: ~30x faster fp32
# matmuls on Linux); conftest runs before any test module imports mlx.
import mlx_spec  # noqa: F401
