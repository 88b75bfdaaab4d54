"""DDTree: the tree built from DFlash's per-position distributions is the optimal one for its
budget; greedy output token-identical to plain decoding; sampling exact."""

import itertools

import numpy as np
import pytest

from exactness import STRICT, VOCAB, repeated_prompt, sampling_pvalue
from mlx_spec.drafters.ddtree import DDTreeDrafter, best_tree
from mlx_spec.engine import Engine
from mlx_spec.sampling import SamplingParams
from mlx_spec.tree import Tree
from test_dflash import PROMPT, random_dflash
from tiny import plain_greedy, run, tiny_target


def expected_length(tokens, parents, marginals):
    """Sum over nodes of the product of the marginals along the path (the tree's value)."""
    tree, total = Tree(parents), 0.0
    for node in range(1, len(tree)):
        path = tree.path_to(node)[1:]
        total += np.prod([marginals[tree.depths[n] - 1][tokens[n - 1]] for n in path])
    return total


def brute_force_best(marginals, budget):
    """The best value over every ancestor-closed set of `budget` nodes, by enumeration."""
    depth, width = len(marginals), len(marginals[0])
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
    best = 0.0
    for subset in itertools.combinations(paths, budget):
        chosen = set(subset)
        if all(p[:-1] in chosen or len(p) == 1 for p in chosen):
            best = max(best, sum(np.prod([marginals[d][t] for d, t in enumerate(p)]) for p in chosen))
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 3, 5])
def test_the_tree_is_optimal_and_within_budget_and_depth(seed, budget):
    rng = np.random.default_rng(seed)
    marginals = rng.dirichlet(np.ones(3) * 0.7, size=3)  # 3 positions, 3 tokens each
    candidates = [
        sorted(((t, float(np.log(p))) for t, p in enumerate(row)), key=lambda c: -c[1]) for row in marginals
    ]
    draft = best_tree(candidates, budget)
    tokens, parents, confidence = draft.tokens, draft.parents, draft.confidence
    tree = Tree(parents)  # also checks breadth-first order
    assert len(tokens) == budget and max(tree.depths) <= 3
    assert np.isclose(expected_length(tokens, parents, marginals), brute_force_best(marginals, budget))
    assert all(
        np.isclose(c, marginals[tree.depths[i + 1] - 1][t])
        for i, (t, c) in enumerate(zip(tokens, confidence))
    )


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_is_token_identical(tmp_path, k, adaptive):
    target = tiny_target("qwen3", num_layers=4)
    expected = plain_greedy(target.model, PROMPT, 40)
    model = random_dflash(tmp_path, target, seed=k)[0]
    engine = Engine(
        target, DDTreeDrafter(target, model, budget=12, topk=3), num_draft_tokens=k, adaptive=adaptive
    )
    tokens, stats = run(engine, PROMPT, 40)
    assert tokens == expected
    most = min(12, sum(3**d for d in range(1, k + 1)))  # budget, or the full tree of depth k
    assert stats.verified_drafts <= stats.steps * most
    assert adaptive or stats.verified_drafts >= (stats.steps - 3) * min(3, most)  # near the end k shrinks


def test_sampled_output_is_exact(tmp_path):
    """The seeded rule (the residual rule's one-hot sibling walk is checked in test_tree)."""
    target = tiny_target("llama", vocab_size=VOCAB, seed=11, scale=2.5, num_layers=1, hidden_size=32)
    model = random_dflash(tmp_path, target, num_layers=1, target_layer_ids=(-1, 0), block_size=4)[0]
    params = SamplingParams(temp=1.0, top_k=10)
    prompt = repeated_prompt()
    engine = Engine(
        target,
        DDTreeDrafter(target, model, budget=6, topk=3),
        num_draft_tokens=3,
        sampling=params,
        adaptive=False,
    )
    pvalue = sampling_pvalue(engine, prompt, params)
    assert pvalue > STRICT, f"p = {pvalue:.2e}"
