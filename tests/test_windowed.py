"""Targets whose caches are not plain KV caches: sliding windows (Gemma 3, gpt-oss alternating
windows, Llama 4's chunked attention) and recurrent layers (Qwen3-Next, Qwen3.5, Mamba-2, Falcon-H1, LFM2), built from
mlx-lm's own classes with tiny random weights, with contexts well past the window. Every output
is plain mlx-lm's, token for token, or refused in one line before any token."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.cache import rollback_to
from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.drafters.lookup import LookupDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.events import Collector, Step
from tiny import ScriptedDrafter, plain_greedy, run, tiny_target

WINDOW = 8
WINDOWED = {
    "gemma3_text": dict(
        head_dim=16,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        query_pre_attn_scalar=16,
        num_hidden_layers=4,
    ),
    "gpt_oss": dict(
        head_dim=16,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    # chunked attention (ChunkedKVCache, which drops the previous chunk) in three layers of four
    "llama4": dict(
        num_hidden_layers=4,
        text_config=dict(
            model_type="llama4_text",
            hidden_size=64,
            num_hidden_layers=4,
            intermediate_size=128,
            head_dim=16,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=32,
            max_position_embeddings=1024,
            rope_theta=10000.0,
            rope_scaling=None,
            attention_bias=False,
            attention_chunk_size=WINDOW,
            interleave_moe_layer_step=2,
            intermediate_size_mlp=128,
            num_experts_per_tok=1,
            num_local_experts=2,
            use_qk_norm=True,
        ),
    ),
}
RECURRENT = {
    "qwen3_next": dict(
        head_dim=16,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        partial_rotary_factor=0.25,
        full_attention_interval=2,
        num_hidden_layers=4,
    ),
    "qwen3_5": dict(
        head_dim=16,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        full_attention_interval=2,
        num_hidden_layers=4,
    ),
    "mamba2": dict(
        num_heads=4,
        head_dim=16,
        intermediate_size=64,
        state_size=16,
        layer_norm_epsilon=1e-5,
        conv_kernel=4,
        n_groups=1,
        use_bias=False,
        use_conv_bias=True,
        time_step_limit=[0.0, float("inf")],
        time_step_rank="auto",
    ),
    # Mamba and attention in every layer: a CacheList of both
    "falcon_h1": dict(
        head_dim=16,
        mamba_d_conv=4,
        mamba_d_head=16,
        mamba_d_ssm=64,
        mamba_d_state=16,
        mamba_n_heads=4,
        mamba_chunk_size=8,
    ),
    "lfm2": dict(
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
    ),
}
# Repeats itself (lookup drafts) and is longer than the window.
PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5, 7]


def target_of(arch, seed=0):
    extra = {**WINDOWED, **RECURRENT}[arch]
    return tiny_target(arch, seed=seed, scale=3.0, **extra)


@pytest.mark.parametrize("arch", list(WINDOWED) + list(RECURRENT))
def test_plain_decoding_runs_every_cache(arch):
    target = target_of(arch)
    expected = plain_greedy(target.model, PROMPT, 30)
    engine = Engine(target)
    tokens, stats = run(engine, PROMPT, 30)
    assert tokens == expected
    # The session goes on: the next turn extends the context (reused), then one that diverges.
    follow_up = PROMPT + tokens + [3, 4]
    assert run(engine, follow_up, 12)[0] == plain_greedy(target.model, follow_up, 12)
    other = [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 3]
    assert run(engine, other, 12)[0] == plain_greedy(target.model, other, 12)


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_chat_crossing_the_window_stays_identical(arch):
    """A conversation shorter than the window at first, well past it later; lookup drafts."""
    target = target_of(arch, seed=2)
    engine = Engine(target, LookupDrafter(), num_draft_tokens=4, adaptive=False)
    context = [1, 5, 7]
    for turn in range(4):
        expected = plain_greedy(target.model, context, 9)
        tokens, _ = run(engine, context, 9)
        assert tokens == expected, turn
        context = context + tokens + [3, 5, 7, 9][: turn + 1]
    assert len(context) > 3 * WINDOW


class NoRebuild(Engine):
    """An engine that fails where it would rebuild its cache from the tokens (the slow way a
    cache that cannot roll back is repaired): recurrent layers must roll back by replay."""

    def reset(self):
        if self.cached_tokens:
            raise AssertionError("the cache was rebuilt")
        super().reset()


def engine_for(arch, target, drafter, k):
    """Recurrent targets must roll back by replay (NoRebuild); a rotating cache may have to be
    rebuilt, exactly, where it has rotated past what a rollback needs."""
    return (NoRebuild if arch in RECURRENT else Engine)(target, drafter, num_draft_tokens=k, adaptive=False)


def draft_model_for(arch):
    """A draft model of the same architecture (seeded otherwise)."""
    return target_of(arch, seed=4)


@pytest.mark.parametrize("arch", list(WINDOWED) + list(RECURRENT))
@pytest.mark.parametrize("k", [1, 3, 8])
def test_speculation_is_token_identical(arch, k):
    target = target_of(arch)
    expected = plain_greedy(target.model, PROMPT, 40)
    for drafter in (
        LookupDrafter(),
        ScriptedDrafter(expected, 3, 32),
        ScriptedDrafter(expected, 100, 32),
        DraftModelDrafter(draft_model_for(arch), 32),
    ):
        tokens, stats = run(engine_for(arch, target, drafter, k), PROMPT, 40)
        assert tokens == expected, (type(drafter).__name__, k)
        assert stats.verified_drafts > 0


@pytest.mark.parametrize("arch", list(WINDOWED) + list(RECURRENT))
def test_every_acceptance_length(arch):
    target = target_of(arch, seed=1)
    expected = plain_greedy(target.model, PROMPT, 40)
    for wrong_every in (2, 4, 5, 7):
        tokens, stats = run(
            engine_for(arch, target, ScriptedDrafter(expected, wrong_every, 32), 8), PROMPT, 40
        )
        assert tokens == expected, wrong_every
        assert 0 < stats.accepted_drafts < stats.verified_drafts


@pytest.mark.parametrize("arch", ["qwen3_next", "falcon_h1"])
def test_recurrent_chat_and_sampling(arch):
    """Turns of a conversation reuse the session's cache (lookup drafts, adaptive); sampled
    output for a seed is what the target alone samples."""
    from mlx_spec.sampling import SamplingParams

    target = target_of(arch, seed=2)
    engine = NoRebuild(target, LookupDrafter(), num_draft_tokens=4, adaptive=False)
    context = [1, 5, 7]
    for turn in range(4):
        expected = plain_greedy(target.model, context, 9)
        tokens, stats = run(engine, context, 9)
        assert tokens == expected, turn
        assert turn == 0 or stats.prompt_cached > 0
        context = context + tokens + [3, 5, 7, 9][: turn + 1]
    params = SamplingParams(temp=1.0, top_p=0.95)
    plain = run(Engine(target, sampling=params, seed=3), PROMPT, 30)[0]
    for drafter in (LookupDrafter(), DraftModelDrafter(tiny_target("llama", seed=4, scale=3.0), 32)):
        engine = NoRebuild(target, drafter, num_draft_tokens=4, sampling=params, seed=3)
        assert run(engine, PROMPT, 30)[0] == plain


def random_feature_models(target, tmp_path):
    """A random EAGLE-3 layer (published layout, loaded) and a random DFlash model for `target`."""
    from mlx_spec.models.eagle3 import load_eagle3
    from test_dflash import random_dflash
    from test_eagle import random_eagle, save_eagle

    eagle = random_eagle(
        target,
        seed=5,
        scale=2.0,
        hidden_size=target.hidden_size,
        aux_layer_ids=list(range(min(3, target.num_layers))),
    )
    eagle = load_eagle3(save_eagle(eagle, tmp_path / "eagle", "speculators"), target)
    return eagle, random_dflash(tmp_path, target, num_layers=1, target_layer_ids=(0, 1), block_size=8)[0]


@pytest.mark.parametrize("arch", ["qwen3_next", "mamba2", "falcon_h1"])
def test_feature_drafters_on_recurrent_targets(arch, tmp_path):
    """EAGLE-3 and DFlash tap the layers of hybrid and recurrent targets and stay exact."""
    from mlx_spec.drafters.dflash import DFlashDrafter
    from mlx_spec.drafters.eagle import EagleDrafter

    target = target_of(arch)
    expected = plain_greedy(target.model, PROMPT, 30)
    eagle, dflash = random_feature_models(target, tmp_path)
    for drafter in (EagleDrafter(eagle, target.vocab_size), DFlashDrafter(target, dflash)):
        tokens, stats = run(NoRebuild(target, drafter, num_draft_tokens=4, adaptive=False), PROMPT, 30)
        assert tokens == expected, type(drafter).__name__
        assert stats.verified_drafts > 0


def test_recurrent_rollback_equals_a_plain_run():
    """After a verification-sized pass and a rollback by replay, the recurrent states (conv
    and SSM) and the attention cache are those of a plain run over the kept tokens."""
    from mlx_spec.cache import Replay

    target = target_of("qwen3_next")

    def cache_after(tokens_fed, replay=None):
        cache = target.model.make_cache()
        for piece in tokens_fed:
            target.forward(mx.array(piece)[None], cache, replay=replay if piece is tokens_fed[-1] else None)
        return cache

    context, step = PROMPT, [3, 4, 6, 8, 10, 12]
    for keep in (1, 3, 5):
        replay = Replay(len(context))
        cache = cache_after([context, step], replay)
        assert rollback_to(cache, len(context) + keep, replay)
        plain = cache_after([context] + [[t] for t in step[:keep]])
        for ours, theirs in zip(cache, plain):
            assert type(ours) is type(theirs)
            if hasattr(ours, "offset"):  # attention: the rows up to the offset
                assert ours.offset == theirs.offset == len(context) + keep
                pairs = [(ours.keys[..., : ours.offset, :], theirs.keys[..., : ours.offset, :])]
            else:  # recurrent: conv state and SSM state
                pairs = list(zip(ours.cache, theirs.cache))
            for a, b in pairs:
                assert np.allclose(np.array(a), np.array(b), atol=1e-4)
        # Without the pass's replay, a recurrent state cannot roll back: the caller rebuilds.
        assert not rollback_to(cache_after([context, step]), len(context) + keep)


@pytest.mark.parametrize("arch", ["qwen3_next", "falcon_h1"])
def test_cache_after_each_step_is_a_plain_runs(arch):
    """After every verification step (drafts rejected at every position in turn), each layer's
    cache equals that of a plain pass over the tokens it holds."""
    target = target_of(arch, seed=3)
    expected = plain_greedy(target.model, PROMPT, 24)
    engine = NoRebuild(target, ScriptedDrafter(expected, 3, 32), num_draft_tokens=5, adaptive=False)
    steps = 0
    for event in engine.generate(PROMPT, max_tokens=24):
        if not isinstance(event, Step):
            continue
        steps += 1
        plain = target.model.make_cache()
        target.model(mx.array(engine.cached_tokens)[None], cache=plain)
        layers_equal(engine.cache, plain, len(engine.cached_tokens))
    assert steps > 5


def leaves(cache):
    from mlx_lm.models.cache import CacheList

    for c in cache:
        yield from (leaves(c.caches) if isinstance(c, CacheList) else [c])


@pytest.mark.parametrize("arch", list(RECURRENT))
def test_a_recurrent_model_drafts_for_itself(arch):
    """A recurrent or hybrid draft model rolls its state back to a snapshot taken before each
    draft: drafting for itself, every draft is accepted (tau 5 with 4 drafts), greedy and over
    a second turn; another model of the same shape drafts exactly too; seeded sampling
    prints what --draft none prints; a smaller model of the family drafts exactly."""
    from mlx_spec.sampling import SamplingParams

    target = target_of(arch)
    engine = NoRebuild(target, DraftModelDrafter(target, 32), num_draft_tokens=4, adaptive=False)
    expected = plain_greedy(target.model, PROMPT, 41)
    tokens, stats = run(engine, PROMPT, 41)
    assert tokens == expected and stats.verified_drafts == stats.accepted_drafts == 32 and stats.steps == 9
    more = PROMPT + tokens + [3, 4]
    tokens, stats = run(engine, more, 21)
    assert (
        tokens == plain_greedy(target.model, more, 21)
        and stats.accepted_drafts == stats.verified_drafts == 16
    )
    engine = NoRebuild(
        target, DraftModelDrafter(target_of(arch, seed=7), 32), num_draft_tokens=3, adaptive=False
    )
    assert run(engine, PROMPT, 30)[0] == plain_greedy(target.model, PROMPT, 30)
    # A smaller model of the family (half the layers) drafting for the larger one.
    smaller = dict(RECURRENT[arch], num_hidden_layers=RECURRENT[arch].get("num_hidden_layers", 2) // 2)
    if "layer_types" in smaller:
        smaller["layer_types"] = smaller["layer_types"][: smaller["num_hidden_layers"]]
    draft = tiny_target(arch, seed=7, scale=3.0, **smaller)
    assert draft.num_layers < target.num_layers
    engine = NoRebuild(target, DraftModelDrafter(draft, 32), num_draft_tokens=3, adaptive=False)
    tokens, stats = run(engine, PROMPT, 30)
    assert tokens == plain_greedy(target.model, PROMPT, 30) and stats.verified_drafts > 0
    params = SamplingParams(temp=1.0)
    plain = run(Engine(target, sampling=params, seed=5), PROMPT, 24)[0]
    engine = NoRebuild(
        target, DraftModelDrafter(target, 32), num_draft_tokens=4, sampling=params, seed=5, adaptive=False
    )
    assert run(engine, PROMPT, 24)[0] == plain


@pytest.mark.parametrize("arch", ["mamba2", "qwen3_next"])
def test_a_recurrent_draft_model_rolls_back_to_the_accepted_drafts(arch):
    """After a step that accepts the first of its drafts, the draft model's recurrent state is
    the one of a plain pass over the context and that draft (its snapshot), not a later one."""
    from mlx_lm.models.cache import ArraysCache

    from mlx_spec.cache import make_cache
    from mlx_spec.sampling import Sampler

    target = target_of(arch)
    drafter = DraftModelDrafter(target, 32)
    drafter.bind(Sampler(), lambda: None)
    drafter.prefill(PROMPT, {}, 0)
    drafts = drafter.propose(4).tokens.tolist()
    drafter.commit(drafts[:1], (drafts[1] + 1) % 32, {})
    plain = make_cache(target.model)
    target.model(mx.array(PROMPT + drafts[:1])[None], cache=plain)
    layers = [(a, b) for a, b in zip(leaves(drafter.cache), leaves(plain)) if isinstance(a, ArraysCache)]
    assert layers and len(drafter.cached) == len(PROMPT) + 1
    for kept, expected in layers:
        for x, y in zip(kept.cache, expected.cache):
            assert np.allclose(np.array(x), np.array(y), atol=1e-4)


TREE_ARCHS = ["qwen3_next", "qwen3_5", "mamba2", "lfm2"]  # falcon_h1: attention and Mamba in one layer


def layers_equal(cache, plain, length):
    """Every layer's cache as a plain run's over `length` tokens: attention rows up to the
    offset, recurrent conv and SSM states."""
    for ours, theirs in zip(leaves(cache), leaves(plain)):
        if hasattr(ours, "offset"):
            assert ours.offset == theirs.offset == length
            pairs = [
                (ours.keys[..., :length, :], theirs.keys[..., :length, :]),
                (ours.values[..., :length, :], theirs.values[..., :length, :]),
            ]
        else:
            pairs = list(zip(ours.cache, theirs.cache))
        for a, b in pairs:
            assert np.allclose(np.array(a), np.array(b), atol=1e-4)


@pytest.mark.parametrize("arch", TREE_ARCHS)
def test_a_tree_pass_over_recurrent_layers_equals_plain_paths(arch):
    """Recurrent layers run the tree one depth at a time, each node from its parent's state:
    every node's logits are a plain pass's over its path; after compaction to the accepted
    path, every layer's cache equals a plain pass over the context and that path."""
    from mlx_spec.cache import Replay, make_cache
    from mlx_spec.tree import Tree, compact, tree_forward
    from test_tree import PARENTS

    target, tree = target_of(arch), Tree(PARENTS)
    context, tokens = PROMPT[:7], [7, 8, 9, 10, 11, 12, 13]
    node_tokens = [context[-1]] + tokens
    for accepted in (7, 6, 3, 0):  # paths of depth 3, 2, 1 and the root alone
        cache = make_cache(target.model)
        target.forward(mx.array(context[:-1])[None], cache)
        replay = Replay(len(context) - 1)
        logits, _ = tree_forward(target, mx.array(node_tokens), tree, cache, taps=(1,), replay=replay)
        for node in range(len(tree)):
            path = [node_tokens[i] for i in tree.path_to(node)]
            plain = target.model(mx.array(context[:-1] + path)[None])[0, -1]
            assert np.allclose(np.array(logits[0, node]), np.array(plain), atol=1e-4), (arch, node)
        path = tree.path_to(accepted)
        compact(cache, len(context) - 1, path, len(tree), replay)
        plain = make_cache(target.model)
        target.model(mx.array(context[:-1] + [node_tokens[i] for i in path])[None], cache=plain)
        layers_equal(cache, plain, len(context) - 1 + len(path))
        # A later rollback inside the path (drafts past EOS or max tokens) is exact too.
        assert rollback_to(cache, len(context), replay)
        plain = make_cache(target.model)
        target.model(mx.array(context)[None], cache=plain)
        layers_equal(cache, plain, len(context))


