"""Batched speculative decoding: every row's output is what it would be alone (greedy: mlx-lm's
own tokens; sampled: the tokens of --draft none with the row's seed), whatever else shares its
passes, whenever rows join and leave."""

import pytest

from exactness import STRICT, VOCAB, chi_square_pvalue, exact_distribution, repeated_prompt
from mlx_spec.batch import BatchEngine
from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.drafters.eagle import EagleDrafter
from mlx_spec.drafters.lookup import LookupDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.events import Collector, Failed, Prefilling, Step, Token
from mlx_spec.sampling import SamplingParams
from test_eagle import eagle_target, random_eagle
from tiny import ScriptedDrafter, plain_greedy, run, tiny_target

PROMPTS = [
    [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5, 7],
    [3, 4],
    [8, 8, 6, 1, 2, 3, 4, 8, 8, 6, 1, 2, 3, 4, 8, 8, 6, 1, 2, 3, 4, 9],
    [30, 2, 17, 4, 30, 2, 17, 5, 30, 2],
    [7],
]


class PerPromptScript(ScriptedDrafter):
    """ScriptedDrafter over the reference continuation of whichever prompt it is given, with
    a corruption period of its own per prompt: rows accept different numbers of drafts."""

    def __init__(self, references, vocab):
        super().__init__([], 1, vocab)
        self.references = references

    def prefill(self, context, taps, start):
        key = tuple(context)
        self.reference = self.references.get(key, [])  # unknown: drafts nothing
        self.wrong_every = 2 + len(key) % 5
        self.position = 0


def batch_run(batch, requests):
    """Run every request (prompt, kwargs) through the batch (BatchEngine.generate_all);
    {request index: (tokens, stats)}."""
    collected = {i: Collector() for i in range(len(requests))}
    for i, event in batch.generate_all([dict(prompt=p, **kwargs) for p, kwargs in requests]):
        if isinstance(collected[i].add(event), Failed):
            raise event.error
    return {i: (c.tokens, c.stats) for i, c in collected.items()}


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=5)


@pytest.fixture(scope="module")
def references(target):
    return {tuple(p): plain_greedy(target.model, p, 40) for p in PROMPTS}


@pytest.mark.parametrize("adaptive", [False, True])
def test_rows_of_every_acceptance_length_match_mlx_lm(target, references, adaptive):
    """Five requests through three rows: rows join as others leave, accept different numbers
    of drafts per step, and stop at different max_tokens."""
    engine = Engine(target, PerPromptScript(references, 32), num_draft_tokens=5, adaptive=adaptive)
    batch = BatchEngine.spawned(engine, 3)
    lengths = [40, 7, 33, 1, 25]
    results = batch_run(batch, [(p, dict(max_tokens=n)) for p, n in zip(PROMPTS, lengths)])
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
        tokens, stats = results[i]
        assert tokens == references[tuple(prompt)][:n], i
        assert stats.finish_reason == "length" and stats.generated_tokens == n
    if not adaptive:
        assert sum(results[i][1].accepted_drafts for i in results) > 20
    assert not batch.rows and len(batch.idle) == 3
    assert all(c.keys is None for c in batch.cache)


def test_mixed_sources_in_one_batch(target, references):
    """Lookup, a draft model, plain decoding and a scripted drafter share each pass."""
    engines = [
        Engine(target, LookupDrafter(), num_draft_tokens=4, adaptive=False),
        Engine(
            target, DraftModelDrafter(tiny_target("llama", seed=6), 32), num_draft_tokens=3, adaptive=False
        ),
        Engine(target),
        Engine(target, PerPromptScript(references, 32), num_draft_tokens=6, adaptive=False),
    ]
    batch = BatchEngine(engines)
    rows = [batch.add(p, max_tokens=40, engine=e) for p, e in zip(PROMPTS, engines)]
    outputs = {id(r): [] for r in rows}
    while batch.rows:
        for row, event in batch.step():
            if isinstance(event, Token):
                outputs[id(row)].append(event.id)
    for prompt, row in zip(PROMPTS, rows):
        assert outputs[id(row)] == references[tuple(prompt)]
    assert engines[0].cached_tokens[: len(PROMPTS[0])] == PROMPTS[0]


