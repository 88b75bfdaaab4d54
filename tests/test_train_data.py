import json
import subprocess
import sys
from pathlib import Path

from tiny import tiny_chat_model_dir

from mlx_spec.bench_suite import SUITE
from mlx_spec.train import data as train_data
from mlx_spec.train.data import build_prompts, is_heldout, read_split, split_of


def test_prompts_are_assembled_offline_and_stable():
    prompts = build_prompts()
    assert len(prompts) > 800
    assert {p["source"] for p in prompts} == {"instructions", "arithmetic", "code", "summarize", "rewrite", "chat"}
    assert len({p["id"] for p in prompts}) == len(prompts)
    assert [p["id"] for p in build_prompts()] == [p["id"] for p in prompts]   # same seed, same order
    assert not {p["prompt"] for p in prompts} & {s["prompt"] for s in SUITE}   # never the bench prompts
    heldout = sum(is_heldout(p["id"]) for p in prompts)
    assert 0.02 * len(prompts) < heldout < 0.09 * len(prompts)
    # Second turns follow a first turn of the set and share its split; no turn of a held-out
    # bench conversation is a training prompt.
    by_id = {p["id"]: p for p in prompts}
    seconds = [p for p in prompts if "follows" in p]
    assert len(seconds) > 300 and all(p["follows"] in by_id and "follows" not in by_id[p["follows"]] for p in seconds)
    assert all(split_of(p) == split_of(by_id[p["follows"]]) for p in seconds)
    bench = [json.loads(line) for line in open(Path(__file__).parents[1] / "benchmarks" / "heldout_prompts.jsonl")]
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
    args = [sys.executable, "-m", "mlx_spec.cli", "train", "data", "--target", str(model), "--out", str(out),
            "--max-tokens", "6", "--batch-size", "4"]
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
    assert (counts["written"], counts["waiting"]) == (2, 1)   # chat-b was never asked
    rows = {r["id"]: r for r in read_split(tmp_path / "data", split_of(first))}
    tokenizer = target.tokenizer
    context = [{"role": "user", "content": first["prompt"]}, {"role": "assistant", "content": rows["chat-a"]["response"]},
               {"role": "user", "content": second["prompt"]}]
    assert rows["chat-a-2"]["prompt_tokens"] == list(tokenizer.apply_chat_template(context, add_generation_prompt=True))
    assert train_data.generate_data(target, tmp_path / "data", max_tokens=5, batch_size=4)["written"] == 0


def test_fixed_text_rows_are_the_packages_text_tokenized_as_answers(tmp_path, monkeypatch):
    from mlx_lm.utils import load_tokenizer

    from mlx_spec.train.data import STDLIB_MODULES, TEXT_MODULES

    # The held-out bench's prompts quote STDLIB_MODULES' documentation: never trained on as text.
    assert not set(TEXT_MODULES) & set(STDLIB_MODULES)
    model = tiny_chat_model_dir(tmp_path / "model")
    out = tmp_path / "text"
    args = [sys.executable, "-m", "mlx_spec.cli", "train", "data", "--fixed-text", "--target", str(model),
            "--out", str(out), "--limit", "40"]
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
        assert row["response_tokens"] == tokenizer.encode(row["response"], add_special_tokens=False) + [tokenizer.eos_token_id]
        assert row["prompt_tokens"] == list(tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True))