@pytest.mark.parametrize("arch", TREE_ARCHS)
def test_tree_drafts_on_recurrent_targets_are_token_identical(arch):
    """A tree whose first path is right: greedy output identical to plain mlx-lm over two
    turns, the whole path accepted, and after every step each layer's cache is a plain
    pass's over the tokens it holds."""
    from test_tree import ScriptedTreeDrafter

    target = target_of(arch, seed=3)
    expected = plain_greedy(target.model, PROMPT, 41)
    engine = NoRebuild(target, ScriptedTreeDrafter(expected, 32), num_draft_tokens=8, adaptive=False)
    collected = Collector()
    for event in engine.generate(PROMPT, max_tokens=41):
        if isinstance(collected.add(event), Step):
            plain = target.model.make_cache()
            target.model(mx.array(engine.cached_tokens)[None], cache=plain)
            layers_equal(engine.cache, plain, len(engine.cached_tokens))
    tokens, stats = collected.tokens, collected.stats
    assert tokens == expected and stats.tokens_per_step > 3.5
    # 41 tokens end inside a step's path: its last drafts were dropped by a rollback.
    more = PROMPT + tokens + [3, 4]
    reference = plain_greedy(target.model, more, 20)
    engine.drafter = ScriptedTreeDrafter(reference, 32)
    assert run(engine, more, 20)[0] == reference


