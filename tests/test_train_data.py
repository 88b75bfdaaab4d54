import json
import subprocess
import sys
from pathlib import Path

from mlx_spec.bench_suite import SUITE
from mlx_spec.train import data as train_data
from mlx_spec.train.data import build_prompts, is_heldout, read_split, split_of
from tiny import tiny_chat_model_dir


def test_prompts_are_assembled_offline_and_stable():
    prompts = build_prompts()
    assert len(prompts) > 800
    assert {p["source"] for p in prompts} == {
        "instructions",
        "arithmetic",
        "code",
        "summarize",
        "rewrite",
        "chat",
    }
    assert len({p["id"] for p in prompts}) == len(prompts)
    assert [p["id"] for p in build_prompts()] == [p["id"] for p in prompts]  # same seed, same order
    assert not {p["prompt"] for p in prompts} & {s["prompt"] for s in SUITE}  # never the bench prompts
    heldout = sum(is_heldout(p["id"]) for p in prompts)
    assert 0.02 * len(prompts) < heldout < 0.09 * len(prompts)
    # Second turns follow a first turn of the set and share its split; no turn of a held-out
    # bench conversation is a training prompt.
    by_id = {p["id"]: p for p in prompts}
    seconds = [p for p in prompts if "follows" in p]
    assert len(seconds) > 300 and all(
        p["follows"] in by_id and "follows" not in by_id[p["follows"]] for p in seconds
    )
    assert all(split_of(p) == split_of(by_id[p["follows"]]) for p in seconds)
    bench = [
        json.loads(line) for line in open(Path(__file__).parents[1] / "benchmarks" / "heldout_prompts.jsonl")
    ]
    held_turns = {t for q in bench for t in q.get("turns", [q.get("prompt")])}
    assert not {p["prompt"] for p in prompts if split_of(p) == "train"} & held_turns
    # Sources added later keep the older prompts' text (their own random streams): the bench's
    # held-out prompts drawn from this set are still the prompts it makes.
    drawn = [q for q in bench if q["question_id"] in by_id]
    assert len(drawn) >= 10 and all(by_id[q["question_id"]]["prompt"] == q["prompt"] for q in drawn)
    assert all(split_of(by_id[q["question_id"]]) == "heldout" for q in drawn)


def test_train_data_answers_with_the_target_and_resumes(tmp_path):
    model = tiny_chat_model_dir(tmp_path / "model")
    out = tmp_path / "data"
    args = [
        sys.executable,
        "-m",
        "mlx_spec.cli",
        "train",
        "data",
        "--target",
        str(model),
        "--out",
        str(out),
        "--max-tokens",
        "6",
        "--batch-size",
        "4",
    ]
    first = subprocess.run(args + ["--limit", "5"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "5 written, 0 already there" in first.stderr
    second = subprocess.run(args + ["--limit", "9"], capture_output=True, text=True, timeout=600)
    assert "4 written, 5 already there" in second.stderr
    held = sum(is_heldout(p["id"]) for p in build_prompts()[:9])
    assert f"{9 - held} in train.jsonl, {held} in heldout.jsonl" in second.stderr
    # An empty held-out split is said, with why (the hashed split), not left to be found.
    assert ("heldout.jsonl is not written" in second.stderr) == (held == 0)
    rows = read_split(out, "train") + read_split(out, "heldout")
    assert len(rows) == 9 and len({r["id"] for r in rows}) == 9
    for row in rows:
        assert 1 <= len(row["response_tokens"]) <= 6 and row["prompt_tokens"]
        assert json.dumps(row)


def test_a_second_turn_is_answered_after_its_first_with_that_answer_as_context(tmp_path, monkeypatch):
    from mlx_spec.models.target import load_target

    target = load_target(tiny_chat_model_dir(tmp_path / "model"), "float32")
    first = {"id": "chat-a", "source": "chat", "prompt": "Give me a simple recipe for pancakes."}
    second = {"id": "chat-a-2", "source": "chat", "prompt": "Can you make that shorter?", "follows": "chat-a"}
    orphan = {"id": "chat-b-2", "source": "chat", "prompt": "Can you make that shorter?", "follows": "chat-b"}
    monkeypatch.setattr(train_data, "build_prompts", lambda seed=0: [second, orphan, first])
    counts = train_data.generate_data(target, tmp_path / "data", max_tokens=5, batch_size=4)
    assert (counts["written"], counts["waiting"]) == (2, 1)  # chat-b was never asked
    rows = {r["id"]: r for r in read_split(tmp_path / "data", split_of(first))}
    tokenizer = target.tokenizer
    context = [
        {"role": "user", "content": first["prompt"]},
        {"role": "assistant", "content": rows["chat-a"]["response"]},
        {"role": "user", "content": second["prompt"]},
    ]
    assert rows["chat-a-2"]["prompt_tokens"] == list(
        tokenizer.apply_chat_template(context, add_generation_prompt=True)
    )
    assert train_data.generate_data(target, tmp_path / "data", max_tokens=5, batch_size=4)["written"] == 0


def test_fixed_text_rows_are_the_packages_text_tokenized_as_answers(tmp_path, monkeypatch):
    from mlx_lm.utils import load_tokenizer

    from mlx_spec.train.data import STDLIB_MODULES, TEXT_MODULES

    # The held-out bench's prompts quote STDLIB_MODULES' documentation: never trained on as text.
    assert not set(TEXT_MODULES) & set(STDLIB_MODULES)
    model = tiny_chat_model_dir(tmp_path / "model")
    out = tmp_path / "text"
    args = [
        sys.executable,
        "-m",
        "mlx_spec.cli",
        "train",
        "data",
        "--fixed-text",
        "--target",
        str(model),
        "--out",
        str(out),
        "--limit",
        "40",
    ]
    first = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "40 written, 0 already there, 40 texts" in first.stderr
    tokenizer = load_tokenizer(model)
    rows = read_split(out, "train") + read_split(out, "heldout")
    # A second run keeps what is there and adds the rest.
    more = {"id": "text-doc-x", "source": "text-doc", "prompt": "What does `x` do?", "response": "It is x."}
    texts = [{k: r[k] for k in ("id", "source", "prompt", "response")} for r in rows] + [more]
    monkeypatch.setattr(train_data, "fixed_text", lambda: list(texts))
    counts = train_data.write_fixed_text(tokenizer, out)
    assert (counts["written"], counts["skipped"]) == (1, 40)
    rows = read_split(out, "train") + read_split(out, "heldout")
    assert len(rows) == 41
    assert len({r["id"] for r in rows}) == 41 and {r["source"] for r in rows} <= {"text-doc", "text-code"}
    for row in rows:
        assert split_of(row) == ("heldout" if row in read_split(out, "heldout") else "train")
        assert row["response_tokens"] == tokenizer.encode(row["response"], add_special_tokens=False) + [
            tokenizer.eos_token_id
        ]
        assert row["prompt_tokens"] == list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True
            )
        )


