"""Medusa heads in their published layouts (FasterDecoding, its whole-model save, vLLM, the
compact variant), on tiny random targets: the same heads whatever the layout, logits as the
reference defines them, token-identical greedy output (chains and trees), exact sampling, and
bad input."""

import json

import mlx.core as mx
import numpy as np
import pytest

from exactness import STRICT, VOCAB, repeated_prompt, sampling_pvalue
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.medusa import MedusaDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.medusa import load_medusa
from mlx_spec.sampling import SamplingParams
from tiny import plain_greedy, run, tiny_target

PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5]
HEADS, LAYERS = 4, 1


def random_heads(hidden, vocab, seed=0, heads=HEADS, layers=LAYERS, compact=False):
    """FasterDecoding's names: {i}.{j}.linear.{weight,bias}, {i}.{layers}.weight."""
    rng = np.random.default_rng(seed)
    w = {}
    for i in range(heads):
        for j in range(layers):
            w[f"{i}.{j}.linear.weight"] = mx.array(
                rng.standard_normal((hidden, hidden)) / np.sqrt(hidden), mx.float32
            )
            w[f"{i}.{j}.linear.bias"] = mx.array(rng.standard_normal(hidden) * 0.1, mx.float32)
        if not compact:
            w[f"{i}.{layers}.weight"] = mx.array(
                rng.standard_normal((vocab, hidden)) * 3 / np.sqrt(hidden), mx.float32
            )
    return w


def write(path, weights, layout="fasterdecoding", heads=HEADS, layers=LAYERS, extra=None):
    path.mkdir(parents=True)
    if layout == "vllm":
        renamed = {}
        for name, w in weights.items():
            i, j, *rest = name.split(".")
            renamed[f"lm_heads.{i}.weight" if int(j) == layers else f"blocks.{i}.layers.{j}.{rest[-1]}"] = w
        config = {"model_type": "medusa", "num_heads": heads, "num_hidden_layers": layers}
        mx.save_safetensors(str(path / "model.safetensors"), renamed)
    else:
        prefix = "medusa_head." if layout == "whole-model" else ""
        config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}
        mx.save_safetensors(
            str(path / "medusa_lm_head.safetensors"), {prefix + k: v for k, v in weights.items()}
        )
    (path / "config.json").write_text(json.dumps({**config, **(extra or {})}))
    return path


@pytest.fixture(scope="module")
def target():
    return tiny_target(scale=3.0)


def reference_logits(target, weights, hidden_prenorm, heads=HEADS, layers=LAYERS):
    """FasterDecoding's forward: hidden = base model output (normed); head i = ResBlocks then
    its linear (or the target's lm_head, compact)."""
    h = target.model.model.norm(hidden_prenorm)
    out = []
    for i in range(heads):
        x = h
        for j in range(layers):
            x = x + nn_silu(x @ weights[f"{i}.{j}.linear.weight"].T + weights[f"{i}.{j}.linear.bias"])
        head = weights.get(f"{i}.{layers}.weight")
        out.append(x @ head.T if head is not None else target.model.lm_head(x))
    return mx.stack(out)


def nn_silu(x):
    return x * mx.sigmoid(x)


@pytest.mark.parametrize("compact", [False, True], ids=["own-heads", "compact"])
def test_layouts_load_the_same_heads(target, tmp_path, compact):
    weights = random_heads(64, 32, compact=compact)
    hidden = mx.random.normal((1, 3, 64), key=mx.random.key(1))
    expected = np.array(reference_logits(target, weights, hidden))
    layouts = ["fasterdecoding", "whole-model"] + ([] if compact else ["vllm"])
    for layout in layouts:
        model = load_medusa(write(tmp_path / layout, weights, layout), target)
        assert model.args.shared_head == compact
        got = np.array(model(model.fuse(hidden), HEADS))
        assert np.allclose(got, expected, atol=1e-4), layout


@pytest.mark.parametrize("tree_budget", [0, 5, 12], ids=["chain", "tree5", "tree12"])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_greedy_is_token_identical(target, tmp_path, tree_budget, k):
    model = load_medusa(write(tmp_path / "m", random_heads(64, 32)), target)
    engine = Engine(
        target,
        MedusaDrafter(target, model, tree_budget=tree_budget, tree_topk=3),
        num_draft_tokens=k,
        adaptive=False,
    )
    expected = plain_greedy(target.model, PROMPT, 40)
    tokens, stats = run(engine, PROMPT, 40)
    assert tokens == expected
    more = PROMPT + tokens + [3, 4]  # a second turn in the same session
    assert run(engine, more, 10)[0] == plain_greedy(target.model, more, 10)
    assert run(engine, [5], 8)[0] == plain_greedy(target.model, [5], 8)  # a one-token prompt


