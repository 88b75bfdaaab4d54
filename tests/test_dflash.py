"""DFlash: the published checkpoint format, the drafter's math against a naive computation,
its bookkeeping inside the engine, losslessness (greedy and sampled) and its load errors."""

import json

import mlx_spec  # noqa: F401  (first: it loads OpenBLAS only if mlx.core is not imported yet)

# isort: split

import mlx.core as mx
import numpy as np
import pytest

from exactness import STRICT, VOCAB, repeated_prompt, sampling_pvalue
from mlx_spec.cache import rollback_to
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.dflash import load_dflash, spread_layer_ids
from mlx_spec.sampling import SamplingParams
from tiny import plain_greedy, run, tiny_target

PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5, 7]


# --- a random drafter in z-lab's published format --------------------------------------------


def dflash_config(
    hidden_size,
    num_layers=2,
    heads=4,
    kv_heads=2,
    head_dim=None,
    block_size=8,
    mask_token_id=0,
    target_layer_ids=(0, 1),
    **extra,
):
    dflash = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash["target_layer_ids"] = list(target_layer_ids)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim or hidden_size // heads,
        "intermediate_size": 2 * hidden_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "block_size": block_size,
        "dflash_config": dflash,
    }
    config.update(extra)
    return config


def random_weights(config, num_features, seed=0):
    """Every tensor under its published name (numpy, float32)."""
    rng = np.random.default_rng(seed)
    H, I, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    nq, nkv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def linear(out_dim, in_dim):
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim):
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    w = {"fc.weight": linear(H, num_features * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        w.update(
            {
                p + "self_attn.q_proj.weight": linear(nq, H),
                p + "self_attn.k_proj.weight": linear(nkv, H),
                p + "self_attn.v_proj.weight": linear(nkv, H),
                p + "self_attn.o_proj.weight": linear(H, nq),
                p + "self_attn.q_norm.weight": norm(hd),
                p + "self_attn.k_norm.weight": norm(hd),
                p + "mlp.gate_proj.weight": linear(I, H),
                p + "mlp.up_proj.weight": linear(I, H),
                p + "mlp.down_proj.weight": linear(H, I),
                p + "input_layernorm.weight": norm(H),
                p + "post_attention_layernorm.weight": norm(H),
            }
        )
    return w


def write_dflash(path, config, weights, prefix="", dtype=mx.float32):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(path / "model.safetensors"), {prefix + k: mx.array(v).astype(dtype) for k, v in weights.items()}
    )
    return path


def random_dflash(tmp_path, target, seed=0, hidden_size=None, **config_args):
    config = dflash_config(hidden_size or target.hidden_size, **config_args)
    num_features = len(
        config["dflash_config"].get("target_layer_ids")
        or spread_layer_ids(target.num_layers, config["num_hidden_layers"])
    )
    weights = random_weights(config, num_features, seed)
    return load_dflash(write_dflash(tmp_path / f"dflash-{seed}", config, weights), target), config, weights


# --- the naive reference: explicit concatenation, softmax attention, no cache ------------------


def rms_norm(x, weight, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def rope(x, positions, theta):
    """Non-traditional RoPE of x [n, heads, d] at absolute positions [n]."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * theta ** (-np.arange(half) / half)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def naive_hidden(w, config, features, block_embeddings):
    """Final-normed block hidden states [B, H] given every context feature [L, n*H]."""
    eps, theta, hd = config["rms_norm_eps"], config["rope_theta"], config["head_dim"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    L, B = features.shape[0], block_embeddings.shape[0]
    context = rms_norm(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    q_pos, k_pos = np.arange(L, L + B), np.arange(L + B)
    visible = np.ones((B, L + B), bool)
    h = block_embeddings
    for i, kind in enumerate(layer_types):
        p = f"layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q = rms_norm(
            (x @ w[p + "self_attn.q_proj.weight"].T).reshape(B, nh, hd), w[p + "self_attn.q_norm.weight"], eps
        )
        both = np.concatenate([context, x])  # the context's and the block's K/V inputs
        k = rms_norm(
            (both @ w[p + "self_attn.k_proj.weight"].T).reshape(L + B, nkv, hd),
            w[p + "self_attn.k_norm.weight"],
            eps,
        )
        v = (both @ w[p + "self_attn.v_proj.weight"].T).reshape(L + B, nkv, hd)
        q, k = rope(q, q_pos, theta), rope(k, k_pos, theta)
        if kind == "sliding_attention":
            visible = (k_pos[None] >= L) | (q_pos[:, None] - k_pos[None] < config["sliding_window"])
        out = np.zeros((B, nh, hd))
        for head in range(nh):
            kv = head // (nh // nkv)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(hd)
            scores = np.where(visible if kind == "sliding_attention" else True, scores, -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (weights / weights.sum(-1, keepdims=True)) @ v[:, kv]
        h = h + out.reshape(B, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(h, w["norm.weight"], eps)


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target("qwen3", num_layers=4)


def test_block_logits_equal_naive_computation(tmp_path, qwen3):
    target = qwen3
    model, config, w = random_dflash(
        tmp_path,
        target,
        num_layers=3,
        target_layer_ids=(0, 2, 3),
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        sliding_window=6,
    )
    w = {k: v.astype(np.float64) for k, v in w.items()}
    rng = np.random.default_rng(1)
    block = mx.array([[7] + [model.args.mask_token_id] * (model.args.block_size - 1)])
    embeddings = np.array(target.embed(block)[0], dtype=np.float64)
    cache = model.make_cache()
    features = np.zeros((0, 3 * target.hidden_size))
    # Rounds of growth (across the cache's 256-row chunks) and rollbacks by offset.
    for rollback, n_new in [(None, 0), (None, 5), (None, 3), (4, 7), (None, 250), (None, 9), (100, 1)]:
        if rollback is not None:
            rollback_to(cache, rollback)
            features = features[:rollback]
        new = rng.standard_normal((n_new, features.shape[1])).astype(np.float32)
        if n_new:
            model.append_context(mx.array(new)[None], cache)
        features = np.concatenate([features, new])
        hidden = model(mx.array(embeddings, mx.float32)[None], cache)
        expected = naive_hidden(w, config, features, embeddings)
        assert np.allclose(np.array(hidden[0]), expected, atol=2e-4), (rollback, n_new)
        logits = target.lm_head(hidden[0])
        expected_logits = target.lm_head(mx.array(expected, mx.float32))
        assert mx.allclose(logits, expected_logits, atol=1e-3).item()
        assert all(c.offset == len(features) for c in cache)


def test_published_variants_load_alike(tmp_path, qwen3):
    """A `model.` prefix, bfloat16 weights (computed in the target's float32) and default taps."""
    config = dflash_config(qwen3.hidden_size, target_layer_ids=None)
    weights = random_weights(config, 2)
    plain = load_dflash(write_dflash(tmp_path / "plain", config, weights, dtype=mx.bfloat16), qwen3)
    nested = load_dflash(
        write_dflash(tmp_path / "nested", config, weights, prefix="model.", dtype=mx.bfloat16), qwen3
    )
    assert plain.args.target_layer_ids == nested.args.target_layer_ids == spread_layer_ids(4, 2) == [1, 1]
    assert plain.fc.weight.dtype == mx.float32
    assert mx.array_equal(plain.fc.weight, nested.fc.weight).item()


def test_default_layer_ids_follow_z_lab():
    assert spread_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert spread_layer_ids(30, 1) == [15]


class Recorder(DFlashDrafter):
    """Records, for every proposal, the committed tokens and the block's logits."""

    def __init__(self, *args):
        super().__init__(*args)
        self.records = []  # kept across the generations of a session

    def prefill(self, context, taps, start):
        super().prefill(context, taps, start)
        self.tokens = list(context)

    def propose(self, k):
        draft = super().propose(k)
        if len(draft):
            # The head of the last proposal's graph, recomputed from the same cache.
            hidden = self.model(
                self.target.embed(
                    mx.array([[self.last_token] + [self.mask_token_id] * (self.block_size - 1)])
                ),
                self.cache,
            )
            self.records.append((list(self.tokens), self.target.lm_head(hidden[0, 1:])))
            mx.eval(self.records[-1][1])
        return draft

    def commit(self, accepted, next_token, taps):
        super().commit(accepted, next_token, taps)
        self.tokens += list(accepted) + [next_token]
        self.most_accepted = max(len(accepted), getattr(self, "most_accepted", 0))


def test_context_is_the_targets_features_of_every_committed_token(tmp_path, qwen3):
    """Features appended at prefill and commit equal a fresh target pass over the context."""
    from mlx_lm.models.cache import make_prompt_cache

    target = qwen3
    model, _, _ = random_dflash(tmp_path, target, target_layer_ids=(3, 0), block_size=4)
    # Sampled hot, so that random drafts are often accepted, several in a row.
    params = SamplingParams(temp=3.0)
    drafter = Recorder(target, model)
    engine = Engine(target, drafter, num_draft_tokens=3, sampling=params, seed=2, adaptive=False)
    first, _ = run(engine, PROMPT, 24)
    run(engine, PROMPT + first + [4, 4, 2], 12)  # a session: the whole cache is reused
    run(engine, PROMPT[:6] + [4, 4, 2], 12)  # a prompt that diverges: rolled back
    engine.num_draft_tokens = 0  # plain steps: the features wait, uncached
    run(engine, PROMPT[:7] + [2, 4, 4, 9], 12)
    engine.num_draft_tokens = 3  # diverges inside the prompt's waiting features
    records = len(drafter.records)
    run(engine, PROMPT[:7] + [2, 4, 7], 12)
    assert len(drafter.records) > records and drafter.most_accepted >= 2
    for tokens, logits in drafter.records:
        _, taps = target.forward(mx.array(tokens[:-1])[None], make_prompt_cache(target.model), drafter.taps)
        fresh = model.make_cache()
        model.append_context(mx.concatenate([taps[3], taps[0]], axis=-1), fresh)
        block = mx.array([[tokens[-1]] + [model.args.mask_token_id] * 3])
        expected = target.lm_head(model(target.embed(block), fresh)[0, 1:])
        assert mx.allclose(logits, expected, atol=1e-4).item(), len(tokens)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("k", [1, 3, 7, 20])
def test_greedy_is_token_identical(tmp_path, qwen3, k, adaptive):
    target = qwen3
    expected = plain_greedy(target.model, PROMPT, 40)
    model, _, _ = random_dflash(tmp_path, target, seed=k)
    engine = Engine(target, DFlashDrafter(target, model), num_draft_tokens=k, adaptive=adaptive)
    tokens, stats = run(engine, PROMPT, 40)
    assert tokens == expected
    assert adaptive or stats.verified_drafts > 0
    assert stats.verified_drafts <= stats.steps * min(k, model.args.block_size - 1)


def test_greedy_on_the_default_model(tmp_path):
    from mlx_spec.convert.default import default_model_path
    from mlx_spec.models.target import load_target

    target = load_target(default_model_path(), "float32")
    prompt = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
        add_generation_prompt=True,
    )
    # Five layers at the default model's width and head shape, taps spread over its 30 layers.
    model, _, _ = random_dflash(
        tmp_path,
        target,
        num_layers=5,
        heads=9,
        kv_heads=3,
        head_dim=64,
        block_size=16,
        mask_token_id=2,
        target_layer_ids=None,
    )
    assert model.args.target_layer_ids == [1, 8, 14, 20, 27]  # round half to even, as z-lab
    engine = Engine(target, DFlashDrafter(target, model), num_draft_tokens=15, adaptive=False)
    tokens, stats = run(engine, prompt, 48)
    assert tokens == plain_greedy(target.model, prompt, 48)
    assert stats.verified_drafts > 0


def test_sampled_output_is_exact(tmp_path):
    # The exactness harness's target: 16 tokens, one narrow layer; taps: embedding and layer 0.
    target = tiny_target("llama", vocab_size=VOCAB, seed=11, scale=2.5, num_layers=1, hidden_size=32)
    model, _, _ = random_dflash(tmp_path, target, num_layers=1, target_layer_ids=(-1, 0), block_size=4)
    params = SamplingParams(temp=1.0, top_k=10)  # q is filtered as p is
    prompt = repeated_prompt()
    engine = Engine(target, DFlashDrafter(target, model), num_draft_tokens=3, sampling=params, adaptive=False)
    pvalue = sampling_pvalue(engine, prompt, params)
    assert pvalue > STRICT, f"p = {pvalue:.2e}"


# --- mismatches and bad files: one-line errors ---------------------------------------------------


def expect_error(match, load):
    with pytest.raises(MlxSpecError, match=match) as info:
        load()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden_size=32, head_dim=8), "hidden size 32 does not match the target's 64"),
        (dict(target_layer_ids=(0, 4)), "taps target layer 4, but the target has 4 layers"),
        (dict(mask_token_id=32), "mask token id 32 is outside the target's vocabulary"),
        (dict(layer_types=["full_attention"]), "has 1 layer_types for 2 layers"),
        (dict(layer_types=["sliding_attention"] * 2), "sliding_attention layers but no sliding_window"),
    ],
)
def test_mismatched_or_inconsistent_config(tmp_path, qwen3, change, match):
    expect_error(match, lambda: random_dflash(tmp_path, qwen3, **change))