# Real prompts (benchmarks/training/real/, scripts/build_real_prompts.py) and their dev set.
ROOT = Path(__file__).parents[1]
REAL = ROOT / "benchmarks" / "training" / "real" / "prompts.jsonl.gz"
REAL_DEV = ROOT / "benchmarks" / "real_dev_prompts.jsonl"


def _normal(text):
    return " ".join(text.lower().split())


def test_real_prompts_load_split_deterministically_and_are_never_a_bench_prompt():
    from mlx_spec.bench_suite import SUITE
    from mlx_spec.train.data import KINDS, load_prompts_file

    prompts = load_prompts_file(REAL)
    assert len(prompts) >= 20_000 and len({p["id"] for p in prompts}) == len(prompts)
    assert [p["id"] for p in load_prompts_file(REAL)] == [p["id"] for p in prompts]  # same file, same order
    assert {p["kind"] for p in prompts} == set(KINDS)
    assert all(p["prompt"].strip() and len(p["prompt"]) < 4000 for p in prompts)
    # No source outside the README's table; GSM8K from its train split only.
    assert {p["source"] for p in prompts} <= {
        "alpaca",
        "alpaca-seed",
        "gpteacher-code",
        "codealpaca",
        "codealpaca-seed",
        "gpteacher-roleplay",
        "gsm8k-train",
        "instructionwild",
        "sgd",
        "samsum",
        "xsum",
        "cnn-dailymail",
        "mrpc",
    }
    # The split: a hash of the id (a later turn: its conversation's first turn's), ~5% held out.
    by_id = {p["id"]: p for p in prompts}
    later = [p for p in prompts if "follows" in p]
    assert len(later) > 1000 and all(by_id[p["follows"]]["source"] == p["source"] for p in later)
    assert all(split_of(p) == split_of(by_id[p["follows"]]) for p in later)
    assert [split_of(p) for p in prompts] == [split_of(p) for p in load_prompts_file(REAL)]
    heldout = sum(split_of(p) == "heldout" for p in prompts)
    assert 0.03 * len(prompts) < heldout < 0.07 * len(prompts)
    # The first prompts of the file (answered first) hold every kind.
    assert {p["kind"] for p in prompts[:60]} == set(KINDS)
    # Never a prompt of the bench suites or of the assembled sources.
    bench = [json.loads(line) for line in open(ROOT / "benchmarks" / "heldout_prompts.jsonl")]
    taken = {_normal(t) for q in bench for t in q.get("turns", [q.get("prompt")])}
    taken |= {_normal(s["prompt"]) for s in SUITE} | {_normal(p["prompt"]) for p in build_prompts()}
    assert not {_normal(p["prompt"]) for p in prompts} & taken
    assert not {p["id"] for p in prompts} & {p["id"] for p in build_prompts()}