def test_learned_tree_sources_on_a_hybrid_target(tmp_path):
    """EAGLE-3's tree, DDTree, Medusa's tree and suffix decoding's trees over Qwen3-Next's
    Gated DeltaNet and attention layers: token-identical to plain mlx-lm."""
    from mlx_spec.drafters.ddtree import DDTreeDrafter
    from mlx_spec.drafters.eagle import EagleDrafter
    from mlx_spec.drafters.medusa import MedusaDrafter
    from mlx_spec.drafters.suffix import SuffixDrafter
    from mlx_spec.models.medusa import load_medusa
    from test_medusa import random_heads, write

    target = target_of("qwen3_next")
    expected = plain_greedy(target.model, PROMPT, 30)
    eagle, dflash = random_feature_models(target, tmp_path)
    medusa = load_medusa(write(tmp_path / "medusa", random_heads(target.hidden_size, 32)), target)
    drafters = (
        EagleDrafter(eagle, target.vocab_size, tree_budget=12, tree_topk=3),
        DDTreeDrafter(target, dflash, budget=12, topk=3),
        MedusaDrafter(target, medusa, tree_budget=12, tree_topk=3),
        SuffixDrafter(12, None, tree=True),
    )
    for drafter in drafters:
        assert drafter.tree
        tokens, stats = run(NoRebuild(target, drafter, num_draft_tokens=4, adaptive=False), PROMPT, 30)
        assert tokens == expected, type(drafter).__name__
        assert stats.drafted_tokens > 0


