"""MTP modules in their published layouts (DeepSeek-V3 / GLM-4.5, MiMo, Qwen3-Next), on tiny
random targets of mlx-lm's own classes: the module's logits against a transcription of the
reference forward (vLLM's deepseek_mtp.py, glm4_moe_mtp.py, mimo_mtp.py, qwen3_next_mtp.py),
token-identical greedy output, exact sampling, conversion with a sidecar, and bad input.

The published checkpoint is written as the model's authors do: target weights plus the MTP
tensors under the layout's names, the decoder layer in Hugging Face naming (experts one by
one, DeepSeek's kv_b_proj whole, Qwen3-Next's zero-centred norms), in two shards with an index."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import KVCache, make_prompt_cache

from exactness import STRICT, VOCAB, repeated_prompt, sampling_pvalue
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.eagle import EagleDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.mtp import LAYOUTS, find_mtp, load_mtp
from mlx_spec.models.target import Target, load_target
from mlx_spec.sampling import SamplingParams
from test_windowed import RECURRENT
from tiny import plain_greedy, run, tiny_config, tiny_model

MOE = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
)
ARCHS = {  # architecture: (layout, config beyond tiny_config)
    "deepseek_v3": (
        "deepseek",
        dict(
            MOE,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            v_head_dim=16,
            qk_nope_head_dim=16,
            moe_layer_freq=1,
        ),
    ),
    "glm4_moe": (
        "deepseek",
        dict(
            MOE,
            head_dim=16,
            use_qk_norm=True,
            attention_bias=True,
            rope_scaling=None,
            partial_rotary_factor=0.5,
        ),
    ),
    "mimo": ("mimo", dict()),
    "qwen3_next": ("qwen3_next", dict(RECURRENT["qwen3_next"])),
    "qwen3_5": ("qwen3_next", dict(RECURRENT["qwen3_5"])),  # a text model inside, dense
    "llama": ("deepseek", dict()),  # the layout `train mtp` writes for the default model
}
PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5]


def config_of(arch, vocab_size=32, **extra):
    layout, more = ARCHS[arch]
    return tiny_config(arch, vocab_size=vocab_size, **{**more, **extra}, num_nextn_predict_layers=1)


def mtp_layer_index(config, layout):
    """The index of a layer of the target's class built like the module's decoder layer."""
    n = config["num_hidden_layers"]
    if layout == "qwen3_next":  # a full-attention layer
        interval = config["full_attention_interval"]
        return next(k for k in range(n, n + interval) if (k + 1) % interval == 0)
    return n


QWEN3_NEXT_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def published(params, arch):
    """mlx-lm's names and layout of weights -> the Hugging Face checkpoint's (what the
    architecture's sanitize undoes)."""
    out = {}
    for name, w in params.items():
        if ".switch_mlp." in name:  # stacked experts -> one per expert
            head, tail = name.split(".switch_mlp.")
            for e in range(w.shape[0]):
                out[f"{head}.experts.{e}.{tail}"] = w[e]
        elif arch == "deepseek_v3" and name.endswith("self_attn.embed_q.weight"):
            unembed = params[name.replace("embed_q", "unembed_out")]
            heads = w.shape[0]
            out[name.replace("embed_q", "kv_b_proj")] = mx.concatenate(
                [w.swapaxes(-1, -2), unembed], axis=1
            ).reshape(heads * (w.shape[2] + unembed.shape[1]), -1)
        elif arch == "deepseek_v3" and "unembed_out" in name:
            continue
        elif arch.startswith("qwen3_") and name.endswith(QWEN3_NEXT_NORMS):
            out[name] = w - 1.0  # zero-centred, as published
        elif arch.startswith("qwen3_") and name.endswith("conv1d.weight"):
            out[name] = w.moveaxis(2, 1)
        else:
            out[name] = w
    return out


def write_published(tmp_path, arch, seed=0, vocab_size=32, with_head=True, scale=3.0, name="hf"):
    """(directory, target, reference decoder layer, raw MTP tensors): a checkpoint directory
    as published (two shards + index); the reference layer is mlx-lm's own, of a model of the
    same architecture with one more layer."""
    layout = LAYOUTS[ARCHS[arch][0]]
    config = config_of(arch, vocab_size=vocab_size)
    n, H, V = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    target_model = tiny_model(config, seed=seed, scale=scale)
    k = mtp_layer_index(config, layout.name)
    bigger = tiny_model(dict(config, num_hidden_layers=k + 1), seed=seed + 1, scale=scale)
    reference = bigger.model.layers[k]
    rng = np.random.default_rng(seed)
    prefix = layout.prefix.format(i=0, n=n)
    layer_prefix = layout.layer_prefix.format(i=0, n=n)
    raw = published({layer_prefix + key: w for key, w in tree_flatten(reference.parameters())}, arch)

    def norm_weight():
        w = 1.0 + 0.3 * rng.standard_normal(H)
        return mx.array(w - 1.0 if layout.zero_centred_norms else w, mx.float32)

    for part in ("embed_norm", "hidden_norm", "final_norm"):
        raw[prefix + getattr(layout, part) + ".weight"] = norm_weight()
    raw[prefix + layout.proj + ".weight"] = mx.array(
        rng.standard_normal((H, 2 * H)) * scale / np.sqrt(2 * H), mx.float32
    )
    if layout.name == "deepseek":
        raw[prefix + "embed_tokens.weight"] = target_model.model.embed_tokens.weight  # a copy, as published
        if with_head:
            raw[prefix + "shared_head.head.weight"] = mx.array(
                rng.standard_normal((V, H)) * scale / np.sqrt(H), mx.float32
            )
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    target_weights = published(dict(tree_flatten(target_model.parameters())), arch)
    mx.save_safetensors(str(path / "model-00001-of-00002.safetensors"), target_weights)
    mx.save_safetensors(str(path / "model-00002-of-00002.safetensors"), raw)
    weight_map = {
        **{k: "model-00001-of-00002.safetensors" for k in target_weights},
        **{k: "model-00002-of-00002.safetensors" for k in raw},
    }
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    target = Target(target_model, None, config, path=str(path))
    return path, target, reference, raw


def rms(x, w, eps, zero_centred=False):
    w = w + 1.0 if zero_centred else w
    return x * mx.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference_forward(arch, target, reference, raw, tokens, hidden, cache, from_target=True):
    """vLLM's MTP forward, transcribed from its files (line numbers as of vLLM 0.33.0):
    deepseek_mtp.py 113-144 / glm4_moe_mtp.py 106-128, mimo_mtp.py 67-88, qwen3_next_mtp.py
    118-162. tokens [n] are x_{t+1} at positions cache.offset.., hidden [1, n, H] the target's
    last-layer output at t (from_target), else the state the previous depth returned.
    Returns (logits, the hidden state fed to the next depth)."""
    layout = LAYOUTS[ARCHS[arch][0]]
    n_layers, eps = target.num_layers, target.config["rms_norm_eps"]
    p = layout.prefix.format(i=0, n=n_layers)
    zc = layout.zero_centred_norms
    e = target.model.model.embed_tokens(mx.array(tokens)[None])
    if cache.offset == 0 and layout.name != "qwen3_next":  # inputs_embeds[positions == 0] = 0
        e = mx.concatenate([mx.zeros_like(e[:, :1]), e[:, 1:]], axis=1)
    if from_target and layout.name != "mimo":  # DeepseekV2Model / Qwen3NextModel return normed states
        hidden = target.model.model.norm(hidden)
    e = rms(e, raw[p + layout.embed_norm + ".weight"], eps, zc)
    h = rms(hidden, raw[p + layout.hidden_norm + ".weight"], eps, zc)
    x = (
        mx.concatenate([h, e] if layout.name == "mimo" else [e, h], axis=-1)
        @ raw[p + layout.proj + ".weight"].T
    )
    from mlx_lm.models.base import create_attention_mask

    mask = create_attention_mask(x, cache, return_array=True) if x.shape[1] > 1 else None
    out = reference(x, mask, cache)  # the decoder layer adds its own residuals
    final = rms(out, raw[p + layout.final_norm + ".weight"], eps, zc)
    if layout.name == "deepseek":  # shared_head(norm(h)); the pre-norm state goes on
        head = raw.get(p + "shared_head.head.weight")
        logits = final @ head.T if head is not None else target.lm_head(final)
        return logits, out
    return target.lm_head(final), final


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_equal_the_reference_forward(tmp_path, arch):
    path, target, reference, raw = write_published(tmp_path, arch)
    model = load_mtp(path, target)
    assert type(model.layer) is type(reference)
    tokens = PROMPT
    _, taps = target.forward(mx.array(tokens)[None], make_prompt_cache(target.model), [target.num_layers - 1])
    hidden = taps[target.num_layers - 1][:, :-1]  # at positions 0..n-2, paired with x_1..x_{n-1}
    ours_cache, ref_cache = model.make_cache(), KVCache()
    ours = model(model.embed(mx.array(tokens[1:])[None]), model.fuse(hidden), ours_cache)
    expected_logits, expected_next = reference_forward(
        arch, target, reference, raw, tokens[1:], hidden, ref_cache
    )
    assert np.allclose(np.array(model.logits(ours)), np.array(expected_logits), atol=2e-4, rtol=1e-4)
    # One depth further: the module's own output with the next token, one position on.
    step = model(model.embed(mx.array([3])[None]), ours[:, -1:], ours_cache)
    ref_logits, _ = reference_forward(
        arch, target, reference, raw, [3], expected_next[:, -1:], ref_cache, from_target=False
    )
    assert np.allclose(np.array(model.logits(step)), np.array(ref_logits), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_is_token_identical(tmp_path, arch, k):
    path, target, _, _ = write_published(tmp_path, arch)
    expected = plain_greedy(target.model, PROMPT, 40)
    engine = Engine(
        target, EagleDrafter(load_mtp(path, target), target.vocab_size), num_draft_tokens=k, adaptive=False
    )
    assert run(engine, PROMPT, 40)[0] == expected
    # A second turn reuses the module's cache.
    more = PROMPT + expected + [3, 4]
    assert run(engine, more, 12)[0] == plain_greedy(target.model, more, 12)


# One layout (the one shipped): what decides exactness is the verification, which every layout
# shares (a hybrid's replay is sampled exactly in test_exactness); 10,000 draws cost half a minute.
@pytest.mark.parametrize("arch", ["llama"])
def test_exact_sampling(tmp_path, arch):
    path, target, _, _ = write_published(tmp_path, arch, seed=2, vocab_size=VOCAB, scale=2.0)
    prompt, params = repeated_prompt(), SamplingParams(temp=1.0)
    engine = Engine(
        target,
        EagleDrafter(load_mtp(path, target), VOCAB),
        num_draft_tokens=3,
        sampling=params,
        seed=1,
        adaptive=False,
    )
    pvalue = sampling_pvalue(engine, prompt, params)
    assert pvalue > STRICT, f"p = {pvalue:.2e}"


# Not deepseek_v3: mlx-lm's sanitize drops only "model.layers.61" (DeepSeek-V3's own size), so
# plain mlx-lm cannot read a tiny original; GLM-4.5 is the same layout with a general sanitize.
@pytest.mark.parametrize("arch", ["glm4_moe", "qwen3_next", "qwen3_5", "mimo"])
def test_converted_directory_keeps_the_module(tmp_path, arch):
    from mlx_lm.utils import load_model

    from mlx_spec.convert.default import default_model_path
    from mlx_spec.convert.hf import convert_hf

    path, target, _, _ = write_published(tmp_path, arch, vocab_size=49152)  # the default tokenizer's
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_path() / name, path / name)
    out = convert_hf(path, tmp_path / "mlx")
    converted, _ = load_model(out)  # plain mlx-lm reads it
    assert plain_greedy(converted, PROMPT, 20) == plain_greedy(load_model(path)[0], PROMPT, 20)
    assert (out / "mtp" / "config.json").is_file()
    loaded = load_target(out, "keep")
    assert find_mtp(loaded) == out / "mtp"
    drafts = []
    for t, directory in ((loaded, None), (target, str(path))):
        drafter = make_drafter("mtp", t, {"draft_model": directory})
        proposed, propose = [], drafter.propose
        drafter.propose = lambda k: proposed.append(propose(k)) or proposed[-1]
        run(Engine(t, drafter, num_draft_tokens=3, adaptive=False), PROMPT, 20)
        drafts.append([np.array(d.tokens).tolist() for d in proposed])
    assert len(drafts[0]) > 3 and drafts[0] == drafts[1]


def test_a_quantized_target_quantizes_its_module(tmp_path):
    from mlx_lm.utils import load_model

    from mlx_spec.convert.default import default_model_path
    from mlx_spec.convert.hf import convert_hf

    path, _, _, _ = write_published(tmp_path, "mimo", vocab_size=49152, scale=2.0)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_path() / name, path / name)
    out = convert_hf(path, tmp_path / "q8", quantize=True, q_bits=8, q_group_size=32)
    target = load_target(out, "keep")
    drafter = make_drafter("mtp", target, {})
    assert "scales" in drafter.model.proj and "scales" in drafter.model.layer.self_attn.q_proj
    expected = plain_greedy(load_model(out)[0], PROMPT, 24)
    assert run(Engine(target, drafter, num_draft_tokens=3, adaptive=False), PROMPT, 24)[0] == expected


