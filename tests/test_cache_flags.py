"""mlx-lm's cache flags under speculation, token for token as plain mlx-lm with the same flags.
- Its quantized KV cache (--kv-bits, --kv-group-size, --quantized-kv-start): the cache switches
  to QuantizedKVCache where mlx-lm's generate_step switches it and a verification pass never
  crosses the switch (at 2 bits a crossing pass changes the output); chains from lookup, a draft
  model and an MTP module; trees and sliding windows are refused in one line. (On these tiny
  models no K/V lies within float32's last bits of a rounding step; on a real model one can,
  and the output then follows mlx-lm's only up to rounding: benchmarks/kv_quantization_rounding.py.)
- Its bounded cache (--max-kv-size: the first 4 positions and a window): verification passes
  masked as one-token decoding, far past the size, prompts longer than it, conversations."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache
from test_mtp import write_published
from test_windowed import WINDOWED
from tiny import ScriptedDrafter, run, tiny_target

from mlx_spec.cache import KVQuantization
from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.drafters.eagle import EagleDrafter
from mlx_spec.drafters.lookup import LookupDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.mtp import load_mtp
from mlx_spec.sampling import SamplingParams

KV = KVQuantization(bits=2, group_size=32, start=24)
PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5]
LONG_PROMPT = PROMPT * 3          # past the switch already at prefill


def target_32():
    """head_dim 32: mx.quantize groups of 32 along it."""
    return tiny_target(num_attention_heads=2, scale=3.0)


def mlx_lm_greedy(model, prompt, max_tokens, kv=KV):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, kv_bits=kv.bits,
                                             kv_group_size=kv.group_size, quantized_kv_start=kv.start)]


def drafters(target, tmp_path):
    return {"none": lambda: None, "lookup": lambda: LookupDrafter(),
            "draft-model": lambda: DraftModelDrafter(tiny_target(num_attention_heads=2, seed=1, scale=3.0),
                                                     target.vocab_size),
            "same-model": lambda: DraftModelDrafter(target, target.vocab_size)}


@pytest.mark.parametrize("source", ["none", "lookup", "draft-model", "same-model"])
@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["switch-while-decoding", "switch-at-prefill"])
def test_chains_equal_mlx_lm_with_the_same_flags(tmp_path, source, prompt):
    target = target_32()
    engine = Engine(target, drafters(target, tmp_path)[source](), num_draft_tokens=4, adaptive=False,
                    kv_quantization=KV)
    tokens, stats = run(engine, prompt, 40)
    assert tokens == mlx_lm_greedy(target.model, prompt, 40)
    assert all(isinstance(c, QuantizedKVCache) for c in engine.cache)   # the switch happened
    assert source == "none" or stats.proposed > 0


def test_an_mtp_module_drafts_over_a_quantized_cache(tmp_path, monkeypatch):
    import test_mtp

    monkeypatch.setitem(test_mtp.ARCHS, "llama", ("deepseek", dict(num_attention_heads=2)))   # head_dim 32
    path, target, _, _ = write_published(tmp_path, "llama")
    engine = Engine(target, EagleDrafter(load_mtp(path, target), target.vocab_size), num_draft_tokens=3,
                    adaptive=False, kv_quantization=KV)
    assert run(engine, PROMPT, 40)[0] == mlx_lm_greedy(target.model, PROMPT, 40)


def test_a_pass_never_crosses_the_switch():
    """Every draft accepted (the target's own tokens, scripted): the step that reaches the
    switch is cut to end right before it, as plain decoding computes those positions."""
    target = target_32()
    expected = mlx_lm_greedy(target.model, PROMPT, 30)
    engine = Engine(target, ScriptedDrafter(expected, 10**6, target.vocab_size), num_draft_tokens=6,
                    adaptive=False, kv_quantization=KV)
    start, starts_and_widths, tokens = len(PROMPT) - 1, [], []
    for event in engine.generate(PROMPT, max_tokens=30):
        if event[0] == "step":       # (step, drafts verified, accepted): the pass computed 1 + drafts
            starts_and_widths.append((start, event[1] + 1))
            start += event[2] + 1
        elif event[0] == "token":
            tokens.append(event[1])
    assert tokens == expected
    for first, width in starts_and_widths:
        assert first + width <= KV.start or first >= KV.start, (first, width)
    assert KV.start in [first for first, _ in starts_and_widths]   # the switch fell between two passes


def test_a_conversation_and_seeded_sampling_equal_draft_none():
    target = target_32()
    params = SamplingParams(temp=1.0)
    plain = Engine(target, kv_quantization=KV, sampling=params, seed=3)
    lookup = Engine(target, LookupDrafter(), num_draft_tokens=4, adaptive=False, kv_quantization=KV,
                    sampling=params, seed=3)
    context = list(PROMPT)
    for turn in range(3):
        expected = run(plain, context, 16, seed=turn)[0]
        assert run(lookup, context, 16, seed=turn)[0] == expected, turn
        context += expected + [3, 4]


def test_refusals():
    target = target_32()
    drafter = ScriptedDrafter([], 1, 32)
    drafter.tree = True
    with pytest.raises(MlxSpecError, match="tree drafts need a plain KV cache, which --kv-bits quantizes"):
        Engine(target, drafter, kv_quantization=KV)
    windowed = tiny_target("gemma3_text", scale=3.0, **WINDOWED["gemma3_text"])
    with pytest.raises(MlxSpecError, match="--kv-bits: mlx-lm cannot quantize the RotatingKVCache"):
        Engine(windowed, LookupDrafter(), kv_quantization=KV)
    with pytest.raises(MlxSpecError, match="--kv-bits must be"):
        KVQuantization(bits=7)


# --- --max-kv-size: mlx-lm's RotatingKVCache(max_kv_size, keep=4) --------------------------------

WINDOW = 16


def qwen3_target(seed=0):
    """mlx-lm's llama builds its own cache (ignoring max_kv_size); its qwen3 does not."""
    return tiny_target("qwen3", seed=seed, scale=3.0)


def mlx_lm_bounded(model, prompt, max_tokens):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, max_kv_size=WINDOW)]


@pytest.mark.parametrize("source", ["none", "lookup", "draft-model", "same-model"])
@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["short-prompt", "prompt-past-the-window"])
def test_a_bounded_cache_equals_mlx_lm_past_its_size(tmp_path, source, prompt):
    target = qwen3_target()
    drafter = {"none": None, "lookup": LookupDrafter(), "draft-model": DraftModelDrafter(qwen3_target(1), 32),
               "same-model": DraftModelDrafter(target, 32)}[source]
    engine = Engine(target, drafter, num_draft_tokens=4, adaptive=False, max_kv_size=WINDOW)
    tokens, stats = run(engine, prompt, 48)
    assert tokens == mlx_lm_bounded(target.model, prompt, 48)
    assert all(type(c).__name__ == "BoundedKVCache" for c in engine.cache)
    assert source in ("none", "draft-model") or stats.accepted > 0


def test_a_bounded_conversation_and_seeded_sampling_equal_draft_none():
    target = qwen3_target()
    params = SamplingParams(temp=1.0)
    plain = Engine(target, max_kv_size=WINDOW, sampling=params, seed=3)
    model = Engine(target, DraftModelDrafter(target, target.vocab_size), num_draft_tokens=4, adaptive=False,
                   max_kv_size=WINDOW, sampling=params, seed=3)
    context = list(PROMPT)
    for turn in range(3):
        expected = run(plain, context, 20, seed=turn)[0]
        assert run(model, context, 20, seed=turn)[0] == expected, turn
        context += expected + [3, 4]
