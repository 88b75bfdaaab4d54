"""`mlx-spec convert`: mlx-lm's conversion of a local Hugging Face directory, and published
drafters cast or quantized; written atomically, with a one-line error for each bad input."""

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
    code, _, err = cli(
        [
            "convert",
            "--hf-path",
            str(source),
            "--mlx-path",
            str(tmp_path / "q8"),
            "-q",
            "--q-bits",
            "8",
            "--q-group-size",
            "32",
        ]
    )
    assert code == 0, err
    config = json.loads((tmp_path / "q8" / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    assert greedy(tmp_path / "q8")
    # An existing output is kept unless --overwrite.
    code, _, err = cli(["convert", "--hf-path", str(source), "--mlx-path", str(tmp_path / "out")])
    assert_one_line_error(code, err, "not empty", "--overwrite")
    code, _, err = cli(
        [
            "convert",
            "--hf-path",
            str(source),
            "--mlx-path",
            str(tmp_path / "out"),
            "--overwrite",
            "--dtype",
            "float16",
        ]
    )
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "mlx_spec_conversion.json").read_text())["dtype"] == "float16"


def test_a_quantized_source_is_requantized_as_asked(source, tmp_path):
    """An mlx-community style directory (already quantized) with -q or --dtype: dequantized, then
    written as asked, and the record says what was written."""
    import mlx.core as mx

    code, _, err = cli(["convert", "--hf-path", str(source), "--mlx-path", str(tmp_path / "q4"), "-q"])
    assert code == 0, err
    code, _, err = cli(
        [
            "convert",
            "--hf-path",
            str(tmp_path / "q4"),
            "--mlx-path",
            str(tmp_path / "q8"),
            "-q",
            "--q-bits",
            "8",
            "--q-group-size",
            "32",
        ]
    )
    assert code == 0, err
    config = json.loads((tmp_path / "q8" / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    info = json.loads((tmp_path / "q8" / "mlx_spec_conversion.json").read_text())
    assert info["quantization"] == {"bits": 8, "group_size": 32} and info["dequantized_from"]["bits"] == 4
    weights = mx.load(str(tmp_path / "q8" / "model.safetensors"))
    q_proj = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q_proj.dtype == mx.uint32 and q_proj.shape[-1] * 32 // 8 == config["hidden_size"]  # 8-bit packing
    assert greedy(tmp_path / "q8")
    code, _, err = cli(
        [
            "convert",
            "--hf-path",
            str(tmp_path / "q4"),
            "--mlx-path",
            str(tmp_path / "f16"),
            "--dtype",
            "float16",
        ]
    )
    assert code == 0, err
    assert "quantization" not in json.loads((tmp_path / "f16" / "config.json").read_text())
    info = json.loads((tmp_path / "f16" / "mlx_spec_conversion.json").read_text())
    assert info["quantization"] is None and info["dtype"] == "float16"
    weights = mx.load(str(tmp_path / "f16" / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float16
    # Neither: the source's quantization, kept and recorded.
    code, _, err = cli(["convert", "--hf-path", str(tmp_path / "q4"), "--mlx-path", str(tmp_path / "same")])
    assert code == 0, err
    assert (
        json.loads((tmp_path / "same" / "mlx_spec_conversion.json").read_text())["quantization"]["bits"] == 4
    )


def broken(source, tmp_path, how):
    bad = tmp_path / how
    shutil.copytree(source, bad)
    weights = bad / "model.safetensors"
    if how == "architecture":
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(dict(config, model_type="no_such_arch")))
    elif how == "shards":
        weights.rename(bad / "model-00001-of-00002.safetensors")
        (bad / "model.safetensors.index.json").write_text(
            json.dumps(
                {
                    "weight_map": {
                        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                        "lm_head.weight": "model-00002-of-00002.safetensors",
                    }
                }
            )
        )
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:-1000])
    elif how == "pickled":
        weights.unlink()
        (bad / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    return bad


@pytest.mark.parametrize(
    "how, fragments",
    [
        ("architecture", ["no_such_arch", "mlx-lm has no port"]),
        ("shards", ["lacks 1 of the 2 shards", "model-00002-of-00002.safetensors"]),
        ("truncated", ["is truncated"]),
        ("pickled", ["pickled weights only"]),
    ],
)
def test_bad_checkpoints_are_one_line(source, tmp_path, how, fragments):
    code, _, err = cli(
        ["convert", "--hf-path", str(broken(source, tmp_path, how)), "--mlx-path", str(tmp_path / "out")]
    )
    assert_one_line_error(code, err, *fragments)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--mlx-path", "{tmp}/o"], "give one source"),
        (["--hf-path", "{tmp}", "--gguf", "{tmp}/x.gguf", "--mlx-path", "{tmp}/o"], "give one source"),
        (["--gguf", "{tmp}/x.gguf", "--mlx-path", "{tmp}/o", "-q"], "x.gguf"),
        (["--hf-path", "{tmp}/missing", "--mlx-path", "{tmp}/o"], "not found"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, args, fragment):
    code, _, err = cli(["convert", *[a.format(tmp=tmp_path) for a in args]])
    assert_one_line_error(code, err, fragment)


def drafts_of(drafter_dir, method, prompt="Count from one to ten.", n=24):
    """Every draft proposed while the default model answers, greedy, every draft verified."""
    from mlx_spec.convert.default import default_model_path
    from mlx_spec.drafters import make_drafter
    from mlx_spec.engine import Engine
    from mlx_spec.events import Collector
    from mlx_spec.models.target import load_target

    target = load_target(default_model_path(), "auto")
    drafter = make_drafter(method, target, {"draft_model": str(drafter_dir)})
    proposed, propose = [], drafter.propose

    def recording(k):
        draft = propose(k)
        proposed.append(draft.tokens.tolist() if hasattr(draft.tokens, "tolist") else list(draft.tokens))
        return draft

    drafter.propose = recording
    engine = Engine(target, drafter, num_draft_tokens=4, adaptive=False)
    prompt = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True
    )
    tokens = Collector.of(engine.generate(prompt, max_tokens=n)).tokens
    return tokens, proposed


# dflash and medusa (~45 s each) are `slow`: the conversion path is the same as eagle's.
@pytest.mark.parametrize(
    "method",
    ["eagle", pytest.param("dflash", marks=pytest.mark.slow), pytest.param("medusa", marks=pytest.mark.slow)],
)
def test_drafter_conversion(method, tmp_path):
    """A converted float drafter drafts exactly what the original does; an 8-bit one loads with
    quantized layers and leaves the output the target's (its agreement with the float drafts on
    held-out prompts is measured by benchmarks/quantized_drafters.py)."""
    from mlx_spec.models.default import SHIPPED_DRAFTERS

    shipped = SHIPPED_DRAFTERS / method
    code, _, err = cli(["convert", "--drafter", str(shipped), "--mlx-path", str(tmp_path / "same")])
    assert code == 0, err
    tokens, drafts = drafts_of(shipped, method)
    assert drafts_of(tmp_path / "same", method) == (tokens, drafts)
    code, _, err = cli(
        ["convert", "--drafter", str(shipped), "--mlx-path", str(tmp_path / "q8"), "-q", "--q-bits", "8"]
    )
    assert code == 0, err
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"]["bits"] == 8

    def size(path):
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))

    assert size(tmp_path / "q8") < 0.6 * size(shipped)
    assert drafts_of(tmp_path / "q8", method)[0] == tokens


def test_bad_drafters_are_one_line(source, tmp_path):
    from mlx_spec.models.default import SHIPPED_DRAFTERS

    code, _, err = cli(["convert", "--drafter", str(source), "--mlx-path", str(tmp_path / "a")])
    assert_one_line_error(code, err, "holds a language model", "--hf-path")
    # Made for another target: the tiny model has 2 layers, the drafter fuses layer 15.
    code, _, err = cli(
        [
            "convert",
            "--drafter",
            str(SHIPPED_DRAFTERS / "eagle"),
            "--model",
            str(source),
            "--mlx-path",
            str(tmp_path / "b"),
        ]
    )
    assert_one_line_error(code, err, str(SHIPPED_DRAFTERS / "eagle"), "outside this target's 2 layers")
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"hidden_size": 8}))
    code, _, err = cli(["convert", "--drafter", str(unknown), "--mlx-path", str(tmp_path / "c")])
    assert_one_line_error(code, err, "no drafter mlx-spec knows")
    assert not any((tmp_path / name).exists() for name in "abc")