def test_eos_inside_drafts_and_the_cache_after(references):
    target = tiny_target("llama", seed=5)
    reference = references[tuple(PROMPTS[0])]
    eos = next(t for i, t in enumerate(reference) if i >= 5 and t not in reference[:i])
    target.eos_token_ids = [eos]
    engine = Engine(target, PerPromptScript(references, 32), num_draft_tokens=6, adaptive=False)
    batch = BatchEngine.spawned(engine, 2)
    results = batch_run(batch, [(PROMPTS[0], dict(max_tokens=40)), (PROMPTS[2], dict(max_tokens=40))])
    tokens, stats = results[0]
    assert tokens == reference[: reference.index(eos)] and stats.finish_reason == "eos"
    # A row that left holds exactly its kept tokens, as a KVCache of its own.
    for e in batch.engines:
        assert all(c.offset == len(e.cached_tokens) for c in e.cache)
    # ... and its next turn reuses that cache.
    first = [e for e in batch.engines if e.cached_tokens[: len(PROMPTS[0])] == PROMPTS[0]][0]
    follow_up = PROMPTS[0] + tokens + [eos, 3, 4]
    tokens, stats = batch_run(batch, [(follow_up, dict(max_tokens=5, engine=first))])[0]
    assert tokens == [t for t in plain_greedy(target.model, follow_up, 5)][: len(tokens)]
    assert stats.prompt_cached >= len(PROMPTS[0]) + 5


def test_eagle_rows_match_mlx_lm():
    target = eagle_target()
    prompts = [repeated_prompt(12, seed) for seed in range(3)]
    model = random_eagle(target)
    model._target_embed = target.embed
    engine = Engine(target, EagleDrafter(model, target.vocab_size), num_draft_tokens=3, adaptive=False)
    results = batch_run(BatchEngine.spawned(engine, 3), [(p, dict(max_tokens=24)) for p in prompts])
    for i, prompt in enumerate(prompts):
        assert results[i][0] == plain_greedy(target.model, prompt, 24)
    assert sum(results[i][1].accepted_drafts for i in results) > 0


def test_seeded_sampling_equals_plain_decoding_per_row(target):
    params = SamplingParams(temp=1.0, top_k=12)
    engine = Engine(target, LookupDrafter(), num_draft_tokens=4)
    requests = [(p, dict(max_tokens=30, sampling=params, seed=100 + i)) for i, p in enumerate(PROMPTS)]
    results = batch_run(BatchEngine.spawned(engine, 3), requests)
    for i, (prompt, kwargs) in enumerate(requests):
        alone, _ = run(Engine(target), prompt, 30, sampling=params, seed=kwargs["seed"])
        assert results[i][0] == alone, i


def test_sampled_batch_is_exact():
    """The statistical harness through a batch of mixed sources: draws of lookup, a draft
    model and plain rows, each with its own seed, against the target's exact distribution."""
    target = tiny_target("llama", vocab_size=VOCAB, seed=11, scale=2.5, num_layers=1, hidden_size=32)
    prompt, params = repeated_prompt(), SamplingParams(temp=1.0)
    draft = tiny_target("llama", vocab_size=VOCAB, seed=12, scale=2.5, num_layers=1, hidden_size=32)
    engines = [
        Engine(target, LookupDrafter(), num_draft_tokens=3, adaptive=False),
        Engine(target, DraftModelDrafter(draft, VOCAB), num_draft_tokens=2, adaptive=False, residual=True),
        Engine(target),
    ]
    engines += [e.spawn() for e in engines]
    n = 3000
    results = batch_run(
        BatchEngine(engines), [(prompt, dict(max_tokens=3, sampling=params, seed=s)) for s in range(n)]
    )
    from collections import Counter

    counts = Counter(tuple(results[i][0]) for i in range(n))
    assert chi_square_pvalue(counts, exact_distribution(target, prompt, 3, params), n) > STRICT


