"""The server's prompt cache: conversations switched in and out of the engine stay lossless and
reuse what they computed."""

import pytest

from mlx_spec.drafters.eagle import EagleDrafter
from mlx_spec.drafters.lookup import LookupDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.eagle3 import load_eagle3
from mlx_spec.server.sessions import SessionCache
from test_eagle import eagle_target, random_eagle, save_eagle
from tiny import plain_greedy, run

MAX_TOKENS = 10


def drafter(method, target, tmp_path):
    if method == "lookup":
        return LookupDrafter()
    path = save_eagle(random_eagle(target), tmp_path / "eagle", "safeailab")
    return EagleDrafter(load_eagle3(path, target), target.vocab_size)


@pytest.mark.parametrize("method", ["lookup", "eagle"])
def test_conversations_switched_in_and_out_stay_lossless(method, tmp_path):
    target = eagle_target()
    engine = Engine(
        target, drafter(method, target, tmp_path), num_draft_tokens=3, adaptive=False, sessions=True
    )
    sessions = SessionCache(engine, max_sessions=4)
    a, b = [1, 5, 7, 9, 11, 13, 2, 5, 7], [3, 4, 6, 8, 10, 3, 4, 6]
    replies = {}

    fresh = Engine(target, drafter(method, target, tmp_path), num_draft_tokens=3, adaptive=False)

    def turn(prompt):
        sessions.prepare(prompt)
        tokens, stats = run(engine, prompt, MAX_TOKENS)
        assert tokens == plain_greedy(target.model, prompt, MAX_TOKENS)
        # The drafter drafts what it drafts from scratch: it was rebuilt on the conversation.
        fresh.reset()
        _, expected = run(fresh, prompt, MAX_TOKENS)
        assert (stats.verified_drafts, stats.accepted_drafts) == (
            expected.verified_drafts,
            expected.accepted_drafts,
        )
        return tokens, stats

    for name, prompt in (("a", a), ("b", b)):
        replies[name] = turn(prompt)[0]
    assert engine.cached_tokens[: len(b)] == b and len(sessions.stored) == 1
    # Each conversation's next turn: the one that was put aside comes back with its cache.
    for name, prompt in (("a", a), ("b", b)):
        history = prompt + replies[name]
        _, stats = turn(history + [2, 7])
        assert stats.prompt_cached >= len(history) - 2, (name, stats.prompt_cached)
    # A prompt that branches off the current conversation keeps the rest of it in the cache.
    _, stats = turn(b + [5, 5])
    assert stats.prompt_cached >= len(b) - 1
    _, stats = turn(b + replies["b"] + [2, 7, 9])
    assert stats.prompt_cached >= len(b + replies["b"])


def test_a_stored_prefix_serves_every_prompt_that_branches_off_it(tmp_path):
    """Prompts sharing a stored conversation's beginning (one system prompt, other questions)
    each reuse it, and the conversation itself stays whole for its next turn."""
    target = eagle_target()
    engine = Engine(target, LookupDrafter(), num_draft_tokens=3, sessions=True)
    other = Engine(target, LookupDrafter(), num_draft_tokens=3, sessions=True)  # a second batch row
    sessions = SessionCache(engine, max_sessions=4)
    system = [1, 5, 7, 9, 11, 13, 2]
    first = system + [4, 4]
    sessions.prepare(first)
    reply, _ = run(engine, first, MAX_TOKENS)
    sessions.keep(engine.detach())
    for row, question in ((engine, [6, 3]), (other, [8, 8, 3])):
        sessions.prepare(system + question, row)
        tokens, stats = run(row, system + question, MAX_TOKENS)
        assert stats.prompt_cached == len(system)
        assert tokens == plain_greedy(target.model, system + question, MAX_TOKENS)
    history = first + reply + [2, 7]
    sessions.prepare(history)
    tokens, stats = run(engine, history, MAX_TOKENS)
    assert stats.prompt_cached >= len(first + reply) - 1
    assert tokens == plain_greedy(target.model, history, MAX_TOKENS)


def test_the_cache_keeps_within_its_bounds(tmp_path):
    target = eagle_target()
    engine = Engine(target, drafter("eagle", target, tmp_path), num_draft_tokens=3, sessions=True)
    sessions = SessionCache(engine, max_sessions=3)
    for first in range(1, 7):
        prompt = [first, 5, 7, 9, 11]
        sessions.prepare(prompt)
        run(engine, prompt, 4)
    assert len(sessions.stored) == 3
    one = sessions.stored[0].nbytes
    sessions.max_bytes = 2 * one
    sessions.prepare([8, 8, 8])
    assert sessions.nbytes <= 2 * one and len(sessions.stored) == 2


def test_a_feature_drafter_needs_sessions_to_switch(tmp_path):
    target = eagle_target()
    engine = Engine(target, drafter("eagle", target, tmp_path), num_draft_tokens=3)
    with pytest.raises(MlxSpecError, match="sessions=True"):
        engine.attach(engine.detach())
