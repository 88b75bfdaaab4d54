"""Cost of one EAGLE-3 draft step, and of a tree verification (budget 16, 32, 64), relative to
one decode step of the default model (float32).

A random EAGLE-3 layer at the default model's width drafts from a context of --context tokens
(its KV cache filled to that length, like the target's). Reported: medians over --runs
rounds of --reps timed calls each, the target's step and the draft step timed in alternation,
for the full 49,152-token draft head and a 32,000-token reduced one, greedy (argmax mapped
through d2t) and sampled (q scattered into target ids)."""

import argparse
import statistics
import time

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core does any work)

# isort: split

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from mlx_spec.cache import make_cache, rollback_to
from mlx_spec.convert.default import default_model_path
from mlx_spec.drafters.eagle import EagleDrafter
from mlx_spec.models.eagle3 import Model, ModelArgs, default_layer_ids
from mlx_spec.models.target import load_target
from mlx_spec.sampling import Sampler, SamplingParams
from mlx_spec.tree import Tree, tree_forward


def timed_ms(step, reps):
    """Mean ms of `reps` calls; each call's lazy result is evaluated on its own (one sync per
    step, as in the engine)."""
    tic = time.perf_counter()
    for _ in range(reps):
        mx.eval(step())
    return (time.perf_counter() - tic) / reps * 1e3


def interleaved_medians(steps, reps, runs):
    """Median ms of each step, timed in alternation so that load on a shared machine hits
    all of them alike."""
    for step in steps:
        timed_ms(step, 3)
    rounds = [[timed_ms(step, reps) for step in steps] for _ in range(runs)]
    return [statistics.median(r[i] for r in rounds) for i in range(len(steps))]


def random_eagle(target, draft_vocab, seed=0):
    c = target.config
    args = ModelArgs(
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c.get("num_key_value_heads"),
        head_dim=c.get("head_dim"),
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c.get("rope_theta", 10000.0),
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=default_layer_ids(target.num_layers),
    )
    mx.random.seed(seed)
    model = Model(args, target_embed=target.embed)
    model.update(tree_map(lambda p: p * 0.05 if p.ndim == 2 else p, model.parameters()))
    ids = np.sort(np.random.default_rng(seed).permutation(target.vocab_size)[:draft_vocab])
    model.d2t = mx.array(ids - np.arange(draft_vocab), mx.int32)
    mx.eval(model.parameters())
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=5)
    opts = parser.parse_args()

    target = load_target(default_model_path(), "float32")
    context = (np.arange(opts.context) * 7919 % 1000 + 100).tolist()
    cache = make_cache(target.model)
    mx.eval(target.model(mx.array(context)[None], cache=cache))
    token = mx.array([[context[-1]]])

    def target_step():
        logits = target.model(token, cache=cache)
        rollback_to(cache, opts.context)  # lazy: the step reads what it wrote before the trim
        return logits

    print(f"target: default model, float32, one-token forward after {opts.context} tokens of context")
    print(f"{'draft head':>10} {'mode':>8} {'target ms':>10} {'draft step ms':>14} {'ratio':>6}")
    for draft_vocab in (target.vocab_size, 32000):
        model = random_eagle(target, draft_vocab)
        for mode, sampling in (("greedy", SamplingParams()), ("sampled", SamplingParams(temp=0.7))):
            drafter = EagleDrafter(model, target.vocab_size)
            drafter.sampler = Sampler(sampling)
            fused = mx.random.normal((1, opts.context - 1, len(model.taps) * target.hidden_size))
            drafter.prefill(
                context,
                {
                    tap: fused[..., i * target.hidden_size : (i + 1) * target.hidden_size]
                    for i, tap in enumerate(model.taps)
                },
                0,
            )
            mx.eval(drafter.last_hidden)

            def two_drafts():
                draft = drafter.propose(2)
                rollback_to(drafter.cache, opts.context - 1)
                return draft.tokens, draft.q

            def first_draft():  # head + pick alone: the first draft reads the hidden prefill left
                draft = drafter.propose(1)
                return draft.tokens, draft.q

            target_ms, two_ms, one_ms = interleaved_medians(
                [target_step, two_drafts, first_draft], opts.reps, opts.runs
            )
            step_ms = two_ms - one_ms  # one layer forward + head + pick
            print(
                f"{draft_vocab:>10} {mode:>8} {target_ms:>10.2f} {step_ms:>14.2f} "
                f"{step_ms / target_ms:>6.3f}   (head + pick alone: {one_ms:.2f} ms)"
            )

    # Tree verification: one target pass over budget + 1 nodes (ancestor mask, depth positions),
    # against the one-token step and a chain pass of the same width.
    print(f"{'budget':>10} {'tree ms':>10} {'/ 1 token':>10} {'chain ms':>10} {'/ 1 token':>10}")
    for budget in (16, 32, 64):
        parents = [i // 4 for i in range(budget)]  # up to 4 children per node, breadth-first
        nodes = mx.array(context[-1:] + list(range(100, 100 + budget)))

        def tree_step():
            logits, _ = tree_forward(target, nodes, Tree(parents), cache)
            rollback_to(cache, opts.context)
            return logits

        def chain_step():
            logits = target.model(nodes[None], cache=cache)
            rollback_to(cache, opts.context)
            return logits

        one_ms, tree_ms, chain_ms = interleaved_medians(
            [target_step, tree_step, chain_step], opts.reps, opts.runs
        )
        print(
            f"{budget:>10} {tree_ms:>10.2f} {tree_ms / one_ms:>10.2f} {chain_ms:>10.2f} {chain_ms / one_ms:>10.2f}"
        )


if __name__ == "__main__":
    main()
