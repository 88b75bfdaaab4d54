"""mlx-spec bench on a tiny model: every field, and a lossless counter that can fail."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from mlx_spec import bench
from mlx_spec.drafters.lookup import LookupDrafter
from mlx_spec.engine import Engine, GenerationOptions
from mlx_spec.events import Token
from mlx_spec.models.target import load_target
from mlx_spec.sampling import SamplingParams
from tiny import tiny_chat_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_chat_model_dir(tmp_path_factory.mktemp("tiny") / "model")


class DivergentEngine(Engine):
    """Replaces the target's 6th token: a method that is NOT lossless."""

    def generate(self, prompt, max_tokens=256, stop_strings=(), options=GenerationOptions()):
        n = 0
        for event in super().generate(prompt, max_tokens, stop_strings, options=options):
            if isinstance(event, Token):
                n += 1
                if n == 6:
                    event = replace(event, id=(event.id + 1) % 100)
            yield event


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_lossless_counter_catches_a_divergent_method(tiny_dir, temp):
    # At temperature 1 the baseline (mlx-lm's loop) draws by the seeded rule: the same text.
    target = load_target(tiny_dir, "float32")
    sampling = SamplingParams(temp=temp)
    engines = {
        "lookup": Engine(target, LookupDrafter(), sampling=sampling, seed=3),
        "broken": DivergentEngine(target, sampling=sampling, seed=3),
    }
    items = bench.load_prompts(None, ["summarize", "code"])
    records = bench.run_bench(target, engines, items, max_tokens=12, repeats=1, sampling=sampling, seed=3)
    rows = {(r["method"], r["category"]): r for r in bench.summarize(records)}
    assert rows[("lookup", "all")]["identical"] == "4/4"
    assert rows[("broken", "all")]["identical"] == "0/4"
    assert rows[("broken", "all")]["first_differences"] == [5, 5, 5, 5]


def test_a_single_category_run_prints_its_histogram(tiny_dir):
    """One category has no "all" row: its own row is the whole, histogram included."""
    target = load_target(tiny_dir, "float32")
    engines = {"none": Engine(target), "lookup": Engine(target, LookupDrafter())}
    records = bench.run_bench(
        target,
        engines,
        bench.load_prompts(None, ["code"]),
        max_tokens=8,
        repeats=1,
        sampling=SamplingParams(),
        seed=0,
    )
    rows = bench.summarize(records)
    assert {row["category"] for row in rows} == {"code"}
    for text in (bench.render_table(rows), bench.render_markdown(rows, {})):
        line = next(line for line in text.splitlines() if line.startswith("tokens committed per step"))
        assert line.split(": ", 1)[1].startswith("none: {1: ") and "; lookup: {" in line, line


def test_interleaved_runs_are_timed_apart_in_turns():
    import time

    order = []

    def sleeper(name, seconds, steps):
        for _ in range(steps):
            time.sleep(seconds)
            order.append(name)
            yield

    fast, slow = bench.timed_in_turns(
        [sleeper("fast", 0.01, 20), sleeper("slow", 0.02, 10)], turn_seconds=0.05
    )
    # Each is charged its own work only (0.2 s), not the other's turns in between...
    assert 0.19 < fast < 0.3 and 0.19 < slow < 0.3
    # ... and they alternated, a few steps at a time.
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert switches >= 5


def test_work_left_in_flight_is_charged_to_the_run_that_left_it():
    import time

    import mlx.core as mx

    x = mx.random.normal((512, 512))

    def heavy():
        y = x
        for _ in range(200):
            y = y @ x / 512
        return y

    tic = time.perf_counter()
    mx.eval(heavy())
    alone = time.perf_counter() - tic

    def asynchronous():
        mx.async_eval(heavy())  # as mlx-lm does with its next step
        yield

    def idle():
        yield

    ahead, other = bench.timed_in_turns([asynchronous(), idle()])
    assert ahead > 0.5 * alone and other < 0.5 * alone


