"""`generate --prompt-cache-file`: a prompt cache written by mlx_lm.cache_prompt, continued as
mlx_lm.generate continues it (the prompt is what follows the cached one), token for token,
with the sources that draft from token ids alone; one line for everything else."""

import json

import mlx_spec  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

from mlx_spec.models.target import load_target
from test_cli import assert_one_line_error, cli
from tiny import tiny_chat_model_dir

DOCUMENT = "The quick brown fox jumps over the lazy dog. " * 6
QUESTION = "What does the fox do?"


def cache_prompt(model_dir, path, kv_bits=None):
    """What `mlx_lm.cache_prompt --model DIR --prompt DOCUMENT` writes (its code, in process)."""
    target = load_target(model_dir, "float32")
    tokenizer = target.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": DOCUMENT}], add_generation_prompt=False, continue_final_message=True
    )
    cache = make_prompt_cache(target.model)
    for _ in generate_step(
        mx.array(prompt),
        target.model,
        max_tokens=0,
        prompt_cache=cache,
        kv_bits=kv_bits,
        kv_group_size=32,
        quantized_kv_start=0,
    ):
        pass
    save_prompt_cache(str(path), cache, {"model": str(model_dir), "tokenizer_config": "{}"})
    return target


def mlx_lm_continues(target, path, max_tokens):
    """mlx_lm.generate --prompt-cache-file PATH --prompt QUESTION: the template's text from the
    user's message on, after the cached prompt."""
    tokenizer = target.tokenizer
    messages = [{"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "<query>"}], tokenize=False, add_generation_prompt=True
    )
    suffix = tokenizer.encode(text[probe.index("<query>") :], add_special_tokens=False)
    cache = load_prompt_cache(str(path))
    tokens = []
    for token, _ in generate_step(mx.array(suffix), target.model, max_tokens=max_tokens, prompt_cache=cache):
        if int(token) in target.eos_token_ids:
            break
        tokens.append(int(token))
    return tokens


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt-cache")
    model_dir = tiny_chat_model_dir(root / "model")
    target = cache_prompt(model_dir, root / "doc.safetensors")
    return root, model_dir, mlx_lm_continues(target, root / "doc.safetensors", 24)


def test_continues_as_mlx_lm_does(made):
    root, _, expected = made
    for draft in ("none", "lookup", "suffix"):
        # The file names its model: --model may be left out.
        code, out, err = cli(
            [
                "generate",
                QUESTION,
                "--prompt-cache-file",
                str(root / "doc.safetensors"),
                "--draft",
                draft,
                "-m",
                "24",
                "--json",
            ]
            + (["--suffix-memory", "off"] if draft == "suffix" else [])
        )
        assert code == 0, err
        result = json.loads(out)
        assert result["tokens"] == expected, draft
        assert result["stats"]["prompt_cached"] > 40  # the document was not computed again


def test_refusals(made, tmp_path):
    root, model_dir, _ = made
    file = str(root / "doc.safetensors")
    code, _, err = cli(
        [
            "generate",
            QUESTION,
            "--prompt-cache-file",
            file,
            "--draft",
            "model",
            "--draft-model",
            str(model_dir),
        ]
    )
    assert_one_line_error(code, err, "a prompt cache file holds no tokens, which this draft source reads")
    other = tiny_chat_model_dir(tmp_path / "other", seed=1, num_key_value_heads=4)  # 4 KV heads, not 2
    code, _, err = cli(["generate", QUESTION, "--prompt-cache-file", file, "--model", str(other)])
    assert_one_line_error(code, err, f"was made with the model {model_dir}, not {other}")
    cache, metadata = load_prompt_cache(file, return_metadata=True)
    save_prompt_cache(str(tmp_path / "renamed.safetensors"), cache, dict(metadata, model=str(other)))
    code, _, err = cli(["generate", QUESTION, "--prompt-cache-file", str(tmp_path / "renamed.safetensors")])
    assert_one_line_error(code, err, "was made by another model (its layers differ from this llama model's)")
    code, _, err = cli(["generate", QUESTION, "--prompt-cache-file", str(tmp_path / "missing.safetensors")])
    assert_one_line_error(code, err, "no prompt cache file")
    # A bounded cache (cache_prompt --max-kv-size): a layer kind mlx-spec does not read.
    target = load_target(model_dir, "float32")
    bounded = [RotatingKVCache(max_size=8, keep=4) for _ in target.layers]  # llama ignores max_kv_size
    target.model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]), cache=bounded)
    save_prompt_cache(str(tmp_path / "bounded.safetensors"), bounded, {"model": str(model_dir)})
    code, _, err = cli(["generate", QUESTION, "--prompt-cache-file", str(tmp_path / "bounded.safetensors")])
    assert_one_line_error(
        code, err, "holds RotatingKVCache: mlx-spec reads caches of KVCache, QuantizedKVCache"
    )
    (tmp_path / "pickled.safetensors").write_bytes(b"\x80\x04\x95 not safetensors")
    code, _, err = cli(["generate", QUESTION, "--prompt-cache-file", str(tmp_path / "pickled.safetensors")])
    assert_one_line_error(code, err, "cannot read the prompt cache file")
    # Quantized (cache_prompt --kv-bits): plain decoding continues it, speculation is refused.
    quantized = tmp_path / "quantized.safetensors"
    target = cache_prompt(
        tiny_chat_model_dir(tmp_path / "head-dim-32", seed=1, num_attention_heads=2), quantized, kv_bits=8
    )
    code, out, err = cli(
        ["generate", QUESTION, "--prompt-cache-file", str(quantized), "--draft", "none", "-m", "12", "--json"]
    )
    assert code == 0, err
    assert json.loads(out)["tokens"] == mlx_lm_continues(target, quantized, 12)
    code, _, err = cli(["generate", QUESTION, "--prompt-cache-file", str(quantized), "--draft", "lookup"])
    assert_one_line_error(code, err, "the prompt cache file is quantized (--kv-bits)")
