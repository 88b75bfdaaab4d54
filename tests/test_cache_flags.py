"""mlx-lm's cache flags.
- Its quantized KV cache (--kv-bits, --kv-group-size, --quantized-kv-start): plain decoding
  through the engine switches the cache where mlx-lm's generate_step switches it and prints
  mlx-lm's tokens; speculation over it is refused in one line (a verification pass's K/V are
  one-token decoding's only up to float32's last bits, which quantization rounds apart:
  benchmarks/kv_quantization_rounding.py), as are sliding windows, which mlx-lm cannot quantize.
- Its bounded cache (--max-kv-size: the first 4 positions and a window): verification passes
  masked as one-token decoding, far past the size, prompts longer than it, conversations."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from mlx_spec.cache import KVQuantization
from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.drafters.eagle import EagleDrafter
from mlx_spec.drafters.lookup import LookupDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.mtp import load_mtp
from mlx_spec.sampling import SamplingParams
from test_mtp import write_published
from test_windowed import WINDOWED
from tiny import ScriptedDrafter, run, tiny_target

KV = KVQuantization(bits=2, group_size=32, start=24)
PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5]
LONG_PROMPT = PROMPT * 3  # past the switch already at prefill


def target_32():
    """head_dim 32: mx.quantize groups of 32 along it."""
    return tiny_target(num_attention_heads=2, scale=3.0)


def mlx_lm_greedy(model, prompt, max_tokens, kv=KV):
    return [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt),
            model,
            max_tokens=max_tokens,
            kv_bits=kv.bits,
            kv_group_size=kv.group_size,
            quantized_kv_start=kv.start,
        )
    ]


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["switch-while-decoding", "switch-at-prefill"])
def test_plain_decoding_equals_mlx_lm_with_the_same_flags(prompt):
    target = target_32()
    engine = Engine(target, kv_quantization=KV)
    assert run(engine, prompt, 40)[0] == mlx_lm_greedy(target.model, prompt, 40)
    assert all(isinstance(c, QuantizedKVCache) for c in engine.cache)  # the switch happened
    # A conversation goes on over the same cache, as mlx-lm's chat goes on over its prompt cache
    # (which holds every token generate_step yielded: it computed the one after the last).
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(target.model)
    first = [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt),
            target.model,
            max_tokens=40,
            prompt_cache=cache,
            kv_bits=KV.bits,
            kv_group_size=KV.group_size,
            quantized_kv_start=KV.start,
        )
    ]
    second = [
        int(t)
        for t, _ in generate_step(
            mx.array([3, 4]),
            target.model,
            max_tokens=20,
            prompt_cache=cache,
            kv_bits=KV.bits,
            kv_group_size=KV.group_size,
            quantized_kv_start=KV.start,
        )
    ]
    assert run(engine, prompt + first + [3, 4], 20)[0] == second


def test_refusals(tmp_path, monkeypatch):
    """Speculation of every kind over a quantized cache, before any token; sliding windows."""
    import test_mtp

    target = target_32()
    monkeypatch.setitem(test_mtp.ARCHS, "llama", ("deepseek", dict(num_attention_heads=2)))
    path, mtp_target, _, _ = write_published(tmp_path, "llama")
    tree = ScriptedDrafter([], 1, 32)
    tree.tree = True
    for drafter, over in (
        (LookupDrafter(), target),
        (DraftModelDrafter(target, target.vocab_size), target),
        (tree, target),
        (EagleDrafter(load_mtp(path, mtp_target), 32), mtp_target),
    ):
        with pytest.raises(
            MlxSpecError, match="--kv-bits: a verification pass computes keys and values equal"
        ):
            Engine(over, drafter, kv_quantization=KV)
    windowed = tiny_target("gemma3_text", scale=3.0, **WINDOWED["gemma3_text"])
    with pytest.raises(MlxSpecError, match="--kv-bits: mlx-lm cannot quantize the RotatingKVCache"):
        Engine(windowed, kv_quantization=KV)
    with pytest.raises(MlxSpecError, match="--kv-bits must be"):
        KVQuantization(bits=7)


# --- --max-kv-size: mlx-lm's RotatingKVCache(max_kv_size, keep=4) --------------------------------

WINDOW = 16


def qwen3_target(seed=0):
    """mlx-lm's llama builds its own cache (ignoring max_kv_size); its qwen3 does not."""
    return tiny_target("qwen3", seed=seed, scale=3.0)


def mlx_lm_bounded(model, prompt, max_tokens):
    return [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, max_kv_size=WINDOW)
    ]


def feature_drafter(source, target, tmp_path):
    """EAGLE-3 (a random layer) or DFlash (DDTree's block drafter, as a chain) on `target`."""
    from mlx_spec.drafters.dflash import DFlashDrafter
    from test_windowed import random_feature_models

    eagle, dflash = random_feature_models(target, tmp_path)
    return EagleDrafter(eagle, target.vocab_size) if source == "eagle" else DFlashDrafter(target, dflash)


