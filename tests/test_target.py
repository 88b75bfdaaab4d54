import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tiny import tiny_target


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_taps_equal_layer_by_layer(arch):
    target = tiny_target(arch, num_layers=4)
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    logits, taps = target.forward(tokens, make_prompt_cache(target.model), taps=(-1, 0, 1, 2, 3))

    # The same computation, written out: embedding, each layer with a causal mask, norm, head.
    inner = target.model.model
    h = inner.embed_tokens(tokens)
    expected = {-1: h}
    for i, layer in enumerate(inner.layers):
        h = layer(h, "causal", cache=None)
        expected[i] = h
    assert sorted(taps) == sorted(expected)
    for i in expected:
        assert mx.allclose(taps[i], expected[i], atol=1e-5).item(), i
    assert mx.allclose(logits, target.model(tokens), atol=1e-5).item()
    assert mx.allclose(logits, target.head(expected[3]), atol=1e-4).item()
    # Layers are restored after the tapped pass.
    assert all(type(layer).__name__ == "TransformerBlock" for layer in target.layers)


def test_taps_with_cache_match_one_pass():
    target = tiny_target("llama")
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    _, whole = target.forward(tokens, make_prompt_cache(target.model), taps=(1,))
    cache = make_prompt_cache(target.model)
    _, first = target.forward(tokens[:, :5], cache, taps=(1,))
    _, rest = target.forward(tokens[:, 5:], cache, taps=(1,))
    joined = mx.concatenate([first[1], rest[1]], axis=1)
    # The scaled random weights give activations near 100; OpenBLAS sums a 5-row and an 8-row
    # product in different orders, so the float32 agreement is relative (a wrong tap is off by O(1)).
    assert mx.allclose(joined, whole[1], rtol=1e-4, atol=1e-4).item()


def test_tap_outside_model_is_an_error():
    from mlx_spec.errors import MlxSpecError

    target = tiny_target("llama", num_layers=2)
    with pytest.raises(MlxSpecError, match="outside"):
        target.forward(mx.array([[1, 2]]), make_prompt_cache(target.model), taps=(5,))


def test_importing_mlx_before_mlx_spec_is_named():
    """Imported after mlx.core, mlx_spec can no longer give MLX an optimized BLAS: it says so
    in one warning where there was one to load (and loads nothing)."""
    import subprocess
    import sys

    def python(code):
        out = subprocess.run(
            [sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return out

    available = python("import mlx_spec; print(mlx_spec.BLAS_PATH)").stdout.strip() != "None"
    late = python("import mlx.core, mlx_spec; print(mlx_spec.BLAS_PATH)")
    assert late.stdout.strip() == "None"
    assert ("import mlx_spec first" in late.stderr) == available