def test_bad_directories(tmp_path, qwen3):
    expect_error("not found", lambda: load_dflash(tmp_path / "absent", qwen3))
    expect_error("has no config.json", lambda: load_dflash(tmp_path, qwen3))

    config = dflash_config(qwen3.hidden_size)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    expect_error("corrupt config.json", lambda: load_dflash(bad, qwen3))
    (bad / "config.json").write_text(json.dumps(dict(config, architectures=["Qwen3ForCausalLM"])))
    expect_error("not a DFlash drafter", lambda: load_dflash(bad, qwen3))
    (bad / "config.json").write_text(json.dumps(dict(config, dflash_config={"target_layer_ids": [0, 1]})))
    expect_error("lacks mask_token_id", lambda: load_dflash(bad, qwen3))

    (bad / "config.json").write_text(json.dumps(config))
    expect_error("no \\*.safetensors", lambda: load_dflash(bad, qwen3))
    # A pickle that would run code if loaded: it must be refused unread.
    (bad / "pytorch_model.bin").write_bytes(b"cos\nsystem\n(S'exit 1'\ntR.")
    expect_error("pickled weights only", lambda: load_dflash(bad, qwen3))

    weights = random_weights(config, 2)
    del weights["layers.1.mlp.up_proj.weight"]
    write_dflash(bad, config, weights)
    expect_error("cannot load DFlash drafter", lambda: load_dflash(bad, qwen3))


def test_factory_needs_a_drafter_path(qwen3):
    expect_error(
        "needs a drafter: --draft-model PATH",
        lambda: make_drafter("dflash", qwen3, dict(sampling=SamplingParams())),
    )