def test_bench_cli_writes_every_field(tiny_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"question_id": "q1", "category": "chat", "turns": ["Hi.", "And then?"]})
        + "\n"
        + json.dumps({"prompt": "Repeat: a b c d e f", "category": "copy"})
        + "\n"
    )
    out = tmp_path / "bench.json"
    markdown = tmp_path / "bench.md"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_spec.cli",
            "bench",
            "--model",
            str(tiny_dir),
            "--prompts",
            str(prompts),
            "--methods",
            "none,lookup",
            "--max-tokens",
            "10",
            "--repeats",
            "2",
            "--json",
            str(out),
            "--markdown",
            str(markdown),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "speedup" in result.stdout and "bench" in result.stderr  # table and progress bar
    data = json.loads(out.read_text())
    assert set(data["meta"]) >= {"machine", "mlx", "mlx-lm", "device", "dtype", "model", "drafters"}
    assert len(data["records"]) == 2 * 2 * 3  # methods x repeats x turns (2 + 1)
    assert {r["turn"] for r in data["records"]} == {0, 1}
    for record in data["records"]:
        assert set(record) >= {
            "method",
            "category",
            "question_id",
            "turn",
            "repeat",
            "generated_tokens",
            "seconds",
            "steps",
            "baseline_tokens",
            "baseline_seconds",
            "identical",
            "first_difference",
            "tokens_per_step_histogram",
        }
        assert record["identical"] is True
    for row in data["summary"]:
        assert set(row) >= {
            "method",
            "category",
            "tokens_per_second",
            "baseline_tokens_per_second",
            "speedup",
            "tokens_per_step",
            "acceptance_rate",
            "identical",
            "tokens_per_step_histogram",
        }
    assert {row["category"] for row in data["summary"]} == {"chat", "copy", "all"}
    assert markdown.read_text().startswith("| method |")


@pytest.mark.parametrize(
    "content,message",
    [
        ("{nope\n", "line 1 is not JSON"),
        ('{"prompt": "a"}\n{"prompt": "b",\n', "line 2 is not JSON"),
        ('["a"]\n', "expected an object"),
        ('{"prompt": 5}\n', "'prompt' must be a string"),
        ('{"turns": "hello"}\n', "'turns' a list of strings"),
        ("\n\n", "holds no prompt"),
    ],
    ids=["json", "json-line-2", "list", "number", "turns-string", "blank"],
)
def test_bad_prompts_file(tmp_path, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    result = subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", "bench", "--prompts", str(bad)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr, result.stderr


@pytest.mark.parametrize("option", ["--json", "--markdown", "--plot"])
def test_unwritable_output_is_refused_before_the_run(tmp_path, option):
    result = subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", "bench", option, "/nonexistent/dir/out"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1 and "bench" not in result.stderr.replace("cannot write", "")
    assert result.stderr.strip().count("\n") == 0 and "no directory /nonexistent/dir" in result.stderr


def test_rows_follow_methods_and_say_what_they_cannot(tmp_path):
    """--methods order, no duplicate 'all' row for one category, n/a acceptance without drafts,
    the shipped drafter named in meta, and a warning that one repeat has no spread."""
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"prompt": "Count from one to five.", "category": "count"}) + "\n")
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_spec.cli",
            "bench",
            "--prompts",
            str(prompts),
            "--methods",
            "none,eagle",
            "--max-tokens",
            "4",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert [(row["method"], row["category"]) for row in data["summary"]] == [
        ("none", "count"),
        ("eagle", "count"),
    ]
    assert data["summary"][0]["acceptance_rate"] is None
    table = result.stdout.splitlines()
    assert table[2].split()[:2] == ["none", "count"] and "n/a" in table[2]
    assert data["meta"]["drafters"]["none"] is None
    assert data["meta"]["drafters"]["eagle"].endswith("shipped/smollm2-135m-instruct/eagle")
    assert "--repeats 1: one run per prompt, no spread" in result.stderr


class DivergentRun(Engine):
    """As DivergentEngine, for the batched path (which drives Engine.run)."""

    def run(
        self, prompt, max_tokens=256, stop_strings=(), sampling=None, seed=None, options=GenerationOptions()
    ):
        n, events = 0, super().run(prompt, max_tokens, stop_strings, sampling, seed, options)
        event = next(events)
        while True:
            if isinstance(event, Token):  # not a pending pass
                n += 1
                if n == 6:
                    event = replace(event, id=(event.id + 1) % 100)
            try:
                event = events.send((yield event))
            except StopIteration:
                return


def test_concurrent_mode_counts_lossless_outputs_against_mlx_lm_batched(tiny_dir):
    target = load_target(tiny_dir, "float32")
    sampling = SamplingParams()
    engines = {
        "lookup": Engine(target, LookupDrafter(), sampling=sampling),
        "broken": DivergentRun(target, sampling=sampling),
    }
    items = bench.load_prompts(None, ["summarize", "code"])
    records = bench.run_concurrent(
        target, engines, items, max_tokens=12, repeats=2, sampling=sampling, concurrency=3
    )
    rows = {r["method"]: r for r in bench.summarize(records)}
    assert rows["lookup"]["identical"] == "8/8" and rows["broken"]["identical"] == "0/8"
    assert rows["broken"]["first_differences"] == [5] * 8
    assert {r.category for r in records} == {"all"} and rows["lookup"]["repeats"] == 2
    assert all(r.generated_tokens == 12 and r.seconds > 0 and r.baseline_seconds > 0 for r in records)