def test_the_real_dev_set_is_held_out_of_training():
    from mlx_spec.bench import load_prompts
    from mlx_spec.train.data import KINDS, load_prompts_file

    dev = load_prompts(REAL_DEV)  # as `mlx-spec bench --prompts` reads it
    assert len(dev) >= 100 and {q["category"] for q in dev} == set(KINDS)
    assert all(sum(q["category"] == kind for q in dev) >= 10 for kind in KINDS)
    assert sum(len(q["turns"]) > 1 for q in dev) >= 5
    prompts = load_prompts_file(REAL)
    by_id = {p["id"]: p for p in prompts}
    for q in dev:  # each dev prompt is a prompt of the file, in its held-out split, turn by turn
        ids = [q["question_id"]] + [f"{q['question_id']}-{i + 1}" for i in range(1, len(q["turns"]))]
        assert [by_id[i]["prompt"] for i in ids] == q["turns"]
        assert all(split_of(by_id[i]) == "heldout" for i in ids)
    training = {_normal(p["prompt"]) for p in prompts if split_of(p) == "train"}
    assert not {_normal(t) for q in dev for t in q["turns"] if len(t) > 40} & training


def test_the_assembled_prompts_keep_their_ids_and_splits():
    """The committed answers (benchmarks/training/answers/) are still the assembled prompts': same
    ids, same text, same split. In a fresh interpreter: under pytest, pdb.set_trace is pytest's
    (its source is not the standard library's, so two code prompts are not made)."""
    import gzip

    script = (
        "import json; from mlx_spec.train.data import build_prompts, split_of; "
        "print(json.dumps({p['id']: [p['prompt'], split_of(p)] for p in build_prompts()}))"
    )
    made = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr
    by_id = json.loads(made.stdout)
    for split in ("train", "heldout"):
        with gzip.open(
            ROOT / "benchmarks" / "training" / "answers" / "greedy" / f"{split}.jsonl.gz", "rt"
        ) as f:
            rows = [json.loads(line) for line in f]
        assert len(rows) > 50
        for row in rows:
            assert by_id[row["id"]] == [row["prompt"], split]


def test_train_data_answers_a_prompts_file_in_its_order_and_stops_at_max_minutes(tmp_path, monkeypatch):
    import mlx_lm

    from mlx_spec.models.target import load_target
    from mlx_spec.train.data import load_prompts_file

    model = tiny_chat_model_dir(tmp_path / "model")
    rows = [
        {"id": f"r-{i}", "source": "t", "kind": "instruction", "prompt": "Say hello. " * (6 - i)}
        for i in range(5)
    ]
    rows.insert(2, {"id": "conv", "source": "t", "kind": "chat", "turns": ["Hi there.", "And then?", "Why?"]})
    rows.append(
        {"question_id": "bench-1", "category": "chat", "turns": ["One.", "Two."]}
    )  # the bench's layout
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_prompts_file(prompts_file)
    assert [p["id"] for p in prompts] == [
        "r-0",
        "r-1",
        "conv",
        "conv-2",
        "conv-3",
        "r-2",
        "r-3",
        "r-4",
        "bench-1",
        "bench-1-2",
    ]
    assert prompts[4]["follows"] == "conv-2" and split_of(prompts[4]) == split_of(prompts[2])

    out = tmp_path / "data"
    args = [
        sys.executable,
        "-m",
        "mlx_spec.cli",
        "train",
        "data",
        "--target",
        str(model),
        "--out",
        str(out),
        "--max-tokens",
        "4",
        "--batch-size",
        "2",
        "--prompts-file",
        str(prompts_file),
    ]
    stopped = subprocess.run(args + ["--max-minutes", "0"], capture_output=True, text=True, timeout=600)
    assert stopped.returncode == 0, stopped.stderr
    assert "0 written, 0 already there, 10 prompts" in stopped.stderr and "10 prompts left" in stopped.stderr

    # A window at a time, in the file's order; each window's later turns after its first turns.
    target = load_target(model, "float32")
    batches, real = [], mlx_lm.batch_generate
    monkeypatch.setattr(
        mlx_lm,
        "batch_generate",
        lambda m, t, encoded, **kw: batches.append(len(encoded)) or real(m, t, encoded, **kw),
    )
    answered = []
    counts = train_data.generate_data(
        target, out, max_tokens=4, batch_size=2, prompts=prompts, window=4, progress=answered.append
    )
    assert (counts["written"], counts["waiting"], counts["stopped"]) == (10, 0, 0)
    # windows of 4: [r-0 r-1 conv conv-2] -> batches [conv r-1] [r-0] [conv-2] (shortest first,
    # the later turn after them); [conv-3 r-2 r-3 r-4] -> [r-4 r-3] [r-2] [conv-3]; [bench-1 bench-1-2].
    assert batches == [2, 1, 1, 2, 1, 1, 1, 1]
    assert answered == [0, 2, 1, 1, 2, 1, 1, 1, 1]
    rows = {r["id"]: r for split in ("train", "heldout") for r in read_split(out, split)}
    tokenizer = target.tokenizer
    context = []
    for i, text in enumerate(["Hi there.", "And then?", "Why?"]):
        row = rows["conv" if i == 0 else f"conv-{i + 1}"]
        context.append({"role": "user", "content": text})
        assert row["prompt_tokens"] == list(
            tokenizer.apply_chat_template(context, add_generation_prompt=True)
        )
        context.append({"role": "assistant", "content": row["response"]})
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert "0 written, 10 already there, 10 prompts" in again.stderr