def test_bad_input(tmp_path):
    path, target, _, raw = write_published(tmp_path, "llama", with_head=True)
    # No MTP weights: a model directory without them.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((path / "config.json").read_text())
    mx.save_safetensors(str(bare / "model.safetensors"), dict(tree_flatten(target.model.parameters())))
    with pytest.raises(MlxSpecError, match="no MTP weights"):
        load_mtp(bare, target)
    with pytest.raises(MlxSpecError, match="has no MTP weights"):
        find_mtp(Target(target.model, None, target.config, path=str(bare)))
    # Another target: hidden size, vocabulary, layer count.
    for other, match in (
        (dict(hidden_size=32), "hidden size"),
        (dict(vocab_size=48), "vocabulary|tokens"),
        (dict(num_layers=3), "layers"),
    ):
        config = config_of("llama", **other)
        wrong = Target(tiny_model(config), None, config)
        with pytest.raises(MlxSpecError, match=match):
            load_mtp(path, wrong)
    # A truncated shard.
    shard = path / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(MlxSpecError, match="cannot read"):
        load_mtp(path, target)
    with pytest.raises(MlxSpecError, match="chain"):
        make_drafter("mtp", target, {"draft_model": str(path), "tree_budget": 4})


def test_the_default_model_without_a_module_is_told_so(tmp_path):
    config = config_of("llama")
    target = Target(tiny_model(config), None, config, path=str(tmp_path))
    with pytest.raises(MlxSpecError, match="no MTP weights.*convert"):
        make_drafter("mtp", target, {})


def test_llama_module_round_trips_through_save(tmp_path):
    """`train mtp` writes what load_mtp reads (the DeepSeek layout, no head of its own)."""
    from mlx_spec.train.mtp import new_mtp_model, save_mtp

    config = config_of("llama")
    target = Target(tiny_model(config, scale=3.0), None, config)
    model = new_mtp_model(target)
    model.update(tree_map(lambda p: p + 0.01 * mx.random.normal(p.shape), model.parameters()))
    loaded = load_mtp(save_mtp(model, target, tmp_path / "m"), target)
    hidden = mx.random.normal((1, 5, config["hidden_size"]))
    tokens = model.embed(mx.array([[3, 4, 5, 6, 7]]))
    a = model.logits(model(tokens, hidden, model.make_cache()))
    b = loaded.logits(loaded(tokens, hidden, loaded.make_cache()))
    assert "head" not in loaded and np.allclose(np.array(a), np.array(b), atol=1e-5)
