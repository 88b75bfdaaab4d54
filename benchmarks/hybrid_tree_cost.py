"""Cost of a tree pass on a hybrid target against a chain pass of the same node count (issue 42).

The Qwen3-Next-shaped layers of recurrent_rollback.py (three Gated DeltaNet layers and one of
attention with Qwen3-Next-80B-A3B's widths, 8 experts, random float32 weights), 512 tokens of
context. A tree pass runs each recurrent layer once per depth (tree.recurrent_by_depth: that
depth's nodes as a batch of one-position sequences from their parents' states), then follows
the accepted path (Replay.follow: the recurrent layers again over the path); a chain pass runs
them once over all positions and rolls back by replay only where a draft was rejected. Times,
medians of several runs, each with its rollback:
  chain   a pass over n positions, then a rollback keeping half of them (a rejection);
  tree    a pass over n nodes in a tree of `depth` levels, then compaction to a path of
          `depth` nodes.

    .venv/bin/python benchmarks/hybrid_tree_cost.py [--context 512] [--repeats 5]
"""

import copy
import statistics
import time

import mlx_spec  # noqa: F401  (loads OpenBLAS before mlx.core does any work)

# isort: split

import mlx.core as mx

from mlx_spec.cache import Replay, rollback_to
from mlx_spec.tree import Tree, compact, tree_forward
from recurrent_rollback import CONFIG, setup


def balanced_parents(nodes: int, depth: int):
    """A breadth-first tree of `nodes` drafts over `depth` levels, as even as it comes."""
    per_level = [nodes // depth + (i < nodes % depth) for i in range(depth)]
    parents, previous, first = [], [0], 1
    for count in per_level:
        level = list(range(first, first + count))
        parents += [previous[i % len(previous)] for i in range(count)]
        previous, first = level, first + count
    return parents


def main():
    args, target, context = setup()
    model = target.model

    context_cache = model.make_cache()
    mx.eval(model(context, cache=context_cache))

    def prefilled():
        return copy.deepcopy(context_cache)

    def chain(cache, tokens):
        replay = Replay(args.context)
        mx.eval(target.forward(tokens[None], cache, replay=replay)[0])
        assert rollback_to(cache, args.context + tokens.size // 2, replay)

    def tree_pass(cache, tokens, tree):
        replay = Replay(args.context)
        mx.eval(tree_forward(target, tokens, tree, cache, replay=replay)[0])
        compact(cache, args.context, tree.path_to(len(tree) - 1), replay)

    print(f"context {args.context}, {args.repeats} runs each (medians)")
    print("| nodes | depth | chain pass + rollback ms | tree pass + compaction ms | tree / chain |")
    print("|---|---|---|---|---|")
    for nodes, depth in ((8, 3), (16, 4), (32, 5), (64, 6)):
        tokens = mx.random.randint(0, CONFIG["vocab_size"], (nodes + 1,))
        tree = Tree(balanced_parents(nodes, depth))
        times = {"chain": [], "tree": []}
        for _ in range(args.repeats):  # alternating, each from a fresh prefilled cache
            for name in ("chain", "tree"):
                cache = prefilled()
                tic = time.perf_counter()
                chain(cache, tokens) if name == "chain" else tree_pass(cache, tokens, tree)
                mx.eval(
                    [a for c in cache for a in (c.cache if hasattr(c, "cache") else c.state) if a is not None]
                )
                times[name].append(time.perf_counter() - tic)
        chain_ms, tree_ms = (1000 * statistics.median(times[k]) for k in ("chain", "tree"))
        print(
            f"| {nodes + 1} | {depth} | {chain_ms:.0f} | {tree_ms:.0f} | {tree_ms / chain_ms:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
