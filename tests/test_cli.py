"""The command line: streaming, --json, and a one-line error for each bad input."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tiny import save_model, tiny_config, tiny_model


def cli(args, **kwargs):
    """Run the installed console script; (exit code, stdout, stderr)."""
    result = subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", *args], capture_output=True, text=True, timeout=600, **kwargs
    )
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
    from mlx_spec.events import STATISTICS

    assert list(result["stats"]) == list(STATISTICS)  # every figure, defined once
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for name, definition in STATISTICS.items():  # and the README's table defines each one so
        assert f"| `{name}` | {definition} |" in readme, name
    stats = result["stats"]
    assert stats["generated_tokens"] == len(result["tokens"]) <= 24
    # The figures add up: tokens per step counts what the steps committed.
    assert stats["tokens_per_step"] == pytest.approx(stats["committed_tokens"] / stats["steps"])
    assert stats["committed_tokens"] == stats["steps"] + stats["accepted_drafts"]
    assert stats["acceptance_rate"] == pytest.approx(
        stats["accepted_drafts"] / max(stats["verified_drafts"], 1)
    )
    assert stats["verified_drafts"] <= stats["drafted_tokens"]
    code, streamed, err = cli(["generate", "List three fruits.", "--max-tokens", "24", "--draft", "none"])
    assert code == 0
    assert streamed.strip() == result["text"].strip()
    assert "(no drafting)" in err and "tok/s" in err


def test_cache_flags_speculate_exactly_or_say_why_not():
    """mlx-lm's flags: the quantized cache switches at 40 tokens, inside the reply: plain
    decoding prints mlx-lm's tokens; speculation over it is refused in one line."""
    from mlx_spec.api import load  # noqa: I001  (mlx_spec before mlx.core: OpenBLAS)

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    prompt = "Repeat this list exactly twice: apples, bananas, cherries, dates, elderberries, figs, grapes."
    flags = ["--kv-bits", "4", "--quantized-kv-start", "40", "--max-tokens", "40", "--json"]
    code, out, err = cli(["generate", prompt, "--draft", "none", *flags])
    assert code == 0, err
    engine, tokenizer = load(draft="none")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    expected = [
        int(t)
        for t, _ in generate_step(
            mx.array(ids), engine.target.model, max_tokens=40, kv_bits=4, quantized_kv_start=40
        )
    ]
    ends = [i for i, t in enumerate(expected) if t in engine.target.eos_token_ids]
    assert json.loads(out)["tokens"] == expected[: ends[0] if ends else 40]
    for draft in ("lookup", "eagle"):
        code, _, err = cli(["generate", "Hi.", "--draft", draft, *flags])
        assert_one_line_error(code, err, "--kv-bits: a verification pass computes keys and values")
    # mlx-lm's llama builds its own cache and does not bound it: said, not silently ignored.
    code, _, err = cli(["generate", "Hi.", "--max-kv-size", "64", "--max-tokens", "4"])
    assert code == 0 and "--max-kv-size: this llama model builds its own cache" in err, err


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

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0")).save(
        str(other / "tokenizer.json")
    )
    (other / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    # Configs without the architecture, or without its sizes (the weights are fine).
    for name, config in (("untyped", {}), ("unsized", {"model_type": "llama", "hidden_size": 64})):
        save_model(tiny_model(tiny_config()), tiny_config(), root / name)
        (root / name / "config.json").write_text(json.dumps(config))
    # A model whose tokenizer files were left behind.
    save_model(tiny_model(tiny_config()), tiny_config(), root / "untokenized")
    (root / "untokenized" / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    return root


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--model", "/no/such/model"], ["model not found"]),
        (["--model", "{root}/corrupt"], ["corrupt config.json"]),
        (["--model", "{root}/pickled"], ["pickled weights"]),
        (["--model", "{root}/garbage"], ["cannot load model"]),
        (["--model", "{root}/untyped"], ["its config.json has no 'model_type'", '"model_type": "llama"']),
        (
            ["--model", "{root}/unsized"],
            ["lacks what the llama architecture needs: num_hidden_layers,", "vocab_size"],
        ),
        (["--model", "{root}/untokenized"], ["has no tokenizer.json", "copy the tokenizer files"]),
        (["--draft", "bogus"], ["unknown draft method 'bogus'"]),
        (["--dtype", "int3"], ["unknown dtype 'int3'"]),
        (["--max-tokens", "9000"], ["exceed the model's context of 8192"]),
        (["--draft", "model"], ["--draft-model"]),
        (["--draft", "model", "--draft-model", "{root}/other"], ["draft model tokenizer has 64 tokens"]),
        (["--temp", "-1"], ["--temp"]),
        (["--bogus-flag"], ["No such option"]),
        (["--draft-model", "/nonexistent"], ["--draft-model is for --draft", "not --draft lookup"]),
        (
            ["--tree-budget", "8"],
            ["--tree-budget is for --draft", "suffix|ddtree|eagle|medusa", "not --draft lookup"],
        ),
        (["--draft", "mtp", "--tree-budget", "4"], ["--tree-budget is for --draft", "not --draft mtp"]),
        (["--draft", "eagle", "--ngram-max", "4"], ["--ngram-max is for --draft lookup, not --draft eagle"]),
        (["--draft", "none", "--exit-layer", "4"], ["--exit-layer is for --draft layerskip"]),
        (["--draft", "dflash", "--stop-early"], ["--stop-early is for --draft model|eagle|mtp"]),
        (["--system", "Be terse.", "--no-chat-template"], ["--system goes into the chat template"]),
        (["--prompt", "Hi"], ["give the prompt once"]),
    ],
)
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_spec.cli", "chat", "--max-tokens", "400"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        # SIGINT as at a terminal, also where the suite runs with it ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
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
    lines = re.findall(r"prompt: (\d+) tokens(?: \((\d+) cached\))?.*\| reply: (\d+) tokens?, .*", err)
    assert len(lines) == 3, err  # one stats line per reply, the interrupted one too
    (first, _, replied), (second, kept, _), (third, _, _) = [[int(n or 0) for n in line] for line in lines]
    assert "interrupted" in err.split("| reply:")[1].split("\n")[0]
    # The interrupted reply is part of the history: the same question costs more prompt
    # tokens before /reset than after; and what it computed stayed in the cache.
    assert second > third + 15
    assert kept >= first + replied - 3
    assert out.startswith(printed)  # nothing printed was taken back


