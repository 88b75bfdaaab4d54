"""End-to-end on the embedded default model: mlx-spec's output is mlx-lm's, token for token."""

import json
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_spec.bench_suite import SUITE
from mlx_spec.convert.default import default_model_path
from mlx_spec.drafters import draft_tokens, make_drafter
from mlx_spec.drafters.lookup import LookupDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.events import Collector
from mlx_spec.models.default import SHIPPED_DRAFTERS
from mlx_spec.models.target import Target, load_target
from mlx_spec.sampling import SamplingParams
from tiny import renormalised, run

MAX_TOKENS = 64
# Tokens per step the shipped drafters must beat on a held-out arithmetic prompt at their
# default draft length, every draft verified (EAGLE-3 3.6, DFlash 2.6, MTP 3.6, Medusa 3.4 there
# with the drafters of 2026-11-30): a random drafter's stay at 1.0.
SHIPPED_MIN_TAU = {"eagle": 1.6, "dflash": 1.25, "mtp": 2.0, "medusa": 2.0}


@pytest.fixture(scope="module")
def target():
    return load_target(default_model_path(), "float32")


def mlx_lm_tokens(target, prompt, max_tokens):
    from mlx_lm import stream_generate

    eos = set(target.eos_token_ids)
    return [
        r.token
        for r in stream_generate(target.model, target.tokenizer, prompt, max_tokens=max_tokens)
        if r.token not in eos
    ]


def chat_prompt(target, text):
    return target.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


# Two of the ten prompts in the default suite (chat, summarize); the others are `slow` (make
# test-all): the engine's token identity is tested on every source with tiny models too.
@pytest.mark.parametrize(
    "item",
    [pytest.param(s, marks=() if i in (0, 6) else pytest.mark.slow) for i, s in enumerate(SUITE)],
    ids=[f"{i}-{s['category']}" for i, s in enumerate(SUITE)],
)
def test_lookup_matches_plain_and_mlx_lm(target, item):
    prompt = chat_prompt(target, item["prompt"])
    expected = mlx_lm_tokens(target, prompt, MAX_TOKENS)
    if SUITE.index(item) % 2 == 0:  # the engine without a drafter: one prompt per category is enough
        plain, _ = run(Engine(target), prompt, MAX_TOKENS)
        assert plain == expected
    looked_up, stats = run(Engine(target, LookupDrafter()), prompt, MAX_TOKENS)
    assert looked_up == expected
    assert len(expected) == MAX_TOKENS or stats.finish_reason == "eos"


def test_mlx_lm_load_generates_what_mlx_spec_generates():
    """The converted directory, loaded by mlx-lm itself (quantized, as converted)."""
    from mlx_lm import load

    model, tokenizer = load(str(default_model_path()))
    target = load_target(default_model_path(), "keep")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colors."}], add_generation_prompt=True
    )
    from mlx_lm import generate

    text = generate(model, tokenizer, prompt, max_tokens=40)
    tokens, _ = run(Engine(target, LookupDrafter()), prompt, 40)
    assert tokenizer.decode(tokens) == text
    assert "blue" in text.lower() or "red" in text.lower()


def test_stop_string_inside_a_draft(target):
    prompt = chat_prompt(target, SUITE[9]["prompt"])  # copies a text: lookup drafts long runs
    full, _ = run(Engine(target), prompt, 60)
    text = target.tokenizer.decode(full)
    stop = text[40:52]
    engine = Engine(target, LookupDrafter())
    collected = Collector.of(engine.generate(prompt, max_tokens=60, stop_strings=[stop]))
    assert collected.stats.finish_reason == "stop"
    assert collected.text == text[: text.find(stop)]


def test_stats_and_tau(target):
    prompt = chat_prompt(target, SUITE[9]["prompt"])
    _, stats = run(Engine(target, LookupDrafter(), adaptive=False), prompt, 64)
    assert stats.steps < 64 and stats.tokens_per_step > 1.2
    assert 0 < stats.acceptance_rate <= 1
    assert stats.committed_tokens == sum([stats.steps, stats.accepted_drafts])
    mx.clear_cache()


