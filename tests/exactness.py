"""The exactness harness: is a draft source's sampled output distributed exactly as the target's?

A tiny target over a small vocabulary makes the exact distribution of the first few generated
tokens enumerable; N sequences drawn through the engine with the draft source are compared with
it by chi-square tests of the first m tokens for each m (cells with small expected counts
pooled). Reused by every drafter."""

from collections import Counter

import mlx.core as mx
import numpy as np
from scipy.stats import chisquare

from mlx_spec.engine import Engine, GenerationOptions
from mlx_spec.events import Collector
from mlx_spec.sampling import probs

VOCAB = 16
# Draws per test: with the prefix tests below, enough to catch a q that is 10% off.
N_SAMPLES = 10_000
N_TOKENS = 3
STRICT = 1e-3  # fail below this p-value (draws are seeded: the verdict is reproducible)


def exact_distribution(target, prompt, n_tokens, params, processors=()):
    """{token tuple: probability} of the first n_tokens generated after prompt (each position's
    logits through mlx-lm's logits processors, given the tokens before it, as mlx-lm applies them)."""
    dist = {(): 1.0}
    for _ in range(n_tokens):
        prefixes = list(dist)
        batch = mx.array([list(prompt) + list(p) for p in prefixes])
        logits = target.model(batch)[:, -1, :]
        if processors:
            rows = []
            for i in range(len(prefixes)):
                row = logits[i : i + 1]
                for processor in processors:
                    row = processor(batch[i], row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        p_next = np.array(probs(logits, params))
        dist = {
            prefix + (t,): dist[prefix] * float(p_next[i, t])
            for i, prefix in enumerate(prefixes)
            for t in range(p_next.shape[1])
            if p_next[i, t] > 0
        }
    return dist


def draw(engine: Engine, prompt, n_tokens, n_samples, options=GenerationOptions()):
    """n_samples generations, each with its own seed (a seed fixes the output)."""
    counts = Counter()
    for seed in range(n_samples):
        engine.sampler.reseed(seed)
        counts[tuple(Collector.of(engine.generate(prompt, max_tokens=n_tokens, options=options)).tokens)] += 1
    return counts


def sampling_pvalue(
    engine: Engine, prompt, params, n_tokens=N_TOKENS, n_samples=N_SAMPLES, options=GenerationOptions()
):
    """p-value of n_samples outputs of the engine (its target, at params, with the options'
    logits processors) under the exact distribution of its target's first n_tokens."""
    counts = draw(engine, prompt, n_tokens, n_samples, options)
    exact = exact_distribution(engine.target, prompt, n_tokens, params, options.logits_processors)
    return chi_square_pvalue(counts, exact, n_samples)


def chi_square_pvalue(counts: Counter, exact: dict, n_samples: int, min_expected: float = 5.0):
    """p-value of the sampled sequences under the exact distribution: one chi-square test per
    prefix length m (the distribution of the first m tokens), Bonferroni-combined. A wrong rule
    shows first in the early tokens, where the cells are few and full; the whole-sequence test
    alone spreads the same samples over hundreds of cells and needs about twice as many to
    catch a q that is 10% off (tests/test_exactness.py::test_harness_catches_a_broken_rule)."""
    n_tokens = max(len(seq) for seq in exact)
    pvalues = [
        _chi_square(_prefixes(counts, m), _prefixes(exact, m), n_samples, min_expected)
        for m in range(1, n_tokens + 1)
    ]
    return min(1.0, n_tokens * min(pvalues))


def _prefixes(dist, m):
    out = Counter()
    for seq, weight in dist.items():
        out[seq[:m]] += weight
    return out


def _chi_square(counts, exact, n_samples, min_expected):
    """Cells expected fewer than min_expected times are pooled into one cell (with every
    sequence outside `exact`)."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, p in exact.items():
        if p * n_samples >= min_expected:
            observed.append(counts.get(seq, 0))
            expected.append(p * n_samples)
        else:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += p * n_samples
    pooled_obs += sum(c for seq, c in counts.items() if seq not in exact)
    if pooled_exp > 0 or pooled_obs:  # no pooled cell where every cell is full and nothing else came
        observed.append(pooled_obs)
        expected.append(max(pooled_exp, 1e-12))
    expected = np.array(expected) * n_samples / sum(expected)  # rounding of the exact sums
    return chisquare(observed, expected).pvalue


def repeated_prompt(length=12, seed=0):
    """A prompt whose n-grams repeat, so that prompt lookup has matches to draft from."""
    rng = np.random.default_rng(seed)
    half = rng.integers(0, VOCAB, size=length // 2).tolist()
    return half + half