def test_chat_in_a_terminal():
    """What a user at a terminal expects: line editing and history, one message from a pasted
    block or from lines joined by a backslash or triple quotes, a long paste kept whole (past the
    kernel's 4095-character line), /help, unknown commands not sent to the model, Ctrl-C that
    clears the line, a full context that says /reset, Ctrl-D that leaves."""
    from terminal import Terminal

    term = Terminal([sys.executable, "-m", "mlx_spec.cli", "chat", "-m", "2", "--draft", "none"])
    reply = r"prompt: (\d+) tokens.*\n"
    term.expect(r"mlx-spec chat: SmolLM2-135M-Instruct, --draft none\r?\n")  # which model, which source
    term.expect(">> ")
    term.type("/xyz\x1b[DQ\r")  # left arrow, then an insertion
    assert term.expect(r"unknown command (\S+);").group(1) == b"/xyQz"
    term.expect(">> ")
    term.type("\x1b[A\r")  # up arrow: the last line again
    assert term.expect(r"unknown command (\S+);").group(1) == b"/xyQz"
    term.expect(">> ")
    term.type("/help\r")
    term.expect(r"/help +list.*\n/reset +start.*\n/quit +leave")

    def message(*keys):
        """Type `keys` at the next prompt; the prompt length of the reply that follows."""
        term.expect(">> ")
        for k in keys:
            term.type(k)
        return int(term.expect(reply).group(1))

    first = message("Hi\r")
    pasted = message("\x1b[200~line one\nline two\nline three\x1b[201~\r")  # bracketed paste
    joined = message("line one \\\r", "line two\r")
    quoted = message('"""\r', "line one\r", "line two\r", "line three\r", '"""\r')
    assert min(pasted, joined, quoted) > first
    long_line = message("alpha " * 2463 + "\r")  # 14,778 characters, one line
    assert long_line > 2400, long_line
    # The cached conversation is not counted as computed prompt: the rate is of the new tokens.
    assert re.search(rb"prompt: %d tokens \(\d+ cached\)" % long_line, term.seen)
    assert re.search(rb"prompt  \[#+-*\] +\d+%", term.seen)  # its progress (more than a chunk of 2,048)

    term.expect(">> ")
    term.type("some words")
    time.sleep(0.5)
    term.type("\x03")  # Ctrl-C: the line goes, the chat stays
    term.expect(">> ")
    term.type("alpha " * 9000 + "\r")
    term.expect(r"fills the model's context of 8192 tokens: /reset starts a new one")
    term.expect(">> ")
    term.type("/reset\r")
    term.expect(r"\(conversation reset\)")
    term.expect(">> ")
    term.type("\x04")  # Ctrl-D
    assert term.wait() == 0
    assert b"Traceback" not in term.seen
    # One reply per message: no pasted or continued line became a turn of its own.
    assert len(re.findall(rb"prompt: \d+ tokens", term.seen)) == 5