# --- the drafters shipped for the default model -------------------------------------------------

HELDOUT = [
    json.loads(line)
    for line in (Path(__file__).resolve().parent.parent / "benchmarks" / "heldout_prompts.jsonl")
    .read_text()
    .splitlines()
]


@pytest.mark.parametrize("method", ["eagle", "dflash", "mtp", "medusa"])
def test_shipped_drafter_is_used_by_default_and_is_lossless(target, method):
    """`--draft eagle|dflash|mtp|medusa` without --draft-model on the default model: the trained drafter
    that ships in the package, token-identical to mlx-lm, and it drafts tokens the target
    accepts (a random drafter's tokens per step stay at 1.0) on a held-out prompt."""
    path = SHIPPED_DRAFTERS / method
    assert sum(f.stat().st_size for f in path.iterdir()) <= 25 * 2**20
    k = draft_tokens(method)
    drafter = make_drafter(method, target, dict(num_draft_tokens=k))
    prompt = chat_prompt(target, HELDOUT[2]["prompt"])  # a word problem
    expected = mlx_lm_tokens(target, prompt, 64)
    tokens, stats = run(Engine(target, drafter, num_draft_tokens=k, adaptive=False), prompt, 64)
    assert tokens == expected
    assert stats.tokens_per_step > SHIPPED_MIN_TAU[method]
    mx.clear_cache()


def test_no_shipped_drafter_for_another_model(target, tmp_path):
    with pytest.raises(MlxSpecError, match="needs a drafter: --draft-model PATH"):
        make_drafter("eagle", Target(target.model, target.tokenizer, target.config, path=str(tmp_path)), {})


# lookup, eagle, dflash and suffix+eagle in the default suite; the others (tests/test_seeded.py
# checks every source on tiny models) are `slow`.
@pytest.mark.parametrize(
    "method,options",
    [
        ("lookup", {}),
        pytest.param("model", {}, marks=pytest.mark.slow),
        ("eagle", {}),
        pytest.param("eagle", {"tree_budget": 8, "tree_topk": 3}, marks=pytest.mark.slow),
        ("dflash", {}),
        pytest.param("ddtree", {}, marks=pytest.mark.slow),
        pytest.param("mtp", {}, marks=pytest.mark.slow),
        pytest.param("medusa", {}, marks=pytest.mark.slow),
        pytest.param("medusa", {"tree_budget": 8, "tree_topk": 3}, marks=pytest.mark.slow),
        pytest.param("layerskip", {"exit_layer": 20}, marks=pytest.mark.slow),
        pytest.param("suffix", {"suffix_memory": "off"}, marks=pytest.mark.slow),
        ("suffix+eagle", {"suffix_memory": "off"}),
    ],
    ids=[
        "lookup",
        "model",
        "eagle",
        "eagle-tree",
        "dflash",
        "ddtree",
        "mtp",
        "medusa",
        "medusa-tree",
        "layerskip",
        "suffix",
        "suffix+eagle",
    ],
)
def test_seed_reproduces_sampled_text_whatever_the_source(target, method, options):
    """--seed S prints what --draft none --seed S prints, with one draft per step and with many."""
    params = SamplingParams(temp=0.8, top_p=0.9, top_k=50)
    prompt = chat_prompt(target, HELDOUT[0]["prompt"])
    plain, _ = run(Engine(target, sampling=params, seed=7), prompt, 32)
    for k in (1, 8):
        drafter = make_drafter(
            method,
            target,
            dict(options, draft_model=str(default_model_path()) if method == "model" else None),
        )
        tokens, stats = run(
            Engine(target, drafter, num_draft_tokens=k, sampling=params, seed=7, adaptive=False), prompt, 32
        )
        assert tokens == plain, (method, k)
        assert stats.verified_drafts > 0
    mx.clear_cache()


def default_copy(directory: Path, **config_changes) -> Path:
    """A copy of the default model as another conversion holds it: the Hugging Face checkpoint's
    config (no quantization, a torch_dtype), its tokenizer, no conversion record."""
    source = default_model_path()
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("quantization")}
    config.update(torch_dtype="bfloat16", **config_changes)
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).write_bytes((source / name).read_bytes())
    return directory