def test_trees_over_attention_and_mamba_in_one_layer_are_refused():
    """Falcon-H1's layers hold attention and Mamba together (a CacheList): one line, no token."""

    class TreeDrafter(LookupDrafter):
        tree = True

    with pytest.raises(
        MlxSpecError,
        match="tree drafts need plain KV caches or recurrent layers; this falcon_h1 model uses CacheList",
    ):
        Engine(target_of("falcon_h1"), TreeDrafter())


def test_rotating_rollback_equals_a_plain_run():
    """After a verification-sized update past the window and a rollback, the sliding layer's
    cache holds the same window as a plain run over the kept tokens."""
    target = target_of("gemma3_text")
    sliding = 0  # layer 0 slides (pattern 2: every second layer is global)

    def window_after(tokens_fed):
        cache = target.model.make_cache()
        for piece in tokens_fed:
            target.model(mx.array(piece)[None], cache=cache)
        return cache

    context, step = PROMPT, [3, 4, 6, 8, 10, 12]
    for keep in (1, 3, 5):
        cache = window_after([context, step])
        assert rollback_to(cache, len(context) + keep)
        plain = window_after([context] + [[t] for t in step[:keep]])
        c, p = cache[sliding], plain[sliding]
        n = WINDOW - 1
        ours = c._temporal_order(c.keys)[..., -n:, :]
        theirs = p._temporal_order(p.keys)[..., -n:, :]
        assert np.allclose(np.array(ours), np.array(theirs), atol=1e-5)
        assert c.offset == p.offset


def test_trees_need_a_plain_kv_cache():
    class TreeDrafter(LookupDrafter):
        tree = True

    with pytest.raises(
        MlxSpecError, match="tree drafts need plain KV caches or recurrent layers; this gemma3_text model"
    ):
        Engine(target_of("gemma3_text"), TreeDrafter())
