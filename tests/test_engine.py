import pytest

from mlx_spec.drafters.lookup import LookupDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from tiny import ScriptedDrafter, plain_greedy, run, tiny_target

# A prompt that repeats itself, so that lookup finds matches and really drafts.
PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5, 7]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_plain_loop_matches_mlx_lm(arch):
    target = tiny_target(arch)
    expected = plain_greedy(target.model, PROMPT, 64)
    tokens, stats = run(Engine(target), PROMPT, 64)
    assert tokens == expected
    assert stats.steps == 64 and stats.tokens_per_step == 1.0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 5, 8])
def test_lookup_is_token_identical(arch, k):
    target = tiny_target(arch)
    expected = plain_greedy(target.model, PROMPT, 80)
    for adaptive in (False, True):
        engine = Engine(target, LookupDrafter(), num_draft_tokens=k, adaptive=adaptive)
        tokens, stats = run(engine, PROMPT, 80)
        assert tokens == expected, (k, adaptive)
        assert stats.committed_tokens == 80 and stats.generated_tokens == 80
        if k and not adaptive:
            assert stats.verified_drafts > 0


@pytest.mark.parametrize("wrong_every", [2, 3, 5, 100])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_every_acceptance_length(wrong_every, k):
    target = tiny_target("llama", seed=1)
    expected = plain_greedy(target.model, PROMPT, 50)
    engine = Engine(target, ScriptedDrafter(expected, wrong_every, 32), num_draft_tokens=k, adaptive=False)
    tokens, stats = run(engine, PROMPT, 50)
    assert tokens == expected
    assert stats.accepted_drafts > 0
    if wrong_every == 100:
        assert stats.tokens_per_step > k  # every draft accepted except at the limit


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 11, 17])
def test_max_tokens_exact_inside_a_draft(max_tokens):
    target = tiny_target("llama", seed=2)
    expected = plain_greedy(target.model, PROMPT, max_tokens)
    engine = Engine(
        target, ScriptedDrafter(expected + [0] * 20, 1000, 32), num_draft_tokens=6, adaptive=False
    )
    tokens, stats = run(engine, PROMPT, max_tokens)
    assert tokens == expected and len(tokens) == max_tokens
    assert stats.finish_reason == "length"


def test_eos_inside_a_draft():
    target = tiny_target("llama", seed=3)
    reference = plain_greedy(target.model, PROMPT, 40)
    eos = reference[9]
    first = reference.index(eos)
    target.tokenizer = None
    target.eos_token_ids = [eos]
    engine = Engine(target, ScriptedDrafter(reference, 1000, 32), num_draft_tokens=6, adaptive=False)
    tokens, stats = run(engine, PROMPT, 40)
    assert tokens == reference[:first]  # EOS is not part of the output
    assert stats.finish_reason == "eos"
    # The cache holds exactly the kept tokens (the drafts after EOS were rolled back).
    assert engine.cached_tokens == (PROMPT + reference[: first + 1])[:-1]
    assert all(c.offset == len(engine.cached_tokens) for c in engine.cache)


def test_session_reuses_the_cache_prefix():
    target = tiny_target("llama", seed=4)
    engine = Engine(target, LookupDrafter())
    first, _ = run(engine, PROMPT, 20)
    follow_up = PROMPT + first + [3, 4, 5]
    tokens, stats = run(engine, follow_up, 20)
    assert tokens == plain_greedy(target.model, follow_up, 20)
    assert stats.prompt_tokens == len(follow_up)
    # A prompt that diverges early rolls the cache back.
    other = [1, 5, 8, 8, 2]
    tokens, _ = run(engine, other, 20)
    assert tokens == plain_greedy(target.model, other, 20)


def test_a_long_prompt_prefills_in_chunks_and_reports_them(monkeypatch):
    """Chunks of 8 (PREFILL_CHUNK, mlx-lm's prefill_step_size, cut down): a Prefilling event after
    each but the last, counting the tokens computed (not those the cache held); the output and
    the drafter's features are what one pass gives (EAGLE-3 reads them)."""
    import mlx_spec.engine as engine_module
    from mlx_spec.drafters.eagle import EagleDrafter
    from mlx_spec.events import Collector, Prefilling, Token
    from test_eagle import eagle_target, random_eagle

    target = eagle_target()
    prompt = (PROMPT * 3)[:40]
    model = random_eagle(target, seed=3, scale=1.0)  # a seed whose drafts are sometimes accepted
    model._target_embed = target.embed
    engine = Engine(target, EagleDrafter(model, target.vocab_size), num_draft_tokens=3, adaptive=False)
    whole = Collector.of(engine.generate(prompt, max_tokens=16))
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 8)
    engine.reset()
    events = list(engine.generate(prompt, max_tokens=16))
    assert [(e.done, e.total) for e in events if isinstance(e, Prefilling)] == [
        (8, 39),
        (16, 39),
        (24, 39),
        (32, 39),
    ]
    chunked = Collector()
    for event in events:
        chunked.add(event)
    assert chunked.tokens == whole.tokens == plain_greedy(target.model, prompt, 16)
    assert chunked.from_draft == whole.from_draft and any(
        whole.from_draft
    )  # the same drafts: the same features
    follow_up = prompt + chunked.tokens + [3, 4, 5, 6, 10] * 4
    events = list(engine.generate(follow_up, max_tokens=8))
    cached = len(prompt) + 16 - 2  # the cache's, less the position a feature drafter recomputes
    assert [(e.done, e.total) for e in events if isinstance(e, Prefilling)] == [
        (8, len(follow_up) - 1 - cached),
        (16, len(follow_up) - 1 - cached),
    ]
    assert [e.id for e in events if isinstance(e, Token)] == plain_greedy(target.model, follow_up, 8)


def test_prompt_longer_than_context():
    target = tiny_target("llama", context=64)
    with pytest.raises(MlxSpecError, match="exceed the model's context of 64"):
        run(Engine(target), list(range(1, 30)), 40)


def test_empty_prompt():
    with pytest.raises(MlxSpecError, match="empty"):
        run(Engine(tiny_target("llama")), [], 4)
