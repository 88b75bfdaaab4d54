"""The Python API, in mlx-lm's shape: load / generate / stream_generate."""

import json
import subprocess
import sys

import pytest

import mlx_spec
from mlx_spec import generate, load, stream_generate
from mlx_spec.errors import MlxSpecError
from tiny import plain_greedy, tiny_chat_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model_dir(tmp_path_factory.mktemp("api") / "tiny-chat")


def test_stream_generate_is_lossless_and_reports_speculation(model_dir):
    model, tokenizer = load(
        str(model_dir), draft="model", draft_model=str(model_dir), adaptive=False, num_draft_tokens=3
    )
    prompt = tokenizer.encode("Tell me a story")
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=20))
    assert [r.token for r in responses] == plain_greedy(model.target.model, prompt, 20)
    last = responses[-1]
    assert last.finish_reason == "length" and [r.finish_reason for r in responses[:-1]] == [None] * 19
    assert last.generation_tokens == 20 and last.prompt_tokens == len(prompt)
    # A model drafting for itself: every draft is accepted, 4 tokens per step.
    assert last.stats.accepted_drafts == last.stats.verified_drafts > 0 and last.tokens_per_step == 4.0
    assert sum(r.from_draft for r in responses) == last.stats.accepted_drafts
    import mlx_lm

    reference = list(mlx_lm.stream_generate(model.target.model, tokenizer, prompt, max_tokens=20))
    assert "".join(r.text for r in responses) == "".join(r.text for r in reference)


def test_seeded_sampling_whatever_the_source(model_dir):
    texts = []
    for draft in ("none", "lookup", "model"):
        model, tokenizer = load(
            str(model_dir), draft=draft, draft_model=str(model_dir) if draft == "model" else None
        )
        texts.append(
            generate(model, tokenizer, "Once upon a time", max_tokens=16, temp=0.9, top_p=0.95, seed=7)
        )
    assert texts[0] and texts[0] == texts[1] == texts[2]
    # Without a seed every call draws a fresh one (reported in the stats).
    seeds = {
        list(stream_generate(model, tokenizer, "Hi", max_tokens=2, temp=0.9))[-1].stats.seed for _ in range(3)
    }
    assert len(seeds) == 3


def test_verbose_prints_the_text_and_the_statistics(model_dir, capsys):
    model, tokenizer = load(str(model_dir), draft="lookup")
    text = generate(model, tokenizer, "Hello", max_tokens=6, verbose=True)
    out = capsys.readouterr().out
    assert out.startswith(text) and "tokens/step" in out and "reply: 6 tokens" in out


def test_bad_arguments_are_clear(model_dir):
    model, tokenizer = load(str(model_dir), draft="none")
    with pytest.raises(MlxSpecError, match="instead of a sampler"):
        generate(model, tokenizer, "Hi", sampler=lambda logits: logits)
    with pytest.raises(MlxSpecError, match="unknown argument 'temperature'"):
        generate(model, tokenizer, "Hi", temperature=0.5)
    with pytest.raises(MlxSpecError, match="unknown draft method"):
        load(str(model_dir), draft="psychic")
    assert mlx_spec.load is load


def test_python_c_with_a_draft_source():
    """As a user would: python -c with the embedded model and its shipped EAGLE-3 drafter, text
    identical to `mlx-spec generate --draft none` on the same raw prompt."""
    code = (
        "from mlx_spec import load, generate; m, t = load(draft='eagle'); "
        "print(generate(m, t, 'The three primary colors are', max_tokens=16), end='')"
    )
    api = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert api.returncode == 0, api.stderr
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_spec.cli",
            "generate",
            "The three primary colors are",
            "--no-chat-template",
            "--draft",
            "none",
            "-m",
            "16",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr
    assert api.stdout == json.loads(cli.stdout)["text"] and api.stdout.strip()


def test_batch_generate_writes_what_generate_writes(model_dir):
    """Several prompts at once (two rows, three prompts: the third starts as one finishes), a
    stop string inside the drafts of one of them, greedy and seeded."""
    from mlx_spec import batch_generate

    model, tokenizer = load(
        str(model_dir), draft="model", draft_model=str(model_dir), adaptive=False, num_draft_tokens=3
    )
    prompts = ["Tell me a story", "Once upon a time", "A list of fruits:"]
    stop = generate(model, tokenizer, prompts[1], max_tokens=14)[5:8]  # ends the second reply mid-way
    alone = [generate(model, tokenizer, p, max_tokens=14, stop=[stop]) for p in prompts]
    batched = batch_generate(model, tokenizer, prompts, max_tokens=14, max_batch=2, stop=[stop])
    assert batched.texts == alone and batched.stats[1].finish_reason == "stop"
    assert all(s.accepted_drafts == s.verified_drafts > 0 for s in batched.stats)
    sampled = batch_generate(model, tokenizer, prompts, max_tokens=10, max_batch=2, temp=0.9, seed=5)
    assert sampled.texts == [
        generate(model, tokenizer, p, max_tokens=10, temp=0.9, seed=5 + i) for i, p in enumerate(prompts)
    ]


def test_a_list_of_messages_gets_the_chat_template(model_dir):
    """generate, stream_generate and batch_generate take messages as a chat does (the README's
    batch example gave a raw string to a chat model, which then saw no template)."""
    from mlx_spec import batch_generate

    model, tokenizer = load(str(model_dir), draft="lookup")
    conversations = [
        [{"role": "user", "content": "Tell me a story"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a planet."}],
    ]
    templated = [tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
    alone = [generate(model, tokenizer, t, max_tokens=10) for t in templated]
    assert [generate(model, tokenizer, c, max_tokens=10) for c in conversations] == alone
    assert (
        "".join(r.text for r in stream_generate(model, tokenizer, conversations[1], max_tokens=10))
        == alone[1]
    )
    assert batch_generate(model, tokenizer, conversations, max_tokens=10).texts == alone
    raw = generate(model, tokenizer, "Name a planet.", max_tokens=10)  # text: encoded as it is
    assert raw == generate(model, tokenizer, tokenizer.encode("Name a planet."), max_tokens=10)