def test_chat_shows_drafted_tokens_in_green():
    """--show-drafts: the tokens that came from accepted drafts in green (as the chat page
    colours them); lookup's drafts are accepted on a sentence the reply repeats."""
    from terminal import Terminal

    args = ["chat", "-m", "24", "--draft", "lookup", "--show-drafts"]
    term = Terminal([sys.executable, "-m", "mlx_spec.cli", *args])
    term.expect(">> ")
    term.type("Repeat this sentence twice: the quick brown fox jumps over the lazy dog.\r")
    shown = term.expect(r"(.*)\r?\nprompt: \d+ tokens").group(1)
    assert b"\x1b[32m" in shown  # green
    term.expect(">> ")
    term.type("/quit\r")
    assert term.wait() == 0


def test_chat_refuses_a_reply_longer_than_the_context_at_start():
    code, out, err = cli(["chat", "-m", "9000"], input="Hello\n")
    assert_one_line_error(code, err, "--max-tokens 9000 leaves no room", "8192")
    assert not out


def test_stats_line_says_what_it_counts():
    from mlx_spec.api import stats_line
    from mlx_spec.events import Stats

    stats = Stats(
        prompt_tokens=155,
        prompt_cached=142,
        prompt_seconds=0.5,
        generated_tokens=43,
        committed_tokens=44,
        steps=22,
        verified_drafts=40,
        accepted_drafts=22,
        plain_steps=2,
        generate_seconds=2.0,
        finish_reason="eos",
        seed=77,
    )
    line = stats_line(stats)
    assert line.startswith("prompt: 155 tokens (142 cached), 24.0 tok/s | ")  # 12 computed (the last: step 1)
    assert "| reply: 43 tokens, 21.5 tok/s, ended by end of text |" in line
    assert "| 22 steps, 2.00 tokens/step (44 committed, end of text included) |" in line
    assert line.endswith("| drafts: 40 verified, 22 accepted (55%); 2 plain steps (no draft verified)")
    assert line.count("end of text") == 2 and "seed" not in line
    assert stats_line(stats, sampled=True).endswith(" | seed 77")
    one = Stats(
        prompt_tokens=1,
        generated_tokens=1,
        committed_tokens=1,
        steps=1,
        plain_steps=1,
        generate_seconds=0.1,
        finish_reason="length",
    )
    line = stats_line(one, speculative=False)
    assert line == "prompt: 1 token | reply: 1 token, 10.0 tok/s, cut at --max-tokens | 1 step (no drafting)"
    assert stats_line(one).endswith("| 1 step, 1.00 tokens/step | drafts: none verified")  # never drafted
    assert one.prompt_tokens_per_second is None and one.as_dict()["prompt_tokens_per_second"] is None


def test_empty_prompts_are_refused():
    code, out, err = cli(["generate", "  "])
    assert_one_line_error(code, err, "the prompt is empty")
    code, out, err = cli(["generate", "--prompt", "-"], input="")
    assert_one_line_error(code, err, "the prompt is empty: nothing came on stdin")
    assert not out