def test_the_default_model_is_recognised_by_what_it_is(target, tmp_path):
    """Another copy of the default model (another dtype, another directory, the hub cache) gets the
    shipped drafters: recognised by its architecture and its tokenizer's vocabulary, not where
    it was converted; another model is told where they are, in the CLI's and Python's words."""
    from mlx_spec.models.default import DEFAULT_VOCABULARY_HASH, is_default_model, tokenizer_vocabulary_hash

    assert tokenizer_vocabulary_hash(default_model_path()) == DEFAULT_VOCABULARY_HASH
    assert is_default_model(default_copy(tmp_path / "copy"))
    assert not is_default_model(default_copy(tmp_path / "deeper", num_hidden_layers=32))
    other_vocabulary = default_copy(tmp_path / "retokenized")
    tokenizer = json.loads((other_vocabulary / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello-token"] = vocab.pop(next(iter(vocab)))
    (other_vocabulary / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert not is_default_model(other_vocabulary)
    assert not is_default_model(tmp_path)  # no config at all
    with pytest.raises(
        MlxSpecError,
        match=r"--draft-model PATH \(Python: draft_model=PATH\).*default model "
        f"SmolLM2-135M-Instruct only: {SHIPPED_DRAFTERS / 'eagle'}",
    ):
        make_drafter(
            "eagle", Target(target.model, target.tokenizer, target.config, path=str(other_vocabulary)), {}
        )


def test_the_default_model_by_hub_id_drafts_with_the_shipped_drafter(tmp_path):
    """The default model's weights in a hub cache (HF_HUB_OFFLINE=1) as
    HuggingFaceTB/SmolLM2-135M-Instruct: --draft eagle needs no --draft-model there."""
    import os
    import subprocess
    import sys

    from test_hub import hub_cache

    files = default_copy(tmp_path / "files")
    config = json.loads((default_model_path() / "config.json").read_text())  # the weights are the 4-bit ones
    config.update(json.loads((files / "config.json").read_text()))
    (files / "config.json").write_text(json.dumps(config))
    (files / "model.safetensors").symlink_to(default_model_path() / "model.safetensors")
    cache = hub_cache(tmp_path / "cache", "HuggingFaceTB/SmolLM2-135M-Instruct", files)
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_spec.cli",
            "generate",
            "What is 7 times 8?",
            "-m",
            "16",
            "--json",
            "--draft",
            "eagle",
            "--fixed",
            "--model",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stats"]["accepted_drafts"] > 0


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_logprobs_with_eagles_accepted_drafts_equal_mlx_lms(target, temp):
    """The shipped EAGLE-3 layer drafts, the target accepts some: every token's logprob (and the
    whole distribution) is mlx-lm's at that position, greedy and seeded."""
    from mlx_lm.generate import generate_step

    from mlx_spec.bench import seeded_sampler
    from mlx_spec.engine import GenerationOptions
    from mlx_spec.sampling import Sampler

    params = SamplingParams(temp=temp)
    prompt = chat_prompt(target, HELDOUT[2]["prompt"])
    sampler = None if temp == 0 else seeded_sampler(Sampler(params, 9), len(prompt))
    reference = [
        (int(t), lp)
        for t, lp in generate_step(mx.array(prompt), target.model, max_tokens=24, sampler=sampler)
    ]
    engine = Engine(
        target, make_drafter("eagle", target, {}), num_draft_tokens=4, adaptive=False, sampling=params, seed=9
    )
    collected = Collector.of(
        engine.generate(prompt, max_tokens=24, options=GenerationOptions(logprobs=3, distribution=True))
    )
    assert collected.tokens == [t for t, _ in reference[: len(collected.tokens)]] and any(
        collected.from_draft
    )
    for (token, logprobs), ours in zip(reference, collected.logprobs):
        logprobs = renormalised(logprobs)
        assert abs(ours.logprob - logprobs[token].item()) < 1e-4
        assert mx.allclose(ours.distribution, logprobs, atol=1e-4)
    mx.clear_cache()
