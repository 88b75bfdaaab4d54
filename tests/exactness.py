"""The exactness harness: is a draft source's sampled output distributed exactly as the target's?

A tiny target over a small vocabulary makes the exact distribution of the first few generated
tokens enumerable; N sequences drawn through the engine with the draft source are compared with
it by a chi-square test (cells with small expected counts pooled). Reused by every drafter."""

from collections import Counter

import mlx.core as mx
import numpy as np
from scipy.stats import chisquare

from mlx_spec.engine import Engine
from mlx_spec.sampling import probs

VOCAB = 16


def exact_distribution(target, prompt, n_tokens, params):
    """{token tuple: probability} of the first n_tokens generated after prompt."""
    dist = {(): 1.0}
    for _ in range(n_tokens):
        prefixes = list(dist)
        batch = mx.array([list(prompt) + list(p) for p in prefixes])
        p_next = np.array(probs(target.model(batch)[:, -1, :], params))
        dist = {prefix + (t,): dist[prefix] * float(p_next[i, t])
                for i, prefix in enumerate(prefixes) for t in range(p_next.shape[1])
                if p_next[i, t] > 0}
    return dist


def draw(engine: Engine, prompt, n_tokens, n_samples):
    """n_samples generations, each with its own seed (a seed fixes the output)."""
    counts = Counter()
    for seed in range(n_samples):
        engine.sampler.reseed(seed)
        tokens = []
        for event in engine.generate(prompt, max_tokens=n_tokens):
            if event[0] == "token":
                tokens.append(event[1])
        counts[tuple(tokens)] += 1
    return counts


def chi_square_pvalue(counts: Counter, exact: dict, n_samples: int, min_expected: float = 5.0):
    """p-value of the sampled counts under the exact distribution; cells expected fewer than
    min_expected times are pooled into one cell (with every sequence outside `exact`)."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, p in exact.items():
        if p * n_samples >= min_expected:
            observed.append(counts.get(seq, 0))
            expected.append(p * n_samples)
        else:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += p * n_samples
    pooled_obs += sum(c for seq, c in counts.items() if seq not in exact)
    observed.append(pooled_obs)
    expected.append(pooled_exp)
    expected = np.array(expected) * n_samples / sum(expected)  # rounding of the exact sums
    return chisquare(observed, expected).pvalue


def repeated_prompt(length=12, seed=0):
    """A prompt whose n-grams repeat, so that prompt lookup has matches to draft from."""
    rng = np.random.default_rng(seed)
    half = rng.integers(0, VOCAB, size=length // 2).tolist()
    return half + half