def test_a_removed_row_leaves_the_others_alone(target, references):
    engine = Engine(target, PerPromptScript(references, 32), num_draft_tokens=4, adaptive=False)
    batch = BatchEngine.spawned(engine, 3)
    rows = [batch.add(p, max_tokens=30) for p in PROMPTS[:3]]
    outputs = {id(r): [] for r in rows}
    for _ in range(3):
        for row, event in batch.step():
            if isinstance(event, Token):
                outputs[id(row)].append(event.id)
    batch.remove(rows[1])
    while batch.rows:
        for row, event in batch.step():
            if isinstance(event, Token):
                outputs[id(row)].append(event.id)
    for i in (0, 2):
        assert outputs[id(rows[i])] == references[tuple(PROMPTS[i])][:30]
    tokens, _ = batch_run(batch, [(PROMPTS[1], dict(max_tokens=30))])[0]  # the engine is reusable
    assert tokens == references[tuple(PROMPTS[1])][:30]


def test_a_long_prompt_prefills_a_chunk_per_step_beside_decoding_rows(target, references, monkeypatch):
    """Chunks of 8 (PREFILL_CHUNK, cut down): a row already decoding steps between the new row's
    chunks (a long prompt does not stall it), and both write mlx-lm's tokens; a row removed while
    it prefills leaves the other alone."""
    import mlx_spec.engine as engine_module

    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 8)
    long = (PROMPTS[2] * 2)[:40]
    engine = Engine(target, PerPromptScript(references, 32), num_draft_tokens=2, adaptive=False)
    batch = BatchEngine.spawned(engine, 2)
    first = batch.add(PROMPTS[0], max_tokens=40)
    events = batch.step() + batch.step()  # its 14 prompt tokens in, in two chunks
    second = batch.add(long, max_tokens=20)
    while batch.rows:
        events += batch.step()
    progress = [i for i, (row, e) in enumerate(events) if row is second and isinstance(e, Prefilling)]
    assert [(events[i][1].done, events[i][1].total) for i in progress] == [
        (8, 39),
        (16, 39),
        (24, 39),
        (32, 39),
    ]
    assert all(
        any(row is first and isinstance(e, Step) for row, e in events[i:j])
        for i, j in zip(progress, progress[1:])
    )
    tokens = {
        id(row): [e.id for r, e in events if r is row and isinstance(e, Token)] for row in (first, second)
    }
    assert tokens[id(first)] == references[tuple(PROMPTS[0])]
    assert tokens[id(second)] == plain_greedy(target.model, long, 20)
    # removed in the middle of its prompt: the other row goes on, the engine serves again
    first, second = batch.add(PROMPTS[3], max_tokens=30), batch.add(long, max_tokens=5)
    events = batch.step() + batch.step()
    assert (
        any(row is second and isinstance(e, Prefilling) for row, e in events) and second.prefill is not None
    )
    batch.remove(second)
    while batch.rows:
        events += batch.step()
    assert [e.id for r, e in events if r is first and isinstance(e, Token)] == references[tuple(PROMPTS[3])][
        :30
    ]
    assert batch_run(batch, [(long, dict(max_tokens=12))])[0][0] == plain_greedy(target.model, long, 12)


def test_a_failing_row_fails_alone(target, references):
    batch = BatchEngine.spawned(Engine(target, LookupDrafter()), 2)
    good = batch.add(PROMPTS[0], max_tokens=10)
    batch.add(list(range(20)) * 60, max_tokens=10)  # past the tiny model's context of 1024
    events = []
    while batch.rows:
        events += batch.step()
    errors = [e for r, e in events if isinstance(e, Failed)]
    assert len(errors) == 1 and isinstance(errors[0].error, MlxSpecError)
    assert [e.id for r, e in events if r is good and isinstance(e, Token)] == references[tuple(PROMPTS[0])][
        :10
    ]


def test_what_cannot_share_a_pass_is_refused_in_one_line(target):
    with pytest.raises(MlxSpecError, match="tree drafts"):
        eagle = eagle_target()
        BatchEngine.spawned(
            Engine(eagle, EagleDrafter(random_eagle(eagle), eagle.vocab_size, tree_budget=8)), 2
        )
    with pytest.raises(MlxSpecError, match="share one target"):
        BatchEngine([Engine(target), Engine(tiny_target("llama", seed=9))])


