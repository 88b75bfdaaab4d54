"""A generation's options under speculation: mlx-lm's logits processors (penalties, logit bias)
applied at every verified position to the tokens before it, drafts included; each token's
logprobs as mlx-lm reports them; a request's prediction (OpenAI's Predicted Outputs) drafting
beside the engine's source. Every source stays lossless: greedy token-identical to mlx-lm with
the same processors, sampling exact."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from exactness import STRICT, repeated_prompt, sampling_pvalue
from mlx_spec.batch import BatchEngine
from mlx_spec.bench import seeded_sampler
from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.drafters.lookup import LookupDrafter
from mlx_spec.drafters.suffix import SuffixDrafter
from mlx_spec.engine import Engine, GenerationOptions
from mlx_spec.events import Collector
from mlx_spec.logprobs import top_indices
from mlx_spec.sampling import Sampler, SamplingParams
from test_tree import ScriptedTreeDrafter
from tiny import ScriptedDrafter, plain_greedy, renormalised, run, tiny_target

PROMPT = [1, 5, 7, 9, 11, 13, 2, 5, 7, 9, 11, 13, 2, 5, 7]
PENALTIES = dict(
    logit_bias={3: 1.5, 20: -2.0},
    repetition_penalty=1.3,
    presence_penalty=0.4,
    frequency_penalty=0.2,
    repetition_context_size=12,
)
SAMPLED = SamplingParams(temp=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=2)


def mlx_lm_run(target, prompt, n, processors=(), params=None, seed=0):
    """mlx-lm's own decoding with the processors: [(token, its logprobs [V])]; sampled by the
    seeded rule (the same distribution mlx-lm's sampler draws from) where params sample."""
    sampler = None if params is None else seeded_sampler(Sampler(params, seed), len(prompt))
    return [
        (int(t), lp)
        for t, lp in generate_step(
            mx.array(prompt), target.model, max_tokens=n, sampler=sampler, logits_processors=list(processors)
        )
    ]


def sources(target, reference):
    """Each source's engine, drafting often enough that accepted drafts meet the processors."""
    return {
        "none": Engine(target),
        "lookup": Engine(target, LookupDrafter(), num_draft_tokens=6, adaptive=False),
        "draft-model": Engine(
            target, DraftModelDrafter(target, target.vocab_size), num_draft_tokens=4, adaptive=False
        ),
        "scripted": Engine(target, ScriptedDrafter(reference, 3, 32), num_draft_tokens=5, adaptive=False),
        "tree": Engine(target, ScriptedTreeDrafter(reference, 32), num_draft_tokens=8, adaptive=False),
        "suffix-tree": Engine(target, SuffixDrafter(12, None, tree=True), num_draft_tokens=8, adaptive=False),
    }


def test_penalties_greedy_equal_mlx_lm_for_every_source_and_a_tree(target):
    processors = make_logits_processors(**PENALTIES)
    reference = [t for t, _ in mlx_lm_run(target, PROMPT, 40, processors)]
    assert reference != plain_greedy(target.model, PROMPT, 40)  # the processors change the text
    options = GenerationOptions(logits_processors=tuple(processors))
    for name, engine in sources(target, reference).items():
        collected = Collector.of(engine.generate(PROMPT, max_tokens=40, options=options))
        assert collected.tokens == reference, name
        assert name in ("none", "suffix-tree") or collected.stats.accepted_drafts > 0, name
        # Without them the same engine writes mlx-lm's plain text: nothing stays behind.
        assert run(engine, PROMPT + [3], 12)[0] == plain_greedy(target.model, PROMPT + [3], 12), name


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_logprobs_equal_mlx_lms_with_accepted_drafts(target, sampled):
    processors = make_logits_processors(**PENALTIES)
    params = SAMPLED if sampled else None
    reference = mlx_lm_run(target, PROMPT, 30, processors, params, seed=4)
    tokens = [t for t, _ in reference]
    options = GenerationOptions(logits_processors=tuple(processors), logprobs=5, distribution=True)
    for name, engine in sources(target, tokens).items():
        collected = Collector.of(
            engine.generate(PROMPT, max_tokens=30, sampling=params, seed=4, options=options)
        )
        assert collected.tokens == tokens, name
        assert any(collected.from_draft) or name in ("none", "lookup"), name  # lookup: no match when sampled
        for (token, logprobs), ours in zip(reference, collected.logprobs):
            logprobs = renormalised(logprobs)
            assert abs(ours.logprob - logprobs[token].item()) < 1e-4, name
            assert [i for i, _ in ours.top] == mx.argsort(-logprobs)[:5].tolist(), name
            assert mx.allclose(ours.distribution, logprobs, atol=1e-4), name


def test_a_batchs_rows_get_their_own_logprobs(target):
    """Rows asking for 5 alternatives, none, and no logprobs at all, worked out together."""
    other = [2, 4, 6, 8, 4, 6, 8, 4, 6]
    references = [mlx_lm_run(target, prompt, 24) for prompt in (PROMPT, other, PROMPT)]
    batch = BatchEngine.spawned(Engine(target, LookupDrafter(), num_draft_tokens=6, adaptive=False), 3)
    asked = [5, 0, None]
    requests = [
        dict(prompt=prompt, max_tokens=24, options=GenerationOptions(logprobs=top))
        for prompt, top in zip((PROMPT, other, PROMPT), asked)
    ]
    collected = {i: Collector() for i in range(3)}
    for i, event in batch.generate_all(requests):
        collected[i].add(event)
    assert any(collected[0].from_draft) and any(collected[1].from_draft)
    for reference, top, got in zip(references, asked, collected.values()):
        assert got.tokens == [t for t, _ in reference]
        if top is None:
            assert got.logprobs == [None] * 24
            continue
        for (token, logprobs), ours in zip(reference, got.logprobs):
            logprobs = renormalised(logprobs)
            assert abs(ours.logprob - logprobs[token].item()) < 1e-4
            assert [i for i, _ in ours.top] == mx.argsort(-logprobs)[:top].tolist()
            assert all(abs(v - logprobs[i].item()) < 1e-4 for i, v in ours.top)


@pytest.mark.parametrize("shape", [(4, 49152), (3, 49153), (2, 1000), (2, 7)])
def test_top_indices_are_the_largest_in_order(shape):
    rng = np.random.default_rng(shape[1])
    values = rng.standard_normal(shape).astype(np.float32)
    values[0, rng.integers(0, shape[1], 3)] = -np.inf  # a processor's banned tokens
    for k in (1, 5, 20):
        assert (top_indices(values, k) == np.argsort(-values, axis=-1)[:, :k]).all(), (shape, k)


def test_no_logprobs_unless_asked(target):
    collected = Collector.of(Engine(target, LookupDrafter()).generate(PROMPT, max_tokens=8))
    assert collected.logprobs == [None] * 8


def test_sampling_with_processors_is_exact():
    from test_exactness import harness_model

    target, prompt = harness_model(11), repeated_prompt()
    processors = tuple(
        make_logits_processors(logit_bias={2: 1.0}, repetition_penalty=1.5, presence_penalty=0.5)
    )
    params = SamplingParams(temp=1.0)
    engine = Engine(target, LookupDrafter(), num_draft_tokens=3, sampling=params, adaptive=False)
    pvalue = sampling_pvalue(engine, prompt, params, options=GenerationOptions(logits_processors=processors))
    assert pvalue > STRICT, f"p = {pvalue:.2e}"


def edited(tokens, every=7):
    """The tokens with every `every`-th changed and one inserted: a prediction that is wrong in places."""
    out = [(t + 1) % 32 if i % every == every - 1 else t for i, t in enumerate(tokens)]
    return out[:10] + [17] + out[10:]


@pytest.mark.parametrize("source", ["none", "lookup"])
def test_a_prediction_drafts_losslessly(target, source):
    expected = plain_greedy(target.model, PROMPT, 48)
    for prediction, least_tau in ((expected, 4.0), (edited(expected), 1.5), ([30, 31] * 5, 0.0)):
        engine = Engine(target, LookupDrafter() if source == "lookup" else None, adaptive=False)
        collected = Collector.of(
            engine.generate(PROMPT, max_tokens=48, options=GenerationOptions(prediction=tuple(prediction)))
        )
        assert collected.tokens == expected, prediction
        assert collected.stats.tokens_per_step >= least_tau, collected.stats
        assert engine.drafter.__class__ is (
            LookupDrafter if source == "lookup" else type(Engine(target).drafter)
        )
        # The next generation drafts with the engine's source alone, from the same cache.
        assert run(engine, PROMPT + expected[:5], 10)[0] == plain_greedy(
            target.model, PROMPT + expected[:5], 10
        )


def test_a_prediction_in_a_batch_and_when_sampling(target):
    expected = plain_greedy(target.model, PROMPT, 30)
    other = PROMPT[:-1] + [9]
    expected_other = plain_greedy(target.model, other, 30)
    batch = BatchEngine.spawned(Engine(target, LookupDrafter(), adaptive=False), 2)
    requests = [
        dict(prompt=PROMPT, max_tokens=30, options=GenerationOptions(prediction=tuple(expected))),
        dict(
            prompt=other, max_tokens=30, options=GenerationOptions(prediction=tuple(edited(expected_other)))
        ),
    ]
    collected = {0: Collector(), 1: Collector()}
    for i, event in batch.generate_all(requests):
        collected[i].add(event)
    assert collected[0].tokens == expected and collected[1].tokens == expected_other
    assert collected[0].stats.tokens_per_step > 3
    # Seeded sampling: the same tokens whatever drafted them.
    sampled = Collector.of(Engine(target).generate(PROMPT, max_tokens=30, sampling=SAMPLED, seed=3)).tokens
    predicted = Collector.of(
        Engine(target).generate(
            PROMPT,
            max_tokens=30,
            sampling=SAMPLED,
            seed=3,
            options=GenerationOptions(prediction=tuple(sampled)),
        )
    )
    assert predicted.tokens == sampled and predicted.stats.accepted_drafts > 10
