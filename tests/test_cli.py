"""The command line: streaming, --json, and a one-line error for each bad input."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from tiny import save_model, tiny_config, tiny_model



def cli(args, **kwargs):
    """Run the installed console script; (exit code, stdout, stderr)."""
    result = subprocess.run([sys.executable, "-m", "mlx_spec.cli", *args], capture_output=True,
                            text=True, timeout=600, **kwargs)
    return result.returncode, result.stdout, result.stderr


def assert_one_line_error(code, stderr, *fragments):
    assert code != 0
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("Error: ")
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_generate_json_matches_the_stream():
    code, out, err = cli(["generate", "List three fruits.", "--max-tokens", "24", "--json"])
    assert code == 0, err
    result = json.loads(out)
    assert set(result) == {"text", "tokens", "stats"}
    assert set(result["stats"]) == {"prompt_tokens", "generated_tokens", "steps", "tokens_per_step",
                                    "acceptance_rate", "tokens_per_second", "prompt_seconds",
                                    "generate_seconds", "seed", "mean_draft_length", "plain_steps",
                                    "drafted", "finish_reason"}
    assert result["stats"]["generated_tokens"] == len(result["tokens"]) <= 24
    code, streamed, err = cli(["generate", "List three fruits.", "--max-tokens", "24", "--draft", "none"])
    assert code == 0
    assert streamed.strip() == result["text"].strip()
    assert "tokens/step" in err and "tok/s" in err


def test_generate_reads_stdin():
    code, out, err = cli(["generate", "--prompt", "-", "--max-tokens", "8", "--json"], input="Say hi.")
    assert code == 0, err
    assert json.loads(out)["stats"]["prompt_tokens"] > 3


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(tiny_config()))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    garbage = root / "garbage"
    save_model(tiny_model(tiny_config()), tiny_config(), garbage)
    (garbage / "model.safetensors").write_bytes(b"garbage" * 10)
    # A draft model with its own (different) tokenizer.
    other = save_model(tiny_model(tiny_config(vocab_size=64)), tiny_config(vocab_size=64), root / "other")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0")).save(str(other / "tokenizer.json"))
    (other / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return root


@pytest.mark.parametrize("args, fragments", [
    (["--model", "/no/such/model"], ["model not found"]),
    (["--model", "{root}/corrupt"], ["corrupt config.json"]),
    (["--model", "{root}/pickled"], ["pickled weights"]),
    (["--model", "{root}/garbage"], ["cannot load model"]),
    (["--draft", "bogus"], ["unknown draft method 'bogus'"]),
    (["--dtype", "int3"], ["unknown dtype 'int3'"]),
    (["--max-tokens", "9000"], ["exceed the model's context of 8192"]),
    (["--draft", "model"], ["--draft-model"]),
    (["--draft", "model", "--draft-model", "{root}/other"], ["draft model tokenizer has 64 tokens"]),
    (["--temp", "-1"], ["--temp"]),
    (["--bogus-flag"], ["No such option"]),
    (["--draft-model", "/nonexistent"], ["--draft-model is for --draft", "not --draft lookup"]),
    (["--system", "Be terse.", "--no-chat-template"], ["--system goes into the chat template"]),
    (["--prompt", "Hi"], ["give the prompt once"]),
])
def test_bad_input_is_one_line(bad_dirs, args, fragments):
    args = [a.format(root=bad_dirs) for a in args]
    code, out, err = cli(["generate", "Hello", *args])
    assert_one_line_error(code, err, *fragments)


def test_convert_bad_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    code, _, err = cli(["convert", "--gguf", str(bad), "--mlx-path", str(tmp_path / "out")])
    assert_one_line_error(code, err, "x.gguf")


def test_chat_turns_reset_and_ctrl_c_keeps_the_conversation():
    """Ctrl-C in the middle of a long reply: the chat goes on, the printed part of the reply
    stays in the history (and on screen); /reset empties the history."""
    proc = subprocess.Popen([sys.executable, "-m", "mlx_spec.cli", "chat", "--max-tokens", "400"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    chars = []
    reader = threading.Thread(target=lambda: chars.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()

    def read_until(predicate, timeout=300):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate("".join(chars)):
                return "".join(chars)
            time.sleep(0.05)
        raise AssertionError(f"timed out; saw {''.join(chars)!r}")

    proc.stdin.write("Write a very long story about a dragon who learns to paint.\n")
    proc.stdin.flush()
    printed = read_until(lambda s: len(s) > 80)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    proc.stdin.write("What is 2 + 2?\n/reset\nWhat is 2 + 2?\n/quit\n")
    proc.stdin.flush()
    err = proc.stderr.read()
    proc.wait(timeout=300)
    reader.join(timeout=10)
    out = "".join(chars)
    assert proc.returncode == 0, err
    assert "(interrupted)" in err
    assert "(conversation reset)" in err
    assert "Traceback" not in err
    prompts = [int(n) for n in re.findall(r"prompt: (\d+) tokens", err)]
    assert len(prompts) == 2                        # one stats line per finished reply
    # The interrupted reply is part of the history: the same question costs more prompt
    # tokens before /reset than after.
    assert prompts[0] > prompts[1] + 15
    assert out.startswith(printed)                 # nothing printed was taken back
