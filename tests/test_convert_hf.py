"""`mlx-spec convert --hf-path`: mlx-lm's conversion of a local Hugging Face directory, written
atomically, with a one-line error for each bad input."""

import json
import shutil

import pytest
from test_cli import assert_one_line_error, cli
from tiny import tiny_chat_model_dir


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return tiny_chat_model_dir(tmp_path_factory.mktemp("hf") / "tiny", seed=3)


def greedy(path, n=12):
    from mlx_lm import generate, load

    model, tokenizer = load(str(path))
    return generate(model, tokenizer, "Hello there, how are", max_tokens=n)


def test_round_trip_gives_mlx_lms_tokens(source, tmp_path):
    code, out, err = cli(["convert", "--hf-path", str(source), "--mlx-path", str(tmp_path / "out")])
    assert code == 0, err
    assert greedy(tmp_path / "out") == greedy(source)
    info = json.loads((tmp_path / "out" / "mlx_spec_conversion.json").read_text())
    assert info["source"] == str(source.resolve()) and info["format"] == "huggingface"
    # Quantized: mlx-lm loads it, with the bits asked for.
    code, _, err = cli(["convert", "--hf-path", str(source), "--mlx-path", str(tmp_path / "q8"), "-q",
                        "--q-bits", "8", "--q-group-size", "32"])
    assert code == 0, err
    config = json.loads((tmp_path / "q8" / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    assert greedy(tmp_path / "q8")
    # An existing output is kept unless --overwrite.
    code, _, err = cli(["convert", "--hf-path", str(source), "--mlx-path", str(tmp_path / "out")])
    assert_one_line_error(code, err, "not empty", "--overwrite")
    code, _, err = cli(["convert", "--hf-path", str(source), "--mlx-path", str(tmp_path / "out"), "--overwrite",
                        "--dtype", "float16"])
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "mlx_spec_conversion.json").read_text())["dtype"] == "float16"


def broken(source, tmp_path, how):
    bad = tmp_path / how
    shutil.copytree(source, bad)
    weights = bad / "model.safetensors"
    if how == "architecture":
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(dict(config, model_type="no_such_arch")))
    elif how == "shards":
        weights.rename(bad / "model-00001-of-00002.safetensors")
        (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:-1000])
    elif how == "pickled":
        weights.unlink()
        (bad / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    return bad


@pytest.mark.parametrize("how, fragments", [
    ("architecture", ["no_such_arch", "mlx-lm has no port"]),
    ("shards", ["lacks 1 of the 2 shards", "model-00002-of-00002.safetensors"]),
    ("truncated", ["is truncated"]),
    ("pickled", ["pickled weights only"]),
])
def test_bad_checkpoints_are_one_line(source, tmp_path, how, fragments):
    code, _, err = cli(["convert", "--hf-path", str(broken(source, tmp_path, how)), "--mlx-path",
                        str(tmp_path / "out")])
    assert_one_line_error(code, err, *fragments)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--mlx-path", "{tmp}/o"], "give one source"),
    (["--hf-path", "{tmp}", "--gguf", "{tmp}/x.gguf", "--mlx-path", "{tmp}/o"], "give one source"),
    (["--gguf", "{tmp}/x.gguf", "--mlx-path", "{tmp}/o", "-q"], "-q is for --hf-path"),
    (["--hf-path", "{tmp}/missing", "--mlx-path", "{tmp}/o"], "not found"),
])
def test_bad_arguments_are_one_line(tmp_path, args, fragment):
    code, _, err = cli(["convert", *[a.format(tmp=tmp_path) for a in args]])
    assert_one_line_error(code, err, fragment)