def test_tree_sources_batch_as_their_chains(target):
    """A tree source's chains (its trees' best paths) share the pass: EAGLE-3 and suffix."""
    from mlx_spec.drafters.suffix import SuffixDrafter

    eagle = eagle_target()
    layer = random_eagle(eagle)
    layer._target_embed = eagle.embed
    for model, drafter, prompts in (
        (
            eagle,
            EagleDrafter(layer, eagle.vocab_size, tree_budget=8),
            [repeated_prompt(12, s) for s in range(3)],
        ),
        (target, SuffixDrafter(tree_budget=8), PROMPTS),
    ):
        engine = Engine(model, drafter, num_draft_tokens=4, adaptive=False)
        assert engine.unbatchable() is not None and drafter.tree
        chains = engine.with_chain_drafts()
        assert chains.unbatchable() is None and not chains.drafter.tree
        results = batch_run(BatchEngine.spawned(chains, 3), [(p, dict(max_tokens=24)) for p in prompts])
        for i, prompt in enumerate(prompts):
            assert results[i][0] == plain_greedy(model.model, prompt, 24), (type(drafter).__name__, i)
        assert sum(stats.verified_drafts for _, stats in results.values()) > 0


def test_dflash_and_medusa_rows_match_mlx_lm(tmp_path):
    """The learned chain sources that read the target's features, a batch each, rows of
    different prompts."""
    from mlx_spec.drafters.dflash import DFlashDrafter
    from mlx_spec.drafters.medusa import MedusaDrafter
    from mlx_spec.models.medusa import load_medusa
    from test_dflash import random_dflash
    from test_medusa import random_heads, write

    target = tiny_target("qwen3", num_layers=4)
    dflash, _, _ = random_dflash(tmp_path, target, seed=1)
    medusa = load_medusa(write(tmp_path / "medusa", random_heads(64, 32)), target)
    requests = [(p, dict(max_tokens=20)) for p in PROMPTS[:4]]
    for drafter in (DFlashDrafter(target, dflash), MedusaDrafter(target, medusa)):
        engine = Engine(target, drafter, num_draft_tokens=4, adaptive=False)
        results = batch_run(BatchEngine.spawned(engine, 3), requests)
        for i, (prompt, _) in enumerate(requests):
            assert results[i][0] == plain_greedy(target.model, prompt, 20), (type(drafter).__name__, i)
        assert sum(results[i][1].verified_drafts for i in results) > 0


def test_a_row_that_widens_the_pass_alone_is_charged_the_widening(target):
    """A pass's seconds reach the rows' policies in shares that add up to the pass: split
    evenly when no row drafted; when one did, the widening (the padding of every other row) is
    its own, so that it does not draft where that does not pay the batch."""
    batch = BatchEngine([Engine(target) for _ in range(4)])
    for _ in range(3):  # a pass costs 10 ms plus 1 ms a token
        for tokens in (4, 8, 12, 20):
            batch.pass_cost.record(tokens, 0.010 + 0.001 * tokens)
    assert batch.shares([1, 1, 1, 1], 1) == pytest.approx([0.25] * 4)
    alone = batch.shares([5, 1, 1, 1], 5)
    assert sum(alone) == pytest.approx(1.0)
    plain = batch.pass_cost(4) / batch.pass_cost(20)  # the plain pass's part of one 5 tokens wide
    assert plain == pytest.approx(0.014 / 0.030, rel=0.02)
    assert alone[0] == pytest.approx(plain / 4 + (1 - plain))
    assert alone[1:] == pytest.approx([plain / 4] * 3)
    together = batch.shares([5, 5, 5, 5], 5)  # every row widened: each pays its part
    assert together == pytest.approx([0.25] * 4)
    assert alone[0] * 0.030 - 0.014 / 4 > 3 * (together[0] * 0.030 - 0.014 / 4)