@pytest.mark.parametrize("source", ["none", "lookup", "draft-model", "same-model", "eagle", "dflash"])
@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["short-prompt", "prompt-past-the-window"])
def test_a_bounded_cache_equals_mlx_lm_past_its_size(tmp_path, source, prompt):
    target = qwen3_target()
    drafter = (
        feature_drafter(source, target, tmp_path)
        if source in ("eagle", "dflash")
        else {
            "none": None,
            "lookup": LookupDrafter(),
            "draft-model": DraftModelDrafter(qwen3_target(1), 32),
            "same-model": DraftModelDrafter(target, 32),
        }[source]
    )
    engine = Engine(target, drafter, num_draft_tokens=4, adaptive=False, max_kv_size=WINDOW)
    tokens, stats = run(engine, prompt, 48)
    assert tokens == mlx_lm_bounded(target.model, prompt, 48)
    assert all(type(c).__name__ == "BoundedKVCache" for c in engine.cache)
    assert source in ("none", "draft-model", "eagle", "dflash") or stats.accepted_drafts > 0
    assert source == "none" or stats.verified_drafts > 0


def test_a_bounded_conversation_and_seeded_sampling_equal_draft_none():
    target = qwen3_target()
    params = SamplingParams(temp=1.0)
    plain = Engine(target, max_kv_size=WINDOW, sampling=params, seed=3)
    model = Engine(
        target,
        DraftModelDrafter(target, target.vocab_size),
        num_draft_tokens=4,
        adaptive=False,
        max_kv_size=WINDOW,
        sampling=params,
        seed=3,
    )
    context = list(PROMPT)
    for turn in range(3):
        expected = run(plain, context, 20, seed=turn)[0]
        assert run(model, context, 20, seed=turn)[0] == expected, turn
        context += expected + [3, 4]


def test_a_tree_pass_over_a_bounded_cache_equals_bounded_decoding_of_each_path():
    """Past the size: every node's logits are those of one-token decoding of its path over
    mlx-lm's bounded cache; after compaction the cache holds what that decoding holds."""
    from mlx_spec.cache import make_cache
    from mlx_spec.tree import Tree, compact, tree_forward
    from test_tree import PARENTS

    target, tree = qwen3_target(), Tree(PARENTS)
    context = LONG_PROMPT[:30]  # past the window of 16
    node_tokens = [context[-1], 7, 8, 9, 10, 11, 12, 13]

    def decoded(tokens):
        """Bounded one-token decoding after a prefill of context[:-1]: (last logits, cache)."""
        cache = make_cache(target.model, WINDOW)
        target.model(mx.array(context[:-1])[None], cache=cache)
        for token in tokens:
            logits = target.model(mx.array([[token]]), cache=cache)
        return logits[0, -1], cache

    for accepted in (7, 6, 0):
        cache = make_cache(target.model, WINDOW)
        target.model(mx.array(context[:-1])[None], cache=cache)
        logits, _ = tree_forward(target, mx.array(node_tokens), tree, cache)
        for node in range(len(tree)):
            expected, _ = decoded([node_tokens[i] for i in tree.path_to(node)])
            assert mx.allclose(logits[0, node], expected, atol=1e-4).item(), node
        path = tree.path_to(accepted)
        compact(cache, len(context) - 1, path, len(tree))
        _, plain = decoded([node_tokens[i] for i in path])
        for ours, theirs in zip(cache, plain):
            assert ours.offset == theirs.offset
            a, b = ours._temporal_order(ours.keys), theirs._temporal_order(theirs.keys)
            n = WINDOW - 1  # the window a next token sees besides itself
            assert mx.allclose(a[..., :4, :], b[..., :4, :], atol=1e-4).item()
            assert mx.allclose(a[..., -(n - 4) :, :], b[..., -(n - 4) :, :], atol=1e-4).item()


@pytest.mark.parametrize("source", ["scripted", "eagle-tree"])
def test_trees_over_a_bounded_cache_equal_mlx_lm_past_its_size(tmp_path, source):
    from test_tree import ScriptedTreeDrafter
    from test_windowed import random_feature_models

    target = qwen3_target()
    expected = mlx_lm_bounded(target.model, LONG_PROMPT, 48)
    if source == "scripted":
        drafter = ScriptedTreeDrafter(expected, 32)
    else:
        drafter = EagleDrafter(
            random_feature_models(target, tmp_path)[0], target.vocab_size, tree_budget=12, tree_topk=3
        )
    engine = Engine(target, drafter, num_draft_tokens=4, adaptive=False, max_kv_size=WINDOW)
    tokens, stats = run(engine, LONG_PROMPT, 48)
    assert tokens == expected
    assert stats.drafted_tokens > 0 and (source != "scripted" or stats.tokens_per_step > 3)
    if source == "eagle-tree":  # seeded sampling: what --draft none --seed S prints
        params = SamplingParams(temp=1.0)
        plain = run(Engine(target, max_kv_size=WINDOW, sampling=params, seed=3), LONG_PROMPT, 40)[0]
        engine = Engine(
            target, drafter, num_draft_tokens=4, adaptive=False, max_kv_size=WINDOW, sampling=params, seed=3
        )
        assert run(engine, LONG_PROMPT, 40)[0] == plain