def test_python_m_mlx_spec_is_the_cli():
    result = subprocess.run(
        [sys.executable, "-m", "mlx_spec", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "Usage: mlx-spec" in result.stdout and "serve" in result.stdout
    assert "EAGLE-3, DFlash, MTP and Medusa" in " ".join(result.stdout.split())


def test_train_takes_model_as_every_command_does():
    for command in ("data", "eagle", "dflash", "mtp", "medusa"):
        code, out, err = cli(["train", command, "--help"])
        assert code == 0 and "--model, --target" in out, out


@pytest.mark.parametrize(
    "method, shipped, fragments",
    [
        ("eagle", "dflash", ["is a DFlash drafter", "use --draft dflash or --draft ddtree"]),
        ("model", "eagle", ["is an EAGLE-3 drafter", "use --draft eagle"]),
        ("dflash", "default", ["is a language model", "use --draft model"]),
    ],
)
def test_a_checkpoint_of_another_kind_is_named(method, shipped, fragments):
    from mlx_spec.convert.default import default_model_path
    from mlx_spec.models.default import shipped_drafter

    path = default_model_path() if shipped == "default" else shipped_drafter(shipped, default_model_path())
    code, _, err = cli(["generate", "Hello", "--draft", method, "--draft-model", str(path)])
    assert_one_line_error(code, err, *fragments)


def test_every_option_and_command_is_explained():
    import click

    from mlx_spec.cli import main
    from mlx_spec.drafters import DRAFTERS

    def walk(command, path):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, path + [name])

    for path, command in walk(main, ["mlx-spec"]):
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"{' '.join(path)} {param.opts[0]} has no help text"
        summaries = click.Context(command).get_help().split("Commands:")[-1]
        assert "..." not in summaries, f"{' '.join(path)} cuts a command's summary"
    code, out, _ = cli(["bench", "--help"])
    assert all(method in out for method in DRAFTERS)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_help_lists_the_everyday_options_first(command):
    code, out, _ = cli([command, "--help"])
    assert code == 0
    where = {
        option: out.index(option + " ")
        for option in (
            "--model",
            "--draft",
            "--max-tokens",
            "--temp",
            "--num-draft-tokens",
            "--kv-bits",
            "--sharding",
        )
    }
    headings = [out.index(heading + ":\n") for heading in ("Options", "Drafting", "Sampling", "KV cache")]
    assert headings == sorted(headings)
    assert (
        max(where["--model"], where["--draft"], where["--max-tokens"])
        < headings[1]
        < where["--num-draft-tokens"]
    )
    assert (
        headings[2] < where["--temp"] < headings[3] < where["--kv-bits"]
        and where["--kv-bits"] > where["--temp"]
    )
    assert where["--sharding"] > headings[2]


def test_bench_takes_every_engine_option_generate_takes_with_the_same_defaults():
    """One configuration (config.py): the commands' options are its fields, declared once."""
    import click

    from mlx_spec.cli import main

    def options(command):
        return {
            p.name: (p.opts, p.default) for p in main.commands[command].params if isinstance(p, click.Option)
        }

    generate, bench = options("generate"), options("bench")
    for name in (
        "temp",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "ngram_max",
        "suffix_memory",
        "kv_bits",
        "sharding",
        "num_draft_tokens",
        "adaptive",
        "residual_sampling",
        "dtype",
        "revision",
        "path_or_hf_repo",
    ):
        assert bench[name] == generate[name], name
    engine_options = set(generate) - {
        "prompt_opt",
        "max_tokens",
        "system",
        "no_chat_template",
        "as_json",
        "prompt_cache_file",
        "help",
    }
    # bench's --methods; its --draft-model takes METHOD=PATH (its destination is draft_models)
    assert engine_options - set(bench) == {"draft", "draft_model"} and bench["draft_models"][0] == [
        "--draft-model"
    ]
    assert engine_options - set(options("serve")) == set() and engine_options - set(options("chat")) == set()


def test_readme_links_stay_inside_the_repository():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    assert "../shared" not in readme
    for link in re.findall(r"\]\(([^)#:]+)\)", readme):
        assert (root / link).exists(), link
    assert "docs/DESIGN.md" in readme and (root / "docs" / "DESIGN.md").is_file()
