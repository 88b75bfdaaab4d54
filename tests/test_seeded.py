"""--seed reproduces sampled output whatever the draft source, draft length or timing: the
token at each position is argmax(log p + Gumbel noise keyed by (seed, position))."""

import pytest

from exactness import repeated_prompt
from mlx_spec.drafters.combined import Combined
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.drafters.eagle import EagleDrafter
from mlx_spec.drafters.lookup import LookupDrafter
from mlx_spec.drafters.suffix import SuffixDrafter
from mlx_spec.engine import Engine
from mlx_spec.models.eagle3 import load_eagle3
from mlx_spec.sampling import SamplingParams
from test_dflash import random_dflash
from test_eagle import eagle_target, random_eagle, save_eagle
from tiny import run, tiny_target

SETTINGS = [SamplingParams(temp=0.7, top_p=0.9, top_k=10), SamplingParams(temp=1.0, top_p=0.95, top_k=12)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target():
    return eagle_target()  # 4 layers: EAGLE-3 and DFlash both find their taps


@pytest.fixture(scope="module")
def sources(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("seeded")
    eagle = save_eagle(random_eagle(target, seed=5, scale=2.0), root / "eagle", "safeailab")
    dflash = random_dflash(root / "dflash", target, num_layers=1, target_layer_ids=(0, 2), block_size=8)[0]
    vocab = target.vocab_size
    return {
        "lookup": lambda: LookupDrafter(),
        "model": lambda: DraftModelDrafter(eagle_target(seed=12), vocab),
        "eagle": lambda: EagleDrafter(load_eagle3(eagle, target), vocab),
        "eagle-tree": lambda: EagleDrafter(load_eagle3(eagle, target), vocab, tree_budget=6, tree_topk=2),
        "dflash": lambda: DFlashDrafter(target, dflash),
        "suffix": lambda: SuffixDrafter(8, None),
        "suffix+eagle": lambda: Combined(
            SuffixDrafter(8, None), EagleDrafter(load_eagle3(eagle, target), vocab), 4
        ),
    }


@pytest.mark.parametrize("params", SETTINGS, ids=["t0.7", "t1.0"])
@pytest.mark.parametrize(
    "source", ["lookup", "model", "eagle", "eagle-tree", "dflash", "suffix", "suffix+eagle"]
)
def test_same_seed_same_tokens_whatever_the_source(target, sources, source, params):
    prompt = repeated_prompt(14)
    plain = run(Engine(target, sampling=params, seed=7), prompt, MAX_TOKENS)[0]
    assert plain != run(Engine(target, sampling=params, seed=8), prompt, MAX_TOKENS)[0]
    proposed = 0
    for k in (1, 3, 8):
        engine = Engine(target, sources[source](), num_draft_tokens=k, sampling=params, seed=7)
        for _ in range(3):  # the session's cache is reused from the second run on
            tokens, stats = run(engine, prompt, MAX_TOKENS)
            assert tokens == plain, (source, k)
            proposed += stats.verified_drafts
    assert proposed > 0


def test_a_fresh_seed_is_reported_and_repeats_the_output():
    target = tiny_target("llama", seed=3)
    params = SETTINGS[1]
    tokens, stats = run(Engine(target, LookupDrafter(), sampling=params), repeated_prompt(), MAX_TOKENS)
    again, _ = run(Engine(target, sampling=params, seed=stats.seed), repeated_prompt(), MAX_TOKENS)
    assert tokens == again


@pytest.mark.parametrize("residual", [False, True])
def test_q_is_computed_only_for_the_residual_rule(residual):
    """The seeded rule needs no draft distribution (its cost is saved); --residual-sampling
    keeps the classic rule, whose exactness the harness checks in test_exactness."""
    import numpy as np

    target = tiny_target("llama", seed=3)
    drafter = DraftModelDrafter(tiny_target("llama", seed=4), 32)
    engine = Engine(target, drafter, num_draft_tokens=3, sampling=SETTINGS[1], seed=7, residual=residual)
    run(engine, repeated_prompt(), 4)
    q = drafter.propose(3).q
    if residual:
        assert q.shape == (3, 32) and np.allclose(np.array(q).sum(-1), 1, atol=1e-5)
    else:
        assert q is None


@pytest.mark.parametrize("source", ["model", "eagle"])
def test_stopping_early_changes_no_token(target, sources, source):
    """Chain drafters that stop once the next draft would not pay (Engine(stop_early=True)) draft
    fewer positions, and print what the target alone prints for the seed."""
    from mlx_spec.policy import DraftPlan, DraftPolicy
    from test_policy import cpu_like_policy

    class DraftsTheMost(DraftPolicy):  # so that every step drafts, and may stop early
        def plan(self, max_k):
            return DraftPlan(max_k)

    params, prompt = SETTINGS[1], repeated_prompt(14)
    plain = run(Engine(target, sampling=params, seed=7), prompt, MAX_TOKENS)[0]
    policy = DraftsTheMost()
    policy.verify_cost, policy.draft_cost = cpu_like_policy().verify_cost, cpu_like_policy().draft_cost
    engine = Engine(
        target, sources[source](), num_draft_tokens=8, sampling=params, seed=7, policy=policy, stop_early=True
    )
    answers = []
    ask = engine.drafter.keep_drafting
    engine.drafter.keep_drafting = lambda confidence: answers.append(ask(confidence)) or answers[-1]
    tokens, stats = run(engine, prompt, MAX_TOKENS)
    assert tokens == plain
    assert False in answers and stats.drafted_tokens < 8 * stats.steps


def test_a_sampled_tree_is_the_greedy_tree_of_the_noisy_drafter():
    """Under the seeded rule the target picks argmax(log p + noise): a tree's best child at each
    position is the chain's draw (the same noise), not the drafter's argmax, which the target
    would pick only as often as p gives it."""
    import mlx.core as mx
    import numpy as np

    from mlx_spec.sampling import Sampler

    logits = mx.random.normal((64, 48), key=mx.random.key(0))
    positions = list(range(100, 164))
    sampler = Sampler(SETTINGS[1], seed=5)
    tree = sampler.tree_log_probs(logits, positions, 48)
    drawn, _, _ = sampler.draw(logits, positions, 48)
    assert np.allclose(np.exp(np.array(tree)).sum(-1), 1, atol=1e-5)
    assert mx.argmax(tree, axis=-1).tolist() == drawn.tolist()
    assert mx.argmax(tree, axis=-1).tolist() != mx.argmax(logits, axis=-1).tolist()
    # The residual rule's verifier does not see the noise: its tree is the drafter's distribution.
    residual = Sampler(SETTINGS[1], seed=5, residual=True).tree_log_probs(logits, positions, 48)
    assert mx.argmax(residual, axis=-1).tolist() == mx.argmax(logits, axis=-1).tolist()
