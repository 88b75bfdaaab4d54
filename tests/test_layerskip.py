"""LayerSkip self-speculation on tiny mlx-lm models: token-identical output, the shared cache
equal to a plain run after every step, the early layers run once per position, exact sampling,
and bad input refused before the first token."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from exactness import STRICT, VOCAB, repeated_prompt, sampling_pvalue
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.layerskip import LayerSkipDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.events import Step
from mlx_spec.sampling import SamplingParams
from test_windowed import target_of
from tiny import plain_greedy, run, tiny_target

PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5]
LAYERS = 4


@pytest.fixture(scope="module")
def target():
    return tiny_target(num_layers=LAYERS, scale=3.0, seed=1)


def quiet_after(exit_layer, **kwargs):
    """A target whose layers from exit_layer on barely change the residual stream: the early
    exit then mostly drafts the target's own tokens (accepted drafts, rejected ones too)."""
    target = tiny_target(num_layers=LAYERS, scale=3.0, **kwargs)
    for layer in target.model.model.layers[exit_layer:]:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * 0.05
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 0.05
    return target


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
@pytest.mark.parametrize("k,adaptive", [(1, False), (3, False), (5, False), (4, True)])
def test_greedy_is_token_identical(exit_layer, k, adaptive):
    target = quiet_after(exit_layer, seed=1)
    engine = Engine(target, LayerSkipDrafter(target, exit_layer), num_draft_tokens=k, adaptive=adaptive)
    expected = plain_greedy(target.model, PROMPT, 40)
    assert run(engine, PROMPT, 40)[0] == expected
    more = PROMPT + expected + [3, 4]  # the next turn of the session
    assert run(engine, more, 12)[0] == plain_greedy(target.model, more, 12)
    assert run(engine, [7], 8)[0] == plain_greedy(target.model, [7], 8)


class Counted:
    """Counts the positions a layer runs over."""

    def __init__(self, layer):
        self.layer, self.positions = layer, 0

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def __call__(self, x, *args, **kwargs):
        self.positions += x.shape[1]
        return self.layer(x, *args, **kwargs)


def test_cache_equals_a_plain_run_and_early_layers_run_once():
    exit_layer = 2
    target = quiet_after(exit_layer, seed=1)
    layers = target.model.model.layers
    originals = list(layers)
    layers[0], layers[exit_layer] = Counted(layers[0]), Counted(layers[exit_layer])
    try:
        engine = Engine(target, LayerSkipDrafter(target, exit_layer), num_draft_tokens=3, adaptive=False)
        steps = accepted = 0
        for event in engine.generate(PROMPT, max_tokens=40):
            if not isinstance(event, Step):
                continue
            steps, accepted = steps + 1, accepted + event.accepted
            # Every layer's cache holds exactly what a plain pass over the cached tokens puts there.
            plain = make_prompt_cache(target.model)
            target.model(mx.array(engine.cached_tokens)[None], cache=plain)
            for ours, theirs in zip(engine.cache, plain):
                assert ours.offset == theirs.offset == len(engine.cached_tokens)
                for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                    assert np.allclose(
                        np.array(a[..., : ours.offset, :]), np.array(b[..., : theirs.offset, :]), atol=1e-4
                    )
        # Drafting ran positions through the early layers that verification did not run again:
        # the first layer saw exactly the positions the exit layer saw (a naive drafter would
        # run every drafted position through the early layers twice).
        assert 5 < accepted < 3 * steps  # some drafts accepted, some rejected
        assert layers[0].positions == layers[exit_layer].positions
    finally:
        layers[:] = originals


def test_exact_sampling():
    target = quiet_after(2, vocab_size=VOCAB, seed=2)
    prompt, params = repeated_prompt(), SamplingParams(temp=1.0)
    engine = Engine(
        target, LayerSkipDrafter(target, 2), num_draft_tokens=3, sampling=params, seed=1, adaptive=False
    )
    pvalue = sampling_pvalue(engine, prompt, params)
    assert pvalue > STRICT, f"p = {pvalue:.2e}"


def test_bad_input(target):
    for bad in (0, LAYERS, -1):
        with pytest.raises(MlxSpecError, match=f"--exit-layer must lie in 1..{LAYERS - 1}"):
            make_drafter("layerskip", target, {"exit_layer": bad})
    with pytest.raises(MlxSpecError, match="needs --exit-layer"):
        make_drafter("layerskip", target, {})
    windowed = target_of("gemma3_text")
    with pytest.raises(MlxSpecError, match="plain KV caches"):
        Engine(windowed, LayerSkipDrafter(windowed, 1))
