import json
import subprocess
import sys

from tiny import tiny_chat_model_dir

from mlx_spec.bench_suite import SUITE
from mlx_spec.train.data import build_prompts, is_heldout, read_split


def test_prompts_are_assembled_offline_and_stable():
    prompts = build_prompts()
    assert len(prompts) > 800
    assert {p["source"] for p in prompts} == {"instructions", "arithmetic", "code", "summarize", "rewrite"}
    assert len({p["id"] for p in prompts}) == len(prompts)
    assert [p["id"] for p in build_prompts()] == [p["id"] for p in prompts]   # same seed, same order
    assert not {p["prompt"] for p in prompts} & {s["prompt"] for s in SUITE}   # never the bench prompts
    heldout = sum(is_heldout(p["id"]) for p in prompts)
    assert 0.02 * len(prompts) < heldout < 0.09 * len(prompts)


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