def test_heads_that_copy_the_target_are_accepted(tmp_path):
    """Heads whose drafts are the target's own tokens (a tiny target that repeats itself)
    are accepted: the drafts line up with the positions they are verified at."""
    target = tiny_target(scale=0.3, seed=1)  # weak weights: greedy text settles on one token
    expected = plain_greedy(target.model, PROMPT, 60)
    # Heads of zero blocks with the target's own output layer: head i drafts what the target
    # would say next from the same state, right whenever the text has become one token repeated.
    path = write(tmp_path / "c", {}, layers=0, extra={"medusa_shared_head": True})
    engine = Engine(
        target, MedusaDrafter(target, load_medusa(path, target)), num_draft_tokens=3, adaptive=False
    )
    tokens, stats = run(engine, PROMPT, 60)
    assert tokens == expected and expected[-25:] == [expected[-1]] * 25
    assert stats.accepted_drafts > 15


# Chains draw as DFlash's do (tested there); the tree is `slow` since 2026-12-07: Medusa's tree
# samples exactly in tests/test_vocabulary.py (with a reduced vocabulary, the same tree rule).
@pytest.mark.parametrize("tree_budget", [pytest.param(6, marks=pytest.mark.slow)], ids=["tree"])
def test_exact_sampling(tmp_path, tree_budget):
    target, prompt, params = (
        tiny_target(vocab_size=VOCAB, scale=2.0, seed=4),
        repeated_prompt(),
        SamplingParams(temp=1.0),
    )
    model = load_medusa(write(tmp_path / "m", random_heads(64, VOCAB, seed=2)), target)
    engine = Engine(
        target,
        MedusaDrafter(target, model, tree_budget=tree_budget, tree_topk=2),
        num_draft_tokens=3,
        sampling=params,
        seed=1,
        adaptive=False,
    )
    pvalue = sampling_pvalue(engine, prompt, params)
    assert pvalue > STRICT, f"p = {pvalue:.2e}"


def test_bad_input(target, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    (pickled / "medusa_lm_head.pt").write_bytes(b"\x80\x04not opened")
    with pytest.raises(MlxSpecError, match="pickle.*safetensors"):
        load_medusa(pickled, target)
    with pytest.raises(MlxSpecError, match="hidden size 32"):
        load_medusa(write(tmp_path / "h", random_heads(32, 32)), target)
    with pytest.raises(MlxSpecError, match="48 tokens"):
        load_medusa(write(tmp_path / "v", random_heads(64, 48)), target)
    bad = write(tmp_path / "t", random_heads(64, 32))
    data = (bad / "medusa_lm_head.safetensors").read_bytes()
    (bad / "medusa_lm_head.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(MlxSpecError, match="cannot read"):
        load_medusa(bad, target)
    corrupt = write(tmp_path / "c", random_heads(64, 32), extra={"medusa_num_heads": "four"})
    with pytest.raises(MlxSpecError, match="corrupt Medusa config"):
        load_medusa(corrupt, target)


def test_registry(target, tmp_path):
    path = write(tmp_path / "m", random_heads(64, 32))
    drafter = make_drafter("medusa", target, {"draft_model": str(path), "tree_budget": 8})
    assert isinstance(drafter, MedusaDrafter) and drafter.tree
    with pytest.raises(MlxSpecError, match="--draft-model"):
        make_drafter("medusa", target, {})


def test_converted_and_quantized_heads_load(target, tmp_path):
    from mlx_spec.convert.drafter import convert_drafter

    source = write(tmp_path / "m", random_heads(64, 32), layout="whole-model")
    out = convert_drafter(source, tmp_path / "q8", target, quantize=True, q_bits=8, q_group_size=32)
    model = load_medusa(out, target)
    assert "scales" in model.blocks[0][0].linear and "scales" in model.lm_heads[0]
    floats = np.array(load_medusa(source, target)(mx.ones((1, 64)), HEADS))
    assert np.abs(np.array(model(mx.ones((1, 64)), HEADS)) - floats).max() < 0.05 * np.abs(floats).max()
    engine = Engine(target, MedusaDrafter(target, model), num_draft_tokens=3, adaptive=False)
    assert run(engine, PROMPT, 20)[0] == plain_greedy(target.model, PROMPT, 20)
    # A reduced draft vocabulary goes along, over the quantized heads' rows.
    from mlx_spec.models import vocabulary

    vocabulary.write(source, np.arange(0, 32, 2))
    out = convert_drafter(source, tmp_path / "q8v", target, quantize=True, q_bits=8, q_group_size=32)
    model = load_medusa(out, target)
    assert model.draft_ids.tolist() == list(range(0, 32, 2))
    engine = Engine(target, MedusaDrafter(target, model), num_draft_tokens=3, adaptive=False)
    assert run(engine, PROMPT, 20)[0] == plain_greedy(target.model, PROMPT, 20)
